"""The learner: a plain synchronous torch loop that turns finished rollout groups into gradient steps.

Rollouts keep running elsewhere (asyncio); the run loop (`harness_rl.run.train`) hands the learner finished
`RolloutGroup`s, one step at a time, and logs the metrics each step returns. Each step: samples (rows,
advantages, staleness, token weights) → padding-free micro-batches → logprobs → loss → backward,
accumulated over every micro-batch of the step → grad-norm clip → AdamW → LR schedule → policy
version + 1 → weight sync (every `sync_every` steps).

Weights are float32 on every device; on a GPU the forward runs under bf16 autocast (the engine's
usual dtype), with the LM head and the loss in float32. `lora_rank > 0` trains a LoRA adapter alone.

Under torchrun the policy is sharded (FSDP2, `distributed`). Rank 0 is the learner the run talks to:
each of its public calls (`step`, `sync_weights`, `save`, `load`, `close`) is first sent to the other
ranks, which wait for them in `follow`. Rank 0 builds the step's samples, splits the rows across ranks
balanced by tokens (the token weights already normalised over the whole step), and every rank runs
as many micro-batches as the busiest one (an idle rank forwards a weightless one, as FSDP's collectives
need every rank in every forward and backward). Gradients are summed, so N processes take the step one
process takes, to float rounding.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from harness_rl.learner import distributed
from harness_rl.learner.checkpoint import (
    ADAPTER_DIR,
    MODEL_DIR,
    TrainerState,
    checkpoint_dir,
    export_model,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from harness_rl.learner.config import LearnerConfig
from harness_rl.learner.distributed import torch_device
from harness_rl.learner.grpo import LossStats, Mismatch, grpo_loss
from harness_rl.learner.lora import Lora
from harness_rl.learner.packing import MicroBatch, PackedPolicy, pack
from harness_rl.learner.samples import Sample, build_samples
from harness_rl.learner.step_metrics import StepTimes, StepTotals, step_metrics
from harness_rl.learner.sync_check import PROMPT_TOKENS, EngineSampler, score
from harness_rl.learner.weight_source import Sends, WeightSource
from harness_rl.learner.weight_sync import NoSync, WeightSync, WeightSyncError
from harness_rl.outcome import RolloutGroup


@dataclass(frozen=True)
class StepPlan:
    """One rank's part of a step: its rows, whether the step trains at all and syncs after; on rank 0 also
    every sample of the step and the metrics of what was kept."""

    share: list[Sample]
    trains: bool
    sync_now: bool
    samples: list[Sample]
    metrics: dict[str, float]


class Learner:
    """Owns the policy, its optimizer and schedule, and pushes each new version to the engine."""

    def __init__(self, model_dir: str | Path, config: LearnerConfig | None = None, *, temperature: float = 1.0,
                 seed: int = 0, weight_sync: WeightSync | None = None, output_dir: str | Path | None = None,
                 save_total_limit: int | None = None, sync_check: EngineSampler | None = None) -> None:
        """`temperature` is the one the proxy pins for sampling: logprobs are compared at it; checkpoints go to
        `output_dir/checkpoints`, the newest `save_total_limit` kept; `sync_check` samples the engine after
        every sync, to check it serves the learner's weights. Under torchrun every rank constructs one."""
        self.config = config = config or LearnerConfig()
        self.temperature = temperature
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.save_total_limit = save_total_limit
        random.seed(seed)
        torch.manual_seed(seed)
        device = torch.device(torch_device(config.device))
        self.ranks = distributed.join(device, config.collective_timeout_s)
        self.device = distributed.local_device(device) if self.ranks.sharded else device
        self.model: Any = self._load_model(model_dir)
        self.lora = Lora(self.model, config, str(model_dir)) if config.lora_rank else None
        if config.gradient_checkpointing:
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.model.config.use_cache = False
        self.model.train()
        self.policy = self._place(PackedPolicy(self.model))
        # Sharded, every rank must run each layer as often as the others: one packed forward per micro-batch
        # (sequence boundaries from the position ids), never one forward per row.
        self.split_rows: bool | None = False if self.ranks.sharded else None
        self.ref_model: Any = None
        self.ref_policy: PackedPolicy | None = None
        if config.loss.beta:
            self.ref_model = self._load_model(model_dir).eval().requires_grad_(False)
            self.ref_policy = self._place(PackedPolicy(self.ref_model))
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad],
                                           lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                                           eps=config.adam_eps, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _schedule(config))
        self.weight_sync = weight_sync or NoSync()
        # What a push gathers, so the other ranks take part in the same collectives.
        self.sends: Sends = self.ranks.broadcast(getattr(self.weight_sync, "sends", "weights")
                                                 if self.ranks.leader else None)
        self.sync_check = sync_check
        self.step_count = 0
        self.policy_version = 0
        self.extra_state: dict[str, Any] = {}
        self.sync_failures = 0

    def _load_model(self, model_dir: str | Path) -> Any:
        from transformers import AutoModelForCausalLM

        attn = self.config.attn_implementation or attention_kernel(self.device)
        return cast(Any, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation=attn))

    def _place(self, policy: PackedPolicy) -> PackedPolicy:
        """On the device; sharded across the ranks under torchrun (FSDP moves each shard to its device)."""
        if self.ranks.sharded:
            distributed.shard(policy, policy.model, self.device)
        else:
            policy.to(self.device)
        return policy

    @property
    def trained_parameters(self) -> tuple[int, int]:
        """(parameters that train, all parameters) of the whole policy, however it is sharded."""
        params = list(self.model.parameters())
        return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)

    @property
    def weights(self) -> WeightSource:
        """The policy's weights as an engine loads them (adapter merged), for a sync or an export."""
        return WeightSource(self.model, self.ranks, self.lora)

    # Rank 0's calls, each sent to the other ranks first (they wait in `follow`).

    def step(self, groups: Sequence[RolloutGroup], rollout_wait_s: float = 0.0) -> dict[str, float]:
        """One optimizer step on these groups (all their micro-batches accumulated); its metrics.

        `rollout_wait_s` is how long the caller waited for these groups (logged as `perf/rollout_wait_s`).
        """
        self._command("step")
        return self._step(groups, rollout_wait_s)

    def sync_weights(self) -> None:
        """Push the current weights and version to the engine (also after `load`, to a fresh engine)."""
        self._command("sync")
        self._sync()

    def save(self, path: str | Path | None = None, *, export: bool = False) -> Path:
        """Write a checkpoint (default: `output_dir/checkpoints/step-N`), pruning beyond the limit; `export`
        adds the model as one Hugging Face directory (`model/`)."""
        if path is None:
            if self.output_dir is None:
                raise ValueError("no checkpoint path given and the learner has no output_dir")
            path = checkpoint_dir(self.output_dir, self.step_count)
        self._command("save", path, export)
        saved = self._save(path, export)
        if self.save_total_limit and self.output_dir is not None:
            prune_checkpoints(self.output_dir, self.save_total_limit)
        return saved

    def load(self, path: str | Path) -> dict[str, Any]:
        """Resume from a checkpoint (written by any number of processes); the rollout-side state saved with it."""
        self._command("load", path)
        return self._load(path)

    def close(self) -> None:
        self._command("close")
        self.weight_sync.close()
        if self.sync_check is not None:
            self.sync_check.close()

    def follow(self) -> None:
        """Ranks other than 0: do what rank 0 does, call by call, until it closes."""
        while True:
            command: tuple[str, tuple[Any, ...]] = self.ranks.broadcast(None)
            name, args = command
            if name == "close":
                return
            getattr(self, "_" + name)(*args)

    def _command(self, name: str, *args: Any) -> None:
        if self.ranks.sharded and self.ranks.leader:
            self.ranks.broadcast((name, args))

    # What every rank does.

    def _step(self, groups: Sequence[RolloutGroup] | None = None, rollout_wait_s: float = 0.0) -> dict[str, float]:
        started = time.perf_counter()
        plan = self._plan(groups, rollout_wait_s)
        if not plan.trains:
            # A skipped step: nothing to learn from (e.g. every group had zero reward variance). It still
            # counts toward max_steps, so a converged run ends; the weights and policy version stay.
            self.step_count += 1
            return {**plan.metrics, "step": float(self.step_count), "policy_version": float(self.policy_version),
                    "batch/trained_tokens_per_step": 0.0}
        totals = self._forward_backward(pack(plan.share, self.config.token_budget))
        fwd_bwd_s = time.perf_counter() - started
        learning_rate = float(self.scheduler.get_last_lr()[0])
        grad_norm = self._optimizer_step()
        optimizer_s = time.perf_counter() - started - fwd_bwd_s
        parts = self.ranks.gather(totals)
        sync_s, checked = self._sync_after_step(plan) if plan.sync_now else (0.0, {})
        if not self.ranks.leader:
            return {}
        times = StepTimes(fwd_bwd_s, optimizer_s, sync_s, time.perf_counter() - started)
        return {**plan.metrics, **checked, **step_metrics(
            sum(parts, StepTotals()), times, grad_norm=grad_norm, learning_rate=learning_rate, step=self.step_count,
            policy_version=self.policy_version, token_budget=self.config.token_budget,
            sync_failures=self.sync_failures)}

    def _plan(self, groups: Sequence[RolloutGroup] | None, rollout_wait_s: float) -> StepPlan:
        """Rank 0 builds the step's samples and splits their rows across the ranks by tokens; each rank gets its
        share, whether the step trains at all, and whether it syncs after."""
        config, ranks = self.config, self.ranks
        samples: list[Sample] = []
        metrics: dict[str, float] = {}
        shares: list[tuple[list[Sample], bool]] | None = None
        if ranks.leader:
            assert groups is not None
            samples, metrics = build_samples(groups, policy_version=self.policy_version,
                                             max_staleness=config.max_staleness,
                                             normalization=config.loss.normalization,
                                             keep_zero_advantage=bool(config.loss.beta),
                                             temperature=self.temperature, train_roles=config.train_roles)
            metrics["perf/rollout_wait_s"] = rollout_wait_s
            sync_now = bool(samples) and (
                (self.step_count + 1) % config.sync_every == 0 or self.sync_failures > 0)
            split = distributed.balance([len(s.row) for s in samples], ranks.world_size)
            shares = [([samples[i] for i in share], sync_now) for share in split]
        share, sync_now = ranks.scatter(shares)
        trains = ranks.broadcast(bool(samples) if ranks.leader else None)
        return StepPlan(share, trains, sync_now, samples, metrics)

    def _forward_backward(self, batches: list[MicroBatch]) -> StepTotals:
        """Every micro-batch's gradient accumulated (as many rounds as the busiest rank has: an idle rank forwards
        a weightless one); the totals of this rank's real ones."""
        totals = StepTotals()
        for index in range(max(self.ranks.gather(len(batches)))):
            real = index < len(batches)
            batch = (batches[index] if real else _weightless_batch()).to(self.device)
            with self._autocast():
                logps, entropy = self.policy(batch, self.temperature, self.split_rows)
                ref_logps = None
                if self.ref_policy is not None:
                    with torch.no_grad():
                        ref_logps, _ = self.ref_policy(batch, self.temperature, self.split_rows)
            loss, stats = grpo_loss(logps, batch.behaviour_logps, batch.advantages, batch.weights,
                                    self.config.loss, ref_logps, batch.row_index)
            loss.backward()
            if not real:
                continue
            fresh = batch.versions == self.policy_version  # sampled by the weights the learner holds now
            stats += LossStats(sums={"entropy": float(entropy.sum())})
            totals += StepTotals(stats, loss.item(), Mismatch.of(logps[fresh], batch.behaviour_logps[fresh]),
                                 (batch.n_tokens,))
        return totals

    def _optimizer_step(self) -> float:
        """Clip, step the optimizer and the schedule, and move to the next policy version; the gradient norm."""
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        self.policy_version += 1
        return grad_norm

    def _sync_after_step(self, plan: StepPlan) -> tuple[float, dict[str, float]]:
        """Push the new weights (a failure tolerated, see `_sync_or_tolerate`), then check the engine serves
        them on a prompt just trained on; the push's seconds and the check's metrics."""
        started = time.perf_counter()
        self._sync_or_tolerate()
        seconds = time.perf_counter() - started
        if not self.ranks.leader:
            return seconds, self._check_sync(None, None)
        return seconds, self._check_sync(plan.samples[0].row.tokens, plan.samples[0].row.mask)

    def _check_sync(self, tokens: list[int] | None, mask: list[int] | None) -> dict[str, float]:
        """The engine's logprobs against ours for a few tokens it samples after a prompt just trained on (see
        `sync_check`): at equal weights, float rounding. Rank 0 asks the engine; every rank scores."""
        turn = None
        if self.ranks.leader and self.sync_check is not None and not self.sync_failures:
            assert tokens is not None and mask is not None
            prompt = (tokens[:mask.index(1)] if 1 in mask else tokens)[-PROMPT_TOKENS:]
            ids, logps = self.sync_check.sample(prompt)
            turn = (prompt, ids, logps)
        turn = self.ranks.broadcast(turn)
        if turn is None:
            return {}
        with self._autocast():
            mismatch = score(self.policy, [turn], self.temperature)
        return {"sync/logp_difference_max": mismatch.abs_diff_max,
                "sync/mismatch_kl": mismatch.kl_sum / max(mismatch.tokens, 1)}

    def _sync(self) -> None:
        """Rank 0 pushes while the other ranks gather the same tensors with it (a failed push still drains)."""
        weights = self.weights
        try:
            if self.ranks.leader:
                self.weight_sync.push(weights, self.policy_version)
        finally:
            weights.drain(self.sends)

    def _sync_or_tolerate(self) -> None:
        """Sync; a failure leaves the engine on older weights (their tokens are IS-corrected or dropped as
        stale) and is retried after the next step, up to `max_sync_failures` in a row."""
        try:
            self._sync()
        except WeightSyncError as error:
            self.sync_failures += 1
            if self.sync_failures > self.config.max_sync_failures:
                raise
            print(f"harness-rl: weight sync failed ({self.sync_failures} in a row), retrying after the next "
                  f"step: {error}", file=sys.stderr, flush=True)
        else:
            self.sync_failures = 0

    def _save(self, path: str | Path, export: bool) -> Path:
        def extras(staging: Path) -> None:
            if self.lora is not None:
                adapter = self.weights.adapter()
                if self.ranks.leader:
                    self.lora.write(adapter, staging / ADAPTER_DIR)
            if export:
                export_model(self.weights, staging / MODEL_DIR)

        state = TrainerState(step=self.step_count, policy_version=self.policy_version,
                             sync_failures=self.sync_failures, extra=self.extra_state)
        return save_checkpoint(path, self.model, self.optimizer, self.scheduler, state, ranks=self.ranks,
                               trainable_only=self.lora is not None, extras=extras)

    def _load(self, path: str | Path) -> dict[str, Any]:
        state = load_checkpoint(path, self.model, self.optimizer, self.scheduler, trainable_only=self.lora is not None)
        self.step_count, self.policy_version, self.extra_state = state.step, state.policy_version, state.extra
        self.sync_failures = state.sync_failures
        return self.extra_state

    def _clip_gradients(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(distributed.full_tensor(norm))

    def _autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")


def _weightless_batch() -> MicroBatch:
    """A two-token micro-batch whose one trained token weighs 0: a rank with no rows left still takes part in
    the step's forward and backward collectives, adding nothing."""
    zero = torch.zeros(1)
    return MicroBatch(input_ids=torch.zeros(1, 2, dtype=torch.long), position_ids=torch.arange(2)[None],
                      target_index=torch.zeros(1, dtype=torch.long), target_ids=torch.zeros(1, dtype=torch.long),
                      behaviour_logps=zero, versions=torch.full((1,), -1), advantages=zero, weights=zero,
                      row_index=torch.zeros(1, dtype=torch.long), row_lengths=[2])


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
