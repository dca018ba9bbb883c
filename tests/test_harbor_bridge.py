"""The Harbor bridge's parts against the installed Harbor (Python >= 3.12 in the tools dir's harbor-venv).

- the catalog names every agent Harbor names, and its claims (dialect, endpoint, ATIF) hold in Harbor's code;
- Harbor's `BaseEnvironment`, as the runner gives it to Harbor's agents, really works the local sandbox:
  exec with env, cwd and a time limit, file and directory uploads and downloads, a missing path;
- Harbor's own error stops a run whose agent Harbor refuses to build, verbatim.

They skip, saying why, where Harbor is not installed (scripts/install_agents.sh installs it).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.harbor_bridge.catalog import API_FORMATS, CATALOG
from adapters.harbor_bridge.host import serve_runner
from adapters.harbor_bridge.install import InstallError, find_python, harbor_python
from adapters.harbor_bridge.protocol import MAX_LINE
from adapters.harnesses import Endpoint, create_harness
from adapters.sandboxes.base import SandboxError
from adapters.sandboxes.local import LocalSandbox, default_tools_dir
from adapters.tasks import load_task

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "examples" / "tasks" / "write-greeting"
PYTHON = harbor_python(default_tools_dir())
needs_harbor = pytest.mark.skipif(not PYTHON.exists(), reason="Harbor is not installed: scripts/install_agents.sh")

FACTS = """
import json
from harbor.agents.factory import AgentFactory
from harbor.models.agent.name import AgentName
facts = {}
for name in AgentName.values():
    path = AgentFactory._AGENT_MAP.get(AgentName(name))
    if path is None:
        facts[name] = None
        continue
    module, cls = path.split(":")
    agent = getattr(__import__(module, fromlist=[cls]), cls)
    spec = agent.MODEL_CONNECTION
    facts[name] = {"base_url": agent.capabilities.base_url, "atif": agent.capabilities.atif,
                   "formats": [f.value for f in spec.supported_api_formats] if spec else None}
print(json.dumps(facts))
"""

ENVIRONMENT_CHECK = """
import asyncio, json, sys, tempfile
from pathlib import Path
from adapters.harbor_bridge.environment import BridgedEnvironment, Channel
from adapters.harbor_bridge.protocol import MAX_LINE, Finished, Outcome, send

