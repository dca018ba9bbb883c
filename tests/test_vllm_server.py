"""`harness-rl serve vllm`: the command it builds, the flags it refuses, and the child process around it."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from harness_rl.cli import main
from harness_rl.tools.vllm_server import (
    VllmLaunch,
    VllmProcess,
    VllmSetupError,
    cpu_kv_cache_gib,
    find_vllm_python,
    health_failure,
    vllm_launch,
)


def model_dir(tmp_path: Path, template: str = "{{ messages }}", **config: object) -> Path:
    directory = tmp_path / "m"
    directory.mkdir(exist_ok=True)
    base = {"model_type": "qwen2", "max_position_embeddings": 131072, "dtype": "float32", "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 128}
    (directory / "config.json").write_text(json.dumps(base | config))
    (directory / "chat_template.jinja").write_text(template)
    return directory


def flags(launch: VllmLaunch) -> dict[str, str | None]:
    """`--flag value` / `--flag` pairs of the command after the module name."""
    args = launch.command[3:]
    out: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            out[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_the_command_sets_every_capture_and_sync_flag(tmp_path: Path) -> None:
    launch = vllm_launch(model_dir(tmp_path), python="/venv/bin/python", cuda=False, port=8123,
                         served_model_name="tiny")
    assert launch.command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flags(launch) == {
        "--model": str(tmp_path / "m"), "--served-model-name": "tiny", "--host": "127.0.0.1", "--port": "8123",
        "--max-model-len": "131072", "--logprobs-mode": "processed_logprobs", "--return-tokens-as-token-ids": None,
        "--generation-config": "vllm", "--enable-scale-out": None, "--enable-auto-tool-choice": None,
        "--dtype": "float32", "--tool-call-parser": "hermes", "--no-enable-chunked-prefill": None,
        "--max-num-batched-tokens": "131072"}
    assert launch.env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert launch.url == "http://127.0.0.1:8123"
    assert launch.shell().startswith("VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 VLLM_SERVER_DEV_MODE=1 "
                                     "/venv/bin/python -m vllm.entrypoints.openai.api_server --model ")


def test_nccl_weight_transfer_only_with_cuda(tmp_path: Path) -> None:
    launch = vllm_launch(model_dir(tmp_path), python="py", cuda=True)
    assert json.loads(flags(launch)["--weight-transfer-config"] or "") == {"backend": "nccl"}
    assert "VLLM_CPU_KVCACHE_SPACE" not in launch.env
    assert "--weight-transfer-config" not in flags(vllm_launch(model_dir(tmp_path), python="py", cuda=False))


def test_vllm_cpu_never_splits_a_prefill_and_cuda_keeps_vllms_default(tmp_path: Path) -> None:
    """vllm-cpu 0.32 dies on a seeded request whose prefill is split (test_vllm_seeded_prefill.py shows it)."""
    cpu = flags(vllm_launch(model_dir(tmp_path), python="py", cuda=False, extra_args=["--max-model-len", "4096"]))
    assert "--no-enable-chunked-prefill" in cpu and cpu["--max-num-batched-tokens"] == "4096"
    gpu = flags(vllm_launch(model_dir(tmp_path), python="py", cuda=True, extra_args=["--enable-chunked-prefill"]))
    assert "--no-enable-chunked-prefill" not in gpu and "--max-num-batched-tokens" not in gpu
    for extra in (["--enable-chunked-prefill"], ["--long-prefill-token-threshold", "512"],
                  ["--long_prefill_token_threshold=8"]):
        with pytest.raises(VllmSetupError, match="^refusing --[a-z-]+ ?[0-9]*: vllm-cpu kills its engine on a seeded"):
            vllm_launch(model_dir(tmp_path), python="py", cuda=False, extra_args=extra)
    allowed = vllm_launch(model_dir(tmp_path), python="py", cuda=False,
                          extra_args=["--long-prefill-token-threshold", "0", "--max-num-batched-tokens", "200000"])
    assert flags(allowed)["--max-num-batched-tokens"] == "200000"


def test_the_gloo_weight_transfer_when_asked_for(tmp_path: Path) -> None:
    launch = vllm_launch(model_dir(tmp_path), python="py", cuda=False, weight_transfer="gloo")
    assert json.loads(flags(launch)["--weight-transfer-config"] or "") == {"backend": "gloo"}
    assert "VLLM_CPU_KVCACHE_SPACE" in launch.env


@pytest.mark.parametrize(("model_type", "template", "tool", "reasoning"), [
    ("qwen2", "<tool_call>", "hermes", None),
    ("qwen3", "<tool_call>", "hermes", "qwen3"),
    ("qwen3_moe", "<tool_call>\n<function=name>", "qwen3_coder", "qwen3"),
    ("qwen3_5", "", "qwen3_coder", "qwen3"),
    ("llama", "", "llama3_json", None),
    ("gpt_oss", "", "openai", "openai_gptoss"),
])
def test_parsers_follow_the_model_family(tmp_path: Path, model_type: str, template: str, tool: str,
                                         reasoning: str | None) -> None:
    found = flags(vllm_launch(model_dir(tmp_path, template, model_type=model_type), python="py", cuda=False))
    assert found["--tool-call-parser"] == tool
    assert found.get("--reasoning-parser") == reasoning


@pytest.mark.parametrize(("files", "mode"), [
    (["tekken.json"], "mistral"), (["tokenizer.model.v7"], "mistral"), (["tekken.json", "tokenizer.json"], None),
    (["tokenizer.json"], None)])
def test_mistrals_own_tokenizer_is_served_in_its_mode(tmp_path: Path, files: list[str], mode: str | None) -> None:
    """A model directory with only mistral-common's tokenizer file: vLLM's auto mode would look for tokenizer.json."""
    directory = model_dir(tmp_path, model_type="mistral")
    for name in files:
        (directory / name).write_text("{}")
    found = flags(vllm_launch(directory, python="py", cuda=False))
    assert found.get("--tokenizer-mode") == mode
    assert found["--tool-call-parser"] == "mistral"


def test_an_unknown_family_asks_for_a_parser_and_extra_args_replace_ours(tmp_path: Path) -> None:
    with pytest.raises(VllmSetupError, match="no tool-call parser known for model_type 'weird': pass one after --"):
        vllm_launch(model_dir(tmp_path, model_type="weird"), python="py", cuda=False)
    launch = vllm_launch(model_dir(tmp_path, model_type="weird"), python="py", cuda=False,
                         extra_args=["--tool-call-parser", "pythonic", "--max_model_len=4096", "--port", "9"])
    assert launch.command[-5:] == ["--tool-call-parser", "pythonic", "--max_model_len=4096", "--port", "9"]
    assert launch.command.count("--port") == 1 and "--max-model-len" not in launch.command
    assert launch.max_model_len == 4096


def test_context_comes_from_the_model(tmp_path: Path) -> None:
    assert vllm_launch(model_dir(tmp_path, max_position_embeddings=32768), python="py", cuda=False).max_model_len \
        == 32768


def test_cpu_kv_cache_holds_one_full_context() -> None:
    qwen_05b = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896}
    # 2 (k, v) × 24 layers × 2 heads × 64 dims × 4 bytes × 131072 tokens = 3 GiB, × 1.25 headroom
    assert cpu_kv_cache_gib(qwen_05b, 131072, "float32") == 4
    assert cpu_kv_cache_gib(qwen_05b, 131072, "bfloat16") == 2
    assert cpu_kv_cache_gib({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 128}, 65536,
                            "float32") == 1


@pytest.mark.parametrize(("extra", "named"), [
    (["--logprobs-mode", "raw_logprobs"], "refusing --logprobs-mode raw_logprobs:"),
    (["--logprobs_mode=processed_logits"], "refusing --logprobs-mode processed_logits:"),
    (["--generation-config", "auto"], "refusing --generation-config auto:"),
    (["--no-return-tokens-as-token-ids"], "refusing --no-return-tokens-as-token-ids:"),
    (["--no-enable-scale-out"], "refusing --no-enable-scale-out:"),
    (["--skip-tokenizer-init"], "refusing --skip-tokenizer-init:"),
])
def test_serve_vllm_refuses_flags_that_break_exact_capture(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           extra: list[str], named: str) -> None:
    assert main(["serve", "vllm", str(model_dir(tmp_path)), "--dry-run", "--", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"harness-rl serve vllm: {named}") and err.count("\n") == 1


def test_serve_vllm_prints_the_full_command(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARNESS_RL_VLLM_PYTHON", sys.executable)  # no CUDA behind this torch
    assert main(["serve", "vllm", str(model_dir(tmp_path)), "--dry-run", "--port", "9100", "--",
                 "--logprobs-mode", "processed_logprobs", "--enforce-eager"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed.startswith("VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 VLLM_SERVER_DEV_MODE=1 ")
    assert " --port 9100 " in printed and printed.endswith("--logprobs-mode processed_logprobs --enforce-eager")
    assert printed.count("--logprobs-mode") == 1


def test_serve_vllm_passes_tensor_and_data_parallel_sizes_to_vllm(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARNESS_RL_VLLM_PYTHON", sys.executable)
    assert main(["serve", "vllm", str(model_dir(tmp_path)), "--dry-run", "--tensor-parallel-size", "2",
                 "--data-parallel-size", "4", "--", "--enforce-eager"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed.endswith("--tensor-parallel-size 2 --data-parallel-size 4 --enforce-eager")
    assert main(["serve", "vllm", str(model_dir(tmp_path)), "--dry-run", "--data-parallel-size", "0"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_arguments_after_a_double_dash_only_go_to_commands_that_take_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "engine", "--", "--port", "1"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: -- --port 1" in capsys.readouterr().err


def test_vllm_python_is_found_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv_python = tmp_path / "tools" / "vllm-venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text("")
    monkeypatch.setenv("HARNESS_RL_TOOLS_DIR", str(tmp_path / "tools"))
    monkeypatch.delenv("HARNESS_RL_VLLM_PYTHON", raising=False)
    assert find_vllm_python() == str(venv_python)
    monkeypatch.setenv("HARNESS_RL_VLLM_PYTHON", sys.executable)
    assert find_vllm_python() == sys.executable
    assert find_vllm_python(str(venv_python)) == str(venv_python)
    with pytest.raises(VllmSetupError, match="^--vllm-python /nope: no such file$"):
        find_vllm_python("/nope")
    monkeypatch.delenv("HARNESS_RL_VLLM_PYTHON")
    monkeypatch.setenv("HARNESS_RL_TOOLS_DIR", str(tmp_path / "empty"))
    with pytest.raises(VllmSetupError, match="vLLM not found: run `make vllm`"):
        find_vllm_python()


def fake_launch(code: str, port: int) -> VllmLaunch:
    return VllmLaunch(command=[sys.executable, "-c", code], env={}, url=f"http://127.0.0.1:{port}",
                      served_model_name="fake", max_model_len=1)


def test_a_child_that_dies_at_start_is_reported_with_its_log(tmp_path: Path) -> None:
    from harness_rl.learner.weight_sync import free_port

    code = "import sys; print('ValueError: no model here', flush=True); sys.exit(3)"
    with pytest.raises(VllmSetupError, match=r"(?s)exited with code 3 before it was ready.*ValueError: no model"):
        VllmProcess(fake_launch(code, free_port()), tmp_path / "vllm.log").start(timeout_s=30)


def test_a_child_that_never_gets_ready_is_stopped_with_its_whole_group(tmp_path: Path) -> None:
    from harness_rl.learner.weight_sync import free_port

    # the "server" forks a worker (as vLLM does) and never answers /health
    code = ("import os, subprocess, sys, time; print('loading', flush=True); "
            "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
            "open(sys.argv[1], 'w').write(str(w.pid)); time.sleep(300)")
    pid_file = tmp_path / "worker.pid"
    launch = fake_launch(code, free_port())
    launch = VllmLaunch(command=[*launch.command, str(pid_file)], env={}, url=launch.url, served_model_name="fake",
                        max_model_len=1)
    started = time.monotonic()
    with pytest.raises(VllmSetupError, match=r"(?s)not ready after 3s.*loading"):
        VllmProcess(launch, tmp_path / "vllm.log").start(timeout_s=3)
    assert time.monotonic() - started < 30
    worker = int(pid_file.read_text())
    for _ in range(50):
        if not _alive(worker):
            break
        time.sleep(0.1)
    assert not _alive(worker)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead too
        return stat.read().split()[2] != "Z"


# A stand-in vLLM: /health answers 200 until /die, which logs an engine error as vLLM's processes do and exits.
FAKE_SERVER = """
import http.server, sys, threading
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
        if self.path == '/die':
            print('(Worker pid=7) ERROR 12-01 [run.py:1] RuntimeError: CPU Generator does not use offset')
            print('(APIServer pid=6) ERROR 12-01 [llm.py:2] EngineDeadError: EngineCore encountered an issue.')
            sys.stdout.flush()
            threading.Thread(target=server.shutdown).start()
    def log_message(self, *args): pass
server = http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), Handler)
server.serve_forever()
sys.exit(3)
"""


def test_a_started_child_that_dies_is_named_with_the_first_error_of_its_log(tmp_path: Path) -> None:
    from harness_rl.learner.weight_sync import free_port

    port = free_port()
    log = tmp_path / "vllm.log"
    log.write_text("(APIServer pid=1) ERROR 11-30 [x.py:1] OSError: from the run before\n")
    launch = fake_launch(FAKE_SERVER, port)
    launch = VllmLaunch(command=[*launch.command, str(port)], env={}, url=launch.url, served_model_name="fake",
                        max_model_len=1)
    with VllmProcess(launch, log) as server:
        server.start(timeout_s=30)
        assert server.failure() is None
        urllib.request.urlopen(f"{server.url}/die", timeout=30).close()
        assert server.process is not None and server.process.wait(30) == 3
        assert server.failure() == f"vLLM exited with code 3 after RuntimeError: CPU Generator does not use offset " \
                                   f"(its log: {log})"
    assert server.failure() == "vLLM is not running"
    assert health_failure(server.url, timeout_s=5, confirm_s=0) == \
        f"GET {server.url}/health failed: [Errno 111] Connection refused"
