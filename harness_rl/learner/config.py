"""The learner's settings: the optimizer and its schedule, the GRPO loss, and `harness-rl sft`'s.

Each field's description is its flag's help (`harness-rl train`, `harness-rl sft`); the run level
composes these sections into a run's configuration (`harness_rl.run.config`).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from harness_rl.settings import AtLeastOne, AtLeastZero, NonNegative, Positive, setting

TrainRole = Literal["agent", "summary", "auxiliary"]


class LossConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    epsilon: Annotated[Positive, setting("lower clip of the ratio")] = 0.2
    epsilon_high: Annotated[Positive | None, setting("upper clip of the ratio; none: epsilon")] = None
    tis_cap: Annotated[Positive | None, setting("truncated importance-sampling cap on the behaviour ratio")] = 3.0
    beta: Annotated[NonNegative, setting("k3 KL weight to the initial model")] = 0.0
    decoupled: Annotated[bool, setting(
        "decoupled PPO: the trust region against the weights before the step, truncated IS against the sampler "
        "(off: clip to the sampler, as TRL's AsyncGRPO)")] = True
    normalization: Annotated[Literal["token", "rollout"], setting(
        "token: every trained token weighs the same; rollout: every rollout does", flag="--loss-normalization")] \
        = "token"

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


class LearnerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    learning_rate: Annotated[Positive, setting("AdamW learning rate")] = 1e-6
    weight_decay: Annotated[NonNegative, setting("AdamW weight decay")] = 0.0
    adam_beta1: Annotated[NonNegative, setting("AdamW beta1", flag=None)] = 0.9
    adam_beta2: Annotated[NonNegative, setting("AdamW beta2", flag=None)] = 0.999
    adam_eps: Annotated[Positive, setting("AdamW epsilon", flag=None)] = 1e-8
    lr_scheduler: Annotated[Literal["constant", "linear", "cosine"], setting("learning-rate schedule")] = "constant"
    warmup_steps: Annotated[AtLeastZero, setting("linear warmup steps")] = 0
    max_steps: Annotated[AtLeastOne, setting("optimizer steps")] = 200
    max_grad_norm: Annotated[Positive | None, setting("gradient-norm clip; none: no clipping")] = 1.0
    groups_per_step: Annotated[AtLeastOne, setting("GRPO groups per optimizer step")] = 1
    token_budget: Annotated[AtLeastOne, setting("tokens per packed micro-batch")] = 16384
    train_roles: Annotated[list[TrainRole], msgspec.Meta(min_length=1), setting(
        "which calls train on the rollout's reward: agent (the agent's own turns), summary (the summary a compaction "
        "asks for), auxiliary (titles and other side calls); repeat the flag for several "
        "(--train-roles agent --train-roles summary)")] = msgspec.field(default_factory=lambda: ["agent"])
    max_staleness: Annotated[AtLeastZero | None, setting(
        "drop tokens sampled more than N policy versions ago; none: keep all")] = 4
    gradient_checkpointing: Annotated[bool, setting("trade compute for activation memory")] = False
    device: Annotated[str, setting("torch device of the learner; auto: cuda when available")] = "auto"
    nproc_per_node: Annotated[AtLeastOne, setting(
        "learner processes on this machine (one per GPU): train starts torchrun, the policy sharded with FSDP2 "
        "across them, rank 0 running the engine, proxy and rollouts (several machines: torchrun --nnodes ... -m "
        "harness_rl train, which ignores this)")] = 1
    attn_implementation: Annotated[str | None, setting("attention kernel; none: flash_attention_2 on CUDA when "
                                                       "installed, else sdpa", flag=None)] = None
    sync_every: Annotated[AtLeastOne, setting("push weights to the engine every N steps")] = 1
    max_sync_failures: Annotated[AtLeastZero, setting("failed weight syncs in a row tolerated", flag=None)] = 3
    lora_rank: Annotated[AtLeastZero, setting(
        "train a LoRA adapter of this rank (peft) instead of every weight; 0: full fine-tuning")] = 0
    lora_alpha: Annotated[AtLeastOne | None, setting("LoRA scale numerator (the update is alpha/rank * B A); "
                                                   "none: 2 x rank")] = None
    lora_target_modules: Annotated[list[str], setting(
        "module names LoRA adapts (repeat the flag); all-linear: every linear layer but the output head")] \
        = msgspec.field(default_factory=lambda: ["all-linear"])
    collective_timeout_s: Annotated[Positive, setting(
        "under torchrun: how long a process waits in a collective, e.g. for rank 0's next step while it waits "
        "for rollouts", flag=None)] = 7200.0
    loss: LossConfig = msgspec.field(default_factory=LossConfig)


class SftConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every setting of `harness-rl sft` (rejection-sampling fine-tuning from captured traces)."""

    traces: Annotated[str, setting("a directory of *.json traces (e.g. runs/<run>/traces) or a glob of trace files",
                                   required=True)] \
        = ""
    model: Annotated[str, setting("a local model directory, a run directory, tiny or tiny-agent", required=True)] = ""
    output_dir: Annotated[str, setting("where the fine-tuned model directory goes (must not exist or be empty)",
                                       required=True)] = ""
    min_reward: Annotated[float, setting("keep traces whose metadata reward is at least this")] = 1.0
    epochs: Annotated[AtLeastOne, setting("passes over the selected traces")] = 3
    learning_rate: Annotated[Positive, setting("AdamW learning rate")] = 1e-5
    token_budget: Annotated[AtLeastOne, setting("tokens per packed micro-batch, one optimizer step each")] = 16384
    seed: Annotated[int, setting("seed of the batch order (and of the tiny model)")] = 0
    weight_decay: Annotated[NonNegative, setting("AdamW weight decay")] = 0.0
    max_grad_norm: Annotated[Positive | None, setting("gradient-norm clip; none: no clipping")] = 1.0
    device: Annotated[str, setting("torch device; auto: cuda when available")] = "auto"
