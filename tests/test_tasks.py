"""Harbor task loading, reward-file parsing, and the shipped tasks' verifiers run in the local sandbox.

Downloading a dataset repo from the Hugging Face Hub cannot run offline; the layout it produces
(`tasks/<name>/`) is tested from a local directory instead.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from adapters.sandboxes.local import LocalSandbox
from adapters.tasks import TaskError, load_task, load_tasks
from adapters.verifier import Reward, parse_reward, verify

pytestmark = pytest.mark.anyio
TASKS = Path(__file__).resolve().parents[1] / "examples" / "tasks"


@pytest.mark.parametrize(
    ("json_text", "txt_text", "key", "expected"),
    [
        (None, "1\n", None, 1.0),
        (None, " 0.25 ", None, 0.25),
        (None, "0", None, 0.0),
        ('{"reward": 0.5, "length": 7}', None, None, 0.5),
        ('{"score": 0.75}', None, None, 0.75),
        ('{"a": 0.1, "b": 0.9}', None, "b", 0.9),
        ('{"a": 0.1, "b": 0.9}', None, "c, a", 0.1),
        ('{"reward": 0.2}', "1", None, 0.2),
    ],
)
def test_reward_files_give_one_number(json_text, txt_text, key, expected) -> None:
    assert parse_reward(json_text, txt_text, key).value == expected


@pytest.mark.parametrize(
    ("json_text", "txt_text", "key", "why"),
    [
        (None, None, None, "neither"),
        (None, "", None, "empty"),
        (None, "  \n", None, "empty"),
        (None, "nan", None, "non-finite"),
        (None, "inf", None, "non-finite"),
        (None, "yes", None, "not hold a number"),
        ("", "1", None, "empty"),
        ("[1]", None, None, "flat map"),
        ("{not json", None, None, "not JSON"),
        ('{"reward": NaN}', None, None, "not a finite number"),
        ('{"reward": "high"}', None, None, "not a finite number"),
        ('{"reward": true}', None, None, "not a finite number"),
        ('{"a": 1, "b": 2}', None, None, "several keys"),
        ('{"a": 1}', None, "b", "no finite value"),
    ],
)
def test_unreadable_rewards_are_unscorable_never_zero(json_text, txt_text, key, why) -> None:
    reward = parse_reward(json_text, txt_text, key)
    assert reward.value is None
    assert why in reward.error


def test_json_keeps_every_finite_value() -> None:
    reward = parse_reward('{"reward": 1, "time": Infinity, "length": 3}', None)
    assert reward == Reward(1.0, {"reward": 1.0, "length": 3.0})
    assert all(math.isfinite(v) for v in reward.rewards.values())


def test_shipped_tasks_load_with_their_settings() -> None:
    tasks = load_tasks(TASKS)
    assert [t.name for t in tasks] == ["harness-rl/digits", "harness-rl/fix-off-by-one", "harness-rl/write-greeting"]
    digits, fix, greeting = tasks
    assert greeting.instruction.strip().endswith("hello harness-rl")
    assert (fix.workdir, fix.agent_timeout_s, fix.verifier_timeout_s) == ("/app", 300.0, 60.0)
    assert fix.workspace_seed == TASKS / "fix-off-by-one" / "environment" / "workspace"
    assert greeting.workspace_seed is None
    assert digits.category is None  # its [metadata] holds only keys harness-rl does not read
    assert load_tasks(TASKS / "digits") == [digits]


def test_a_dataset_laid_out_as_tasks_dirs_loads(tmp_path: Path) -> None:
    shutil.copytree(TASKS / "write-greeting", tmp_path / "tasks" / "hello")
    (tmp_path / "tasks" / "README.md").write_text("not a task")
    assert [t.path.name for t in load_tasks(tmp_path)] == ["hello"]


def test_broken_tasks_name_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "instruction.md").write_text("do it")
    with pytest.raises(TaskError, match="tests/test.sh"):
        load_task(tmp_path)
    with pytest.raises(TaskError, match="instruction.md"):
        load_task(tmp_path / "nowhere")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test.sh").write_text("exit 0")
    (tmp_path / "task.toml").write_text("[agent\n")
    with pytest.raises(TaskError, match="task.toml"):
        load_task(tmp_path)
    with pytest.raises(TaskError, match="no task directory"):
        load_tasks(tmp_path / "missing" / "deeper" / "still")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TaskError, match="holds no Harbor tasks"):
        load_tasks(empty)


ISOLATIONS = ["none", pytest.param("bwrap", marks=pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed"))]
SOLUTIONS = [
    ("write-greeting", None, 0.0),
    ("write-greeting", "printf 'hello harness-rl\\n' > greeting.txt", 1.0),
    ("write-greeting", "echo 'hello world' > greeting.txt", 0.0),
    ("fix-off-by-one", None, 0.0),
    ("fix-off-by-one", "sed -i 's/range(n)/range(n + 1)/' mathlib.py", 1.0),
    ("digits", None, 0.0),
    ("digits", "echo 12ab > answer.txt", 0.5),
    ("digits", "printf '3 1 4 1 5\\n9' > answer.txt", 1.0),
]


@pytest.mark.parametrize("isolation", ISOLATIONS)
@pytest.mark.parametrize(("name", "solution", "expected"), SOLUTIONS)
async def test_shipped_verifiers_score_the_work(isolation, name, solution, expected) -> None:
    task = load_task(TASKS / name)
    async with LocalSandbox(isolation=isolation) as sandbox:
        await sandbox.start(task)
        if solution:
            assert (await sandbox.exec(solution)).ok
        result = await verify(task, sandbox)
    assert result.reward.value == expected, result.output
    assert result.exit_code == 0 and not result.timed_out


async def test_a_verifier_that_writes_nothing_is_unscorable(tmp_path: Path) -> None:
    task_dir = tmp_path / "silent"
    shutil.copytree(TASKS / "write-greeting", task_dir)
    (task_dir / "tests" / "test.sh").write_text("echo checked but wrote no reward\n")
    async with LocalSandbox() as sandbox:
        task = load_task(task_dir)
        await sandbox.start(task)
        await sandbox.write_text("/logs/verifier/reward.txt", "1")
        result = await verify(task, sandbox)
    assert result.reward.value is None
    assert "neither reward.json nor reward.txt" in result.reward.error
    assert "checked but wrote no reward" in result.output


async def test_a_verifier_past_its_limit_is_killed_and_unscorable(tmp_path: Path) -> None:
    task_dir = tmp_path / "slow"
    shutil.copytree(TASKS / "write-greeting", task_dir)
    (task_dir / "tests" / "test.sh").write_text("sleep 60; echo 1 > /logs/verifier/reward.txt\n")
    toml = (task_dir / "task.toml").read_text().replace("[verifier]\ntimeout_sec = 60", "[verifier]\ntimeout_sec = 1")
    (task_dir / "task.toml").write_text(toml)
    async with LocalSandbox() as sandbox:
        task = load_task(task_dir)
        await sandbox.start(task)
        result = await verify(task, sandbox, reward_key="reward")
    assert result.timed_out and result.reward.value is None


def test_a_dataset_the_hub_cannot_serve_offline_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    """The download itself needs the Hub (not reachable here); offline, the error names the dataset."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TaskError, match="could not download dataset 'someorg/some-tasks'"):
        load_tasks("hf://datasets/someorg/some-tasks", cache_dir=tmp_path)
