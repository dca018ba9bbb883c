"""The local sandbox: a temporary directory tree per rollout on this machine, optionally in bubblewrap.

Layout: each sandbox owns a fresh root directory holding `work/` (the task's workdir), `logs/`
(`agent/`, `verifier/`, `artifacts/`), `tests/`, `home/` (the agent's HOME and XDG dirs) and `tmp/`.

With bubblewrap (`isolation="bwrap"`, the default when `bwrap` is installed) every command runs in
fresh user, pid, ipc, uts and cgroup namespaces over a read-only view of the host's top-level
directories, with those five directories bound writable at the paths a Harbor task expects
(`/app` or the task's workdir, `/logs`, `/tests`, `/agent`, `/tmp`). Each command gets its own
pid namespace, so under bubblewrap nothing a command starts outlives it.

Network, two choices:
- `network="host"` (default): the network namespace is shared (`--share-net`), so the agent
  reaches the proxy on the host's loopback, and also whatever else the host reaches (package
  registries for installs, for instance). Filesystem and processes are isolated, the network not.
- `network="proxy-only"`: a private network namespace too (`--unshare-all` alone: only `lo`).
  The endpoints passed to `allow(url)` (the scheduler allows each rollout's proxy URL) are relayed
  in through Unix sockets (see `relay.py`), on the same port of the sandbox's own 127.0.0.1, so
  the agent reaches the proxy and nothing else. Agent CLIs must then be installed beforehand
  (scripts/install_agents.sh); an install inside the sandbox has no registry to reach.

Without bubblewrap (`isolation="none"`) the same directories are used at their host paths, and
the Harbor paths are rewritten to them: in command strings and arguments, in environment values,
and inside the text files uploaded to `tests/` (the verifier script writes `/logs/verifier/...`).
An agent that types an absolute `/app/...` path itself still misses; tasks should speak of
relative paths.

Every process started here carries `HARNESS_RL_SANDBOX=<id>` in its environment and runs in its
own process group. A command past its time limit has its whole group killed; `close` also kills
anything that escaped the group (setsid, daemons) by finding that marker in `/proc/*/environ`.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlparse

from adapters.sandboxes.base import Command, ExecResult, Sandbox, SandboxError, SandboxStartError
from adapters.sandboxes.relay import FORWARDER, HostRelay

if TYPE_CHECKING:
    from adapters.tasks import Task

Isolation = Literal["auto", "bwrap", "none"]
Network = Literal["host", "proxy-only"]
RELAY_MOUNT = "/harness-rl-relay"
MAX_OUTPUT_BYTES = 4 << 20
HIDDEN_HOST_DIRS = {"proc", "dev", "tmp", "sys"}
MARKER = "HARNESS_RL_SANDBOX"


def default_tools_dir() -> Path:
    """Where agent CLIs live: $HARNESS_RL_TOOLS_DIR, else the checkout's `.tools/`, else a user cache dir."""
    if "HARNESS_RL_TOOLS_DIR" in os.environ:
        return Path(os.environ["HARNESS_RL_TOOLS_DIR"])
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file():
        return checkout / ".tools"
    return Path.home() / ".cache" / "harness-rl" / "tools"



