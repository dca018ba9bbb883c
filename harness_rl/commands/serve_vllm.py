"""`harness-rl serve vllm MODEL [-- extra vllm args]`: real vLLM, set up for exact capture and weight sync."""

import argparse
import os
import sys
from pathlib import Path

from harness_rl.learner.sync_backends import driving, vllm_transfers


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "vllm",
        help="start vLLM with the flags exact capture and weight sync need (see harness_rl/tools/vllm_server.py)",
        description="Prints the full vLLM command, then runs it in the foreground. Extra vLLM arguments go "
                    "after `--`; ones that would break exact capture (e.g. --logprobs-mode raw_logprobs) are "
                    "refused with exit code 2.",
    )
    parser.add_argument("model", help="a local model directory, or 'tiny' (the offline tiny model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="default: the directory's name ('tiny')")
    parser.add_argument("--vllm-python", default=None,
                        help="vLLM's interpreter (default: $HARNESS_RL_VLLM_PYTHON, .tools/vllm-venv, this one)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the tiny model is built")
    parser.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                        help="GPUs one copy of the model spans (vLLM's flag; default: vLLM's, 1)")
    parser.add_argument("--data-parallel-size", type=int, default=None, metavar="N",
                        help="copies of the model inside this one server (vLLM's flag, on GPUs); the proxy keeps "
                             "each agent session on one copy, for its prefix cache")
    parser.add_argument("--lora-rank", type=int, default=0, metavar="R",
                        help="also serve LoRA adapters up to rank R, loaded at run time (for train --lora-rank R: "
                             "--enable-lora, --max-lora-rank, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; default: 0, off)")
    parser.add_argument("--weight-sync", choices=vllm_transfers(), default=None,
                        help="how train's learner will push weights, as train's --weight-sync names it (default: "
                             "nccl with CUDA, the learner on other GPUs; ipc: the learner on this GPU, vLLM taking "
                             "0.4 of its memory unless --gpu-memory-utilization is given after --)")
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit")
    parser.set_defaults(run=run, passthrough=[])


def run(args: argparse.Namespace) -> int:
    from harness_rl.tools.vllm_server import (
        MIN_AGENT_CONTEXT,
        VllmSetupError,
        find_vllm_python,
        has_cuda,
        refuse_breaking_flags,
        vllm_launch,
    )

    parallel = [arg for flag, size in (("--tensor-parallel-size", args.tensor_parallel_size),
                                       ("--data-parallel-size", args.data_parallel_size))
                if size is not None for arg in (flag, str(size))]
    try:
        if any(size is not None and size < 1 for size in (args.tensor_parallel_size, args.data_parallel_size)):
            raise VllmSetupError("--tensor-parallel-size and --data-parallel-size are at least 1")
        refuse_breaking_flags(args.passthrough)  # before the slow CUDA probe
        model_dir, name = _model(args)
        python = find_vllm_python(args.vllm_python)
        cuda = has_cuda(python)
        transfer = driving(args.weight_sync) if args.weight_sync else None
        if transfer is not None and transfer.colocated and not cuda:
            raise VllmSetupError(f"--weight-sync {args.weight_sync}: vLLM and the learner share a CUDA GPU, and "
                                 "vLLM's torch sees none here; without a GPU use --weight-sync gloo")
        launch = vllm_launch(model_dir, python=python, cuda=cuda, host=args.host, port=args.port,
                             served_model_name=name, extra_args=[*parallel, *args.passthrough],
                             lora_rank=args.lora_rank, weight_transfer=args.weight_sync)
    except VllmSetupError as error:
        print(f"harness-rl serve vllm: {error}", file=sys.stderr)
        return 2
    if launch.max_model_len < MIN_AGENT_CONTEXT:
        print(f"harness-rl serve vllm: warning: context {launch.max_model_len} < {MIN_AGENT_CONTEXT}; "
              "long agent prompts (Claude Code ~30k tokens) may not fit", file=sys.stderr)
    print(launch.shell(), flush=True)
    if args.dry_run:
        return 0
    os.execve(launch.command[0], launch.command, {**os.environ, **launch.env})


def _model(args: argparse.Namespace) -> tuple[Path, str | None]:
    """The model directory and served name; 'tiny' is built offline (and served as 'tiny')."""
    if args.model != "tiny":
        return Path(args.model).resolve(), args.served_model_name
    from harness_rl.engine.tiny_model import build_tiny_model, default_cache_dir

    return build_tiny_model(args.cache_dir or default_cache_dir(0), seed=0), args.served_model_name or "tiny"
