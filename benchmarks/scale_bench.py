"""Memory per rank and step time of the learner: one process vs two (FSDP2), full fine-tuning vs LoRA rank 8.

A Qwen2-shaped model of about 50M parameters (built offline, random) takes the same steps on the same
synthetic rollouts in each layout. Per rank it counts the bytes a step holds for training: parameters
(this rank's shards; frozen ones included), gradients (one per trainable shard, alive from the backward
to the optimizer step) and AdamW's moments, and reports the process's peak RSS beside them. Step time is
the median of the timed steps, rank 0's clock. Ratios are against one process with full fine-tuning.

    python benchmarks/scale_bench.py [--steps 3] [--device cpu] [--quick]

On CPU every process gets `--threads` threads (1, as torchrun sets), so two processes use twice the
cores of one; the memory ratios are what sharding buys on any device.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from conventions import load_average, parse_args

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"full:1": ("full", 1, 0), "full:2": ("full", 2, 0), "lora8:1": ("lora8", 1, 8), "lora8:2": ("lora8", 2, 8)}
VOCAB = 32000


def build_model(path: Path, hidden: int = 512, layers: int = 6) -> Path:
    """Qwen2 shape, untied head; hidden 512 and 6 layers (the default): 51.7M parameters."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden,
                                  num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                  max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=1,
                                  pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def groups(step: int, rollouts: int, prompt: int, completion: int) -> list:
    from harness_rl.outcome import RolloutGroup, RolloutOutcome
    from harness_rl.trace import TrainingTrace, Turn

    rng = random.Random(step)
    outcomes = []
    for i in range(rollouts):
        ids = [rng.randrange(2, VOCAB) for _ in range(prompt + completion)]
        turn = Turn(node_id="t", prompt_token_ids=ids[:prompt], completion_token_ids=ids[prompt:],
                    per_token_logps=[-10.0] * completion, loss_mask=[0] * prompt + [1] * completion,
                    policy_version=step)
        outcomes.append(RolloutOutcome(rollout_id=f"r{i}", task="t", reward=float(i % 2),
                                       trace=TrainingTrace(rollout_id=f"r{i}", turns=[turn])))
    return [RolloutGroup(group_id=step, task="t", outcomes=outcomes)]


def local_bytes(tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def worker(args: argparse.Namespace) -> None:
    import torch

    from harness_rl.learner.config import LearnerConfig
    from harness_rl.learner.learner import Learner

    config = LearnerConfig(learning_rate=1e-5, token_budget=4096, lora_rank=args.lora_rank, device=args.device,
                           max_steps=100)
    learner = Learner(args.model_dir, config)
    if not learner.ranks.leader:
        learner.follow()
    else:
        times = []
        for step in range(args.steps + 1):
            metrics = learner.step(groups(step, args.rollouts, args.prompt, args.completion))
            if step:  # the first step warms up
                times.append(metrics["perf/step_s"])
        learner.close()
    params = sum(local_bytes(p) for p in learner.model.parameters())
    grads = sum(local_bytes(p) for p in learner.model.parameters() if p.requires_grad)
    optimizer = sum(local_bytes(t) for state in learner.optimizer.state.values() for t in state.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
    report = {"rank": learner.ranks.rank, "params": params, "grads": grads, "optimizer": optimizer,
              "trainable": sum(p.numel() for p in learner.model.parameters() if p.requires_grad),
              "total": sum(p.numel() for p in learner.model.parameters()),
              "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if learner.ranks.leader:
        report["step_s"] = statistics.median(times)
    Path(f"{args.out}.{learner.ranks.rank}").write_text(json.dumps(report))


def launch(model_dir: Path, out: Path, processes: int, lora_rank: int, args: argparse.Namespace) -> list[dict]:
    prefix = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    command = [*prefix, __file__, "--worker", "--model-dir", str(model_dir), "--out", str(out), "--lora-rank",
               str(lora_rank), "--steps", str(args.steps), "--device", args.device, "--rollouts", str(args.rollouts),
               "--prompt", str(args.prompt), "--completion", str(args.completion)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"scale_bench: {' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(processes)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout (after one warm-up step)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for one GPU per process")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per process (torchrun's default: 1)")
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--completion", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512, help="the model's hidden size")
    parser.add_argument("--layers", type=int, default=6, help="the model's layers")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"the layouts to run, of {', '.join(LAYOUTS)} (full:1, the ratios' base, always runs)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--lora-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parse_args(parser, {"steps": 1, "rollouts": 2, "prompt": 16, "completion": 8, "hidden": 64, "layers": 2,
                               "layouts": "full:1,lora8:2"})
    if args.worker:
        worker(args)
        return
    work = Path(tempfile.mkdtemp(prefix="scale-bench-"))
    model_dir = build_model(work / "model", args.hidden, args.layers)
    load_before = os.getloadavg()
    rows = {}
    chosen = ["full:1", *(layout for layout in args.layouts.split(",") if layout != "full:1")]
    if unknown := [layout for layout in chosen if layout not in LAYOUTS]:
        parser.error(f"--layouts: no layout {', '.join(unknown)}; the layouts are {', '.join(LAYOUTS)}")
    for name, processes, lora_rank in (LAYOUTS[layout] for layout in chosen):
        rows[(name, processes)] = launch(model_dir, work / f"{name}-{processes}", processes, lora_rank, args)
    load_after = os.getloadavg()
    base = rows[("full", 1)][0]
    base_bytes = base["params"] + base["grads"] + base["optimizer"]
    mib = 2**20
    print(f"learner memory per rank and step time, {base['total'] / 1e6:.1f}M-parameter Qwen2 on {args.device}, "
          f"{args.rollouts} rollouts x {args.prompt}+{args.completion} tokens, median of {args.steps} steps")
    print(f"{'layout':<14}{'trained':>10}{'params':>10}{'grads':>9}{'adamw':>9}{'P+G+O':>10}{'ratio':>7}"
          f"{'peak RSS':>10}{'step s':>8}{'ratio':>7}")
    for (name, processes), reports in rows.items():
        worst = max(reports, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
        held = worst["params"] + worst["grads"] + worst["optimizer"]
        step_s = reports[0]["step_s"]
        print(f"{name + ' x' + str(processes):<14}{worst['trainable'] / worst['total']:>9.2%} "
              f"{worst['params'] / mib:>8.1f}M{worst['grads'] / mib:>8.1f}M{worst['optimizer'] / mib:>8.1f}M"
              f"{held / mib:>9.1f}M{held / base_bytes:>7.2f}{max(r['peak_rss'] for r in reports) / mib:>9.0f}M"
              f"{step_s:>8.2f}{step_s / base['step_s']:>7.2f}")
    print(f"(MiB; the busiest rank; {args.threads} CPU thread(s) per process; 1-minute load {load_before[0]:.1f} "
          f"before, {load_after[0]:.1f} after; {load_average()})")


if __name__ == "__main__":
    main()
