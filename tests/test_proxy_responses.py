"""OpenAI Responses through the proxy: codex's requests translated, the typed event stream, echoes that
come back as the very assistant message answered, previous_response_id, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import http_json
import httpx
import msgspec
import pytest
from fake_engine import FakeEngine, Scripted
from proxy_agent import Agent, comparable

from harness_rl.trace import Reply, ToolCall
from proxy.chat import Answer, assistant_message
from proxy.dialects import openai_responses
from proxy.dialects.openai_responses_stream import ResponsesStream
from proxy.live import head_of, whole_stream
from proxy.server.app import RunningProxy

FIXTURES = Path(__file__).parent / "fixtures" / "agents"


def codex_body(n: int) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((FIXTURES / "codex" / f"request_{n}.json").read_text())["body"]
    return body


def post(agent: Agent, body: dict[str, Any], **headers: str) -> httpx.Response:
    return http_json.post(agent.base, "/responses", body, {**agent.auth, **headers}, timeout=30)


def events(text: str) -> list[dict[str, Any]]:
    """The SSE events, checking each `event:` line names its data's `type`."""
    out = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        out.append(event)
    return out


def answer(reply: Reply, finish: str = "stop") -> Answer:
    return Answer(id="resp_0123abcd", created=1, model="policy", reply=reply, finish_reason=finish,
                  prompt_tokens=10, completion_tokens=5)


def as_codex_echoes(item: dict[str, Any]) -> dict[str, Any]:
    """codex stores the done item and sends it back: same ids and strings, reasoning text dropped."""
    return {**item, "content": None} if item["type"] == "reasoning" else item


def as_opaque_only(item: dict[str, Any]) -> dict[str, Any]:
    """A client that keeps nothing of a reasoning item but its id and `encrypted_content`."""
    return {"type": "reasoning", "id": item["id"], "summary": [], "encrypted_content": item["encrypted_content"]} \
        if item["type"] == "reasoning" else item


def as_pi_echoes(item: dict[str, Any]) -> dict[str, Any]:
    """pi (api: openai-responses) re-serialises arguments compactly."""
    if item["type"] != "function_call":
        return item
    return {**item, "arguments": json.dumps(json.loads(item["arguments"]), separators=(",", ":"))}


