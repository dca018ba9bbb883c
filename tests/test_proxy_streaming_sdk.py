"""Every dialect's official SDK reads the proxy's live stream (embedded engine) into the very message a
non-streamed call gets, the recorded reply is what it read, and the agent's next turn, sent back as the SDK
gave it, is spliced onto the streamed one."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

from harness_rl.trace import TrainingTrace, Turn
from proxy.server.app import RunningProxy

pytestmark = pytest.mark.slow

TEXT = 'Let me look around first.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command.", "parameters": SCHEMA}}]
USER = "List the files."


@pytest.fixture(scope="module")
def proxy_settings() -> dict[str, Any]:
    """This module's `proxy` (tests/conftest.py) in front of the embedded engine."""
    return {"max_tokens_per_turn": 96}


def session_of(proxy: RunningProxy, engine_url: str) -> dict[str, Any]:
    httpx.delete(f"{engine_url}/forced_completions").raise_for_status()
    httpx.post(f"{engine_url}/forced_completions", json={"tools": [TEXT, TEXT, "Done."], "no_tools": []}
               ).raise_for_status()
    return httpx.post(f"{proxy.url}/sessions", headers={"Authorization": f"Bearer {proxy.admin_token}"},
                      json={}).json()


def turns_of(proxy: RunningProxy, session: dict[str, Any]) -> list[Turn]:
    got = httpx.get(f"{proxy.url}/sessions/{session['id']}/trace",
                    headers={"Authorization": f"Bearer {proxy.admin_token}"})
    return TrainingTrace.from_json(got.content).validate().turns


def assert_streamed_turn_splices(turns: list[Turn], call_id: str) -> None:
    whole, streamed, follow = turns
    assert streamed.completion_token_ids == whole.completion_token_ids and streamed.metadata["stream"]
    assert streamed.reply.content == whole.reply.content == "Let me look around first.\n"
    assert streamed.reply.tool_calls[0].id.removeprefix("toolu_") == call_id.removeprefix("toolu_")
    assert follow.prompt_source == "spliced" and follow.parent_id == streamed.node_id
    assert follow.prompt_token_ids[:len(streamed.sequence)] == streamed.sequence


def test_openai_chat_stream(proxy: RunningProxy, engine_url: str) -> None:
    session = session_of(proxy, engine_url)
    client = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["key"])
    messages: list[Any] = [{"role": "user", "content": USER}]
    whole = client.chat.completions.create(model="policy", messages=messages, tools=CHAT_TOOLS).choices[0]
    with client.chat.completions.stream(model="policy", messages=messages, tools=CHAT_TOOLS) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    assert streamed.message.content == whole.message.content
    (call,) = streamed.message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()] == [
        (call.function.name, call.function.arguments)]
    messages += [{"role": "assistant", "content": streamed.message.content, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "a.txt"}]
    client.chat.completions.create(model="policy", messages=messages, tools=CHAT_TOOLS, stream=True).close()
    assert_streamed_turn_splices(turns_of(proxy, session), call.id)


def test_anthropic_messages_stream(proxy: RunningProxy, engine_url: str) -> None:
    session = session_of(proxy, engine_url)
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["key"])
    tools: list[Any] = [{"name": "bash", "description": "Run a command.", "input_schema": SCHEMA}]
    messages: list[Any] = [{"role": "user", "content": USER}]
    whole = client.messages.create(model="tiny", max_tokens=96, messages=messages, tools=tools)
    with client.messages.stream(model="tiny", max_tokens=96, messages=messages, tools=tools) as stream:
        streamed = stream.get_final_message()

    def blocks(message: Any) -> list[dict[str, Any]]:
        return [b.model_dump(exclude={"id"}) for b in message.content]

    assert blocks(streamed) == blocks(whole) and streamed.stop_reason == whole.stop_reason == "tool_use"
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    tool_use = streamed.content[-1]
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in streamed.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "a"}]}]
    with client.messages.stream(model="tiny", max_tokens=96, messages=messages, tools=tools) as follow:
        follow.get_final_message()
    assert_streamed_turn_splices(turns_of(proxy, session), tool_use.id)


def test_openai_responses_stream(proxy: RunningProxy, engine_url: str) -> None:
    session = session_of(proxy, engine_url)
    client = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["key"])
    tools: list[Any] = [{"type": "function", "name": "bash", "description": "Run a command.", "parameters": SCHEMA,
                         "strict": False}]
    whole = client.responses.create(model="policy", input=USER, tools=tools)
    with client.responses.stream(model="policy", input=USER, tools=tools) as stream:
        streamed = stream.get_final_response()

    def items(response: Any) -> list[dict[str, Any]]:
        return [i.model_dump(exclude_none=True, exclude={"id", "call_id"}) for i in response.output]

    assert items(streamed) == items(whole) and streamed.output_text == whole.output_text
    call = streamed.output[-1]
    echoed = [{"role": "user", "content": USER}, *(i.model_dump(exclude_none=True) for i in streamed.output),
              {"type": "function_call_output", "call_id": call.call_id, "output": "a.txt"}]
    with client.responses.stream(model="policy", input=echoed, tools=tools) as follow:
        follow.get_final_response()
    assert_streamed_turn_splices(turns_of(proxy, session), call.call_id)


def test_google_genai_stream(proxy: RunningProxy, engine_url: str) -> None:
    from google import genai
    from google.genai import types

    session = session_of(proxy, engine_url)
    client = genai.Client(api_key=session["key"], http_options=types.HttpOptions(base_url=session["gemini_base_url"]))
    declaration = types.FunctionDeclaration(name="bash", description="Run a command.", parameters_json_schema=SCHEMA)
    config = types.GenerateContentConfig(tools=[types.Tool(function_declarations=[declaration])])
    contents: list[Any] = [types.Content(role="user", parts=[types.Part(text=USER)])]
    whole = client.models.generate_content(model="policy", contents=contents, config=config)
    chunks = list(client.models.generate_content_stream(model="policy", contents=contents, config=config))
    streamed_calls = [c for chunk in chunks for c in chunk.function_calls or ()]
    assert "".join(c.text or "" for c in chunks) == whole.text
    assert [(c.name, c.args) for c in streamed_calls] == [(c.name, c.args) for c in whole.function_calls or ()]
    assert chunks[-1].usage_metadata.candidates_token_count == whole.usage_metadata.candidates_token_count
    parts = [p for chunk in chunks for p in chunk.candidates[0].content.parts]
    contents += [types.Content(role="model", parts=parts), types.Content(role="user", parts=[
        types.Part.from_function_response(name="bash", response={"output": "a.txt"})])]
    list(client.models.generate_content_stream(model="policy", contents=contents, config=config))
    assert_streamed_turn_splices(turns_of(proxy, session), streamed_calls[0].id or "")
    assert json.loads(turns_of(proxy, session)[1].reply.tool_calls[0].arguments) == {"command": "ls -la"}
