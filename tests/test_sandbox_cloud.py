"""The e2b and harbor sandboxes, against their SDKs' interfaces.

No E2B cloud and no Docker engine are reachable from the build machine, so these tests drive the
adapters with recording stand-ins: every call the e2b adapter makes is bound to the real SDK's
`AsyncSandbox.create`, `Commands.run`, `Filesystem.write/read` signatures (a wrong keyword fails
the test), and results come back as the SDK's own `CommandResult` / exception types. Harbor needs
Python >= 3.12 and is not installed here; its stand-in has `BaseEnvironment`'s method names.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from adapters.sandboxes import SandboxError, SandboxStartError, create_sandbox
from adapters.tasks import load_task

pytestmark = pytest.mark.anyio
TASKS = Path(__file__).resolve().parents[1] / "examples" / "tasks"
e2b = pytest.importorskip("e2b", reason="the e2b SDK is not installed (extra: e2b)")
from e2b.sandbox.commands.command_handle import CommandResult  # noqa: E402
from e2b.sandbox_async.commands.command import Commands  # noqa: E402
from e2b.sandbox_async.filesystem.filesystem import Filesystem  # noqa: E402


class RecordingE2B:
    """Stands in for `e2b.AsyncSandbox`; binds every call to the real SDK signature."""

    instances: list[RecordingE2B] = []
    fail_create = False
    create_delay_s = 0.0
    creating = asyncio.Event()  # set once a create has begun

    def __init__(self, create_kwargs: dict[str, Any]) -> None:
        self.create_kwargs = create_kwargs
        self.runs: list[dict[str, Any]] = []
        self.stored: dict[str, bytes] = {}
        self.killed = 0
        self.next_results: list[Any] = []
        self.commands, self.files = self, self
        self.sandbox_id = "sbx-test"

    @classmethod
    async def create(cls, *args: Any, **kwargs: Any) -> RecordingE2B:
        inspect.signature(e2b.AsyncSandbox.create).bind(*args, **kwargs)
        if cls.fail_create:
            raise e2b.RateLimitException("too many sandboxes")
        cls.creating.set()
        await asyncio.sleep(cls.create_delay_s)
        box = cls(kwargs)
        cls.instances.append(box)
        return box

    async def run(self, *args: Any, **kwargs: Any) -> CommandResult:
        bound = inspect.signature(Commands.run).bind(None, *args, **kwargs)
        self.runs.append(dict(bound.arguments))
        outcome = self.next_results.pop(0) if self.next_results else CommandResult("", "ok\n", 0, None)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def write(self, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(Filesystem.write).bind(None, *args, **kwargs)
        self.stored[bound.arguments["path"]] = bound.arguments["data"]

    async def read(self, *args: Any, **kwargs: Any) -> bytes:
        bound = inspect.signature(Filesystem.read).bind(None, *args, **kwargs)
        assert bound.arguments["format"] == "bytes"
        if bound.arguments["path"] not in self.stored:
            raise e2b.FileNotFoundException("no such file")
        return self.stored[bound.arguments["path"]]

    async def kill(self, **kwargs: Any) -> bool:
        inspect.signature(e2b.AsyncSandbox.kill).bind(None, **kwargs)
        self.killed += 1
        return True


@pytest.fixture
def recorder():
    RecordingE2B.instances, RecordingE2B.fail_create, RecordingE2B.create_delay_s = [], False, 0.0
    RecordingE2B.creating = asyncio.Event()
    yield RecordingE2B


@pytest.fixture
async def started(recorder):
    box = create_sandbox("e2b", template="harness-rl-base", sandbox_class=recorder)
    await box.start(load_task(TASKS / "fix-off-by-one"))
    yield box, recorder.instances[0]
    await box.close()


async def test_start_creates_prepares_and_seeds(started) -> None:
    box, fake = started
    assert fake.create_kwargs["template"] == "harness-rl-base"
    assert fake.create_kwargs["timeout"] == 3600
    assert fake.create_kwargs["metadata"]["task"] == "harness-rl/fix-off-by-one"
    setup = fake.runs[0]
    assert setup["user"] == "root" and "mkdir -p" in setup["cmd"] and "/logs/verifier" in setup["cmd"]
    assert box.workdir == "/app" and not box.reaches_host_loopback


async def test_exec_wraps_a_real_time_limit_and_maps_results(started) -> None:
    box, fake = started
    fake.next_results = [CommandResult("", "hi\n", 0, None)]
    result = await box.exec(["echo", "it's"], env={"A": "1"}, timeout=30)
    call = fake.runs[-1]
    assert call["cmd"] == "timeout -k 5 30 bash -c " + shlex.quote(shlex.join(["echo", "it's"]))
    assert call["envs"] == {"A": "1"} and call["cwd"] == "/app" and call["timeout"] > 30
    assert (result.exit_code, result.stdout, result.timed_out) == (0, "hi\n", False)

    fake.next_results = [e2b.CommandExitException("boom\n", "", 2, "exit status 2")]
    failed = await box.exec("false", timeout=30)
    assert (failed.exit_code, failed.stderr, failed.timed_out) == (2, "boom\n", False)

    fake.next_results = [e2b.CommandExitException("", "partial\n", 124, "exit status 124")]
    killed = await box.exec("sleep 100", timeout=1)
    assert killed.timed_out and killed.exit_code is None and killed.stdout == "partial\n"

    fake.next_results = [e2b.TimeoutException("context deadline exceeded")]
    lost = await box.exec("sleep 100", timeout=1)
    assert lost.timed_out


async def test_files_round_trip_and_missing_is_none(started) -> None:
    box, fake = started
    await box.write_text("/logs/verifier/reward.txt", "1")
    assert await box.read_text("/logs/verifier/reward.txt") == "1"
    assert await box.read_file("/logs/verifier/reward.json") is None
    assert fake.stored["/app/mathlib.py"].startswith(b"def total")


async def test_close_kills_once(started) -> None:
    box, fake = started
    await box.close()
    await box.close()
    assert fake.killed == 1


async def test_create_failure_is_a_retryable_start_error(recorder) -> None:
    recorder.fail_create = True
    box = create_sandbox("e2b", sandbox_class=recorder)
    with pytest.raises(SandboxStartError, match="too many sandboxes"):
        await box.start(load_task(TASKS / "digits"))


async def test_a_start_cancelled_during_creation_kills_the_new_sandbox(recorder) -> None:
    recorder.create_delay_s = 0.3
    starting = asyncio.create_task(create_sandbox("e2b", sandbox_class=recorder).start(load_task(TASKS / "digits")))
    await recorder.creating.wait()
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert [box.killed for box in recorder.instances] == [1]


async def test_missing_sdk_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "e2b", None)
    with pytest.raises(SandboxError, match=r"harness-rl\[e2b\]"):
        await create_sandbox("e2b").start(load_task(TASKS / "digits"))


class RecordingHarborEnvironment:
    """Harbor's `BaseEnvironment` surface: start/stop/exec/upload_file/download_file."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.files: dict[str, bytes] = {}

    async def start(self, force_build: bool) -> None:
        self.calls.append(("start", {"force_build": force_build}))

    async def stop(self, delete: bool) -> None:
        self.calls.append(("stop", {"delete": delete}))

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None) -> Any:
        self.calls.append(("exec", {"command": command, "cwd": cwd, "env": env, "timeout_sec": timeout_sec}))
        if command.startswith("sleep"):
            raise TimeoutError("exec timed out")
        code = 0 if not command.startswith("test -f") or command.split()[-1] in self.files else 1
        return type("ExecResult", (), {"return_code": code, "stdout": "", "stderr": ""})()

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        self.files[target_path] = Path(source_path).read_bytes()

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        Path(target_path).write_bytes(self.files[source_path])


