"""Memory per rank and step time of the learner: one process vs two (FSDP2), full fine-tuning vs LoRA rank 8;
and what a weight push costs each rank of a sharded learner on the broadcast path, at real models' shapes.

A Qwen2-shaped model of about 50M parameters (built offline, random) takes the same steps on the same
synthetic rollouts in each layout. Per rank it counts the bytes a step holds for training: parameters
(this rank's shards; frozen ones included), gradients (one per trainable shard, alive from the backward
to the optimizer step) and AdamW's moments, and reports the process's peak RSS beside them. Step time is
the median of the timed steps, rank 0's clock. Ratios are against one process with full fine-tuning.

The second table (`--gather`) is the price of vLLM's broadcast backend (nccl; gloo here) under FSDP2: every
rank all-gathers each whole tensor as the run's `WeightSource` yields it, and rank 0 sends it on. For each
shape (Qwen2.5-0.5B, Qwen3-8B, Qwen2.5-32B as published, in bf16) two gloo processes shard a copy with
`--gather-layers` decoder layers (built on the meta device: no weights are made up front) and time
`--gather-passes` passes; a layer's figures are scaled to the model's depth. It prints what one push costs a
rank: the largest whole tensor it must hold at once, the bytes gathered into it, the gather's seconds on this
machine, and beside them what vLLM's `nccl_m2n` would move instead (each rank its own shard, nothing whole).

    python benchmarks/scale_bench.py [--steps 3] [--device cpu] [--gather 0.5b,8b,32b] [--quick]

On CPU every process gets `--threads` threads (1, as torchrun sets), so two processes use twice the
cores of one; the memory ratios are what sharding buys on any device. The gather's seconds are gloo over
loopback on this machine's memory, not NVLink: its bytes are what carry to a GPU cluster.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conventions import load_average, parse_args

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"full:1": ("full", 1, 0), "full:2": ("full", 2, 0), "lora8:1": ("lora8", 1, 8), "lora8:2": ("lora8", 2, 8)}
VOCAB = 32000
# Published configurations (their config.json on the hub), for `--gather`: name, model type, sizes.
SHAPES: dict[str, tuple[str, str, dict[str, object]]] = {
    "tiny": ("tiny Qwen2", "qwen2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                                         tie_word_embeddings=False)),
    "0.5b": ("Qwen2.5-0.5B", "qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                           num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                           tie_word_embeddings=True)),
    "8b": ("Qwen3-8B", "qwen3", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                     tie_word_embeddings=False)),
    "32b": ("Qwen2.5-32B", "qwen2", dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                                         num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                                         tie_word_embeddings=False)),
}
LAYER = re.compile(r"\.layers\.\d+\.")


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


def gather_worker(args: argparse.Namespace) -> None:
    """One rank of a sharded copy of shape `args.gather` with `args.gather_layers` layers: weight passes timed."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness_rl.learner.distributed import join, leave, shard
    from harness_rl.learner.weight_source import WeightSource

    ranks = join(torch.device("cpu"), timeout_s=1800)
    _, kind, sizes = SHAPES[args.gather]
    config = AutoConfig.for_model(kind, **{**sizes, "num_hidden_layers": args.gather_layers})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shard(model, model, torch.device("cpu"))
    model.to_empty(device="cpu")  # this rank's shards only, never the whole model
    local = {name: local_bytes(p) for name, p in model.named_parameters()}
    source = WeightSource(model, ranks)
    passes = []
    for _ in range(args.gather_passes):
        tensors, last = [], time.perf_counter()
        tensor = None
        for name, tensor in source:  # each whole tensor is gathered as the pass reaches it
            now = time.perf_counter()
            tensors.append((name, tensor.numel() * tensor.element_size(), now - last))
            last = now
        passes.append(tensors)
    Path(f"{args.out}.{ranks.rank}").write_text(json.dumps({"local": local, "passes": passes}))
    del source, model, tensor
    gc.collect()  # the shards gone before the group is: a gloo group torn down beside live tensors can abort
    leave()