REPLIES = [
    Reply(content="All done."),
    Reply(content="Let me look.", reasoning="The user wants a file listing."),
    Reply(reasoning="Two commands.", tool_calls=[ToolCall(id="chatcmpl-tool-a1", name="exec_command",
                                                          arguments='{"cmd": "ls -la"}'),
                                                 ToolCall(id="chatcmpl-tool-b2", name="exec_command",
                                                          arguments='{"cmd": "pwd", "workdir": "/tmp"}')]),
    Reply(content="Running it.", tool_calls=[ToolCall(id="call_9", name="exec_command", arguments='{"cmd": "é"}')]),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("echo", [as_codex_echoes, as_opaque_only, as_pi_echoes])
@pytest.mark.parametrize("reply", REPLIES)
def test_an_echoed_answer_is_the_assistant_message_it_answered(reply: Reply, echo: Any, stream: bool) -> None:
    """Answer → Responses JSON (or the stream's done items) → echoed by the agent → ChatCall → the same message."""
    done = answer(reply)
    first, _ = openai_responses.to_call(openai_responses.decode_body(msgspec.json.encode(
        {"model": "policy", "input": "go", "stream": stream}))[0], [], [])
    if stream:
        items = [e["item"] for e in events(whole_stream(ResponsesStream(head_of(done), first), done).decode())
                 if e["type"] == "response.output_item.done"]
    else:
        items = json.loads(openai_responses.response(done, first))["output"]
    calls = [i for i in items if i["type"] == "function_call"]
    outputs = [{"type": "function_call_output", "call_id": c["call_id"], "output": "ok"} for c in calls]
    body = {"model": "policy", "input": [{"role": "user", "content": "go"}, *map(echo, items), *outputs,
                                         *([] if calls else [{"role": "user", "content": "next"}])]}
    call, _ = openai_responses.to_call(openai_responses.decode_body(msgspec.json.encode(body))[0], [], [])
    assert [m.role for m in call.messages] == ["user", "assistant", *(["tool"] * len(calls) or ["user"])]
    assert comparable(call.messages[1]) == comparable(assistant_message(reply))
    if echo is not as_pi_echoes:  # byte-identical arguments and the engine's ids
        assert call.messages[1] == assistant_message(reply)


def test_codex_requests_translate_and_splice(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.script.append(Scripted(tool=("exec_command", {"cmd": "echo hi > hello.txt"})))
    first = codex_body(1)
    got = post(agent, first)
    assert got.status_code == 200 and got.headers["content-type"].startswith("text/event-stream")
    stream = events(got.text)
    sent = fake_engine.whole_conversations[-1]
    assert [m["role"] for m in sent["messages"]] == ["system", "system", "user", "user"]
    assert sent["messages"][1]["content"] == [{"type": "text", "text": p["text"]}
                                              for p in first["input"][1]["content"]]
    assert sent["messages"][3] == {"role": "user", "content": "write hello"}
    assert [t["function"]["name"] for t in sent["tools"]] == ["exec_command", "write_stdin", "request_user_input",
                                                               "view_image"]
    assert sent["tools"][0]["function"]["parameters"] == first["tools"][0]["parameters"]
    assert sent["tool_choice"] == "auto"
    done = [e["item"] for e in stream if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["function_call"]
    assert done[0]["name"] == "exec_command" and json.loads(done[0]["arguments"]) == {"cmd": "echo hi > hello.txt"}
    completed = stream[-1]
    assert completed["type"] == "response.completed" and completed["response"]["status"] == "completed"

    second = codex_body(2)
    fixture_call = second["input"][4]
    second["input"][4] = {**done[0], "id": done[0]["id"]}  # codex echoes our item
    second["input"][5]["call_id"] = done[0]["call_id"]
    fake_engine.script.append(Scripted(content="Wrote hello.txt."))
    assert fixture_call["type"] == "function_call" and post(agent, second).status_code == 200
    sent = fake_engine.whole_conversations[-1]["messages"]
    assert sent[4]["tool_calls"][0]["id"] == done[0]["call_id"]
    assert sent[5] == {"role": "tool", "tool_call_id": done[0]["call_id"], "content": second["input"][5]["output"]}
    t1, t2 = agent.trace().turns
    assert t2.parent_id == t1.node_id and t2.prompt_token_ids[:len(t1.sequence)] == t1.sequence
    assert (t1.prompt_source, t2.prompt_source) == ("rendered", "spliced") and t2.prefix_break is None
    usage = completed["response"]["usage"]
    assert usage == {"input_tokens": len(t1.prompt_token_ids), "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": len(t1.completion_token_ids), "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": len(t1.prompt_token_ids) + len(t1.completion_token_ids)}
    assert t1.metadata["dialect"] == "openai_responses"
    assert t1.metadata["ignored_fields"] == ["client_metadata", "include", "parallel_tool_calls", "prompt_cache_key",
                                             "reasoning", "store"]


def test_stream_event_sequence(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.script.append(Scripted(content="Checking.", reasoning="hmm"))
    got = events(post(agent, {"model": "m", "input": "go", "stream": True}).text)
    assert [e["type"] for e in got if not e["type"].endswith(".delta")] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert got[0]["response"]["status"] == "in_progress" and got[0]["response"]["output"] == []

    def text(kind: str) -> str:
        return "".join(e["delta"] for e in got if e["type"] == kind)

    assert text("response.reasoning_summary_text.delta") == text("response.reasoning_text.delta") == "hmm"
    assert text("response.output_text.delta") == "Checking."
    reasoning, message = (e["item"] for e in got if e["type"] == "response.output_item.done")
    assert reasoning["summary"] == [{"type": "summary_text", "text": "hmm"}] and reasoning["encrypted_content"]
    assert message["content"] == [{"type": "output_text", "text": "Checking.", "annotations": []}]
    assert got[-1]["response"]["output"] == [reasoning, message] and got[-1]["response"]["id"].startswith("resp_")

    fake_engine.script.append(Scripted(tool=("exec_command", {"cmd": "ls"})))
    tool = events(post(agent, {"model": "m", "input": "go", "stream": True}).text)
    assert [e["type"] for e in tool[2:-1]] == ["response.output_item.added", "response.function_call_arguments.delta",
                                               "response.function_call_arguments.done", "response.output_item.done"]
    assert tool[2]["item"]["arguments"] == "" and tool[3]["delta"] == tool[5]["item"]["arguments"]


def test_token_limit_is_an_incomplete_response(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.script.append(Scripted(content="cut", finish_reason="length"))
    whole = post(agent, {"model": "m", "input": "x"}).json()
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    fake_engine.script.append(Scripted(content="cut", finish_reason="length"))
    assert events(post(agent, {"model": "m", "input": "x", "stream": True}).text)[-1]["type"] == "response.incomplete"


def test_previous_response_id_continues_within_the_session(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.script.append(Scripted(content="Hello."))
    first = post(agent, {"model": "m", "instructions": "Be brief.", "input": "hi"}).json()
    fake_engine.script.append(Scripted(content="More."))
    second = post(agent, {"model": "m", "instructions": "Be kind.", "input": "more",
                          "previous_response_id": first["id"]}).json()
    assert second["output"][0]["content"][0]["text"] == "More."
    assert fake_engine.whole_conversations[-1]["messages"] == [
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "more"}]
    t1, t2 = agent.trace().turns
    other = Agent(fake_proxy)
    stolen = post(other, {"model": "m", "input": "x", "previous_response_id": second["id"]})
    assert stolen.status_code == 404 and "previous_response_id" in stolen.json()["error"]["message"]
    assert stolen.json()["error"]["type"] == "not_found_error"
    assert t2.parent_id is None  # the instructions changed: a new root, as the engine saw it


def test_tools_flat_namespaced_and_hosted(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    schema = {"type": "object", "properties": {"cmd": {"type": "string"}}}
    tools = [{"type": "function", "name": "exec_command", "description": "run", "strict": False, "parameters": schema},
             {"type": "namespace", "name": "multi_agent_v1", "tools": [
                 {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}]},
             {"type": "web_search", "external_web_access": True}]
    body = {"model": "m", "input": [{"role": "developer", "content": "sys"}, {"role": "user", "content": "go"}],
            "tools": tools, "tool_choice": {"type": "function", "name": "exec_command"}, "temperature": 0.5,
            "max_output_tokens": 7, "store": False}
    assert post(agent, body).status_code == 200
    sent = fake_engine.whole_conversations[-1]
    assert sent["tools"] == [
        {"type": "function", "function": {"name": "exec_command", "description": "run", "parameters": schema,
                                          "strict": False}},
        {"type": "function", "function": {"name": "spawn_agent", "parameters": {"type": "object"}}}]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "exec_command"}}
    assert sent["messages"][0] == {"role": "system", "content": "sys"}
    sampling = fake_engine.requests[-1]["sampling_params"]
    assert sampling["max_tokens"] == 7 and sampling["temperature"] == 1.0  # the proxy's sampling policy decides
    turn = agent.trace().turns[0]
    assert turn.metadata["ignored_fields"] == ["store", "tools.web_search"]
    assert turn.sampling.requested == {"temperature": 0.5, "max_tokens": 7}


def test_errors_use_the_openai_shape(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    cases = [({"model": "m", "input": [{"type": "custom_tool_call", "call_id": "c", "input": "x"}]}, "input[0].type"),
             ({"model": "m", "input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
             ({"model": "m", "input": []}, "input"),
             ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
             ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
              "no images"),
             ({"model": "m"}, "input")]
    for body, where in cases:
        got = post(agent, body)
        assert got.status_code == 400, body
        error = got.json()["error"]
        assert error["type"] == "invalid_request_error" and where in error["message"], error
    assert agent.trace().turns == []


def test_key_routing_and_budget(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy, max_turns=1)
    by_key = httpx.post(f"{fake_proxy.url}/v1/responses", json={"model": "m", "input": "hi"}, headers=agent.auth)
    assert by_key.status_code == 200 and by_key.json()["object"] == "response"
    stopped = post(agent, {"model": "m", "input": "hi", "stream": True})
    assert events(stopped.text)[-1]["response"]["output"][0]["content"][0]["text"] == "Step budget exhausted; stopping."
    assert httpx.post(f"{fake_proxy.url}/v1/responses", json={"input": "x"}).status_code == 401


def test_engine_failure_after_keepalives_is_response_failed(keepalive_proxy: RunningProxy,
                                                            fake_engine: FakeEngine) -> None:
    agent = Agent(keepalive_proxy)
    fake_engine.script.append(Scripted(delay_s=0.3, status=503))
    got = post(agent, {"model": "m", "input": "x", "stream": True})
    assert got.status_code == 200 and got.text.startswith(": keepalive\n\n")
    (failed,) = events(got.text.replace(": keepalive\n\n", ""))
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    error = failed["response"]["error"]
    assert error["code"] == "server_error" and "HTTP 503" in error["message"]


def test_codex_echo_of_reasoning_and_call_splices(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    """The template re-renders replies differently (drift): only the echo matching the answer keeps one chain."""
    fake_engine.drift = True
    agent = Agent(fake_proxy)
    tools = [{"type": "function", "name": "exec_command", "parameters": {"type": "object"}}]
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                                    "text": "go"}]}]
    fake_engine.script.append(Scripted(tool=("exec_command", {"cmd": "ls"}), reasoning="Look first."))
    first = events(post(agent, {"model": "m", "input": items, "tools": tools, "stream": True}).text)
    done = [e["item"] for e in first if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["reasoning", "function_call"]
    items += [as_codex_echoes(i) for i in done]
    items.append({"type": "function_call_output", "call_id": done[1]["call_id"], "output": "a.txt"})
    fake_engine.script.append(Scripted(content="Done."))
    assert post(agent, {"model": "m", "input": items, "tools": tools, "stream": True}).status_code == 200
    t1, t2 = agent.trace().turns
    assert t2.prompt_source == "spliced" and t2.parent_id == t1.node_id and t2.prefix_break is None
    assert t2.prompt_token_ids[:len(t1.sequence)] == t1.sequence
    assert t2.request.messages[1]["reasoning"] == "Look first."


def test_input_tokens_is_the_engines_exact_count(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    body = {"model": "m", "instructions": "Be brief.", "input": [{"role": "user", "content": "count me"}],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}
    counted = httpx.post(f"{agent.base}/responses/input_tokens", json=body, headers=agent.auth)
    assert post(agent, body).status_code == 200
    (turn,) = agent.trace().turns  # counting is never recorded
    assert counted.json() == {"object": "response.input_tokens", "input_tokens": len(turn.prompt_token_ids)}
