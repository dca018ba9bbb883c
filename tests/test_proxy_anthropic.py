"""Anthropic Messages through the proxy: translation, the exact SSE event sequence, count_tokens, errors."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import http_json
import httpx
import pytest
from fake_engine import FakeEngine, Scripted
from proxy_agent import Agent

from proxy.dialects.anthropic import signature_for
from proxy.server.app import RunningProxy

TOOLS = [{"name": "Bash", "description": "Run a command", "input_schema": {"type": "object"}},
         {"type": "web_search_20250305", "name": "web_search"}]
SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197; cch=93ab1;"},
          {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
          {"type": "text", "text": "Be careful."}]
CLAUDE_CODE_HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"}


def claude_code_body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """Shaped like Claude Code 2.1's requests (agents.md §3 and §8)."""
    return {"model": "claude-policy", "max_tokens": 32000, "system": SYSTEM, "messages": messages, "tools": TOOLS,
            "thinking": {"type": "adaptive"}, "metadata": {"user_id": "u"}, "context_management": {"edits": []},
            "output_config": {"effort": "low"}, **extra}


def post(agent: Agent, path: str, body: Any, **kw: Any) -> httpx.Response:
    headers = {**CLAUDE_CODE_HEADERS, "x-api-key": agent.session["key"]}
    return http_json.post(agent.session["anthropic_base_url"], path, body, headers, timeout=30, **kw)


def sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append((name[7:], json.loads(data[6:])))
    return out


