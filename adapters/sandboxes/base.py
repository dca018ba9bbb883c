"""The sandbox interface every backend implements: start, exec, upload, download, close.

A sandbox is one rollout's private machine. Paths passed to `exec`, `upload` and `download` are
paths as seen inside the sandbox; each backend says where its `workdir`, `home`, `logs_dir` and
`tests_dir` are, so harnesses and verifiers never hard-code a layout.
"""

from __future__ import annotations

import shlex
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from adapters.tasks import Task

Command = str | Sequence[str]
"""A shell string (run by `bash -c`) or an argv list (no shell, no quoting worries)."""


@dataclass(frozen=True)
class ExecResult:
    """How a command ended. `exit_code` is None when it was killed at its time limit."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, lost its connection), not the command run in it."""


class SandboxStartError(SandboxError):
    """The sandbox could not be created; the scheduler retries these with backoff."""


def as_shell(cmd: Command) -> str:
    """One shell string for backends that only take strings (e2b, Harbor)."""
    return cmd if isinstance(cmd, str) else shlex.join(cmd)


class Sandbox(ABC):
    """One rollout's isolated machine. Use as `async with`, or call `start` and `close` yourself."""

    kind: str = "abstract"
    reaches_host_loopback: bool = True
    """False where an agent cannot reach a proxy on this machine's 127.0.0.1 (cloud, containers)."""
    workdir: str = "/app"
    home: str = "/agent"
    logs_dir: str = "/logs"
    tests_dir: str = "/tests"
    tools_dir: str = "/opt/harness-rl"
    shares_host_tools: bool = False
    """True where `tools_dir` is this machine's own: agent CLIs are installed there once, before a run, never
    by a rollout (a remote sandbox installs its own)."""
    python: str = "python3"

    @abstractmethod
    async def start(self, task: Task) -> None:
        """Create the machine and seed `workdir` with the task's starting files."""

    @abstractmethod
    async def exec(
        self,
        cmd: Command,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        """Run a command; at `timeout` seconds kill it and everything it started."""

    @abstractmethod
    async def write_file(self, path: str, data: bytes) -> None:
        """Create or replace one file (parents created)."""

    @abstractmethod
    async def read_file(self, path: str) -> bytes | None:
        """One file's bytes, or None when it does not exist."""

    @abstractmethod
    async def close(self) -> None:
        """Kill every process and free the machine. Safe to call twice, and after a failed start."""

    async def allow(self, url: str) -> None:
        """Make the service at `url` (the proxy) reachable from inside; a no-op where the network is open."""
        return None

    async def upload(self, src: Path, dest: str) -> None:
        """Copy a local file or directory tree to `dest` inside the sandbox."""
        src = Path(src)
        if src.is_dir():
            for file in sorted(p for p in src.rglob("*") if p.is_file()):
                await self.write_file(str(PurePosixPath(dest) / file.relative_to(src).as_posix()), file.read_bytes())
        else:
            await self.write_file(dest, src.read_bytes())

    async def download(self, src: str, dest: Path) -> None:
        """Copy a file or directory tree from inside the sandbox to the local path `dest`."""
        listing = await self.exec(["find", src, "-type", "f"], timeout=60)
        files = [line for line in listing.stdout.splitlines() if line]
        if listing.exit_code != 0 or not files:
            raise FileNotFoundError(f"{src} does not exist in the {self.kind} sandbox")
        for name in files:
            data = await self.read_file(name)
            target = Path(dest) if name == src else Path(dest) / PurePosixPath(name).relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data or b"")

    async def read_text(self, path: str) -> str | None:
        data = await self.read_file(path)
        return None if data is None else data.decode("utf-8", errors="replace")

    async def write_text(self, path: str, text: str) -> None:
        await self.write_file(path, text.encode())

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
