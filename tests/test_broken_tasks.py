"""Broken tasks never train silently on nothing: each kind is named in one line, and the run refuses to start,
stops, or counts the rollouts unscorable; a reward is never shown as a 0 that nobody earned.

The kinds: a task.toml value of the wrong type (refused when tasks load: `train` exits 2, no run folder), a
verifier that writes no reward, one that times out, one whose reward is not a number (each unscorable, with
the cause; a first step scoring none stops the run), and a test.sh that is not executable, which is not
broken here: every sandbox runs it as `bash tests/test.sh`, so it scores as usual.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fake_engine import Scripted

from adapters.sandboxes.local import LocalSandbox
from adapters.tasks import TaskError, load_tasks
from harness_rl.learner.samples import build_samples
from harness_rl.outcome import RolloutGroup
from harness_rl.run.engines import RunStopped
from harness_rl.run.metrics import console_line, rollout_metrics
from harness_rl.run.report import summarize
from harness_rl.run.rollouts import RolloutConfig, RolloutScheduler
from harness_rl.run.train import _stop_on_setup_failures
from proxy.client import ProxyClient

TASKS = Path(__file__).resolve().parents[1] / "examples" / "tasks"
TRAIN = [sys.executable, "-m", "harness_rl.cli", "train"]
GROUP = 2


def broken_digits(tmp_path: Path, test_sh: str, verifier_timeout: int = 30) -> Path:
    """The digits task with its verifier replaced (and its time limit set), in `tmp_path/task`."""
    task = tmp_path / "task"
    shutil.copytree(TASKS / "digits", task)
    (task / "tests" / "test.sh").write_text(test_sh)
    toml = (task / "task.toml").read_text().replace("[verifier]\ntimeout_sec = 30", f"[verifier]\ntimeout_sec = "
                                                                                   f"{verifier_timeout}")
    (task / "task.toml").write_text(toml)
    return task


async def run_group(proxy, fake_engine, task: Path) -> RolloutGroup:
    """One group of the echo agent (answering "1234") on `task`, in real local sandboxes behind a real proxy."""
    fake_engine.script.extend(Scripted(content="1234") for _ in range(GROUP))
    async with ProxyClient(proxy.url, proxy.admin_token) as client:
        scheduler = RolloutScheduler(load_tasks(task), client, RolloutConfig(
            harness="echo", num_generations=GROUP, max_concurrent_rollouts=GROUP),
            sandbox_factory=lambda: LocalSandbox(isolation="none"))
        return await scheduler.run_group(scheduler.tasks[0], 0)


BROKEN_VERIFIERS = [
    pytest.param("echo 'checked the answer' && echo 'no reward file written' >&2\n", 30,
                 "the verifier wrote neither reward.json nor reward.txt in /logs/verifier; the verifier exited 0; its "
                 "output ends: checked the answer no reward file written", id="writes-nothing"),
    pytest.param("echo 'waiting for a service'\nsleep 60\n", 1,
                 "the verifier wrote neither reward.json nor reward.txt in /logs/verifier; the verifier timed out "
                 "after 1s (task.toml verifier.timeout_sec); its output ends: waiting for a service",
                 id="times-out"),
    pytest.param("mkdir -p /logs/verifier && echo high > /logs/verifier/reward.txt\nexit 3\n", 30,
                 "/logs/verifier/reward.txt does not hold a number: 'high'; the verifier exited 3; it printed nothing",
                 id="not-a-number"),
]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(("test_sh", "timeout", "cause"), BROKEN_VERIFIERS)
async def test_a_broken_verifier_leaves_its_rollouts_unscorable_named_and_stops_the_first_step(
        fake_proxy, fake_engine, tmp_path: Path, test_sh: str, timeout: int, cause: str, anyio_backend) -> None:
    group = await run_group(fake_proxy, fake_engine, broken_digits(tmp_path, test_sh, timeout))
    assert [(o.env_reward, o.reward, o.error) for o in group.outcomes] == [(None, None, f"unscorable: {cause}")] * GROUP
    metrics = rollout_metrics([group], custom_reward=False)
    assert (metrics["rollouts/scored"], metrics["rollouts/unscorable"]) == (0, GROUP)
    _, learned = build_samples([group], policy_version=0, max_staleness=None, normalization="token")
    assert "reward" not in learned and "reward_std" not in learned  # no mean of nothing, never 0.0
    line = console_line(1, {**learned, **metrics})
    assert "reward" not in line and f"scored 0 | unscorable {GROUP}" in line
    with pytest.raises(RunStopped) as stopped:
        _stop_on_setup_failures([group], step=1)
    assert str(stopped.value) == f"no rollout of step 1 could be scored: {cause} ({GROUP} of {GROUP} rollouts)"
    _stop_on_setup_failures([group], step=2)  # later steps go on, counted unscorable


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_test_sh_that_is_not_executable_still_scores(fake_proxy, fake_engine, tmp_path: Path,
                                                             anyio_backend) -> None:
    task = broken_digits(tmp_path, (TASKS / "digits" / "tests" / "test.sh").read_text())
    (task / "tests" / "test.sh").chmod(0o644)
    group = await run_group(fake_proxy, fake_engine, task)
    assert [(o.reward, o.error) for o in group.outcomes] == [(1.0, None)] * GROUP
    assert rollout_metrics([group], custom_reward=False)["rollouts/scored"] == GROUP


@pytest.mark.parametrize(("toml", "message"), [
    ('[agent]\ntimeout_sec = "two minutes"\n', 'agent.timeout_sec: expected a number, got "two minutes"'),
    ("[agent]\ntimeout_sec = -5\n", "agent.timeout_sec: expected a number > 0, got -5"),
    ("[verifier]\ntimeout_sec = true\n", "verifier.timeout_sec: expected a number, got true"),
    ('[verifier.env]\nLANG = "C"\nRETRIES = 3\n', "verifier.env.RETRIES: expected a string, got 3"),
    ('[environment]\nworkdir = "app"\n', 'environment.workdir: expected an absolute path, got "app"'),
    ('environment = "docker"\n', 'environment: expected a table, got "docker"'),
    ("[task]\nname = 7\n", "task.name: expected a string, got 7"),
    ("metadata = [1, 2]\n", "metadata: expected a table, got [1, 2]"),
])
def test_a_bad_task_toml_value_is_one_line_naming_file_field_and_value(tmp_path: Path, toml: str,
                                                                        message: str) -> None:
    task = tmp_path / "tasks" / "bad"
    shutil.copytree(TASKS / "write-greeting", task)
    (task / "task.toml").write_text(f'version = "1.0"\n{toml}[solution]\nenv = {{ X = "kept, not read" }}\n')
    with pytest.raises(TaskError) as error:
        load_tasks(tmp_path / "tasks")
    assert str(error.value) == f"{task / 'task.toml'}: {message}"


def test_unknown_task_toml_keys_are_allowed_and_known_ones_typed(tmp_path: Path) -> None:
    task = tmp_path / "task"
    shutil.copytree(TASKS / "write-greeting", task)
    (task / "task.toml").write_text('version = "1.0"\nartifacts = ["out"]\n[agent]\ntimeout_sec = 90\nuser = "agent"\n'
                                    '[verifier]\ntimeout_sec = 12.5\nenv = { MODE = "strict" }\n'
                                    '[environment]\ncpus = 2\nenv = { TZ = "UTC" }\n[metadata]\nlevel = 3\n'
                                    'category = "files"\n')
    [loaded] = load_tasks(task)
    assert (loaded.name, loaded.agent_timeout_s, loaded.verifier_timeout_s) == ("task", 90.0, 12.5)
    assert (loaded.verifier_env, loaded.environment_env, loaded.workdir) == ({"MODE": "strict"}, {"TZ": "UTC"}, "/app")
    assert loaded.category == "files"  # Harbor's own metadata key; the others are allowed and not read


def test_missing_task_files_are_named_at_load(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    shutil.copytree(TASKS / "write-greeting", tasks / "a")
    shutil.copytree(TASKS / "write-greeting", tasks / "b")
    (tasks / "b" / "instruction.md").unlink()
    with pytest.raises(TaskError, match=r"^\S+/tasks/b is not a Harbor task: instruction.md is missing$"):
        load_tasks(tasks)
    shutil.copy(TASKS / "write-greeting" / "instruction.md", tasks / "b")
    (tasks / "b" / "tests" / "test.sh").unlink()
    with pytest.raises(TaskError, match=r"tasks/b is not a Harbor task: tests/test.sh \(the verifier\) is missing$"):
        load_tasks(tasks)
    with pytest.raises(TaskError, match=r"instruction.md is a file; give a Harbor task directory"):
        load_tasks(tasks / "a" / "instruction.md")


def test_train_refuses_a_bad_task_toml_in_one_line_and_leaves_no_run_folder(tmp_path: Path) -> None:
    task = tmp_path / "task"
    shutil.copytree(TASKS / "digits", task)
    (task / "task.toml").write_text('[agent]\ntimeout_sec = "two minutes"\n')
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run([*TRAIN, "--tasks", str(task), "--output-dir", "run"], capture_output=True, text=True,
                          timeout=120, cwd=work)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f'harness-rl train: --tasks: {task}/task.toml: agent.timeout_sec: expected a number, got "two minutes"']
    assert os.listdir(work) == []


def test_the_summary_counts_scored_and_unscorable_rollouts_and_averages_only_scored_steps() -> None:
    rows = [{"step": 1, "rollouts/scored": 0, "rollouts/unscorable": 4},
            {"step": 2, "reward": 0.5, "rollouts/scored": 3, "rollouts/unscorable": 1},
            {"step": 3, "reward": 0.25, "rollouts/scored": 4, "rollouts/unscorable": 0}]
    summary = summarize(rows, duration_s=1.0)
    assert (summary["rollouts_scored"], summary["rollouts_unscorable"]) == (7, 5)
    assert summary["reward_first_steps"] == summary["reward_last_steps"] == 0.375


@pytest.mark.slow
def test_train_with_a_verifier_that_writes_nothing_stops_at_step_1_naming_it(tmp_path: Path) -> None:
    """The embedded default on a task whose verifier writes no reward: exit 1 with the cause in one line, and
    summary.json says why it stopped; no "mean reward 0.000"."""
    task = broken_digits(tmp_path, "echo 'looked at answer.txt'\n")
    out = tmp_path / "run"
    done = subprocess.run([*TRAIN, "--tasks", str(task), "--max-steps", "2", "--output-dir", str(out),
                           "--report-to", "none"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    cause = ("no rollout of step 1 could be scored: the verifier wrote neither reward.json nor reward.txt in "
             "/logs/verifier; the verifier exited 0; its output ends: looked at answer.txt (8 of 8 rollouts)")
    assert f"harness-rl train: stopped: {cause}" in done.stderr.splitlines() and "Traceback" not in done.stderr
    assert "0.000" not in done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == f"RunStopped: {cause}" and summary["steps"] == 0
    assert summary["reward_first_steps"] is None
