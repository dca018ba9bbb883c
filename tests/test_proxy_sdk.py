"""Official SDKs through the proxy to the real embedded engine; the traces hold the engine's own ids and logprobs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from harness_rl.trace import TrainingTrace
from proxy.server.app import RunningProxy

pytestmark = pytest.mark.slow

TOOL_TEXT = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
ANTHROPIC_TOOLS = [{"name": "bash", "description": "Run a shell command.",
                    "input_schema": OPENAI_TOOLS[0]["function"]["parameters"]}]


@pytest.fixture(scope="module")
def proxy_settings() -> dict[str, Any]:
    """This module's `proxy` (tests/conftest.py) in front of the embedded engine."""
    return {"max_tokens_per_turn": 64}


def force(engine_url: str, tools: list[str] = (), no_tools: list[str] = ()) -> None:
    httpx.delete(f"{engine_url}/forced_completions").raise_for_status()
    httpx.post(f"{engine_url}/forced_completions", json={"tools": list(tools), "no_tools": list(no_tools)}
               ).raise_for_status()


def new_session(proxy: RunningProxy) -> dict[str, Any]:
    got = httpx.post(f"{proxy.url}/sessions", headers={"Authorization": f"Bearer {proxy.admin_token}"}, json={})
    return got.json()


def trace_of(proxy: RunningProxy, session: dict[str, Any]) -> TrainingTrace:
    got = httpx.get(f"{proxy.url}/sessions/{session['id']}/trace",
                    headers={"Authorization": f"Bearer {proxy.admin_token}"})
    assert got.status_code == 200, got.text
    return TrainingTrace.from_json(got.content).validate()


def engine_answer(engine_url: str, turn: Any, forced: str | None) -> dict[str, Any]:
    """Ask the engine directly for the same turn (same forced text): what the proxy must have recorded."""
    if forced is not None:
        force(engine_url, tools=[forced] if turn.request.tools else [],
              no_tools=[] if turn.request.tools else [forced])
    sampling = {"temperature": turn.sampling.temperature, "max_tokens": turn.sampling.max_tokens,
                "seed": turn.sampling.seed}
    body = {"model": "tiny", "messages": turn.request.messages, "logprobs": True, "top_logprobs": 0,
            "return_token_ids": True, "return_tokens_as_token_ids": True,
            **{k: v for k, v in sampling.items() if v is not None}}
    if turn.request.tools:
        body["tools"] = turn.request.tools
    return httpx.post(f"{engine_url}/v1/chat/completions", json=body, timeout=60).json()


def assert_turn_is_the_engines(engine_url: str, turn: Any, forced: str) -> None:
    direct = engine_answer(engine_url, turn, forced)
    choice = direct["choices"][0]
    assert turn.prompt_token_ids == direct["prompt_token_ids"]
    assert turn.completion_token_ids == choice["token_ids"]
    assert turn.per_token_logps == pytest.approx([e["logprob"] for e in choice["logprobs"]["content"]], abs=1e-5)
    assert turn.loss_mask == [0] * len(turn.prompt_token_ids) + [1] * len(turn.completion_token_ids)


def test_openai_sdk_tool_round_trip_stream_and_not(proxy: RunningProxy, engine_url: str) -> None:
    session = new_session(proxy)
    client = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["key"])
    force(engine_url, tools=[TOOL_TEXT, "All done."])
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": "List the files."}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=OPENAI_TOOLS)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "bash" and json.loads(call.function.arguments) == {"command": "ls"}
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "README.md"}]
    stream = client.chat.completions.create(model="policy", messages=messages, tools=OPENAI_TOOLS, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "All done."
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    sampled = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=6)
    assert sampled.choices[0].message.role == "assistant"

    trace = trace_of(proxy, session)
    t1, t2, t3 = trace.turns
    assert_turn_is_the_engines(engine_url, t1, TOOL_TEXT)
    assert_turn_is_the_engines(engine_url, t2, "All done.")
    assert t1.finish_reason == "tool_calls" and t2.finish_reason == "stop"
    assert t1.policy_version == 0
    assert t2.parent_id == t1.node_id  # the tiny template re-renders the tool call exactly
    assert t2.prompt_token_ids[:len(t1.sequence)] == t1.sequence
    assert t3.parent_id is None and t3.role == "auxiliary"  # tool-less side call in a tool session
    assert session["key"] not in trace.to_json().decode()


