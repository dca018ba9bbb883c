"""The embedded engine's streaming derender: what vLLM 0.32 answers for a recorded tool-call chunk (tool calls go
out whole, where vLLM sends fragments), and step by step it reads exactly what the whole derender reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from http_json import post

FIXTURES = Path(__file__).parent / "fixtures" / "vllm_0_32"
MESSAGES = [{"role": "system", "content": "You are a coder."}, {"role": "user", "content": "List the files."}]
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
TOOL_TEXT = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
DERENDER = "/v1/chat/completions/derender"


def sampled(url: str, text: str, tools: bool) -> tuple[dict[str, Any], list[int], list[int]]:
    """A chat body, its prompt ids and the ids the engine samples when forced to answer `text`."""
    httpx.delete(f"{url}/forced_completions").raise_for_status()
    queue = {"tools": [text], "no_tools": []} if tools else {"tools": [], "no_tools": [text]}
    httpx.post(f"{url}/forced_completions", json=queue).raise_for_status()
    chat: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, **({"tools": TOOLS} if tools else {})}
    prompt = post(url, "/v1/chat/completions/render", chat).json()["token_ids"]
    generated = post(url, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
        "logprobs": 0, "skip_special_tokens": False}}).json()
    return chat, prompt, generated["choices"][0]["token_ids"]


def stepwise(url: str, chat: dict[str, Any], prompt: list[int], ids: list[int], size: int) -> list[dict[str, Any]]:
    """The streamed chunks of `ids` read `size` at a time, the last step carrying the finish."""
    state, chunks = None, []
    for start in range(0, len(ids), size):
        last = start + size >= len(ids)
        step = {"index": 0, "token_ids": ids[start:start + size], "finish_reason": "stop" if last else None}
        reply = post(url, DERENDER, {"stream": True, "generate_chunk": {"request_id": "r", "choices": [step]},
                                     "stream_state": state, "chat_request": chat, "prompt_token_ids": prompt})
        assert reply.status_code == 200, reply.text
        state = reply.json()["stream_state"]
        chunks.append(reply.json()["chunk"])
    assert state is not None and state["output_token_ids"] == ids and sum(state["output_chunk_lens"]) == len(ids)
    return chunks


def test_a_finishing_tool_call_chunk_is_vllms_but_for_the_call_going_out_whole(engine_url: str) -> None:
    recorded = json.loads((FIXTURES / "derender_stream_toolcall_last.json").read_text())
    got = post(engine_url, recorded["path"], recorded["request"]).json()
    want = recorded["response"]
    (choice,) = got["chunk"]["choices"]
    (expected,) = want["chunk"]["choices"]
    call = choice["delta"].pop("tool_calls")[0]  # vLLM sent this call's name and arguments in the earlier chunks
    assert call["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert call["id"] == want["stream_state"]["last_tool_call_ids"][0]  # the id it went out with before
    assert choice == expected and choice["finish_reason"] == "tool_calls"
    assert got["stream_state"] == want["stream_state"]


@pytest.mark.parametrize("size", [1, 2, 5])
@pytest.mark.parametrize(("text", "tools"), [(TOOL_TEXT, True), ("Ça marche: ünïcödé ✓ — 日本語 ok.", False)])
def test_step_by_step_reads_what_the_whole_derender_reads(engine_url: str, text: str, tools: bool,
                                                          size: int) -> None:
    chat, prompt, ids = sampled(engine_url, text, tools)
    whole = post(engine_url, DERENDER, {"generate_response": {"choices": [
        {"index": 0, "token_ids": ids[:-1], "finish_reason": "stop"}]}, "chat_request": chat}).json()
    message = whole["choices"][0]["message"]
    chunks = stepwise(engine_url, chat, prompt, ids[:-1], size)  # the stop token left out, as the proxy does
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert [d["role"] for d in deltas] == ["assistant"] + [None] * (len(deltas) - 1)
    assert "".join(d["content"] or "" for d in deltas) == (message["content"] or "")
    assert not any("\ufffd" in (d["content"] or "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls") or ()]
    assert [c["function"] for c in calls] == [c["function"] for c in message.get("tool_calls") or ()]
    assert chunks[-1]["choices"][0]["finish_reason"] == ("tool_calls" if tools else "stop")


def test_streaming_derender_refuses_what_vllm_refuses(engine_url: str) -> None:
    step = {"index": 0, "token_ids": [53, 820, 16]}
    chat = {"messages": MESSAGES}
    body = {"stream": True, "generate_chunk": {"choices": [step, {**step, "index": 1}]}, "chat_request": chat,
            "prompt_token_ids": [1, 2]}
    refused = post(engine_url, DERENDER, body)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "derender_chat_stream expects at most one choice per chunk (got 2)."
    long = post(engine_url, DERENDER, {**body, "generate_chunk": {"choices": [step]}, "prompt_token_ids": [5] * 65535})
    assert long.status_code == 400 and "exceeds max_model_len (65536)" in long.json()["error"]["message"]
    usage = post(engine_url, DERENDER, {**body, "generate_chunk": {"choices": [], "usage": {
        "prompt_tokens": 9, "completion_tokens": 3}}, "prompt_tokens": 7}).json()["chunk"]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 7 and usage["usage"]["total_tokens"] == 10
