# /// script
# requires-python = ">=3.11"
# dependencies = ["huggingface_hub>=1.0"]
# ///
"""Run harness-rl training on Hugging Face Jobs: vLLM on one GPU, the learner on another.

From a laptop, `submit` sends this very script to HF Jobs; inside the job it runs itself again
with `run`, which starts vLLM with the capture and weight-transfer flags harness-rl needs, waits
for it, runs `harness-rl train` against it (weights synced over NCCL after every step), and uploads
the run directory to a Hub repo at the end. The agents run in the job's own container with the
local sandbox, so they reach the proxy on loopback and no tunnel is needed.

    python examples/hf_jobs_launcher.py submit --flavor h200x2 \\
        --package 'harness-rl[train,vllm] @ git+https://github.com/<you>/harness-rl' \\
        --model Qwen/Qwen3.5-2B --push-to <you>/harness-rl-runs -- \\
        --harness mini-swe-agent --tasks hf://<you>/my-harbor-tasks --max-steps 100

Everything after `--` goes to `harness-rl train` unchanged. `submit --dry-run` prints the job
instead of sending it. opencode and Claude Code need Node.js in the image (`--image`);
mini-swe-agent and the echo harness need only Python.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

VLLM_PORT = 8000


def vllm_command(model: str, served_name: str, *, port: int, max_model_len: int, tool_call_parser: str,
                 reasoning_parser: str | None) -> list[str]:
    """vLLM with exact token capture (ids, processed logprobs) and NCCL weight transfer."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(max_model_len), "--logprobs-mode", "processed_logprobs",
        "--return-tokens-as-token-ids", "--generation-config", "vllm", "--enable-auto-tool-choice",
        "--tool-call-parser", tool_call_parser, "--weight-transfer-config", json.dumps({"backend": "nccl"}),
    ]
    if reasoning_parser:
        command += ["--reasoning-parser", reasoning_parser]
    return command


def train_command(model: str, output_dir: str, train_args: list[str], *, port: int) -> list[str]:
    return ["harness-rl", "train", "--preset", "real", "--engine", f"http://127.0.0.1:{port}", "--model", model,
            "--weight-sync", "nccl", "--output-dir", output_dir, *train_args]


def served_name(model: str) -> str:
    """A leaf name without '/': Claude Code rejects model names with a slash."""
    return model.rstrip("/").rsplit("/", 1)[-1]


def job_spec(args: argparse.Namespace) -> dict:
    """What `submit` sends: this script, re-run with `run`, on the chosen hardware."""
    script_args = ["run", "--model", args.model, "--max-model-len", str(args.max_model_len),
                   "--tool-call-parser", args.tool_call_parser, "--output-dir", args.output_dir]
    if args.reasoning_parser:
        script_args += ["--reasoning-parser", args.reasoning_parser]
    if args.push_to:
        script_args += ["--push-to", args.push_to]
    script_args += ["--", *args.train_args]
    spec = {"script": str(Path(__file__).resolve()), "script_args": script_args, "dependencies": [args.package],
            "flavor": args.flavor, "timeout": args.timeout, "secrets": {"HF_TOKEN": None},
            "env": {"HF_HUB_ENABLE_HF_TRANSFER": "1", "PYTHONUNBUFFERED": "1"}}
    if args.image:
        spec["image"] = args.image
    return spec


def submit(args: argparse.Namespace) -> int:
    spec = job_spec(args)
    if args.dry_run:
        print(json.dumps(spec, indent=2))
        return 0
    from huggingface_hub import get_token, run_uv_job

    spec["secrets"] = {"HF_TOKEN": get_token()}
    job = run_uv_job(**spec)
    print(f"submitted job {job.id}: {job.url}")
    return 0


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Wait for `url` to answer 200; fail fast if the server process dies first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"launcher: vLLM exited with status {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"launcher: vLLM not healthy after {timeout_s:.0f}s at {url}")


def stop(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the whole process group, SIGKILL what is left after the grace period."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def run(args: argparse.Namespace) -> int:
    """Inside the job: vLLM on GPU `--vllm-device`, the learner on `--train-device`."""
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": str(args.vllm_device)}
    vllm = subprocess.Popen(vllm_command(args.model, served_name(args.model), port=VLLM_PORT,
                                         max_model_len=args.max_model_len, tool_call_parser=args.tool_call_parser,
                                         reasoning_parser=args.reasoning_parser),
                            env=env, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{VLLM_PORT}/health", vllm, args.vllm_timeout)
        train_env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(args.train_device)}
        status = subprocess.call(train_command(args.model, args.output_dir, args.train_args, port=VLLM_PORT),
                                 env=train_env)
    finally:
        stop(vllm)
    if args.push_to:
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(args.push_to, exist_ok=True, private=True)
        api.upload_folder(repo_id=args.push_to, folder_path=args.output_dir,
                          path_in_repo=Path(args.output_dir).name)
        print(f"launcher: uploaded {args.output_dir} to {args.push_to}")
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    for mode in ("submit", "run"):
        sub = modes.add_parser(mode)
        sub.add_argument("--model", required=True, help="hub id or path served by vLLM and trained")
        sub.add_argument("--max-model-len", type=int, default=65536)
        sub.add_argument("--tool-call-parser", default="hermes", help="vLLM's parser for the model's tool calls")
        sub.add_argument("--reasoning-parser", default=None)
        sub.add_argument("--output-dir", default="/tmp/harness-rl-run")
        sub.add_argument("--push-to", default=None, help="Hub repo that receives the run directory")
        sub.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then flags for `harness-rl train`")
    submit_parser, run_parser = modes.choices["submit"], modes.choices["run"]
    submit_parser.add_argument("--package", default="harness-rl[train,vllm]",
                               help="pip requirement that installs harness-rl in the job")
    submit_parser.add_argument("--flavor", default="h200x2")
    submit_parser.add_argument("--timeout", default="4h")
    submit_parser.add_argument("--image", default=None, help="container image (needs Node.js for opencode/Claude)")
    submit_parser.add_argument("--dry-run", action="store_true", help="print the job instead of sending it")
    submit_parser.set_defaults(handler=submit)
    run_parser.add_argument("--vllm-device", type=int, default=0)
    run_parser.add_argument("--train-device", type=int, default=1)
    run_parser.add_argument("--vllm-timeout", type=float, default=1200.0)
    run_parser.set_defaults(handler=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.train_args[:1] == ["--"]:
        args.train_args = args.train_args[1:]
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
