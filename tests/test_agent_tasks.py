"""The shipped agent tasks (examples/agent-tasks): each one is solved by its reference solution and
failed by doing nothing, judged by its own verifier in the real local sandbox.

The reference solution is replayed the way the teacher replays it, one `solution_steps` command per
tool call in the task's workdir, and also run whole as Harbor's oracle would (`bash solve.sh`).
Both isolation modes run: bubblewrap (real `/app`, `/logs` paths) and none (the sandbox rewrites the
verifier's Harbor paths to its host directories).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path, PurePosixPath

import pytest

from adapters.sandboxes.local import LocalSandbox
from adapters.tasks import Task, load_tasks
from adapters.verifier import verify

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[1] / "examples" / "agent-tasks"
WARMUP = load_tasks(ROOT / "warmup")
TRAIN = load_tasks(ROOT / "train")
HELDOUT = load_tasks(ROOT / "heldout")
FAMILIES = ("copy-into", "count-lines", "sort-lines", "append-word")
INSPECTIONS = ("cat", "grep", "wc")
ISOLATIONS = ["none", pytest.param("bwrap", marks=pytest.mark.skipif(shutil.which("bwrap") is None,
                                                                     reason="bubblewrap is not installed"))]


def test_the_split_is_large_enough_and_disjoint() -> None:
    assert len(TRAIN) >= 6 and len(HELDOUT) >= 2
    names = [t.name for t in WARMUP + TRAIN + HELDOUT]
    assert len(set(names)) == len(names)
    assert len({t.path.name for t in WARMUP + TRAIN + HELDOUT}) == len(names)


def test_the_tasks_are_the_families_draw_and_every_held_out_task_is_a_new_instance_of_a_trained_family() -> None:
    checked = subprocess.run([sys.executable, str(ROOT / "families.py"), "--check"], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    for split, count in ((WARMUP, 12), (TRAIN, 6), (HELDOUT, 5)):
        assert Counter(t.category for t in split) == dict.fromkeys(FAMILIES, count)
    instructions = [t.instruction for t in WARMUP + TRAIN + HELDOUT]
    assert len(set(instructions)) == len(instructions)


@pytest.mark.parametrize("task", WARMUP + TRAIN + HELDOUT, ids=lambda t: t.path.name)
def test_each_task_is_short_and_needs_several_commands(task: Task) -> None:
    assert len(task.solution_steps) >= 2
    assert all("\n" not in step for step in task.solution_steps)
    assert len(task.instruction.split()) <= 25
    assert (task.workdir, task.agent_timeout_s) == ("/app", 120.0)


async def _reward(task: Task, isolation: str, steps: list[str], whole_script: bool = False,
                  strict: bool = True) -> float | None:
    """The verifier's reward after running `steps` (each must succeed when `strict`) in a fresh sandbox."""
    async with LocalSandbox(isolation=isolation) as sandbox:  # type: ignore[arg-type]
        await sandbox.start(task)
        for step in steps:
            result = await sandbox.exec(step, timeout=30)
            assert result.ok or not strict, f"{task.path.name}: {step!r} failed: {result.stderr}"
        if whole_script:
            solution = str(PurePosixPath(sandbox.logs_dir) / "solution")
            await sandbox.upload(task.path / "solution", solution)
            result = await sandbox.exec(["bash", f"{solution}/solve.sh"], timeout=30)
            assert result.ok, result.stderr
        verification = await verify(task, sandbox)
        assert verification.exit_code == 0, verification.output
        return verification.reward.value


@pytest.mark.parametrize("isolation", ISOLATIONS)
@pytest.mark.parametrize("task", WARMUP + TRAIN + HELDOUT, ids=lambda t: t.path.name)
async def test_solution_steps_pass_and_doing_nothing_fails(task: Task, isolation: str) -> None:
    assert await _reward(task, isolation, []) == 0.0
    assert await _reward(task, isolation, task.solution_steps) == 1.0


@pytest.mark.parametrize("task", WARMUP + TRAIN + HELDOUT, ids=lambda t: t.path.name)
async def test_solution_runs_whole_as_harbors_oracle(task: Task) -> None:
    assert await _reward(task, "none", [], whole_script=True) == 1.0


@pytest.mark.parametrize("task", WARMUP + TRAIN + HELDOUT, ids=lambda t: t.path.name)
async def test_half_the_work_scores_0(task: Task) -> None:
    """The first command alone never solves a task; nor do the others alone, unless the first only looks."""
    first, *rest = task.solution_steps
    assert await _reward(task, "none", [first], strict=False) == 0.0
    if first.split()[0] not in INSPECTIONS:
        assert await _reward(task, "none", rest, strict=False) == 0.0
