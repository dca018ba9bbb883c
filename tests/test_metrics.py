"""Metrics backends: report_to parsing, TensorBoard read back with TensorBoard's own reader, trackio offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness_rl.run.metrics import MetricsBackendError, MetricsLogger, parse_report_to

STEPS = [
    {"reward": 0.25, "loss": -0.5, "sample/staleness_mean": 1.0, "mismatch_kl": 1e-3},
    {"reward": 0.75, "loss": 0.125, "sample/staleness_mean": 0.5, "mismatch_kl": 2e-3},
    {"reward": 1.0, "loss": float("nan"), "sample/staleness_mean": 0.0, "mismatch_kl": 4e-3},  # nan is dropped
]


def test_report_to_is_checked_and_normalised():
    assert parse_report_to("jsonl, TensorBoard,jsonl") == ("jsonl", "tensorboard")
    assert parse_report_to(["trackio"]) == ("trackio",)
    assert parse_report_to("none") == ()
    assert parse_report_to("") == ()
    with pytest.raises(MetricsBackendError, match="unknown --report-to backend 'wandb': choose from jsonl, "
                                                  "tensorboard, trackio"):
        parse_report_to("jsonl,wandb")


def test_tensorboard_events_read_back_with_trl_names(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, console=False, report_to="jsonl,tensorboard")
    for step, metrics in enumerate(STEPS, start=1):
        logger.log(step, metrics)
    logger.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/reward", "train/loss", "train/sample/staleness_mean",
                                             "train/mismatch_kl"}
    reward = events.Scalars("train/reward")
    assert [(e.step, e.value) for e in reward] == [(1, 0.25), (2, 0.75), (3, 1.0)]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, -0.5), (2, 0.125)]
    assert [e.value for e in events.Scalars("train/mismatch_kl")] == pytest.approx([1e-3, 2e-3, 4e-3], rel=1e-6)
    # metrics.jsonl keeps the plain names, one row per step
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[2] == {"step": 3, "reward": 1.0, "sample/staleness_mean": 0.0, "mismatch_kl": 4e-3}


def test_only_the_named_backends_write(tmp_path):
    logger = MetricsLogger(tmp_path, console=False, report_to="tensorboard")
    logger.log(1, STEPS[0])
    logger.close()
    assert not (tmp_path / "metrics.jsonl").exists()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert not (tmp_path / "trackio").exists()


TRACKIO_SCRIPT = """
import json, sys
from harness_rl.run.metrics import MetricsLogger
steps = json.loads(sys.argv[2])
logger = MetricsLogger(sys.argv[1], console=False, report_to="trackio")
for step, metrics in enumerate(steps, start=1):
    logger.log(step, metrics)
logger.close()
from trackio.sqlite_storage import SQLiteStorage
print("LOGS " + json.dumps(SQLiteStorage.get_logs("harness-rl", "run"), default=str))
"""


def test_trackio_logs_offline_under_the_run_directory(tmp_path):
    """A fresh interpreter: trackio fixes its directory when first imported."""
    pytest.importorskip("trackio")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACKIO_")}
    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run([sys.executable, "-c", TRACKIO_SCRIPT, str(tmp_path / "run"), json.dumps(STEPS[:2])],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "run" / "trackio" / "harness-rl.db").is_file()
    logs = json.loads(next(line[5:] for line in done.stdout.splitlines() if line.startswith("LOGS ")))
    assert [(row["step"], row["train/reward"], row["train/loss"], row["train/global_step"]) for row in logs] == [
        (1, 0.25, -0.5, 1), (2, 0.75, 0.125, 2)]


def test_no_output_dir_writes_only_the_console(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    logger = MetricsLogger(None, report_to="jsonl,tensorboard,trackio")
    logger.log(4, {"reward": 0.5, "loss": 0.25})
    logger.close()
    assert capsys.readouterr().out == "step 4 | loss 0.2500 | reward 0.500\n"
    assert list(Path(tmp_path).iterdir()) == []


def test_a_resumed_run_shows_each_step_once_in_tensorboard(tmp_path):
    """The stopped process logged steps 1-4; resumed from its checkpoint of step 2, steps 3 and 4 are logged again
    (other values): TensorBoard shows the new ones only."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    stopped = MetricsLogger(tmp_path, console=False, report_to="tensorboard")
    for step in range(1, 5):
        stopped.log(step, {"reward": float(step)})
    stopped.close()
    resumed = MetricsLogger(tmp_path, console=False, report_to="tensorboard", resumed_after=2)
    for step in (3, 4):
        resumed.log(step, {"reward": 10.0 * step})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/reward")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
