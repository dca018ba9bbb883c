"""The E2B cloud sandbox, through the `e2b` SDK (`AsyncSandbox`), imported only when used.

An agent inside E2B cannot reach this machine's loopback, so rollouts using it need the proxy
advertised at a public URL (`--advertise-url`); `reaches_host_loopback = False` makes the
scheduler refuse a loopback proxy URL up front instead of letting every agent fail to connect.

Commands run through `commands.run` wrapped in coreutils `timeout`, so the process really dies
at the limit inside the sandbox (the SDK's own timeout only drops the connection); the SDK's
timeout is set a little longer as a backstop. A start cancelled while E2B is still creating the
sandbox waits for it and kills it, so no billed machine is left running. Setup runs as root (to create `/logs`, `/tests`
and the workdir and hand them to the sandbox user); everything else runs as the default user.

No E2B cloud is reachable from the build machine: this module is tested against the SDK's call
signatures (a recording stand-in whose calls are bound to the real `AsyncSandbox`, `Commands`
and `Filesystem` signatures), not against a live sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import time
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from adapters.sandboxes.base import Command, ExecResult, Sandbox, SandboxError, SandboxStartError, as_shell

if TYPE_CHECKING:
    from adapters.tasks import Task

KILL_GRACE_S = 5
SDK_SLACK_S = 30
DEFAULT_COMMAND_TIMEOUT_S = 3600
TIMEOUT_EXIT_CODES = (124, 137)


def _sdk() -> Any:
    try:
        import e2b
    except ImportError as error:
        raise SandboxError("the e2b sandbox needs the e2b SDK: pip install 'harness-rl[e2b]'") from error
    return e2b


class E2BSandbox(Sandbox):
    """One E2B sandbox per rollout."""

    kind = "e2b"
    reaches_host_loopback = False
    home = "/home/user/.harness-rl/home"
    tools_dir = "/home/user/.harness-rl/tools"

    def __init__(
        self,
        template: str | None = None,
        lifetime_s: int = 3600,
        api_key: str | None = None,
        metadata: dict[str, str] | None = None,
        sandbox_class: Any = None,
    ) -> None:
        self.template = template
        self.lifetime_s = lifetime_s
        self.api_key = api_key
        self.metadata = metadata or {}
        self._sandbox_class = sandbox_class
        self._sbx: Any = None

    async def start(self, task: Task) -> None:
        if self._sbx is not None:
            raise SandboxError("this sandbox is already started")
        sandbox_class = self._sandbox_class or _sdk().AsyncSandbox
        options: dict[str, Any] = {"api_key": self.api_key} if self.api_key else {}
        creating = asyncio.ensure_future(sandbox_class.create(
            template=self.template,
            timeout=self.lifetime_s,
            metadata={"app": "harness-rl", "task": task.name, **self.metadata},
            envs=task.environment_env,
            **options,
        ))
        try:
            self._sbx = await asyncio.shield(creating)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await (await creating).kill()
            raise
        except Exception as error:
            raise SandboxStartError(f"could not create an E2B sandbox: {error}") from error
        self.workdir = task.workdir
        dirs = [f"{self.logs_dir}/agent", f"{self.logs_dir}/verifier", f"{self.logs_dir}/artifacts",
                self.tests_dir, self.workdir, self.home, self.tools_dir]
        setup = f"mkdir -p {shlex.join(dirs)} && chown -R user {shlex.join([self.logs_dir, *dirs[3:]])}"
        result = await self._run(setup, None, 120, "/", user="root")
        if not result.ok:
            await self.close()
            raise SandboxStartError(f"E2B sandbox setup failed: {result.stderr.strip() or result.stdout.strip()}")
        if task.workspace_seed is not None:
            await self.upload(task.workspace_seed, self.workdir)

    async def exec(
        self,
        cmd: Command,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        return await self._run(as_shell(cmd), env, timeout, cwd or self.workdir)

    async def _run(
        self, cmd: str, env: dict[str, str] | None, timeout: float | None, cwd: str, user: str | None = None,
    ) -> ExecResult:
        if self._sbx is None:
            raise SandboxError("the sandbox is not started")
        limit = int(timeout or DEFAULT_COMMAND_TIMEOUT_S)
        wrapped = f"timeout -k {KILL_GRACE_S} {limit} bash -c {shlex.quote(cmd)}"
        options: dict[str, Any] = {"user": user} if user else {}
        started = time.monotonic()
        try:
            result = await self._sbx.commands.run(
                wrapped, envs=env or {}, cwd=cwd, timeout=limit + KILL_GRACE_S + SDK_SLACK_S, **options,
            )
            exit_code, stdout, stderr = result.exit_code, result.stdout, result.stderr
        except Exception as error:
            kind = type(error).__name__
            if kind == "CommandExitException":
                failed: Any = error  # the SDK's CommandExitException carries the command's result
                exit_code, stdout, stderr = failed.exit_code, failed.stdout, failed.stderr
            elif kind == "TimeoutException":
                return ExecResult(None, "", str(error), timed_out=True, duration_s=time.monotonic() - started)
            else:
                raise SandboxError(f"E2B command failed: {error}") from error
        timed_out = timeout is not None and exit_code in TIMEOUT_EXIT_CODES
        return ExecResult(
            None if timed_out else exit_code, stdout or "", stderr or "", timed_out, time.monotonic() - started,
        )

    async def write_file(self, path: str, data: bytes) -> None:
        if self._sbx is None:
            raise SandboxError("the sandbox is not started")
        await self._sbx.files.write(str(PurePosixPath(path)), data)

    async def read_file(self, path: str) -> bytes | None:
        if self._sbx is None:
            raise SandboxError("the sandbox is not started")
        try:
            data = await self._sbx.files.read(path, format="bytes")
        except Exception as error:
            if type(error).__name__ in ("NotFoundException", "FileNotFoundException"):
                return None
            raise SandboxError(f"E2B could not read {path}: {error}") from error
        return bytes(data)

    async def close(self) -> None:
        sbx, self._sbx = self._sbx, None
        if sbx is not None:
            try:
                await sbx.kill()
            except Exception as error:
                name = getattr(sbx, "sandbox_id", "?")
                raise SandboxError(f"E2B sandbox {name} could not be killed: {error}") from error