def launch_gather(shape: str, out: Path, args: argparse.Namespace) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
               "--gather-worker", "--gather", shape, "--out", str(out), "--gather-layers", str(args.gather_layers),
               "--gather-passes", str(args.gather_passes)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"scale_bench: {' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]


def push_cost(shape: str, reports: list[dict], measured_layers: int) -> dict[str, float]:
    """One push of the whole model, per rank (the busier of the two): measured tensors outside the decoder
    layers as they are, the measured layers' mean scaled to the model's depth."""
    depth = int(SHAPES[shape][2]["num_hidden_layers"])  # type: ignore[call-overload]
    scale = depth / measured_layers

    def whole(values: dict[str, float]) -> float:
        return sum(v * (scale if LAYER.search(n) else 1) for n, v in values.items())

    seconds, gathered, held = [], [], []
    for report in reports:
        full = {name: size for name, size, _ in report["passes"][0]}
        local = {name: report["local"].get(name, 0) for name in full}
        seconds.append(statistics.median(whole({n: s for n, _, s in p}) for p in report["passes"]))
        gathered.append(whole(full) - whole(local))
        held.append(whole(local))
    full = {name: size for name, size, _ in reports[0]["passes"][0]}
    return {"params_bytes": whole(full), "largest": max(full.values()), "gathered": max(gathered),
            "seconds": max(seconds), "shard": max(held)}


def print_gather(args: argparse.Namespace, work: Path) -> None:
    def size(n: float) -> str:
        return f"{n / 2**30:.2f}G" if n >= 2**30 else f"{n / 2**20:.1f}M"

    load_before = os.getloadavg()
    rows = [(shape, push_cost(shape, launch_gather(shape, work / f"gather-{shape}", args), args.gather_layers))
            for shape in args.gather.split(",")]
    load_after = os.getloadavg()
    print(f"\none weight push on the broadcast path (nccl; gloo here), learner FSDP2 over 2 ranks, bf16; per rank, "
          f"the busier; {args.gather_layers} layer(s) measured and scaled to the model's depth, median of "
          f"{args.gather_passes} passes")
    print(f"{'shape':<14}{'bytes':>9}{'whole at once':>15}{'gathered in':>13}{'gather s':>10}{'rank 0 sends':>14}"
          f"{'nccl_m2n sends':>16}")
    for shape, cost in rows:
        print(f"{SHAPES[shape][0]:<14}{size(cost['params_bytes']):>9}{size(cost['largest']):>15}"
              f"{size(cost['gathered']):>13}{cost['seconds']:>10.2f}{size(cost['params_bytes']):>14}"
              f"{size(cost['shard']):>16}")
    print(f"(whole at once: the largest tensor a rank holds whole during a push; nccl_m2n holds none whole and each "
          f"rank sends its own shard; 1-minute load {load_before[0]:.1f} before, {load_after[0]:.1f} after; "
          f"{load_average()})")


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
    parser.add_argument("--gather", default="0.5b,8b,32b",
                        help=f"the shapes whose push to measure, of {', '.join(SHAPES)} (none: skip)")
    parser.add_argument("--gather-layers", type=int, default=1, help="decoder layers built per shape")
    parser.add_argument("--gather-passes", type=int, default=3, help="weight passes timed per shape")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gather-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--lora-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parse_args(parser, {"steps": 1, "rollouts": 2, "prompt": 16, "completion": 8, "hidden": 64, "layers": 2,
                               "layouts": "full:1,lora8:2", "gather": "tiny", "gather_layers": 2,
                               "gather_passes": 2})
    if args.gather_worker:
        gather_worker(args)
        return
    if args.worker:
        worker(args)
        return
    if unknown := [shape for shape in args.gather.split(",") if shape not in (*SHAPES, "none")]:
        parser.error(f"--gather: no shape {', '.join(unknown)}; the shapes are {', '.join(SHAPES)}")
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
    if args.gather != "none":
        print_gather(args, work)


if __name__ == "__main__":
    main()