def test_messages_translate_to_chat_and_back(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.script.append(Scripted(tool=("Bash", {"command": "ls"}), reasoning="look first"))
    messages = [{"role": "system", "content": "Inner system note."},
                {"role": "user", "content": [{"type": "text", "text": "List files."}]}]
    got = post(agent, "/v1/messages?beta=true", claude_code_body(messages))
    assert got.status_code == 200, got.text
    answer = got.json()
    assert answer["type"] == "message" and answer["role"] == "assistant" and answer["model"] == "claude-policy"
    thinking, tool_use = answer["content"]
    assert thinking == {"type": "thinking", "thinking": "look first", "signature": signature_for("look first")}
    assert tool_use["type"] == "tool_use" and tool_use["name"] == "Bash" and tool_use["input"] == {"command": "ls"}
    assert tool_use["id"].startswith("toolu_")
    assert answer["stop_reason"] == "tool_use"
    assert answer["usage"]["input_tokens"] > 0 and answer["usage"]["output_tokens"] > 0
    sent = fake_engine.whole_conversations[-1]
    assert sent["messages"][:3] == [{"role": "system", "content": "You are Claude Code.\nBe careful."},
                                    {"role": "system", "content": "Inner system note."},
                                    {"role": "user", "content": "List files."}]
    assert sent["tools"] == [{"type": "function", "function": {"name": "Bash", "description": "Run a command",
                                                               "parameters": {"type": "object"}}}]
    sampling = fake_engine.requests[-1]["sampling_params"]
    assert sampling["max_tokens"] == 32000 and sampling["temperature"] == 1.0
    assert "thinking" not in sent and "metadata" not in sent and "system" not in sent

    messages += [{"role": "assistant", "content": answer["content"]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use["id"],
                                               "content": [{"type": "text", "text": "a.py"}]},
                                              {"type": "text", "text": "Now explain."}]}]
    fake_engine.script.append(Scripted(content="It is a.py."))
    second = post(agent, "/v1/messages", claude_code_body(messages)).json()
    assert second["content"] == [{"type": "text", "text": "It is a.py."}] and second["stop_reason"] == "end_turn"
    sent = fake_engine.whole_conversations[-1]["messages"]
    assert sent[3] == {"role": "assistant", "reasoning": "look first",
                       "tool_calls": [{"id": tool_use["id"], "type": "function",
                                       "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}]}
    assert sent[4] == {"role": "tool", "tool_call_id": tool_use["id"], "content": "a.py"}
    assert sent[5] == {"role": "user", "content": "Now explain."}
    t1, t2 = agent.trace().turns
    assert t1.metadata["dialect"] == "anthropic_messages"
    assert t1.reply.tool_calls[0].name == "Bash"
    assert t2.request.messages == sent
    assert agent.session["key"] not in agent.trace().to_json().decode()


def test_streaming_event_sequence(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.script.append(Scripted(content="Checking.", tool=None, reasoning="hmm"))
    got = post(agent, "/v1/messages?beta=true", claude_code_body([{"role": "user", "content": "go"}], stream=True))
    assert got.headers["content-type"].startswith("text/event-stream")
    events = sse(got.text)
    assert [(name, data.get("delta", {}).get("type") or data.get("content_block", {}).get("type"))
            for name, data in events] == [
        ("message_start", None), ("ping", None),
        ("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "signature_delta"), ("content_block_stop", None),
        ("content_block_start", "text"), ("content_block_delta", "text_delta"), ("content_block_stop", None),
        ("message_delta", None), ("message_stop", None)]
    assert all(name == data["type"] for name, data in events)
    assert events[0][1]["message"]["content"] == [] and events[0][1]["message"]["usage"]["output_tokens"] == 0
    assert events[7][1]["delta"]["text"] == "Checking." and events[7][1]["index"] == 1
    assert events[9][1]["delta"]["stop_reason"] == "end_turn" and events[9][1]["usage"]["output_tokens"] > 0

    fake_engine.script.append(Scripted(tool=("Bash", {"command": "pwd"})))
    tool_events = sse(post(agent, "/v1/messages", claude_code_body([{"role": "user", "content": "go"}],
                                                                   stream=True)).text)
    start = next(d for n, d in tool_events if n == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["input"] == {}
    delta = next(d for n, d in tool_events if n == "content_block_delta")
    assert delta["delta"]["type"] == "input_json_delta" and json.loads(delta["delta"]["partial_json"]) == {
        "command": "pwd"}
    assert next(d for n, d in tool_events if n == "message_delta")["delta"]["stop_reason"] == "tool_use"


def test_count_tokens_is_the_engines_exact_count(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    body = claude_code_body([{"role": "user", "content": "count me"}])
    counted = post(agent, "/v1/messages/count_tokens?beta=true", {k: v for k, v in body.items() if k != "max_tokens"})
    assert counted.status_code == 200
    assert post(agent, "/v1/messages", body).status_code == 200
    turn = agent.trace().turns[0]
    assert counted.json() == {"input_tokens": len(turn.prompt_token_ids)}
    assert len(agent.trace().turns) == 1  # count_tokens is never recorded


def test_stop_reason_mapping(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.script.append(Scripted(content="cut", finish_reason="length"))
    assert post(agent, "/v1/messages", claude_code_body([{"role": "user", "content": "x"}])).json()[
        "stop_reason"] == "max_tokens"


def test_errors_use_the_anthropic_shape(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    missing = post(agent, "/v1/messages", {"model": "m", "max_tokens": 5})
    assert missing.status_code == 400
    assert missing.json()["type"] == "error" and missing.json()["error"]["type"] == "invalid_request_error"
    assert "missing required field messages" in missing.json()["error"]["message"]
    no_max_tokens = post(agent, "/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert no_max_tokens.status_code == 400 and "max_tokens" in no_max_tokens.json()["error"]["message"]
    bad_system = post(agent, "/v1/messages", {"model": "m", "max_tokens": 5, "system": 3, "messages": []})
    assert bad_system.status_code == 400
    unknown = httpx.post(f"{fake_proxy.url}/v1/messages", json={"model": "m", "max_tokens": 5, "messages": []},
                         headers={"x-api-key": "nope"})
    assert unknown.status_code == 401 and unknown.json()["error"]["type"] == "authentication_error"
    by_key = httpx.post(f"{fake_proxy.url}/v1/messages", headers={"x-api-key": agent.session["key"]},
                        json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert by_key.status_code == 200 and by_key.json()["type"] == "message"


def test_budget_stop_in_anthropic_dialect(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy, max_turns=1)
    body = claude_code_body([{"role": "user", "content": "x"}])
    assert post(agent, "/v1/messages", body).status_code == 200
    stopped = post(agent, "/v1/messages", body).json()
    assert stopped["content"] == [{"type": "text", "text": "Step budget exhausted; stopping."}]
    assert stopped["stop_reason"] == "end_turn"
    streamed = sse(post(agent, "/v1/messages", {**body, "stream": True}).text)
    assert streamed[-1][0] == "message_stop"
    assert len(agent.trace().turns) == 1


def test_engine_failure_after_keepalives_is_an_error_event(keepalive_proxy: RunningProxy,
                                                           fake_engine: FakeEngine) -> None:
    agent = Agent(keepalive_proxy)
    fake_engine.script.append(Scripted(delay_s=0.3, status=503))
    got = post(agent, "/v1/messages", claude_code_body([{"role": "user", "content": "x"}], stream=True))
    assert got.status_code == 200 and got.text.startswith(": keepalive\n\n")
    name, data = sse(got.text.replace(": keepalive\n\n", ""))[-1]
    assert name == "error" and data["type"] == "error" and data["error"]["type"] == "api_error"
    assert "HTTP 503" in data["error"]["message"]
    client = anthropic.Anthropic(base_url=agent.session["anthropic_base_url"], api_key="k")
    fake_engine.script.append(Scripted(delay_s=0.3, status=503))
    with pytest.raises(anthropic.APIStatusError):
        with client.messages.stream(model="m", max_tokens=5, messages=[{"role": "user", "content": "y"}]) as s:
            s.get_final_message()