def test_anthropic_sdk_tool_use_round_trip_stream_and_not(proxy: RunningProxy, engine_url: str) -> None:
    session = new_session(proxy)
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["key"])
    force(engine_url, tools=[TOOL_TEXT, "The file is README.md."])
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=abc;"},
              {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "List the files."}]}]
    first = client.messages.create(model="tiny", max_tokens=64, system=system, messages=messages,
                                   tools=ANTHROPIC_TOOLS)
    assert first.stop_reason == "tool_use"
    tool_use = next(b for b in first.content if b.type == "tool_use")
    assert tool_use.name == "bash" and tool_use.input == {"command": "ls"}
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                               "content": "README.md"}]}]
    events = []
    with client.messages.stream(model="tiny", max_tokens=64, system=system, messages=messages,
                                tools=ANTHROPIC_TOOLS) as stream:
        for event in stream:
            events.append(event.type)
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn"
    assert [b.text for b in final.content if b.type == "text"] == ["The file is README.md."]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "message_delta" in events
    count = client.messages.count_tokens(model="tiny", system=system, messages=messages, tools=ANTHROPIC_TOOLS)

    trace = trace_of(proxy, session)
    t1, t2 = trace.turns
    assert t2.parent_id == t1.node_id
    assert count.input_tokens == len(t2.prompt_token_ids)  # exact: the engine's own template
    assert_turn_is_the_engines(engine_url, t1, TOOL_TEXT)
    assert_turn_is_the_engines(engine_url, t2, "The file is README.md.")
    assert t1.request.messages[0] == {"role": "system", "content": "You are Claude Code."}
    assert t2.request.messages[2]["tool_calls"][0]["function"]["name"] == "bash"
    assert t2.request.messages[3]["role"] == "tool" and t2.request.messages[3]["content"] == "README.md"
    assert t1.metadata["dialect"] == "anthropic_messages"
    assert session["key"] not in trace.to_json().decode()


def test_forced_completion_queue_is_left_clean(engine_url: str) -> None:
    httpx.delete(f"{engine_url}/forced_completions").raise_for_status()
    assert httpx.get(f"{engine_url}/forced_completions").json() == {"tools": [], "no_tools": []}


def test_path_of_store_is_per_session(proxy: RunningProxy) -> None:
    session = new_session(proxy)
    assert (Path(proxy.proxy.registry.store_dir) / f"{session['id']}.jsonl").exists()


RESPONSES_TOOLS = [{"type": "function", "name": "bash", "description": "Run a shell command.",
                    "parameters": OPENAI_TOOLS[0]["function"]["parameters"], "strict": False}]