class LocalSandbox(Sandbox):
    """A rollout's workspace on this machine; see the module docstring for the layout and isolation."""

    kind = "local"
    shares_host_tools = True

    def __init__(
        self,
        isolation: Isolation = "auto",
        tools_dir: str | Path | None = None,
        base_dir: str | Path | None = None,
        keep: bool = False,
        network: Network = "host",
    ) -> None:
        if isolation == "auto":
            isolation = "bwrap" if shutil.which("bwrap") else "none"
        if isolation == "bwrap" and not shutil.which("bwrap"):
            raise SandboxError("isolation='bwrap' needs bubblewrap: apt-get install bubblewrap (or isolation='none')")
        if network == "proxy-only" and isolation != "bwrap":
            raise SandboxError("network='proxy-only' needs bubblewrap isolation (a private network namespace)")
        self.isolation: Literal["bwrap", "none"] = isolation
        self.network = network
        self._relay: HostRelay | None = None
        self.id = uuid.uuid4().hex[:12]
        self.tools_dir = str(Path(tools_dir or default_tools_dir()).resolve())
        self.python = sys.executable
        self._base_dir = base_dir
        self._keep = keep
        self.root: Path | None = None
        self._mounts: dict[str, Path] = {}
        self._exec_count = 0

    async def start(self, task: Task) -> None:
        if self.root is not None:
            raise SandboxError("this sandbox is already started")
        try:
            self.root = Path(tempfile.mkdtemp(prefix=f"harness-rl-{self.id}-", dir=self._base_dir))
            host = {name: self.root / name for name in ("work", "logs", "tests", "home", "tmp", "relay")}
            for directory in (*host.values(), host["logs"] / "agent", host["logs"] / "verifier",
                              host["logs"] / "artifacts"):
                directory.mkdir(parents=True, exist_ok=True)
            Path(self.tools_dir).mkdir(parents=True, exist_ok=True)
            if task.workspace_seed is not None:
                shutil.copytree(task.workspace_seed, host["work"], dirs_exist_ok=True)
        except OSError as error:
            raise SandboxStartError(f"could not create the local sandbox: {error}") from error
        self._relay = HostRelay(host["relay"])
        self._mounts = {
            task.workdir: host["work"], "/logs": host["logs"], "/tests": host["tests"],
            "/agent": host["home"], "/tmp": host["tmp"],
        }
        if self.isolation == "bwrap":
            self.workdir, self.logs_dir, self.tests_dir, self.home = task.workdir, "/logs", "/tests", "/agent"
        else:
            self.workdir, self.logs_dir, self.tests_dir, self.home = (
                str(host["work"]), str(host["logs"]), str(host["tests"]), str(host["home"]))

    async def allow(self, url: str) -> None:
        if self.network == "host":
            return
        if self._relay is None:
            raise SandboxError("the sandbox is not started")
        parsed = urlparse(url)
        if parsed.hostname not in ("127.0.0.1", "localhost"):
            raise SandboxError(f"network='proxy-only' relays loopback endpoints only, not {url}")
        await self._relay.allow(parsed.port or (443 if parsed.scheme == "https" else 80))

    def mount(self, path: str, host_dir: Path | None) -> None:
        """Show `host_dir` (None: a fresh private directory) at the absolute `path` to every later command.

        For what an agent's own commands name by absolute path (`/opt/<agent>-venv`, an installer's
        `/installed-agent`): bound there under bubblewrap, rewritten to `host_dir` without it.
        """
        if self.root is None:
            raise SandboxError("the sandbox is not started")
        if host_dir is None:
            host_dir = self.root / "mounts" / path.strip("/").replace("/", "-")
        host_dir.mkdir(parents=True, exist_ok=True)
        self._mounts[path] = host_dir

    def host_path(self, path: str) -> Path:
        """Where a sandbox path lives on this machine."""
        if self.root is None:
            raise SandboxError("the sandbox is not started")
        if self.isolation == "none":
            return Path(self._rewrite(path))
        posix = PurePosixPath(path)
        for mount, target in sorted(self._mounts.items(), key=lambda m: -len(m[0])):
            if posix == PurePosixPath(mount) or PurePosixPath(mount) in posix.parents:
                return target / posix.relative_to(mount)
        if posix == PurePosixPath(self.tools_dir) or PurePosixPath(self.tools_dir) in posix.parents:
            return Path(posix)
        raise SandboxError(f"{path} is outside the sandbox's writable directories ({', '.join(self._mounts)})")

    def _rewrite(self, text: str) -> str:
        """Harbor paths (`/app/...`, `/logs/...`, `/tests/...`) → this sandbox's host paths."""
        harbor = [mount for mount in self._mounts if mount != "/tmp"]
        if not harbor:
            return text
        names = "|".join(re.escape(m) for m in sorted(harbor, key=len, reverse=True))
        pattern = re.compile(rf"(?<![\w.~/-])({names})(?=[/\s'\"`;:)|&>]|$)")
        return pattern.sub(lambda m: str(self._mounts[m.group(1)]), text)

    def _environment(self, env: dict[str, str] | None) -> dict[str, str]:
        base = {
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "/usr/bin:/bin")]),
            "LANG": "C.UTF-8",
            "HOME": self.home,
            "TMPDIR": "/tmp" if self.isolation == "bwrap" else str(self._mounts["/tmp"]),
            "TMUX_TMPDIR": "/tmp" if self.isolation == "bwrap" else str(self._mounts["/tmp"]),  # one tmux server each
            MARKER: self.id,
        }
        merged = {**base, **(env or {}), MARKER: self.id}
        if self.isolation == "none":
            merged = {key: self._rewrite(value) for key, value in merged.items()}
        return merged

    def _bwrap(self, cwd: str) -> list[str]:
        argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session"]
        if self.network == "host":
            argv.append("--share-net")
        carved = {str(parent) for mount in self._mounts for parent in PurePosixPath(mount).parents} - {"/"}
        argv += _read_only_view("/", carved, set(self._mounts))
        argv += ["--dev", "/dev", "--proc", "/proc", "--ro-bind", "/sys", "/sys"]
        for mount, target in sorted(self._mounts.items()):
            argv += ["--bind", str(target), mount]
        for path in self._hidden_runtime():
            argv += ["--ro-bind", path, path]
        argv += ["--bind", self.tools_dir, self.tools_dir, "--chdir", cwd]
        if self._relay is not None and self._relay.ports:
            argv += ["--bind", str(self._relay.directory), RELAY_MOUNT, "--", self.python, "-c", FORWARDER,
                     RELAY_MOUNT, ",".join(map(str, self._relay.ports)), "--"]
        else:
            argv.append("--")
        return argv

    def _hidden_runtime(self) -> list[str]:
        """The Python this sandbox runs agents with, where a sandbox mount would hide it.

        A checkout (and its virtualenv) under `/tmp` vanishes behind the sandbox's private `/tmp`;
        these are bound back read-only, so `/tmp` stays private apart from the path to them.
        """
        runtime = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(self.python))}
        hidden = [p for p in sorted(runtime) if any(_under(p, mount) for mount in self._mounts)]
        return [p for p in hidden if not any(_under(p, other) for other in hidden if other != p)]

    async def exec(
        self,
        cmd: Command,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        if self.root is None:
            raise SandboxError("the sandbox is not started")
        argv = ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        cwd = cwd or self.workdir
        if self.isolation == "bwrap":
            argv, host_cwd = self._bwrap(cwd) + argv, str(self.root)
        else:
            argv, host_cwd = [self._rewrite(arg) for arg in argv], self._rewrite(cwd)
        started = time.monotonic()
        self._exec_count += 1
        out_path, err_path = (self.root / f".exec-{self._exec_count}.{stream}" for stream in ("out", "err"))
        with out_path.open("wb") as out, err_path.open("wb") as err:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=err,
                    env=self._environment(env), cwd=host_cwd, start_new_session=True,
                )
            except OSError as error:
                return ExecResult(127, "", f"could not start {argv[0]}: {error}", duration_s=time.monotonic() - started)
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            timed_out = True
        finally:
            if proc.returncode is None:
                _kill_tree(proc.pid)
                await asyncio.shield(proc.wait())
        return ExecResult(
            exit_code=None if timed_out else proc.returncode,
            stdout=_tail(out_path),
            stderr=_tail(err_path),
            timed_out=timed_out,
            duration_s=time.monotonic() - started,
        )

    async def write_file(self, path: str, data: bytes) -> None:
        target = self.host_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(self._rewrite_test_file(target, data))

    async def read_file(self, path: str) -> bytes | None:
        target = self.host_path(path)
        return target.read_bytes() if target.is_file() else None

    async def upload(self, src: Path, dest: str) -> None:
        src, target = Path(src), self.host_path(dest)
        if src.is_dir():
            shutil.copytree(src, target, dirs_exist_ok=True)
            for file in (p for p in target.rglob("*") if p.is_file()):
                file.write_bytes(self._rewrite_test_file(file, file.read_bytes()))
        else:
            await self.write_file(dest, src.read_bytes())
            shutil.copymode(src, target)

    async def download(self, src: str, dest: Path) -> None:
        source = self.host_path(src)
        if source.is_dir():
            shutil.copytree(source, dest, dirs_exist_ok=True)
        elif source.is_file():
            Path(dest).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest)
        else:
            raise FileNotFoundError(f"{src} does not exist in the local sandbox")

    def _rewrite_test_file(self, target: Path, data: bytes) -> bytes:
        """Unisolated only: point the verifier's Harbor paths at this sandbox's directories."""
        if self.isolation != "none" or self.root is None or (self.root / "tests") not in target.parents:
            return data
        try:
            return self._rewrite(data.decode()).encode()
        except UnicodeDecodeError:
            return data

    async def close(self) -> None:
        kill_marked_processes(self.id)
        if self._relay is not None:
            await self._relay.close()
            self._relay = None
        if self.root is not None and not self._keep:
            await asyncio.to_thread(shutil.rmtree, self.root, True)
        self.root = None


