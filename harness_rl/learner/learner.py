"""The learner: a plain synchronous torch loop that turns finished rollout groups into gradient steps.

Rollouts keep running elsewhere (asyncio); the run loop (`harness_rl.run.train`) hands the learner finished
`RolloutGroup`s, one step at a time, and logs the metrics each step returns. Each step: samples (rows,
advantages, staleness, token weights) → padding-free micro-batches → logprobs → loss → backward,
accumulated over every micro-batch of the step → grad-norm clip → AdamW → LR schedule → policy
version + 1 → weight sync (every `sync_every` steps).

Weights are float32 on every device; on a GPU the forward runs under bf16 autocast (the engine's
usual dtype), with the LM head and the loss in float32.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from harness_rl.learner.checkpoint import (
    TrainerState,
    checkpoint_dir,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from harness_rl.learner.config import LearnerConfig
from harness_rl.learner.grpo import Mismatch, grpo_loss
from harness_rl.learner.packing import fill_fraction, pack, packed_logprobs
from harness_rl.learner.rows import Row
from harness_rl.learner.samples import build_samples
from harness_rl.learner.sync_check import PROMPT_TOKENS, EngineSampler, score
from harness_rl.learner.weight_sync import NoSync, WeightSync, WeightSyncError
from harness_rl.outcome import RolloutGroup


class Learner:
    """Owns the policy, its optimizer and schedule, and pushes each new version to the engine."""

    def __init__(self, model_dir: str | Path, config: LearnerConfig | None = None, *, temperature: float = 1.0,
                 seed: int = 0, weight_sync: WeightSync | None = None, output_dir: str | Path | None = None,
                 save_total_limit: int | None = None, sync_check: EngineSampler | None = None) -> None:
        """`temperature` is the one the proxy pins for sampling: logprobs are compared at it; checkpoints go to
        `output_dir/checkpoints`, the newest `save_total_limit` kept; `sync_check` samples the engine after
        every sync, to check it serves the learner's weights."""
        from transformers import AutoModelForCausalLM

        self.config = config = config or LearnerConfig()
        self.temperature = temperature
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.save_total_limit = save_total_limit
        random.seed(seed)
        torch.manual_seed(seed)
        self.device = torch.device(torch_device(config.device))
        attn = config.attn_implementation or attention_kernel(self.device)
        self.model: Any = cast(Any, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                         attn_implementation=attn))
        self.model.to(self.device)
        if config.gradient_checkpointing:
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.model.config.use_cache = False
        self.model.train()
        self.ref_model: Any = None
        if config.loss.beta:
            self.ref_model = cast(Any, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                            attn_implementation=attn))
            self.ref_model.to(self.device).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.learning_rate,
                                           betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                                           weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _schedule(config))
        self.weight_sync = weight_sync or NoSync()
        self.sync_check = sync_check
        self.step_count = 0
        self.policy_version = 0
        self.extra_state: dict[str, Any] = {}
        self.sync_failures = 0

    def step(self, groups: Sequence[RolloutGroup], rollout_wait_s: float = 0.0) -> dict[str, float]:
        """One optimizer step on these groups (all their micro-batches accumulated); its metrics.

        `rollout_wait_s` is how long the caller waited for these groups (logged as `perf/rollout_wait_s`).
        """
        config, started = self.config, time.perf_counter()
        samples, metrics = build_samples(groups, policy_version=self.policy_version,
                                         max_staleness=config.max_staleness,
                                         normalization=config.loss.normalization,
                                         keep_zero_advantage=bool(config.loss.beta),
                                         temperature=self.temperature, train_roles=config.train_roles)
        metrics["perf/rollout_wait_s"] = rollout_wait_s
        if not samples:
            # A skipped step: nothing to learn from (e.g. every group had zero reward variance). It still
            # counts toward max_steps, so a converged run ends; the weights and policy version stay.
            self.step_count += 1
            metrics.update({"step": float(self.step_count), "policy_version": float(self.policy_version),
                            "batch/trained_tokens_per_step": 0.0})
            return metrics
        batches = pack(samples, config.token_budget)
        sums: dict[str, float] = {}
        loss_total = 0.0
        mismatch = Mismatch()
        for batch in batches:
            batch = batch.to(self.device)
            with self._autocast():
                logps, entropy = packed_logprobs(self.model, batch, self.temperature)
                ref_logps = None
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref_logps, _ = packed_logprobs(self.ref_model, batch, self.temperature)
            loss, stats = grpo_loss(logps, batch.behaviour_logps, batch.advantages, batch.weights,
                                    config.loss, ref_logps, batch.row_index)
            fresh = batch.versions == self.policy_version  # sampled by the weights the learner holds now
            mismatch = mismatch + Mismatch.of(logps[fresh], batch.behaviour_logps[fresh])
            loss.backward()
            loss_total += loss.item()
            stats["entropy"] = entropy.sum()
            for key, value in stats.items():
                sums[key] = _reduce(key, sums.get(key), float(value))
        fwd_bwd_s = time.perf_counter() - started
        learning_rate = float(self.scheduler.get_last_lr()[0])
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        optimizer_s = time.perf_counter() - started - fwd_bwd_s
        self.step_count += 1
        self.policy_version += 1
        sync_s = 0.0
        if self.step_count % config.sync_every == 0 or self.sync_failures:
            sync_started = time.perf_counter()
            self._sync_or_tolerate()
            sync_s = time.perf_counter() - sync_started
            if not self.sync_failures:
                metrics.update(self._check_sync(samples[0].row))
        step_s = time.perf_counter() - started
        forwarded = sum(b.n_tokens for b in batches)
        trained = sums["tokens"]
        metrics.update({key: value if _is_extremum(key) else value / trained
                        for key, value in sums.items() if key != "tokens"})
        metrics.update(mismatch.metrics())
        metrics.update({
            "loss": loss_total,
            "grad_norm": grad_norm,
            "learning_rate": learning_rate,
            "step": float(self.step_count),
            "policy_version": float(self.policy_version),
            "batch/microbatches_per_step": float(len(batches)),
            "batch/forwarded_tokens_per_step": float(forwarded),
            "batch/trained_tokens_per_step": trained,
            "batch/row_fill_frac": fill_fraction(batches, config.token_budget),
            "perf/fwd_bwd_s": fwd_bwd_s,
            "perf/optimizer_s": optimizer_s,
            "perf/weight_sync_s": sync_s,
            "weight_sync/consecutive_failures": float(self.sync_failures),
            "perf/step_s": step_s,
            "perf/forwarded_tok_s_fwd_bwd": forwarded / fwd_bwd_s,
            "perf/forwarded_tok_s_wall_clock": forwarded / step_s,
            "perf/trained_tok_s_wall_clock": trained / step_s,
        })
        return metrics

    def _check_sync(self, row: Row) -> dict[str, float]:
        """The engine's logprobs against ours for a few tokens it samples after this row's prompt (see
        `sync_check`): at equal weights, float rounding."""
        if self.sync_check is None:
            return {}
        prompt = (row.tokens[:row.mask.index(1)] if 1 in row.mask else row.tokens)[-PROMPT_TOKENS:]
        ids, logps = self.sync_check.sample(prompt)
        with self._autocast():
            mismatch = score(self.model, [(prompt, ids, logps)], self.temperature)
        return {"sync/logp_difference_max": mismatch.abs_diff_max,
                "sync/mismatch_kl": mismatch.kl_sum / max(mismatch.tokens, 1)}

    def sync_weights(self) -> None:
        """Push the current weights and version to the engine (also after `load`, to a fresh engine)."""
        self.weight_sync.push(self.model, self.policy_version)

    def _sync_or_tolerate(self) -> None:
        """Sync; a failure leaves the engine on older weights (their tokens are IS-corrected or dropped as
        stale) and is retried after the next step, up to `max_sync_failures` in a row."""
        try:
            self.sync_weights()
        except WeightSyncError as error:
            self.sync_failures += 1
            if self.sync_failures > self.config.max_sync_failures:
                raise
            print(f"harness-rl: weight sync failed ({self.sync_failures} in a row), retrying after the next "
                  f"step: {error}", file=sys.stderr, flush=True)
        else:
            self.sync_failures = 0

    def save(self, path: str | Path | None = None) -> Path:
        """Write a checkpoint (default: `output_dir/checkpoints/step-N`), pruning beyond the limit."""
        if path is None:
            if self.output_dir is None:
                raise ValueError("no checkpoint path given and the learner has no output_dir")
            path = checkpoint_dir(self.output_dir, self.step_count)
        state = TrainerState(step=self.step_count, policy_version=self.policy_version, extra=self.extra_state)
        saved = save_checkpoint(path, self.model, self.optimizer, self.scheduler, state)
        if self.save_total_limit and self.output_dir is not None:
            prune_checkpoints(self.output_dir, self.save_total_limit)
        return saved

    def load(self, path: str | Path) -> dict[str, Any]:
        """Resume from a checkpoint; returns the opaque rollout-side state saved with it."""
        state = load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        self.step_count, self.policy_version, self.extra_state = state.step, state.policy_version, state.extra
        return self.extra_state

    def close(self) -> None:
        self.weight_sync.close()
        if self.sync_check is not None:
            self.sync_check.close()

    def _clip_gradients(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def _autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")


def _is_extremum(key: str) -> bool:
    return "max" in key or "min" in key


def _reduce(key: str, total: float | None, value: float) -> float:
    """Combine a micro-batch's statistic into the step's (TRL's rule): extrema by max/min, the rest summed."""
    if total is None:
        return value
    if _is_extremum(key):
        return max(total, value) if "max" in key else min(total, value)
    return total + value


def torch_device(name: str) -> str:
    """`auto`: cuda when available, else cpu; anything else as given."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def attention_kernel(device: torch.device) -> str:
    """flash_attention_2 on CUDA when installed (packed rows stay apart at varlen cost), else sdpa."""
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def _schedule(config: LearnerConfig):
    """LR multiplier per step: linear warmup, then constant, linear or cosine decay to 0 at max_steps."""
    warmup, horizon, kind = config.warmup_steps, config.max_steps, config.lr_scheduler
    if kind not in ("constant", "linear", "cosine"):
        raise ValueError(f"unknown lr_scheduler {kind!r}: use constant, linear or cosine")
    if kind != "constant" and horizon <= warmup:
        raise ValueError(f"a {kind} schedule needs max_steps > warmup_steps")

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / (horizon - warmup))
        return 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
