"""The Hugging Face Jobs launcher: the job it would submit and the servers it would start (no cloud here)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "hf_jobs_launcher.py"


@pytest.fixture(scope="module")
def launcher():
    spec = importlib.util.spec_from_file_location("hf_jobs_launcher", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_prints_a_job_that_reruns_the_script_inside(capsys, launcher) -> None:
    assert launcher.main(["submit", "--model", "Qwen/Qwen3.5-2B", "--dry-run", "--push-to", "me/runs",
                          "--package", "harness-rl[train,vllm] @ git+https://example.invalid/h.git",
                          "--", "--harness", "opencode", "--max-steps", "5"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["script"] == str(SCRIPT) and spec["flavor"] == "h200x2"
    assert spec["dependencies"] == ["harness-rl[train,vllm] @ git+https://example.invalid/h.git"]
    args = spec["script_args"]
    assert args[0] == "run" and args[args.index("--model") + 1] == "Qwen/Qwen3.5-2B"
    assert args[args.index("--push-to") + 1] == "me/runs"
    assert args[args.index("--") + 1:] == ["--harness", "opencode", "--max-steps", "5"]


def test_vllm_is_started_with_every_capture_and_weight_transfer_flag(launcher) -> None:
    command = launcher.vllm_command("Qwen/Qwen3.5-2B", launcher.served_name("Qwen/Qwen3.5-2B"), port=8000,
                                    max_model_len=65536, tool_call_parser="qwen3_xml", reasoning_parser="qwen3")
    joined = " ".join(command)
    for flag in ("--logprobs-mode processed_logprobs", "--return-tokens-as-token-ids", "--generation-config vllm",
                 "--enable-auto-tool-choice", "--tool-call-parser qwen3_xml", "--reasoning-parser qwen3",
                 "--served-model-name Qwen3.5-2B", "--host 127.0.0.1"):
        assert flag in joined
    assert json.loads(command[command.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}
    train = launcher.train_command("Qwen/Qwen3.5-2B", "/data/run", ["--max-steps", "3"], port=8000)
    assert train[:4] == ["harness-rl", "train", "--preset", "real"]
    assert " ".join(train).endswith("--weight-sync nccl --output-dir /data/run --max-steps 3")


def test_a_server_that_dies_before_it_is_ready_fails_fast(launcher) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    started = time.monotonic()
    with pytest.raises(SystemExit, match="exited with status 3"):
        launcher.wait_healthy("http://127.0.0.1:9/health", dead, timeout_s=60)
    assert time.monotonic() - started < 10


def test_stop_ends_the_whole_process_group(launcher) -> None:
    sleeper = "import time; time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, "
                               f"'-c', {sleeper!r}]); {sleeper}"], start_new_session=True)
    time.sleep(0.5)
    launcher.stop(parent, grace_s=5)
    assert parent.returncode is not None
    deadline = time.monotonic() + 5
    while subprocess.run(["pgrep", "-g", str(parent.pid)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "a process of the group outlived stop()"
        time.sleep(0.1)
