"""The learner's GPU paths, checked and timed in one short run (needs CUDA; prints side by side).

1. Packed logprobs equal per-row logprobs on the GPU, for every attention kernel available here
   (sdpa always, flash_attention_2 when flash-attn is installed: the varlen path), in float32 and
   under the learner's bf16 autocast.
2. Learner step throughput on the GPU (forwarded and trained tokens/s), float32 weights + bf16 autocast.

    python benchmarks/learner_gpu_check.py
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import torch

from harness_rl.learner.packing import pack, packed_logprobs
from harness_rl.learner.rows import Row
from harness_rl.learner.samples import Sample


def kernels() -> list[str]:
    found = ["sdpa"]
    try:
        import flash_attn  # noqa: F401

        found.append("flash_attention_2")
    except ImportError:
        pass
    return found


def random_samples(vocab: int, n: int = 12) -> list[Sample]:
    rng = random.Random(0)
    samples = []
    for _ in range(n):
        length = rng.randint(64, 900)
        tokens = [rng.randrange(vocab) for _ in range(length)]
        mask = [0] * 16 + [rng.randint(0, 1) for _ in range(length - 17)] + [1]
        samples.append(Sample(Row("r", tokens, mask, [-1.0 if m else 0.0 for m in mask],
                                  [0 if m else -1 for m in mask]), "0/r", 1.0, 1.0))
    return samples


def per_row(model, batch) -> torch.Tensor:
    out = []
    for ids in batch.input_ids[0].split(batch.row_lengths):
        logits = model(input_ids=ids[None]).logits[0].float()
        nxt = torch.cat([ids[1:], ids[:1]])
        out.append(torch.log_softmax(logits, -1).gather(-1, nxt[:, None])[:, 0])
    return torch.cat(out)[batch.target_index]


def check_kernels(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    print("1. packed vs per-row logprobs on cuda (max |Δ|)")
    for attn in kernels():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
        model = model.cuda().eval()
        batches = [b.to("cuda") for b in pack(random_samples(model.config.vocab_size), token_budget=4096)]
        for autocast in (False, True):
            if attn.startswith("flash") and not autocast:
                continue  # flash kernels take bf16/fp16 only
            worst = 0.0
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                for batch in batches:
                    for split in (False, True):
                        got, _ = packed_logprobs(model, batch, split_rows=split)
                        worst = max(worst, (got - per_row(model, batch)).abs().max().item())
            limit = 5e-2 if autocast else 1e-4
            print(f"   {attn:<18} {'bf16 autocast' if autocast else 'float32':<14} {worst:.2e} "
                  f"({'ok' if worst < limit else 'TOO LARGE'}, limit {limit:g})")


def time_learner(model_dir: Path) -> None:
    from harness_rl.learner.learner import Learner
    from harness_rl.outcome import RolloutGroup, RolloutOutcome
    from harness_rl.run.config import LearnerConfig
    from harness_rl.run.metrics import MetricsLogger
    from harness_rl.trace import TrainingTrace, Turn

    learner = Learner(model_dir, LearnerConfig(learning_rate=1e-5, token_budget=16384),
                      metrics=MetricsLogger(None, console=False))
    rng = random.Random(1)

    def group(step: int) -> RolloutGroup:
        outcomes = []
        for i in range(8):
            prompt = [rng.randrange(4000) for _ in range(1500)]
            completion = [rng.randrange(4000) for _ in range(500)]
            turn = Turn(node_id="t", prompt_token_ids=prompt, completion_token_ids=completion,
                        per_token_logps=[-8.0] * 500, loss_mask=[0] * 1500 + [1] * 500, policy_version=step)
            outcomes.append(RolloutOutcome(rollout_id=str(i), task="t", reward=float(i % 2),
                                           trace=TrainingTrace(rollout_id=str(i), turns=[turn])))
        return RolloutGroup(group_id=step, task="t", outcomes=outcomes)

    learner.step([group(0)])
    torch.cuda.synchronize()
    started, forwarded, trained = time.perf_counter(), 0.0, 0.0
    for step in range(1, 6):
        metrics = learner.step([group(step)])
        forwarded += metrics["batch/forwarded_tokens_per_step"]
        trained += metrics["batch/trained_tokens_per_step"]
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    print(f"2. learner on cuda: {forwarded / elapsed:.0f} forwarded tok/s, {trained / elapsed:.0f} trained tok/s, "
          f"{elapsed / 5:.3f} s/step")


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("learner_gpu_check: no CUDA device here")
    from harness_rl.engine import build_tiny_model

    model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    check_kernels(model_dir)
    time_learner(model_dir)


if __name__ == "__main__":
    main()