async def test_harbor_maps_onto_base_environment() -> None:
    environment = RecordingHarborEnvironment()
    factory_args: list[tuple] = []

    def factory(env_type, task, trial_dir, options):
        factory_args.append((env_type, task.name, options))
        return environment

    box = create_sandbox("harbor", env_type="modal", options={"region": "eu"}, environment_factory=factory)
    await box.start(load_task(TASKS / "write-greeting"))
    assert factory_args == [("modal", "harness-rl/write-greeting", {"region": "eu"})]
    assert environment.calls[0] == ("start", {"force_build": False})
    result = await box.exec(["echo", "a b"], env={"K": "v"}, timeout=12.5)
    assert result.ok
    assert environment.calls[-1] == ("exec", {"command": "echo 'a b'", "cwd": "/app", "env": {"K": "v"},
                                              "timeout_sec": 12})
    assert (await box.exec("sleep 100", timeout=1)).timed_out
    await box.write_text("/logs/verifier/reward.txt", "0.5")
    assert await box.read_text("/logs/verifier/reward.txt") == "0.5"
    assert await box.read_file("/logs/verifier/reward.json") is None
    await box.close()
    assert environment.calls[-1] == ("stop", {"delete": True})


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="checks the error shown on Python < 3.12")
async def test_harbor_on_old_python_says_what_it_needs() -> None:
    with pytest.raises(SandboxError, match=r"Python >= 3.12"):
        await create_sandbox("harbor").start(load_task(TASKS / "digits"))


HARBOR_CHECK = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from harbor.environments.base import BaseEnvironment
from adapters.sandboxes.harbor_env import _harbor_environment
from adapters.tasks import load_task
task = load_task(Path(sys.argv[1]) / "examples" / "tasks" / "fix-off-by-one")
env = _harbor_environment("docker", task, Path(sys.argv[2]), {})
assert isinstance(env, BaseEnvironment), type(env)
assert env.environment_dir == task.environment_dir
print(type(env).__name__)
"""


@pytest.mark.skipif(not os.environ.get("HARNESS_RL_HARBOR_PYTHON"),
                    reason="set HARNESS_RL_HARBOR_PYTHON to a Python >= 3.12 with harbor installed")
def test_real_harbor_builds_an_environment_for_a_shipped_task(tmp_path: Path) -> None:
    """With Harbor present (a separate 3.12 interpreter), our factory call matches its API."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([os.environ["HARNESS_RL_HARBOR_PYTHON"], "-c", HARBOR_CHECK, str(root), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "DockerEnvironment"
