"""The tiny model: deterministic offline build, Hermes chat template, an end-of-turn habit."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness_rl.engine import build_tiny_model, default_cache_dir
from harness_rl.learner.weight_sync import free_port


@pytest.mark.slow
def test_same_seed_gives_byte_identical_files_and_reuses_the_cache(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0)
    names = sorted(p.name for p in tiny_model_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(names)
    for name in names:
        assert (tiny_model_dir / name).read_bytes() == (again / name).read_bytes(), name
    stamp = (again / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(again, seed=0) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp


def test_default_cache_dir_honours_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HARNESS_RL_CACHE", str(tmp_path))
    assert default_cache_dir(3) == tmp_path / "tiny-3"
    monkeypatch.delenv("HARNESS_RL_CACHE")
    assert default_cache_dir(0) == Path.home() / ".cache" / "harness-rl" / "tiny-0"


def test_tokenizer_specials_and_hermes_template(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tokenizer) == 4096
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    for token in [
        "<|im_start|>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
    ]:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "list files"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert json.dumps(tools[0]) in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\na.py\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_model_shape_and_end_of_turn_habit(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["max_position_embeddings"] >= 65536
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (128, 2, 1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config._attn_implementation == "sdpa"
    eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id
    contexts = torch.randint(3, 4090, (8, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        p_eos = model(contexts).logits.softmax(-1)[..., eos]
    # a geometric stop with this per-token probability ends a reply after ~1/p tokens on average
    assert 0.02 < float(p_eos.min()) and float(p_eos.max()) < 0.06


@pytest.mark.slow
def test_cli_serves_and_stops_cleanly_on_sigterm(tiny_model_dir: Path) -> None:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable,
        "-m",
        "harness_rl.cli",
        "serve",
        "engine",
        "--model",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "4096",
        "--logprobs-mode",
        "raw_logprobs",
    ]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models["data"][0]["max_model_len"] == 4096
        assert httpx.post(f"http://127.0.0.1:{port}/forced_completions", json={}).status_code == 404
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3},
        )
        assert reply.status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
