"""GRPO's math as pure functions: group-relative advantages and the clipped, truncated token loss.

The loss compares the current policy π_θ with the behaviour policy π_b that sampled each token (the
engine's own logprob, never recomputed), so one ratio r = π_θ/π_b covers both the train/inference
mismatch and staleness. Per token, with advantage A:

- PPO clipping: a token with A > 0 and r > 1 + ε_high, or A < 0 and r < 1 − ε, is clipped and gives
  no gradient (its loss value is TRL's clipped term, −clip(r)·A).
- Truncated importance sampling: an unclipped token's gradient is min(r, tis_cap)·A·∇log π_θ instead
  of r·A·∇log π_θ, so a negative-advantage token whose ratio exploded (a stale sample, an engine
  numerics outlier) cannot dominate the step. Its loss value is −min(r, tis_cap)·A.

With `tis_cap=None` the loss value and gradient equal TRL's `−min(r·A, clip(r)·A)` exactly (the
AsyncGRPOTrainer's loss). An optional k3 KL penalty to a frozen reference adds β·(e^{ref−θ} − (ref−θ) − 1).

`decoupled=True` is decoupled PPO (AReaL): the trust region is taken against the proximal policy (the
current weights before this step's update), and only the truncated weight min(π_θ/π_b, tis_cap)
corrects for the behaviour policy. With one optimizer step per batch the proximal ratio is 1, so no
token is clipped and every token's gradient is min(r, tis_cap)·A·∇log π_θ: exactly TRL's synchronous
GRPO loss under vLLM token-truncated importance sampling. Clipping against π_b instead stops
learning from stale samples once the policy has moved ε away from the one that sampled them: on the
tiny model at lr 1e-2 with tokens 1–2 versions stale, 20–35% of tokens sat in the clipped region and
the digit reward stayed near 0.03 after 24 steps, where decoupled PPO reached 0.99
(`benchmarks/learner_bench.py`, section 4).

Normalisation lives in per-token weights (see `token_weights`): the loss is Σ w·ℓ over every trained
token of the step, so micro-batching and gradient accumulation never change the gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from harness_rl.learner.config import LossConfig

Normalization = Literal["token", "rollout"]


def group_advantages(rewards: Sequence[float | None], eps: float = 1e-8) -> list[float | None] | None:
    """(r − mean) / (std + eps) over the scorable rewards (population std); `None` stays `None`.

    Returns `None` for a group that teaches nothing: fewer than two scorable rewards, or all equal.
    """
    scored = [r for r in rewards if r is not None]
    if len(scored) < 2 or min(scored) == max(scored):
        return None
    values = torch.tensor(scored, dtype=torch.float64)
    mean, std = values.mean(), values.std(correction=0)
    return [None if r is None else float((r - mean) / (std + eps)) for r in rewards]


def token_weights(tokens_per_rollout: dict[str, int], mode: Normalization) -> dict[str, float]:
    """The weight of each trained token of each rollout, summing to 1 over the step.

    `token`: every trained token counts the same (TRL's global token mean), so long rollouts weigh
    more. `rollout`: every rollout counts the same however many tokens or forked rows it has.
    """
    live = {k: n for k, n in tokens_per_rollout.items() if n > 0}
    if mode == "token":
        total = sum(live.values())
        return {k: 1.0 / total for k in live}
    if mode == "rollout":
        return {k: 1.0 / (len(live) * n) for k, n in live.items()}
    raise ValueError(f"unknown loss normalisation {mode!r}: use 'token' or 'rollout'")


def k3_kl(logps: torch.Tensor, other_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π_θ ‖ π_other) per token: e^{o−θ} − (o−θ) − 1 ≥ 0."""
    delta = other_logps - logps
    return torch.exp(delta) - delta - 1


@dataclass(frozen=True)
class Mismatch:
    """Train/inference mismatch over trained tokens: the learner's logprobs against the engine's.

    Holds sums so micro-batches add up (`a + b`); `metrics()` gives the step's values under TRL's
    names where TRL has one. At equal weights the two logprobs differ only by numerics (kernels,
    dtype, batch shape), so these measure how far the engine's sampler is from the policy trained.
    """

    tokens: int = 0
    kl_sum: float = 0.0  # Σ k3 estimate of KL(π_behaviour ‖ π_learner), sampled from the behaviour policy
    abs_diff_sum: float = 0.0  # Σ |log π_learner − log π_behaviour|
    abs_diff_max: float = 0.0

    @classmethod
    def of(cls, learner_logps: torch.Tensor, behaviour_logps: torch.Tensor) -> Mismatch:
        """Over the given trained tokens (1-D tensors, one entry per token, as `grpo_loss` takes them)."""
        learner_logps, behaviour_logps = learner_logps.detach().double(), behaviour_logps.detach().double()
        if learner_logps.shape != behaviour_logps.shape:
            raise ValueError(f"mismatch: {learner_logps.numel()} learner logprobs for "
                             f"{behaviour_logps.numel()} behaviour logprobs")
        if not learner_logps.numel():
            return cls()
        diff = (learner_logps - behaviour_logps).abs()
        return cls(tokens=learner_logps.numel(), kl_sum=float(k3_kl(behaviour_logps, learner_logps).sum()),
                   abs_diff_sum=float(diff.sum()), abs_diff_max=float(diff.max()))

    def __add__(self, other: Mismatch) -> Mismatch:
        return Mismatch(self.tokens + other.tokens, self.kl_sum + other.kl_sum,
                        self.abs_diff_sum + other.abs_diff_sum, max(self.abs_diff_max, other.abs_diff_max))

    def metrics(self) -> dict[str, float]:
        """`mismatch_kl` (logged as `train/mismatch_kl`) and TRL's `sampling/sampling_logp_difference/*`."""
        if not self.tokens:
            return {}
        return {"mismatch_kl": self.kl_sum / self.tokens,
                "sampling/sampling_logp_difference/mean": self.abs_diff_sum / self.tokens,
                "sampling/sampling_logp_difference/max": self.abs_diff_max}


@dataclass(frozen=True)
class LossStats:
    """Statistics of trained tokens, kept apart by how micro-batches and ranks combine them: `sums` add up
    (TRL's means once divided by `tokens`), `maxima` and `minima` keep the largest and the smallest. A new
    statistic joins the dict of its kind; its name decides nothing."""

    tokens: float = 0.0
    sums: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)
    minima: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, tokens: int, sums: dict[str, torch.Tensor], maxima: dict[str, torch.Tensor],
           minima: dict[str, torch.Tensor]) -> LossStats:
        """From scalar tensors, read back in one transfer."""
        tensors = [*sums.values(), *maxima.values(), *minima.values()]
        values = iter(torch.stack(tensors).tolist())
        return cls(float(tokens), {k: next(values) for k in sums}, {k: next(values) for k in maxima},
                   {k: next(values) for k in minima})

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(self.tokens + other.tokens, _merge(self.sums, other.sums, lambda a, b: a + b),
                         _merge(self.maxima, other.maxima, max), _merge(self.minima, other.minima, min))

    def metrics(self) -> dict[str, float]:
        """Means per trained token, and the extrema as they are."""
        return {**{k: v / self.tokens for k, v in self.sums.items()}, **self.maxima, **self.minima}