def test_openai_responses_sdk_function_call_round_trip_stream_and_not(proxy: RunningProxy, engine_url: str) -> None:
    session = new_session(proxy)
    client = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["key"])
    force(engine_url, tools=[TOOL_TEXT, "All done.", "You are welcome."])
    items: list[Any] = [{"role": "developer", "content": "You are a coding agent."},
                        {"role": "user", "content": [{"type": "input_text", "text": "List the files."}]}]
    first = client.responses.create(model="policy", input=items, tools=RESPONSES_TOOLS)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "bash" and json.loads(call.arguments) == {"command": "ls"}
    assert first.status == "completed" and first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    items += [call.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": call.call_id,
                                                   "output": "README.md"}]
    counted = client.responses.input_tokens.count(model="policy", input=items, tools=RESPONSES_TOOLS)
    with client.responses.stream(model="policy", input=items, tools=RESPONSES_TOOLS) as stream:
        kinds = [event.type for event in stream]
        second = stream.get_final_response()
    assert second.output_text == "All done." and kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    third = client.responses.create(model="policy", input="Thanks.", previous_response_id=second.id,
                                    tools=RESPONSES_TOOLS, stream=True)
    final = [event for event in third if event.type == "response.completed"][0].response
    assert final.output_text == "You are welcome."

    trace = trace_of(proxy, session)
    t1, t2, t3 = trace.turns
    assert_turn_is_the_engines(engine_url, t1, TOOL_TEXT)
    assert_turn_is_the_engines(engine_url, t2, "All done.")
    assert t2.parent_id == t1.node_id and t3.parent_id == t2.node_id
    assert [t.prompt_source for t in trace.turns] == ["rendered", "spliced", "spliced"]  # previous_response_id too
    assert t3.prompt_token_ids[:len(t2.sequence)] == t2.sequence
    assert (first.usage.input_tokens, first.usage.output_tokens) == (len(t1.prompt_token_ids),
                                                                     len(t1.completion_token_ids))
    assert counted.input_tokens == len(t2.prompt_token_ids)  # exact: the engine's own template
    assert t1.request.messages[0] == {"role": "system", "content": "You are a coding agent."}
    assert t1.metadata["dialect"] == "openai_responses"


def test_google_genai_sdk_function_call_round_trip_stream_and_not(proxy: RunningProxy, engine_url: str) -> None:
    from google import genai
    from google.genai import types

    session = new_session(proxy)
    client = genai.Client(api_key=session["key"], http_options=types.HttpOptions(base_url=session["gemini_base_url"]))
    declaration = types.FunctionDeclaration(name="bash", description="Run a shell command.",
                                            parameters_json_schema=OPENAI_TOOLS[0]["function"]["parameters"])
    config = types.GenerateContentConfig(system_instruction="You are a coding agent.",
                                         tools=[types.Tool(function_declarations=[declaration])])
    force(engine_url, tools=[TOOL_TEXT, "All done."], no_tools=["Hello."])
    contents: list[Any] = [types.Content(role="user", parts=[types.Part(text="List the files.")])]
    first = client.models.generate_content(model="policy", contents=contents, config=config)
    (call,) = first.function_calls or []
    assert call.name == "bash" and call.args == {"command": "ls"}
    assert first.candidates[0].finish_reason == types.FinishReason.STOP
    contents += [first.candidates[0].content, types.Content(role="user", parts=[
        types.Part.from_function_response(name="bash", response={"output": "README.md"})])]
    chunks = list(client.models.generate_content_stream(model="policy", contents=contents, config=config))
    assert "".join(c.text or "" for c in chunks) == "All done."
    usage = chunks[-1].usage_metadata
    counted = client.models.count_tokens(model="policy", contents="Say hello.")
    plain = client.models.generate_content(model="policy", contents="Say hello.")
    assert plain.text == "Hello."

    trace = trace_of(proxy, session)
    t1, t2, t3 = trace.turns
    assert_turn_is_the_engines(engine_url, t1, TOOL_TEXT)
    assert_turn_is_the_engines(engine_url, t2, "All done.")
    assert t2.parent_id == t1.node_id and t2.prompt_token_ids[:len(t1.sequence)] == t1.sequence
    assert [t.prompt_source for t in trace.turns] == ["rendered", "spliced", "rendered"]
    assert t2.request.messages[3] == {"role": "tool", "tool_call_id": t1.reply.tool_calls[0].id, "content": "README.md"}
    assert (usage.prompt_token_count, usage.candidates_token_count) == (len(t2.prompt_token_ids),
                                                                        len(t2.completion_token_ids))
    assert counted.total_tokens == len(t3.prompt_token_ids)  # exact: the engine's own template
    assert t1.metadata["dialect"] == "google_gemini"
    assert session["key"] not in trace.to_json().decode()