def _read_only_view(directory: str, carved: set[str], mounts: set[str]) -> list[str]:
    """bwrap arguments showing the host's `directory` read-only, minus our mount points.

    A directory on the way to a mount point (`/usr/src` for a workdir `/usr/src/app`) cannot be
    bound whole, since a read-only bind leaves no room for the mount point; it is rebuilt as an
    empty directory holding read-only binds of its other entries instead.
    """
    argv: list[str] = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.path in mounts or (directory == "/" and entry.name in HIDDEN_HOST_DIRS):
            continue
        if entry.is_symlink():
            argv += ["--symlink", os.readlink(entry.path), entry.path]
        elif entry.path in carved and entry.is_dir():
            argv += ["--dir", entry.path, *_read_only_view(entry.path, carved, mounts)]
        else:
            argv += ["--ro-bind", entry.path, entry.path]
    return argv


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _tail(path: Path) -> str:
    """A command's output file, keeping the last MAX_OUTPUT_BYTES, then removed.

    Output goes to files rather than pipes so a process that escaped the group and still holds
    the descriptor cannot keep the command from finishing.
    """
    with path.open("rb") as file:
        size = file.seek(0, os.SEEK_END)
        file.seek(max(0, size - MAX_OUTPUT_BYTES))
        data = file.read()
    path.unlink(missing_ok=True)
    return data.decode(errors="replace")


def _kill_tree(pid: int) -> None:
    """SIGKILL a command's process group and every descendant, including those that left the group."""
    doomed = [pid, *_descendants(pid)]
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for victim in doomed:
        try:
            os.kill(victim, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found += kids
        frontier += kids
    return found


def marked_processes(sandbox_id: str) -> list[int]:
    """Pids whose environment carries this sandbox's marker."""
    marker = f"{MARKER}={sandbox_id}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def kill_marked_processes(sandbox_id: str, rounds: int = 5) -> None:
    """SIGKILL every process of this sandbox, repeating while any forked in between."""
    for _ in range(rounds):
        pids = marked_processes(sandbox_id)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)
