"""What one learner step measured, and the metrics it logs.

Each rank adds up its micro-batches into a `StepTotals`; rank 0 adds the ranks' totals (in rank order, so
the sums round as one process's would) and turns them, with the step's timings, into the step's metrics,
named as TRL names them where TRL has the same meaning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness_rl.learner.grpo import LossStats, Mismatch


@dataclass(frozen=True)
class StepTotals:
    """The trained tokens' statistics, the summed loss, the train/inference mismatch on tokens the current
    weights sampled, and the forwarded tokens of each micro-batch."""

    stats: LossStats = field(default_factory=LossStats)
    loss: float = 0.0
    mismatch: Mismatch = field(default_factory=Mismatch)
    lengths: tuple[int, ...] = ()

    def __add__(self, other: StepTotals) -> StepTotals:
        return StepTotals(self.stats + other.stats, self.loss + other.loss, self.mismatch + other.mismatch,
                          self.lengths + other.lengths)


@dataclass(frozen=True)
class StepTimes:
    """Seconds spent in each part of a step; `total_s` from its start to its metrics."""

    fwd_bwd_s: float
    optimizer_s: float
    weight_sync_s: float
    total_s: float


def step_metrics(totals: StepTotals, times: StepTimes, *, grad_norm: float, learning_rate: float, step: int,
                 policy_version: int, token_budget: int, sync_failures: int) -> dict[str, float]:
    """The metrics of a step that trained: the statistics' means and extrema, the mismatch, the loss, the
    optimizer's, how full the micro-batches were, and throughput."""
    forwarded = sum(totals.lengths)
    trained = totals.stats.tokens
    batches = len(totals.lengths)
    return {
        **totals.stats.metrics(),
        **totals.mismatch.metrics(),
        "loss": totals.loss,
        "grad_norm": grad_norm,
        "learning_rate": learning_rate,
        "step": float(step),
        "policy_version": float(policy_version),
        "batch/microbatches_per_step": float(batches),
        "batch/forwarded_tokens_per_step": float(forwarded),
        "batch/trained_tokens_per_step": trained,
        "batch/row_fill_frac": forwarded / (batches * token_budget),
        "perf/fwd_bwd_s": times.fwd_bwd_s,
        "perf/optimizer_s": times.optimizer_s,
        "perf/weight_sync_s": times.weight_sync_s,
        "weight_sync/consecutive_failures": float(sync_failures),
        "perf/step_s": times.total_s,
        "perf/forwarded_tok_s_fwd_bwd": forwarded / times.fwd_bwd_s,
        "perf/forwarded_tok_s_wall_clock": forwarded / times.total_s,
        "perf/trained_tok_s_wall_clock": trained / times.total_s,
    }