async def main(socket, local):
    reader, writer = await asyncio.open_unix_connection(socket, limit=MAX_LINE)
    env = BridgedEnvironment(Channel(reader, writer), Path(tempfile.mkdtemp()))
    seen = {}
    with env.scoped_exec_env({"SCOPED": "scoped"}):
        done = await env.exec("echo $GIVEN $SCOPED; pwd; echo oops >&2; exit 3", cwd="/logs", env={"GIVEN": "given"})
    seen["exec"] = [done.return_code, done.stdout, done.stderr]
    Path(local, "up.txt").write_text("uploaded")
    Path(local, "tree", "sub").mkdir(parents=True)
    Path(local, "tree", "sub", "leaf.txt").write_text("leaf")
    await env.upload_file(Path(local, "up.txt"), "/app/up.txt")
    await env.upload_dir(Path(local, "tree"), "/app/tree")
    await env.download_file("/app/up.txt", Path(local, "down.txt"))
    await env.download_dir("/app/tree", Path(local, "back"))
    seen["round_trip"] = [Path(local, "down.txt").read_text(), Path(local, "back", "sub", "leaf.txt").read_text()]
    try:
        await env.exec("sleep 5", timeout_sec=1)
    except RuntimeError as error:
        seen["timeout"] = str(error)
    try:
        await env.download_file("/app/missing.txt", Path(local, "missing.txt"))
    except FileNotFoundError as error:
        seen["missing"] = "does not exist" in str(error)
    print(json.dumps(seen), flush=True)
    await send(writer, Finished(outcome=Outcome()))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_a_pyenv_shim_that_cannot_run_is_passed_over_for_pyenvs_own_interpreter(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pyenv shim for python3.12 is on PATH but fails while another version is selected (so Harbor was never
    installed on a machine like this one): the interpreter under `$PYENV_ROOT/versions` is taken instead."""
    shims, root = tmp_path / "shims", tmp_path / "pyenv"
    shims.mkdir()
    (shims / "python3.12").write_text("#!/bin/sh\necho 'pyenv: python3.12: command not found' >&2\nexit 127\n")
    real = root / "versions" / "3.12.1" / "bin" / "python3.12"
    real.parent.mkdir(parents=True)
    real.write_text("#!/bin/sh\necho 3.12\n")
    for script in (shims / "python3.12", real):
        script.chmod(0o755)
    monkeypatch.delenv("HARNESS_RL_PYTHON312", raising=False)
    monkeypatch.setenv("PATH", f"{shims}:/usr/bin:/bin")
    monkeypatch.setenv("PYENV_ROOT", str(root))
    assert find_python("3.12") == str(real)
    real.unlink()
    with pytest.raises(InstallError, match=r"Python 3\.12 is needed and not found: .* HARNESS_RL_PYTHON312"):
        find_python("3.12")


@pytest.mark.slow  # Harbor imports all 49 agent modules
@needs_harbor
def test_catalog_names_every_harbor_agent_and_its_claims_hold() -> None:
    done = subprocess.run([str(PYTHON), "-c", FACTS], capture_output=True, text=True, timeout=300,
                          env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout)
    assert set(facts) == set(CATALOG)
    for name, agent in CATALOG.items():
        fact = facts[name]
        if agent.state in ("proven", "registry"):
            assert fact is not None and fact["base_url"], name
            assert API_FORMATS[agent.dialect] in fact["formats"], name  # type: ignore[index]
            assert agent.atif <= fact["atif"], name  # we claim a trajectory only where Harbor converts one
            assert fact["atif"] <= (agent.atif or bool(agent.atif_reason)), name  # and say why we get none
        if agent.state == "no-endpoint":
            assert fact is None or not fact["base_url"] or not fact["formats"], name
        if fact is None:
            assert agent.state == "host", name  # named, but Harbor's factory cannot build it


@pytest.mark.anyio
@needs_harbor
async def test_harbors_environment_works_the_local_sandbox(tmp_path: Path) -> None:
    socket, local = tmp_path / "bridge.sock", tmp_path / "local"
    local.mkdir()
    async with LocalSandbox(isolation="none") as sandbox:
        await sandbox.start(load_task(TASK))
        outcomes: asyncio.Queue[object] = asyncio.Queue()

        async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await outcomes.put(await serve_runner(reader, writer, sandbox, {"HOST": "host"}))

        server = await asyncio.start_unix_server(connected, path=str(socket), limit=MAX_LINE)
        process = await asyncio.create_subprocess_exec(
            str(PYTHON), "-c", ENVIRONMENT_CHECK, str(socket), str(local), cwd=str(ROOT),
            env={"PYTHONPATH": str(ROOT), "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PATH": "/usr/bin:/bin"},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(process.communicate(), 120)
        server.close()
        assert process.returncode == 0, err.decode()
        assert await asyncio.wait_for(outcomes.get(), 5) is not None
        seen = json.loads(out.decode().strip().splitlines()[-1])
        assert seen["exec"] == [3, f"given scoped\n{sandbox.host_path('/logs')}\n", "oops\n"]
        assert seen["round_trip"] == ["uploaded", "leaf"]
        assert (sandbox.host_path("/app/tree/sub/leaf.txt")).read_text() == "leaf"
        assert seen["timeout"] == "Command timed out after 1 seconds"
        assert seen["missing"] is True


@pytest.mark.anyio
@needs_harbor
async def test_harbors_own_error_stops_an_agent_it_refuses(tmp_path: Path) -> None:
    """An option Harbor's terminus-2 does not know: its setup fails with Harbor's message, as a sandbox error."""
    harness = create_harness("harbor:terminus-2", no_such_option=1)
    endpoint = Endpoint("http://127.0.0.1:9/v1", "http://127.0.0.1:9", "key")
    async with LocalSandbox(isolation="none") as sandbox:
        await sandbox.start(load_task(TASK))
        with pytest.raises(SandboxError, match=r"Harbor's terminus-2 setup failed: ValueError: Invalid kwargs for "
                                               r"agent 'terminus-2':\n  Unknown option 'no_such_option'"):
            await harness.run(sandbox, endpoint, "do nothing", timeout=60)


@pytest.mark.anyio
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
async def test_an_agent_that_needs_processes_to_outlive_a_command_refuses_bubblewrap(tmp_path: Path) -> None:
    harness = create_harness("terminus-2")
    async with LocalSandbox(isolation="bwrap") as sandbox:
        await sandbox.start(load_task(TASK))
        with pytest.raises(SandboxError, match="needs the local sandbox with isolation=none: its tmux server"):
            await harness.install(sandbox)


@needs_harbor
def test_train_preflight_stops_with_harbors_refusal_and_says_why_others_cannot_run(tmp_path: Path) -> None:
    """Before anything starts (exit 2, one line, no run directory): Harbor's own error for options it refuses,
    and the catalog's reason for an agent that cannot run here."""
    def train(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "harness_rl.cli", "train", "--model", "tiny", "--max-steps", "1",
                               "--output-dir", str(tmp_path / "run"), *flags], capture_output=True, text=True,
                              timeout=300, cwd=ROOT)

    config = tmp_path / "run.toml"
    config.write_text('[rollouts]\nharness = "terminus-2"\n[rollouts.harness_options]\nno_such_option = 1\n'
                      '[rollouts.sandbox_options]\nisolation = "none"\n')
    refused = train("--config", str(config))
    assert refused.returncode == 2 and "Harbor refuses terminus-2: ValueError: Invalid kwargs for agent " \
                                       "'terminus-2':" in refused.stderr, refused.stderr
    network = train("--harness", "harbor:goose")
    assert network.returncode == 2 and "Harbor's goose cannot run here (network)" in network.stderr, network.stderr
    assert not (tmp_path / "run").exists()
