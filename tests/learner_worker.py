"""One process of a learner test run, alone or under torchrun: seeded groups whose rows differ widely in
length, a few steps, the losses and a checkpoint (model exported) written by rank 0.

    python tests/learner_worker.py MODEL_DIR OUT [--steps 3] [--lora-rank 8] [--resume CKPT]
    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/learner_worker.py MODEL_DIR OUT
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
from pathlib import Path

from harness_rl.learner.config import LearnerConfig, LossConfig
from harness_rl.learner.distributed import leave
from harness_rl.learner.learner import Learner
from harness_rl.outcome import RolloutGroup, RolloutOutcome
from harness_rl.trace import TrainingTrace, Turn

VOCAB = 97  # tests/tiny_lm.py


def rollout(rng: random.Random, rid: str, reward: float, version: int) -> RolloutOutcome:
    """One turn whose prompt is 3 to 700 tokens long and whose completion is 2 to 60."""
    prompt = [rng.randrange(VOCAB) for _ in range(rng.choice([3, 9, 40, 700]))]
    completion = [rng.randrange(VOCAB) for _ in range(rng.choice([2, 7, 60]))]
    logps = [min(math.log(1 / VOCAB) + rng.gauss(0, 0.3), -1e-3) for _ in completion]
    turn = Turn(node_id=f"{rid}.0", prompt_token_ids=prompt, completion_token_ids=completion, per_token_logps=logps,
                loss_mask=[0] * len(prompt) + [1] * len(completion), policy_version=version)
    return RolloutOutcome(rollout_id=rid, task="t", reward=reward, trace=TrainingTrace(rollout_id=rid, turns=[turn]))


def groups(step: int) -> list[RolloutGroup]:
    rng = random.Random(step)
    return [RolloutGroup(group_id=g, task="t", outcomes=[
        rollout(rng, f"s{step}g{g}r{i}", [0.0, 1.0, 0.5, 0.0, 1.0][i], step) for i in range(5)]) for g in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--normalization", default="token")
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--save-at", type=int, default=0, help="also checkpoint after this step")
    args = parser.parse_args()
    config = LearnerConfig(learning_rate=1e-3, token_budget=256, max_steps=10, lora_rank=args.lora_rank,
                           lr_scheduler="linear", warmup_steps=1, loss=LossConfig(normalization=args.normalization))
    try:
        run(Learner(args.model_dir, config, seed=3, output_dir=args.out), args)
    finally:
        gc.collect()
        leave()  # as `train` does, once the learner is gone: a gloo group torn down at exit can abort there


def run(learner: Learner, args: argparse.Namespace) -> None:
    if learner.ranks.leader:
        lead(learner, args)
    else:
        learner.follow()


def lead(learner: Learner, args: argparse.Namespace) -> None:
    if args.resume:
        learner.load(args.resume)
    losses = {}
    while learner.step_count < args.steps:
        metrics = learner.step(groups(learner.step_count))
        losses[learner.step_count] = metrics["loss"]
        if learner.step_count == args.save_at:
            learner.save()
    learner.save(export=True)
    learner.close()
    (args.out / "losses.json").write_text(json.dumps({"world_size": learner.ranks.world_size, "losses": losses}))


if __name__ == "__main__":
    main()
