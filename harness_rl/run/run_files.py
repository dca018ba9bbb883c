"""The run directory: its settings (`OutputConfig`), and every finished rollout with its trace.

`<run>/rollouts.jsonl` gets one `RolloutRecord` per rollout the learner consumed (its step, group,
reward, advantage and how the agent ended); `<run>/traces/<rollout_id>.json` holds its trace (the
delta form, readable with `TrainingTrace.load` and `harness-rl traces`), with the reward and outcome
in the trace's metadata.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import msgspec

from harness_rl.outcome import RolloutGroup, RolloutOutcome
from harness_rl.settings import AtLeastOne, AtLeastZero, setting

ROLLOUTS_FILE = "rollouts.jsonl"
TRACES_DIR = "traces"


class OutputConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    output_dir: Annotated[str | None, setting("the run directory (metrics, traces, checkpoints, plot, summary); "
                                              "none: runs/<harness>-<UTC time>")] = None
    resume: Annotated[bool, setting("continue the run in --output-dir from its latest checkpoint")] = False
    save_every: Annotated[AtLeastZero, setting("checkpoint every N steps; 0: only at the end")] = 10
    save_total_limit: Annotated[AtLeastOne | None, setting("keep the newest N checkpoints; none: all")] = 3
    report_to: Annotated[str, setting("where step metrics go besides metrics.jsonl: tensorboard, trackio "
                                      "(comma-separated) or none")] = "tensorboard"


class RolloutRecord(msgspec.Struct, kw_only=True):
    step: int
    group_id: int
    rollout_id: str
    task: str
    harness: str
    reward: float | None
    env_reward: float | None
    advantage: float | None
    error: str | None
    timed_out: bool
    exit_code: int | None
    tool_call_count: int
    tool_failure_count: int
    turns: int
    duration_s: float
    trace: str | None  # relative to the run directory


# What a run writes besides config.toml and its checkpoints: a run started again from step 0 starts without them.
RUN_RECORDS = ("metrics.jsonl", ROLLOUTS_FILE, TRACES_DIR, "proxy", "summary.json", "training.png", "tensorboard",
               "trackio", "view.html")


def start_over(run_dir: Path) -> None:
    """Remove what a run that never finished a checkpoint wrote, so it starts again from step 0."""
    for name in (*RUN_RECORDS, "checkpoints"):
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def rewind(run_dir: Path, step: int) -> None:
    """Drop the records of the steps after `step` (taken after the checkpoint a run resumes from, then lost with the
    process), so each step is recorded once; their traces go with them."""
    for name in ("metrics.jsonl", ROLLOUTS_FILE):
        path = run_dir / name
        if not path.is_file():
            continue
        lines = path.read_bytes().splitlines(keepends=True)
        kept = []
        for line in lines:
            try:
                record = msgspec.json.decode(line, type=_Stepped)
            except msgspec.DecodeError:  # a line cut short by the kill
                continue
            if record.step <= step:
                kept.append(line if line.endswith(b"\n") else line + b"\n")
            elif record.trace:
                (run_dir / record.trace).unlink(missing_ok=True)
        if kept != lines:
            path.write_bytes(b"".join(kept))


class _Stepped(msgspec.Struct):
    step: float
    trace: str | None = None


class RunFiles:
    """Appends each consumed group's rollouts to the run directory."""

    def __init__(self, run_dir: Path, harness: str) -> None:
        self.run_dir = run_dir
        self.harness = harness
        (run_dir / TRACES_DIR).mkdir(parents=True, exist_ok=True)
        self._records = (run_dir / ROLLOUTS_FILE).open("ab")

    def write(self, step: int, groups: Sequence[RolloutGroup]) -> None:
        from harness_rl.learner.grpo import group_advantages

        for group in groups:
            advantages = group_advantages([o.reward for o in group.outcomes]) or [None] * len(group.outcomes)
            for outcome, advantage in zip(group.outcomes, advantages, strict=True):
                self._records.write(msgspec.json.encode(self._record(step, group, outcome, advantage)) + b"\n")
        self._records.flush()

    def _record(self, step: int, group: RolloutGroup, outcome: RolloutOutcome,
                advantage: float | None) -> RolloutRecord:
        trace_path = None
        if outcome.trace is not None:
            trace = outcome.trace
            trace.metadata.update({"task": outcome.task, "group_id": group.group_id, "harness": self.harness,
                                   "reward": outcome.reward, "env_reward": outcome.env_reward,
                                   "advantage": advantage, "error": outcome.error, "step": step})
            trace_path = f"{TRACES_DIR}/{outcome.rollout_id}.json"
            trace.save(self.run_dir / trace_path)
        return RolloutRecord(
            step=step, group_id=group.group_id, rollout_id=outcome.rollout_id, task=outcome.task, harness=self.harness,
            reward=outcome.reward, env_reward=outcome.env_reward, advantage=advantage, error=outcome.error,
            timed_out=outcome.timed_out, exit_code=outcome.exit_code, tool_call_count=outcome.tool_call_count,
            tool_failure_count=outcome.tool_failure_count,
            turns=len(outcome.trace.turns) if outcome.trace else 0, duration_s=round(outcome.duration_s, 3),
            trace=trace_path)

    def close(self) -> None:
        self._records.close()
