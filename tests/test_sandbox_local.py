"""The local sandbox: workspace layout, isolation, time limits, and nothing left behind."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path, PurePosixPath

import pytest

from adapters.sandboxes import SandboxError, create_sandbox
from adapters.sandboxes.local import LocalSandbox, marked_processes
from adapters.tasks import load_task

TASKS = Path(__file__).resolve().parents[1] / "examples" / "tasks"
pytestmark = pytest.mark.anyio
ISOLATIONS = ["none", pytest.param("bwrap", marks=pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (scripts/install_agents.sh installs it)"))]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


async def wait_dead(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return not alive(pid)


async def no_processes_left(sandbox: LocalSandbox, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while any(alive(pid) for pid in marked_processes(sandbox.id)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return not any(alive(pid) for pid in marked_processes(sandbox.id))


@pytest.fixture(params=ISOLATIONS)
async def sandbox(request, tmp_path):
    box = LocalSandbox(isolation=request.param, tools_dir=tmp_path / "tools")
    await box.start(load_task(TASKS / "fix-off-by-one"))
    yield box
    await box.close()


async def test_workspace_is_seeded_and_commands_run_in_it(sandbox: LocalSandbox) -> None:
    result = await sandbox.exec("pwd; cat mathlib.py | head -1; echo $HOME; echo $GREETING >&2; exit 3",
                                env={"GREETING": "hi"})
    assert result.exit_code == 3 and not result.timed_out
    lines = result.stdout.splitlines()
    assert lines == [sandbox.workdir, "def total(n: int) -> int:", sandbox.home]
    assert result.stderr == "hi\n"


async def test_files_written_inside_are_read_back_and_argv_needs_no_quoting(sandbox: LocalSandbox) -> None:
    text = "it's \"quoted\" $HOME `x`"
    result = await sandbox.exec(["python3", "-c", "import sys; open('out.txt', 'w').write(sys.argv[1])", text])
    assert result.ok, result.stderr
    assert await sandbox.read_text(f"{sandbox.workdir}/out.txt") == text
    assert await sandbox.read_file(f"{sandbox.workdir}/missing.txt") is None


async def test_harbor_paths_reach_the_sandbox_logs_and_tests(sandbox: LocalSandbox, tmp_path: Path) -> None:
    script = tmp_path / "tests" / "test.sh"
    script.parent.mkdir()
    script.write_text("echo 0.25 > /logs/verifier/reward.txt\ncp /app/mathlib.py /logs/artifacts/\n")
    await sandbox.upload(script.parent, sandbox.tests_dir)
    result = await sandbox.exec(["bash", f"{sandbox.tests_dir}/test.sh"])
    assert result.ok, result.stderr
    assert await sandbox.read_text(f"{sandbox.logs_dir}/verifier/reward.txt") == "0.25\n"
    out = tmp_path / "downloaded"
    await sandbox.download(f"{sandbox.logs_dir}/artifacts", out)
    assert (out / "mathlib.py").read_text().startswith("def total")


async def test_timeout_kills_the_whole_tree_including_escaped_sessions(sandbox: LocalSandbox) -> None:
    started = time.monotonic()
    result = await sandbox.exec("echo started; setsid sleep 300 & sleep 300 & wait", timeout=1.0)
    assert result.timed_out and result.exit_code is None
    assert result.stdout == "started\n"
    assert time.monotonic() - started < 15
    assert await no_processes_left(sandbox)


async def test_close_kills_background_daemons_and_removes_the_workspace(sandbox: LocalSandbox) -> None:
    """Unisolated, a daemon outlives its command until close; under bwrap it dies with its pid namespace."""
    result = await sandbox.exec("nohup setsid sleep 300 >/dev/null 2>&1 & echo $!")
    assert result.ok
    if sandbox.isolation == "none":  # the daemon may still be between setsid's fork and its exec: wait for it
        for _ in range(250):
            if marked_processes(sandbox.id):
                break
            await asyncio.sleep(0.02)
        assert marked_processes(sandbox.id)
    root = sandbox.root
    await sandbox.close()
    assert await no_processes_left(sandbox)
    assert root is not None and not root.exists()
    await sandbox.close()


async def test_cancelling_exec_kills_the_command(sandbox: LocalSandbox) -> None:
    running = asyncio.create_task(sandbox.exec("sleep 300"))
    for _ in range(100):
        if marked_processes(sandbox.id):
            break
        await asyncio.sleep(0.02)
    victims = marked_processes(sandbox.id)
    assert victims
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    for pid in victims:
        assert await wait_dead(pid)


async def test_process_environment_is_clean() -> None:
    os.environ["HARNESS_RL_TEST_SECRET"] = "leak"
    try:
        async with LocalSandbox(isolation="none") as box:
            await box.start(load_task(TASKS / "write-greeting"))
            result = await box.exec("env")
        assert "HARNESS_RL_TEST_SECRET" not in result.stdout
        assert f"HARNESS_RL_SANDBOX={box.id}" in result.stdout
    finally:
        del os.environ["HARNESS_RL_TEST_SECRET"]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
async def test_bwrap_keeps_the_host_read_only_and_tmp_private() -> None:
    outside = Path(__file__).resolve().parent / f"outside-{os.getpid()}.txt"
    async with create_sandbox("local", isolation="bwrap") as box:
        await box.start(load_task(TASKS / "write-greeting"))
        denied = await box.exec(f"touch {outside}")
        assert denied.exit_code != 0 and not outside.exists()
        assert (await box.exec("echo kept > /tmp/note")).ok
        assert (await box.exec("cat /tmp/note")).stdout == "kept\n"
        runtime = {PurePosixPath(path).parts[2] for path in box._hidden_runtime() if path.startswith("/tmp/")}
        assert (await box.exec("ls /tmp")).stdout.split() == sorted({"note"} | runtime)
        pid_view = await box.exec("ps -e -o pid= | wc -l")
        assert int(pid_view.stdout) < 10


def test_unknown_sandbox_kind_is_named() -> None:
    with pytest.raises(ValueError, match="local, e2b, harbor"):
        create_sandbox("docker")


FETCH = """
import sys, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())
except Exception as error:
    print(type(error).__name__, error)
