"""From finished rollout groups to trainable samples: rows, advantages, staleness and token weights.

- Advantages are group-relative over the scorable rollouts (`grpo.group_advantages`). A rollout with
  a reward but no usable trace (none captured, or one failing validation) still counts in its
  group's baseline, since its reward is a real draw from the policy; it just has nothing to train.
- Groups without reward variance and rollouts whose advantage is exactly 0 produce no samples (no
  forward pass spent on a zero gradient), unless a KL penalty is on.
- Staleness is per token: a trained token sampled more than `max_staleness` policy versions ago is
  not trained (it stays as context when a later trained token follows it, else it is cut); fresher
  tokens are trained and corrected by the loss's truncated importance ratio against their own
  behaviour logprobs. Tokens of unknown version are treated as fresh.
- A turn the proxy recorded as sampled at another temperature than the learner's is kept as context
  only: its behaviour logprobs describe a different distribution, so its ratios would be wrong.
- `train_roles` chooses which calls train (`rows.completion_mask`); every row of a rollout, whichever
  branch it holds (main, subagent, after a compaction), carries the rollout's one advantage.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import msgspec

from harness_rl.learner.grpo import Normalization, group_advantages, token_weights
from harness_rl.learner.rows import AGENT_ONLY, NO_VERSION, Row, trace_rows
from harness_rl.outcome import RolloutGroup
from harness_rl.trace import TraceValidationError, TrainingTrace
from harness_rl.trace.stats import trace_stats


@dataclass(slots=True)
class Sample:
    """One row to train, with its rollout's advantage and the weight of each of its trained tokens."""

    row: Row
    rollout_key: str  # "group_id/rollout_id"
    advantage: float
    weight: float = 0.0


def build_samples(
    groups: Sequence[RolloutGroup],
    *,
    policy_version: int,
    max_staleness: int | None,
    normalization: Normalization,
    keep_zero_advantage: bool = False,
    temperature: float | None = None,
    train_roles: Collection[str] = AGENT_ONLY,
) -> tuple[list[Sample], dict[str, float]]:
    """The step's samples (weights normalised over all of them) and the metrics of what was kept."""
    samples: list[Sample] = []
    rewards: list[float] = []
    counts = {"zero_std_groups": 0, "unscorable": 0, "invalid_traces": 0, "dropped_stale_tokens": 0,
              "temperature_mismatch_tokens": 0}
    rows_per_rollout: list[int] = []
    turns_per_rollout: list[int] = []
    branches_per_rollout: list[int] = []
    sources = {"spliced": 0, "rendered": 0}
    chained = later = 0
    staleness: list[int] = []
    for group in groups:
        for outcome in group.outcomes:
            for turn in outcome.trace.turns if outcome.trace is not None else ():
                if turn.role == "agent" and turn.prompt_source is not None:
                    sources[turn.prompt_source] += 1
            if outcome.trace is not None:
                branches_per_rollout.append(len({t.branch.id for t in outcome.trace.turns if t.branch is not None}))
                stats = trace_stats(outcome.trace)
                chained, later = chained + stats.chained_turns, later + stats.later_turns
        scores = [o.reward for o in group.outcomes]
        rewards.extend(r for r in scores if r is not None)
        counts["unscorable"] += sum(r is None for r in scores)
        advantages = group_advantages(scores)
        if advantages is None:
            counts["zero_std_groups"] += 1
            continue
        for outcome, advantage in zip(group.outcomes, advantages, strict=True):
            if advantage is None or (advantage == 0.0 and not keep_zero_advantage):
                continue
            trace = _trainable_trace(outcome.trace, temperature, train_roles, counts)
            if trace is None:
                continue
            key = f"{group.group_id}/{outcome.rollout_id}"
            kept = []
            for row in trace_rows(trace, train_roles):
                counts["dropped_stale_tokens"] += _drop_stale(row, policy_version, max_staleness, staleness)
                if row.n_trained:
                    kept.append(Sample(row, key, advantage))
            samples.extend(kept)
            rows_per_rollout.append(len(kept))
            turns_per_rollout.append(len(trace.turns))
    tokens_per_rollout: dict[str, int] = {}
    for sample in samples:
        tokens_per_rollout[sample.rollout_key] = tokens_per_rollout.get(sample.rollout_key, 0) + sample.row.n_trained
    weights = token_weights(tokens_per_rollout, normalization) if samples else {}
    for sample in samples:
        sample.weight = weights[sample.rollout_key]
    forwarded = [len(s.row) for s in samples]
    trained = [s.row.n_trained for s in samples]
    metrics = {
        # over the scored rollouts; with none scored there is no mean (absent), never a 0
        **({"reward": _mean(rewards), "reward_std": statistics.pstdev(rewards)} if rewards else {}),
        "batch/groups_per_step": float(len(groups)),
        "batch/samples_per_step": float(len(samples)),
        "sample/zero_std_groups_total": float(counts["zero_std_groups"]),
        "sample/unscorable_total": float(counts["unscorable"]),
        "sample/invalid_traces_total": float(counts["invalid_traces"]),
        "sample/dropped_stale_total": float(counts["dropped_stale_tokens"]),  # tokens, not rows
        "sample/temperature_mismatch_total": float(counts["temperature_mismatch_tokens"]),
        "sample/staleness_mean": _mean(staleness),
        "sample/staleness_max": float(max(staleness, default=0)),
        "sample/forwarded_tokens_mean": _mean(forwarded),
        "sample/forwarded_tokens_max": float(max(forwarded, default=0)),
        "sample/trained_tokens_mean": _mean(trained),
        "rollout/samples_per_rollout": _mean(rows_per_rollout),
        "rollout/fork_frac": _mean([float(n > 1) for n in rows_per_rollout]),
        "rollout/turns_mean": _mean(turns_per_rollout),
        "rollout/turns_max": float(max(turns_per_rollout, default=0)),
        "rollout/branches_mean": _mean(branches_per_rollout),  # conversations per rollout (main, subagents, ...)
        "rollout/spliced_turns": float(sources["spliced"]),
        "rollout/rendered_turns": float(sources["rendered"]),
        "rollout/chained_turns": float(chained),  # agent turns after a rollout's first that chain onto the one before
        "rollout/later_turns": float(later),
        "rollout/chained_frac": chained / later if later else 0.0,
    }
    return samples, metrics


