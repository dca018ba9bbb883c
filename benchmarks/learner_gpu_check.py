"""The learner's GPU paths, checked and timed in one short run (needs CUDA; prints side by side).

1. Packed logprobs equal per-row logprobs on the GPU, for every attention kernel available here
   (sdpa always, flash_attention_2 when flash-attn is installed: the varlen path), in float32 and
   under the learner's bf16 autocast.
2. Learner step throughput on the GPU (forwarded and trained tokens/s), float32 weights + bf16 autocast,
   full fine-tuning and LoRA rank 8 (the merged weights a sync sends checked against peft's own merge).
3. FSDP2 (needs 2 GPUs): the same 3 steps in 1 process and in 2 (torchrun, NCCL, bf16 compute with fp32
   reduction), full and LoRA: losses and exported weights side by side, and the memory per rank
   (`scale_bench.py`'s layouts on cuda).

    python benchmarks/learner_gpu_check.py             # about 5 minutes on one H100-class GPU
    python benchmarks/learner_gpu_check.py --dry-run   # what would run, and whether it can (any machine)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness_rl.learner.packing import pack, packed_logprobs
from harness_rl.learner.rows import Row
from harness_rl.learner.samples import Sample

ROOT = Path(__file__).resolve().parents[1]
BF16_LIMIT = 5e-2  # |Δ logprob| between bf16 runs whose reductions run in another order


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
            limit = BF16_LIMIT if autocast else 1e-4
            print(f"   {attn:<18} {'bf16 autocast' if autocast else 'float32':<14} {worst:.2e} "
                  f"({'ok' if worst < limit else 'TOO LARGE'}, limit {limit:g})")


def time_learner(model_dir: Path) -> None:
    from harness_rl.learner.config import LearnerConfig
    from harness_rl.learner.learner import Learner
    from harness_rl.outcome import RolloutGroup, RolloutOutcome
    from harness_rl.trace import TrainingTrace, Turn

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

    print("2. learner step on cuda")
    for lora_rank in (0, 8):
        learner = Learner(model_dir, LearnerConfig(learning_rate=1e-5, token_budget=16384, lora_rank=lora_rank))
        learner.step([group(0)])
        torch.cuda.synchronize()
        started, forwarded, trained = time.perf_counter(), 0.0, 0.0
        for step in range(1, 6):
            metrics = learner.step([group(step)])
            forwarded += metrics["batch/forwarded_tokens_per_step"]
            trained += metrics["batch/trained_tokens_per_step"]
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        label = f"lora {lora_rank}" if lora_rank else "full"
        print(f"   {label:<8} {forwarded / elapsed:.0f} forwarded tok/s, {trained / elapsed:.0f} trained tok/s, "
              f"{elapsed / 5:.3f} s/step, peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        if lora_rank:
            check_merge(learner)
        del learner
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def check_merge(learner) -> None:
    """The merged weights a sync sends against peft's own merge of the same adapter."""
    from peft.tuners.lora import LoraLayer

    ours = dict(learner.weights)
    worst = 0.0
    for name, layer in learner.lora.layers.items():
        assert isinstance(layer, LoraLayer)
        base = layer.get_base_layer().weight
        theirs = base + layer.get_delta_weight("default")
        worst = max(worst, (ours[f"{name}.weight"] - theirs).abs().max().item())
    print(f"   lora merge: ours vs peft's max |Δ| {worst:.2e} ({'ok' if worst < 1e-5 else 'TOO LARGE'})")


def check_fsdp(model_dir: Path, work: Path) -> None:
    if torch.cuda.device_count() < 2:
        print("3. FSDP2 across 2 GPUs: skipped, this machine has one")
        return
    print("3. FSDP2: 1 process vs 2 (torchrun, NCCL, bf16 compute), 3 steps")
    from safetensors.torch import load_file

    for lora_rank in (0, 8):
        runs = {n: fsdp_run(model_dir, work / f"fsdp-{lora_rank}-{n}", n, lora_rank) for n in (1, 2)}
        loss_delta = max(abs(a - b) for a, b in zip(runs[1][0], runs[2][0], strict=True))
        exported = [load_file(runs[n][1] / "model.safetensors") for n in (1, 2)]
        worst = max((exported[0][k].float() - exported[1][k].float()).abs().max().item() for k in exported[0])
        label = f"lora {lora_rank}" if lora_rank else "full"
        print(f"   {label:<8} losses 1 proc {runs[1][0]}, 2 procs {runs[2][0]}: max |Δ| {loss_delta:.2e}; "
              f"weights max |Δ| {worst:.2e} ({'ok' if loss_delta < BF16_LIMIT else 'TOO LARGE'})")
    bench = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale_bench.py"), "--device", "cuda",
                            "--rollouts", "8", "--prompt", "1024", "--completion", "256"],
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    print("   " + (bench.stdout or bench.stderr[-2000:]).replace("\n", "\n   "))


def fsdp_run(model_dir: Path, out: Path, processes: int, lora_rank: int) -> tuple[list[float], Path]:
    prefix = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    command = [*prefix, __file__, "--fsdp-worker", str(model_dir), str(out), str(lora_rank)]
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"learner_gpu_check: {' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads((out / "losses.json").read_text()), out / "checkpoints" / "step-00000003" / "model"


def fsdp_worker(model_dir: Path, out: Path, lora_rank: int) -> None:
    from scale_bench import groups

    from harness_rl.learner.config import LearnerConfig
    from harness_rl.learner.learner import Learner

    learner = Learner(model_dir, LearnerConfig(learning_rate=1e-5, lora_rank=lora_rank), output_dir=out)
    if not learner.ranks.leader:
        learner.follow()
        return
    losses = [learner.step(groups(step, 8, 512, 128))["loss"] for step in range(3)]
    learner.save(export=True)
    learner.close()
    (out / "losses.json").write_text(json.dumps(losses))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="say what would run here, and stop")
    parser.add_argument("--fsdp-worker", nargs=3, metavar=("MODEL", "OUT", "LORA_RANK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fsdp_worker:
        model, out, rank = args.fsdp_worker
        fsdp_worker(Path(model), Path(out), int(rank))
        return
    gpus = torch.cuda.device_count()
    if args.dry_run:
        import peft  # noqa: F401  (LoRA needs it)

        print(f"learner_gpu_check: {gpus} GPU(s); would run 1 (kernels: {', '.join(kernels())}), 2 (full, lora 8), "
              f"and {'3 (FSDP2 1 vs 2 processes, scale_bench on cuda)' if gpus >= 2 else 'not 3 (needs 2 GPUs)'}")
        return
    if not gpus:
        raise SystemExit("learner_gpu_check: no CUDA device here (--dry-run says what would run)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from scale_bench import build_model

    from harness_rl.engine import build_tiny_model

    work = Path(tempfile.mkdtemp())
    check_kernels(build_tiny_model(work / "tiny", seed=0))
    model_dir = build_model(work / "model-50m")
    time_learner(model_dir)
    check_fsdp(model_dir, work)


if __name__ == "__main__":
    main()
