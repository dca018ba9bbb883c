"""`harness-rl train` under torchrun (2 gloo processes on CPU): the demo learns as the one-process demo does,
and a run killed after a checkpoint resumes with 1 or 2 processes from where it stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness_rl.learner.checkpoint import checkpoint_dir, complete_checkpoints

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
TRAIN = [sys.executable, "-m", "harness_rl", "train", "--report-to", "none"]


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_demo_learns_with_two_learner_processes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    started = time.monotonic()
    done = subprocess.run([*TRAIN, "--nproc-per-node", "2", "--max-steps", "30", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    print(f"2-process demo: {time.monotonic() - started:.0f}s, reward {summary['reward_first_steps']:.3f} -> "
          f"{summary['reward_last_steps']:.3f}")
    assert "harness_rl.torchrun --standalone --nproc-per-node 2 -m harness_rl train" in done.stderr
    assert summary["steps"] == 30 and summary["reward_first_steps"] < 0.15
    assert summary["reward_last_steps"] > summary["reward_first_steps"] + 0.3
    final = checkpoint_dir(out, 30)
    assert sorted(p.name for p in (final / "state").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (final / "model" / "config.json").is_file() and (final / "model" / "tokenizer.json").is_file()
    assert all(row["sync/logp_difference_max"] < 1e-5 for row in read_metrics(out) if "sync/logp_difference_max" in row)


@pytest.mark.parametrize("resumed_by", [1, 2])
def test_a_run_killed_after_a_checkpoint_resumes_with_one_or_two_processes(tmp_path: Path, resumed_by: int) -> None:
    out = tmp_path / "run"
    common = ["--output-dir", str(out), "--max-steps", "5", "--save-every", "2", "--num-generations", "4"]
    first = subprocess.Popen([*TRAIN, "--nproc-per-node", "2", *common], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 1500
        while not complete_checkpoints(out) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert complete_checkpoints(out), first.stderr.read().decode()[-4000:] if first.poll() is not None else ""
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # torchrun and both learner processes, with no chance to clean up
        first.wait()
    saved = complete_checkpoints(out)[-1]
    step = int(saved.name.removeprefix("step-"))
    resumed = subprocess.run([*TRAIN, "--nproc-per-node", str(resumed_by), *common, "--resume"], capture_output=True,
                             text=True, timeout=3000)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    steps = [int(row["step"]) for row in read_metrics(out)]
    assert steps[-(5 - step):] == list(range(step + 1, 6))  # the resumed run went on from the checkpoint's step
    assert json.loads((out / "summary.json").read_text())["steps"] == 5
    assert (checkpoint_dir(out, 5) / "model" / "config.json").is_file()