def _merge(ours: dict[str, float], theirs: dict[str, float],
           combine: Callable[[float, float], float]) -> dict[str, float]:
    merged = dict(ours)
    for key, value in theirs.items():
        merged[key] = combine(merged[key], value) if key in merged else value
    return merged


def grpo_loss(
    logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    config: LossConfig,
    ref_logps: torch.Tensor | None = None,
    row_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Σ weights·ℓ over the given trained tokens (1-D tensors, one entry per token), and their statistics.

    The sums (`ratio`, `kl`, `clip_ratio/*_mean`, `tis/truncated_frac`, `ref_kl`) add up across
    micro-batches into TRL's means; the extrema are the importance ratio's, and with `row_index` (each
    token's row) TRL's per-sequence `clip_ratio/low_min` and `clip_ratio/high_max`.
    """
    log_ratio = logps - behaviour_logps
    ratio = torch.exp(log_ratio.detach())
    unit = torch.exp(log_ratio - log_ratio.detach())
    is_weight = ratio if config.tis_cap is None else ratio.clamp(max=config.tis_cap)
    low = (ratio < 1 - config.epsilon) & (advantages < 0)
    high = (ratio > 1 + config.eps_high) & (advantages > 0)
    if config.decoupled:  # the proximal ratio is 1: nothing is clipped
        low = high = torch.zeros_like(low)
    clipped = low | high
    clipped_value = ratio.clamp(1 - config.epsilon, 1 + config.eps_high) * advantages
    per_token = -torch.where(clipped, clipped_value, is_weight * unit * advantages)
    sums = {
        "ratio": ratio.sum(),
        "kl": ((ratio - 1) - log_ratio.detach()).sum(),
        "clip_ratio/low_mean": low.float().sum(),
        "clip_ratio/high_mean": high.float().sum(),
        "clip_ratio/region_mean": clipped.float().sum(),
    }
    minima = {"sampling/importance_sampling_ratio/min": ratio.min()}
    maxima = {"sampling/importance_sampling_ratio/max": ratio.max()}
    if row_index is not None:
        rows = int(row_index.max()) + 1 if row_index.numel() else 0
        per_row = torch.zeros(rows, device=ratio.device).index_add_(0, row_index, torch.ones_like(ratio))
        low_share = torch.zeros_like(per_row).index_add_(0, row_index, low.float()) / per_row
        high_share = torch.zeros_like(per_row).index_add_(0, row_index, high.float()) / per_row
        minima["clip_ratio/low_min"] = low_share.min()
        maxima["clip_ratio/high_max"] = high_share.max()
    if config.tis_cap is not None:
        sums["tis/truncated_frac"] = ((ratio > config.tis_cap) & ~clipped).float().sum()
    if config.beta:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference model's logprobs")
        kl = k3_kl(logps, ref_logps)
        per_token = per_token + config.beta * kl
        sums["ref_kl"] = kl.detach().sum()
    return (weights * per_token).sum(), LossStats.of(logps.numel(), sums, maxima, minima)
