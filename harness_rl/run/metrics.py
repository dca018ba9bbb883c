"""Per-step metrics: one console line, and the backends named in `report_to`.

Backends: `jsonl` (`metrics.jsonl`, the run's own record, read back by the report and the viewer),
`tensorboard` (event files under `tensorboard/`) and `trackio` (offline, a local SQLite store under
`trackio/`). TensorBoard and trackio get TRL's names: transformers' callbacks prefix every training
metric with `train/` (`train/reward`, `train/loss`, ...) at the learner's step, and so do we, so a
harness-rl run and a TRL run plot side by side.

`rollout_metrics` adds what TRL's harness trainer logs about the step's rollouts themselves: tool use
(`tools/call_frequency`, `tools/failure_frequency`, `tools/<name>/call_total`,
`tools/<name>/failure_total`) and, when a reward function replaces the verifier's reward,
`rollout/correctness_mean` (the verifier's mean); and what TRL has no name for: how many rollouts were
scored (`rollouts/scored`) and how many were not (`rollouts/unscorable`, no reward at all: never
averaged as 0, so a step with none scored has no `reward`).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

from harness_rl.outcome import RolloutGroup

BACKENDS = ("jsonl", "tensorboard", "trackio")
DEFAULT_REPORT_TO = ("jsonl", "tensorboard")
TRL_PREFIX = "train/"

CONSOLE_KEYS = (
    ("loss", "loss", "{:.4f}"), ("reward", "reward", "{:.3f}"), ("rollouts/scored", "scored", "{:.0f}"),
    ("rollouts/unscorable", "unscorable", "{:.0f}"), ("grad_norm", "gnorm", "{:.3f}"),
    ("learning_rate", "lr", "{:.2e}"), ("kl", "kl", "{:.4f}"), ("entropy", "ent", "{:.3f}"),
    ("clip_ratio/region_mean", "clip", "{:.3f}"), ("sample/staleness_mean", "stale", "{:.2f}"),
    ("batch/trained_tokens_per_step", "tok", "{:.0f}"), ("rollout/correctness_mean", "correct", "{:.3f}"),
    ("tools/call_frequency", "tools", "{:.1f}"), ("tools/failure_frequency", "tool fail", "{:.2f}"),
    ("sampling/sampling_logp_difference/max", "mismatch", "{:.1e}"),
    ("sync/logp_difference_max", "sync Δ", "{:.1e}"), ("perf/step_s", "s", "{:.2f}"),
)


class MetricsBackendError(ValueError):
    """A `report_to` entry that is unknown or whose package is not installed."""


def console_line(step: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step}"]
    for key, label, fmt in CONSOLE_KEYS:
        if key in metrics:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    return " | ".join(parts)


def rollout_metrics(groups: Sequence[RolloutGroup], custom_reward: bool) -> dict[str, float]:
    """TRL's tool and correctness metrics of a step's rollouts (its harness trainer's rules), and how many were
    scored and unscorable.

    Per rollout, its tool calls and the share of them whose result failed (0 without calls); each a mean
    over the rollouts of the groups that called any tool. Per tool, sums over every rollout.
    `rollout/correctness_mean` is the mean verifier reward of the rollouts that have one, logged only when
    `custom_reward` (a reward function) made the rewards something else.
    """
    outcomes = [o for group in groups for o in group.outcomes]
    scored = sum(o.scorable for o in outcomes)
    metrics = {"rollouts/scored": float(scored), "rollouts/unscorable": float(len(outcomes) - scored)}
    calls: list[float] = []
    failure_rates: list[float] = []
    correctness: list[float] = []
    for group in groups:
        if sum(o.tool_call_count for o in group.outcomes):
            calls.extend(float(o.tool_call_count) for o in group.outcomes)
            failure_rates.extend(o.tool_failure_count / o.tool_call_count if o.tool_call_count else 0.0
                                 for o in group.outcomes)
        for outcome in group.outcomes:
            for name, count in outcome.tool_calls_by_name.items():
                key = f"tools/{name}/call_total"
                metrics[key] = metrics.get(key, 0.0) + count
            for name, count in outcome.tool_failures_by_name.items():
                key = f"tools/{name}/failure_total"
                metrics[key] = metrics.get(key, 0.0) + count
            if custom_reward and outcome.env_reward is not None:
                correctness.append(outcome.env_reward)
    if calls:
        metrics["tools/call_frequency"] = sum(calls) / len(calls)
        metrics["tools/failure_frequency"] = sum(failure_rates) / len(failure_rates)
    if correctness:
        metrics["rollout/correctness_mean"] = sum(correctness) / len(correctness)
    return metrics


def parse_report_to(value: str | Iterable[str]) -> tuple[str, ...]:
    """`"jsonl,tensorboard"` (or a list) as a checked tuple; `"none"` or empty means console only."""
    names = value.split(",") if isinstance(value, str) else list(value)
    chosen = tuple(dict.fromkeys(n.strip().lower() for n in names if n.strip() and n.strip().lower() != "none"))
    unknown = [n for n in chosen if n not in BACKENDS]
    if unknown:
        raise MetricsBackendError(f"unknown --report-to backend {', '.join(map(repr, unknown))}: "
                                  f"choose from {', '.join(BACKENDS)} (comma-separated) or none")
    return chosen


def trl_names(metrics: dict[str, float]) -> dict[str, float]:
    """TRL's names for TensorBoard and trackio: `train/<name>`, as transformers' `rewrite_logs` writes them."""
    return {TRL_PREFIX + key: value for key, value in metrics.items()}


class MetricsLogger:
    """Writes each step's metrics to the console and to every backend in `report_to`.

    With `output_dir=None` only the console line is written. A named backend whose package is missing
    is an error at construction (not a silent gap discovered after a long run). `resumed_after`, the step of the
    checkpoint a run resumes from, hides from TensorBoard the later steps its stopped process had logged (their
    `metrics.jsonl` rows are dropped by `run_files.rewind`), so each step shows once.
    """

    def __init__(self, output_dir: str | Path | None, *, console: bool = True,
                 report_to: str | Iterable[str] = DEFAULT_REPORT_TO, project: str = "harness-rl",
                 resumed_after: int | None = None) -> None:
        self.console = console
        self.report_to = parse_report_to(report_to)
        self.jsonl: TextIO | None = None
        self.tensorboard: Any = None
        self.trackio: Any = None
        if output_dir is None:
            return
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        if "tensorboard" in self.report_to:
            self.tensorboard = _tensorboard_writer(output_dir / "tensorboard",
                                                   None if resumed_after is None else resumed_after + 1)
        if "trackio" in self.report_to:
            self.trackio = _trackio_run(output_dir, project)
        if "jsonl" in self.report_to:
            self.jsonl = (output_dir / "metrics.jsonl").open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}
        if self.console:
            print(console_line(step, clean), file=sys.stdout, flush=True)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            self.jsonl.flush()
        if self.tensorboard is not None:
            for key, value in trl_names(clean).items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.trackio is not None:
            self.trackio.log({**trl_names(clean), "train/global_step": step}, step=step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.trackio is not None:
            self.trackio.finish()


def _tensorboard_writer(log_dir: Path, purge_step: int | None) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise MetricsBackendError("--report-to tensorboard needs the tensorboard package: "
                                  "pip install 'harness-rl[train]' (or drop tensorboard from --report-to)") from None
    return SummaryWriter(str(log_dir), purge_step=purge_step)


def _trackio_run(output_dir: Path, project: str) -> Any:
    """A local trackio run stored under `output_dir/trackio` (unless `TRACKIO_DIR` says otherwise).

    trackio fixes its storage directory from `TRACKIO_DIR` when first imported, so the variable is set
    before that import; a process that imported trackio earlier keeps the directory it chose then.
    Nothing leaves the machine unless the user set `TRACKIO_SPACE_ID` or `TRACKIO_SERVER_URL`.
    """
    os.environ.setdefault("TRACKIO_DIR", str((output_dir / "trackio").resolve()))
    try:
        import trackio
    except ImportError:
        raise MetricsBackendError("--report-to trackio needs the trackio package: "
                                  "pip install 'harness-rl[train]' (or drop trackio from --report-to)") from None
    return trackio.init(project=project, name=output_dir.resolve().name, resume="allow",
                        auto_log_gpu=False, auto_log_cpu=False)