"""


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
async def test_proxy_only_network_reaches_the_allowed_port_and_nothing_else() -> None:
    from aiohttp import web

    name_key = web.AppKey("name", str)

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text=f"hello from {request.app[name_key]}")

    runners, urls = [], []
    for name in ("proxy", "other"):
        app = web.Application()
        app[name_key] = name
        app.router.add_route("*", "/{tail:.*}", hello)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    try:
        async with LocalSandbox(isolation="bwrap", network="proxy-only") as box:
            await box.start(load_task(TASKS / "write-greeting"))
            await box.allow(urls[0] + "/s/abc/v1")
            allowed = await box.exec(["python3", "-c", FETCH, urls[0] + "/s/abc/v1/models"])
            assert allowed.stdout.strip() == "hello from proxy", allowed.stderr
            again = await box.exec(["python3", "-c", FETCH, urls[0]])
            assert again.stdout.strip() == "hello from proxy"
            blocked = await box.exec(["python3", "-c", FETCH, urls[1]])
            assert "Connection refused" in blocked.stdout
            outside = await box.exec(["python3", "-c", FETCH, "https://registry.npmjs.org/"])
            assert outside.stdout.startswith("URLError")
            with pytest.raises(SandboxError, match="loopback"):
                await box.allow("https://example.com/v1")
    finally:
        for runner in runners:
            await runner.cleanup()


def test_proxy_only_needs_bubblewrap() -> None:
    with pytest.raises(SandboxError, match="bubblewrap"):
        LocalSandbox(isolation="none", network="proxy-only")


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
async def test_a_workdir_inside_a_host_directory_keeps_the_rest_of_it(tmp_path: Path) -> None:
    shutil.copytree(TASKS / "fix-off-by-one", tmp_path / "task")
    toml = tmp_path / "task" / "task.toml"
    toml.write_text(toml.read_text().replace('workdir = "/app"', 'workdir = "/usr/src/app"'))
    async with LocalSandbox(isolation="bwrap") as box:
        await box.start(load_task(tmp_path / "task"))
        result = await box.exec("pwd; ls; python3 -c 'import mathlib; print(mathlib.total(3))'; ls /usr/bin/env")
        assert result.ok, result.stderr
        assert result.stdout.split() == ["/usr/src/app", "mathlib.py", "3", "/usr/bin/env"]