def _trainable_trace(trace: TrainingTrace | None, temperature: float | None, train_roles: Collection[str],
                     counts: dict[str, int]) -> TrainingTrace | None:
    """The validated trace, turns sampled at another temperature made context; None when unusable."""
    if trace is None:
        counts["invalid_traces"] += 1
        return None
    try:
        trace.validate()
    except TraceValidationError:
        counts["invalid_traces"] += 1
        return None
    if temperature is None:
        return trace
    trace, mismatched = _untrain_other_temperatures(trace, temperature, train_roles)
    counts["temperature_mismatch_tokens"] += mismatched
    return trace


def _untrain_other_temperatures(trace: TrainingTrace, temperature: float,
                                train_roles: Collection[str]) -> tuple[TrainingTrace, int]:
    """The trace with turns sampled at another recorded temperature marked context-only; their masked count."""
    turns, mismatched = [], 0
    for turn in trace.turns:
        recorded = turn.sampling.temperature if turn.sampling is not None else None
        if turn.role in train_roles and recorded is not None and abs(recorded - temperature) > 1e-6:
            mismatched += sum(turn.completion_mask)
            turn = msgspec.structs.replace(turn, role="discarded")
        turns.append(turn)
    return (msgspec.structs.replace(trace, turns=turns) if mismatched else trace), mismatched


def _drop_stale(row: Row, policy_version: int, max_staleness: int | None, staleness: list[int]) -> int:
    """Untrain the row's tokens older than `max_staleness`; record the others' staleness; count drops."""
    dropped = 0
    for pos, (m, version) in enumerate(zip(row.mask, row.versions, strict=True)):
        if not m:
            continue
        age = 0 if version == NO_VERSION else max(0, policy_version - version)
        if max_staleness is not None and age > max_staleness:
            row.mask[pos], row.logprobs[pos], row.versions[pos] = 0, 0.0, NO_VERSION
            dropped += 1
        else:
            staleness.append(age)
    if dropped:
        row.trim_context_tail()
    return dropped


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0
