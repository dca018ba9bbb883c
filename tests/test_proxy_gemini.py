"""Google Gemini generateContent through the proxy: gemini-cli's requests translated, the SSE chunks,
echoes that come back as the very assistant message answered, countTokens, routing, errors."""

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
from proxy.dialects import gemini
from proxy.dialects.gemini_stream import GeminiStream
from proxy.live import head_of, whole_stream
from proxy.server.app import RunningProxy

FIXTURES = Path(__file__).parent / "fixtures" / "agents"
SYNTHETIC_SIGNATURE = "skip_thought_signature_validator"


def cli_body(n: int) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((FIXTURES / "gemini-cli" / f"request_{n}.json").read_text())["body"]
    return body


def url(agent: Agent, method: str = "streamGenerateContent", model: str = "policy") -> str:
    return f"{agent.session['gemini_base_url']}/v1beta/models/{model}:{method}"


def post(agent: Agent, body: Any, method: str = "generateContent", query: str = "",
         headers: dict[str, str] | None = None) -> httpx.Response:
    stream = "?alt=sse" if method == "streamGenerateContent" else ""
    return http_json.post(url(agent, method), query or stream, body, timeout=30,
                          headers={"x-goog-api-key": agent.session["key"]} if headers is None else headers)


def chunks(text: str) -> list[dict[str, Any]]:
    return [json.loads(block.removeprefix("data: ")) for block in text.strip().split("\n\n")]


def answer(reply: Reply, finish: str = "stop") -> Answer:
    return Answer(id="chatcmpl-1", created=1, model="policy", reply=reply, finish_reason=finish, prompt_tokens=10,
                  completion_tokens=5)


def as_gemini_cli_echoes(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gemini-cli's history: thought parts dropped, keys reordered (id, args, name), and the synthetic
    signature added to the first call of a turn that has none."""
    kept = [{**p, "functionCall": {"id": p["functionCall"]["id"], "args": p["functionCall"]["args"],
                                   "name": p["functionCall"]["name"]}} if "functionCall" in p else p
            for p in parts if not p.get("thought")]
    first = next((p for p in kept if "functionCall" in p), None)
    if first is not None and "thoughtSignature" not in first:
        first["thoughtSignature"] = SYNTHETIC_SIGNATURE
    return kept


def as_sdk_echoes(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An SDK client sending the candidate's content back as it came."""
    return parts


REPLIES = [
    Reply(content="All done."),
    Reply(content="Let me look.", reasoning="The user wants a listing."),
    Reply(reasoning="Two commands.", tool_calls=[
        ToolCall(id="chatcmpl-tool-a1", name="run_shell_command", arguments='{"command": "ls -la"}'),
        ToolCall(id="chatcmpl-tool-b2", name="run_shell_command", arguments='{"command": "pwd", "dir_path": "/"}')]),
    Reply(content="Running it.", tool_calls=[ToolCall(id="call_9", name="run_shell_command",
                                                      arguments='{"command": "é", "n": [1, 2.5]}')]),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("echo", [as_gemini_cli_echoes, as_sdk_echoes])
@pytest.mark.parametrize("reply", REPLIES)
def test_an_echoed_answer_is_the_assistant_message_it_answered(reply: Reply, echo: Any, stream: bool) -> None:
    """Answer → Gemini JSON (or its SSE chunks) → echoed by the agent → ChatCall → the same message."""
    done = answer(reply)
    if stream:
        streamed = chunks(whole_stream(GeminiStream(head_of(done)), done).decode())
        parts = [p for c in streamed for p in c["candidates"][0]["content"]["parts"]]
    else:
        parts = json.loads(gemini.response(done))["candidates"][0]["content"]["parts"]
    calls = [p["functionCall"] for p in parts if "functionCall" in p]
    results = [{"functionResponse": {"name": c["name"], "response": {"output": "ok"}, "id": c["id"]}} for c in calls]
    contents = [{"role": "user", "parts": [{"text": "go"}]}, {"role": "model", "parts": echo(parts)},
                {"role": "user", "parts": results or [{"text": "next"}]}]
    body, ignored = gemini.decode_body(msgspec.json.encode({"contents": contents}))
    call = gemini.to_call(body, ignored, model="policy", stream=stream)
    assert [m.role for m in call.messages] == ["user", "assistant", *(["tool"] * len(calls) or ["user"])]
    assert comparable(call.messages[1]) == comparable(assistant_message(reply))
    assert [m.tool_call_id for m in call.messages[2:] if m.role == "tool"] == [c.id for c in reply.tool_calls]


def test_results_without_ids_answer_the_oldest_open_call_of_their_name() -> None:
    contents = [{"role": "user", "parts": [{"text": "go"}]},
                {"role": "model", "parts": [{"functionCall": {"name": "a", "args": {}, "id": "c1"}},
                                            {"functionCall": {"name": "b", "args": {"x": 1}, "id": "c2"}},
                                            {"functionCall": {"name": "a", "args": {"y": 2}, "id": "c3"}},
                                            {"functionCall": {"name": "d", "args": {}}}]},
                {"role": "user", "parts": [{"functionResponse": {"name": "b", "response": {"output": "B"}}},
                                           {"functionResponse": {"name": "a", "response": {"output": "A1"}}},
                                           {"functionResponse": {"name": "a", "response": {"error": "no"}}},
                                           {"functionResponse": {"name": "d", "response": {"n": 1}}},
                                           {"text": "and?"}]}]
    body, _ = gemini.decode_body(msgspec.json.encode({"contents": contents}))
    messages = gemini.chat_messages(body)
    assert [c.id for c in messages[1].tool_calls or ()] == ["c1", "c2", "c3", ""]  # an id never sent stays empty
    assert [(m.role, m.tool_call_id, m.content) for m in messages[2:]] == [
        ("tool", "c2", "B"), ("tool", "c1", "A1"), ("tool", "c3", "Error: no"), ("tool", "", '{"n": 1}'),
        ("user", None, "and?")]


def test_gemini_cli_requests_translate_and_splice(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.script.append(Scripted(tool=("run_shell_command", {"command": "echo hi > hello.txt"})))
    first = cli_body(1)
    got = post(agent, first, "streamGenerateContent")
    assert got.status_code == 200 and got.headers["content-type"].startswith("text/event-stream")
    (chunk,) = chunks(got.text)
    sent = fake_engine.whole_conversations[-1]
    assert sent["messages"] == [
        {"role": "system", "content": first["systemInstruction"]["parts"][0]["text"]},
        {"role": "user", "content": [{"type": "text", "text": p["text"]} for p in first["contents"][0]["parts"]]}]
    declared = first["tools"][0]["functionDeclarations"]
    assert sent["tools"] == [{"type": "function", "function": {"name": d["name"], "description": d["description"],
                                                               "parameters": d["parametersJsonSchema"]}}
                             for d in declared]
    candidate = chunk["candidates"][0]
    assert candidate["finishReason"] == "STOP" and candidate["content"]["role"] == "model"
    (part,) = candidate["content"]["parts"]
    assert part["functionCall"]["name"] == "run_shell_command"
    assert part["functionCall"]["args"] == {"command": "echo hi > hello.txt"}

    second = cli_body(2)
    call_id = part["functionCall"]["id"]
    second["contents"][1]["parts"] = as_gemini_cli_echoes([part])
    second["contents"][2]["parts"][0]["functionResponse"]["id"] = call_id
    fake_engine.script.append(Scripted(content="Wrote hello.txt."))
    final = chunks(post(agent, second, "streamGenerateContent").text)
    assert "".join(p["text"] for c in final for p in c["candidates"][0]["content"]["parts"]) == "Wrote hello.txt."
    assert final[-1]["candidates"][0]["finishReason"] == "STOP" and "usageMetadata" in final[-1]
    sent = fake_engine.whole_conversations[-1]["messages"]
    assert sent[2]["tool_calls"][0]["id"] == call_id
    assert sent[3] == {"role": "tool", "tool_call_id": call_id,
                       "content": second["contents"][2]["parts"][0]["functionResponse"]["response"]["output"]}
    t1, t2 = agent.trace().turns
    assert t2.parent_id == t1.node_id and t2.prompt_token_ids[:len(t1.sequence)] == t1.sequence
    assert (t1.prompt_source, t2.prompt_source) == ("rendered", "spliced") and t2.prefix_break is None
    assert chunk["usageMetadata"] == {"promptTokenCount": len(t1.prompt_token_ids),
                                      "candidatesTokenCount": len(t1.completion_token_ids),
                                      "totalTokenCount": len(t1.sequence)}
    assert t1.metadata["dialect"] == "google_gemini" and t1.metadata["model"] == "policy"
    assert t1.metadata["ignored_fields"] == ["generationConfig.thinkingConfig"]
    assert t1.sampling.requested == {"temperature": 1, "top_p": 0.95, "top_k": 64}


def test_stream_chunks_one_part_each(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.script.append(Scripted(tool=("run_shell_command", {"command": "ls"}), reasoning="list it"))
    got = chunks(post(agent, {"contents": [{"role": "user", "parts": [{"text": "go"}]}],
                              "tools": [{"functionDeclarations": [{"name": "run_shell_command"}]}]},
                      "streamGenerateContent").text)
    assert [c["candidates"][0]["content"]["parts"] for c in got] == [
        [{"text": "list it", "thought": True}],
        [{"functionCall": {"id": got[1]["candidates"][0]["content"]["parts"][0]["functionCall"]["id"],
                           "name": "run_shell_command", "args": {"command": "ls"}},
          "thoughtSignature": got[1]["candidates"][0]["content"]["parts"][0]["thoughtSignature"]}]]
    assert "finishReason" not in got[0]["candidates"][0] and "usageMetadata" not in got[0]
    assert got[1]["candidates"][0]["finishReason"] == "STOP" and got[1]["usageMetadata"]["candidatesTokenCount"] > 0
    fake_engine.script.append(Scripted(content="cut", finish_reason="length"))
    whole = post(agent, {"contents": [{"parts": [{"text": "go"}]}]}).json()
    assert whole["candidates"][0]["finishReason"] == "MAX_TOKENS"


def test_generation_config_tool_config_and_google_schemas(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    schema = {"type": "OBJECT", "properties": {"cmd": {"type": "STRING"}, "n": {"type": "ARRAY",
                                                                                 "items": {"type": "INTEGER"}}},
              "required": ["cmd"]}
    body = {"contents": [{"role": "user", "parts": [{"text": "a"}, {"text": "b"}]}],
            "systemInstruction": {"parts": [{"text": "one"}, {"text": "two"}]},
            "tools": [{"functionDeclarations": [{"name": "bash", "description": "run", "parameters": schema}]},
                      {"googleSearch": {}}],
            "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["bash"]}},
            "generationConfig": {"temperature": 0.2, "topP": 0.5, "topK": 3, "maxOutputTokens": 9,
                                 "stopSequences": ["END"], "responseMimeType": "text/plain"},
            "safetySettings": []}
    assert post(agent, body).status_code == 200
    sent = fake_engine.whole_conversations[-1]
    assert sent["messages"][0] == {"role": "system", "content": "one\ntwo"}
    assert sent["tools"][0]["function"]["parameters"] == {
        "type": "object", "required": ["cmd"],
        "properties": {"cmd": {"type": "string"}, "n": {"type": "array", "items": {"type": "integer"}}}}
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "bash"}}
    sampling = fake_engine.requests[-1]["sampling_params"]
    assert sampling["max_tokens"] == 9 and sampling["stop"] == ["END"]
    turn = agent.trace().turns[0]
    assert turn.metadata["ignored_fields"] == ["safetySettings", "generationConfig.responseMimeType",
                                               "tools.googleSearch"]
    assert turn.sampling.requested == {"temperature": 0.2, "top_p": 0.5, "top_k": 3, "max_tokens": 9, "stop": ["END"]}


def test_count_tokens_is_the_engines_exact_count(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    contents = [{"role": "user", "parts": [{"text": "count me"}]}]
    counted = post(agent, {"contents": contents}, "countTokens")
    wrapped = post(agent, {"generateContentRequest": {"contents": contents, "model": "models/policy"}}, "countTokens")
    assert post(agent, {"contents": contents}).status_code == 200
    turn = agent.trace().turns[0]
    assert counted.json() == wrapped.json() == {"totalTokens": len(turn.prompt_token_ids)}
    assert len(agent.trace().turns) == 1  # countTokens is never recorded


def test_routing_keys_and_errors(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    body = {"contents": [{"parts": [{"text": "hi"}]}]}
    plain = f"{fake_proxy.url}/V1BETA/models/policy:GENERATECONTENT"
    assert httpx.post(plain, json=body, params={"key": agent.session["key"]}).json()["candidates"]
    assert httpx.post(plain, json=body, headers={"x-goog-api-key": agent.session["key"]}).status_code == 200
    assert post(agent, body, "generateContent", headers={"x-goog-api-key": "nope"}).status_code == 401
    cases = [(post(agent, body, "streamGenerateContent", query="?alt=json"), 400, "alt=sse"),
             (post(agent, body, "embedContent"), 404, "embedContent"),
             (post(agent, {"contents": []}), 400, "contents"),
             (post(agent, {"contents": [{"parts": [{"text": "a", "functionCall": {"name": "f"}}]}]}), 400,
              "contents[0].parts[0]"),
             (post(agent, {"contents": [{"role": "bot", "parts": [{"text": "a"}]}]}), 400, "contents[0].role"),
             (post(agent, {"contents": [{"parts": [{"inlineData": {"mimeType": "image/png", "data": "AA=="}}]}]}), 400,
              "no images"),
             (post(agent, {**body, "generationConfig": {"candidateCount": 2}}), 400, "candidateCount"),
             (post(agent, {**body, "system_instruction": {"parts": [{"text": "s"}]}}), 400, "systemInstruction"),
             (httpx.post(f"{fake_proxy.url}/v1beta/models/policy:generateContent", json=body), 401, "API key")]
    for got, status, words in cases:
        assert got.status_code == status, got.text
        error = got.json()["error"]
        assert error["code"] == status and words in error["message"], error
        assert error["status"] == {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND"}[status]
    assert len(agent.trace().turns) == 2


def test_engine_failure_after_keepalives_is_a_bare_error(keepalive_proxy: RunningProxy,
                                                         fake_engine: FakeEngine) -> None:
    agent = Agent(keepalive_proxy)
    fake_engine.script.append(Scripted(delay_s=0.3, status=503))
    got = post(agent, {"contents": [{"parts": [{"text": "x"}]}]}, "streamGenerateContent")
    assert got.status_code == 200 and got.text.startswith("\n")  # blank-line keep-alives: no SSE comments
    error = json.loads(got.text.strip())["error"]
    assert error["code"] == 502 and error["status"] == "UNAVAILABLE" and "HTTP 503" in error["message"]


def test_gemini_cli_echo_without_thoughts_splices(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    """The template re-renders replies differently (drift): only the echo matching the answer keeps one chain,
    and gemini-cli's echo has lost the thought part."""
    fake_engine.drift = True
    agent = Agent(fake_proxy)
    tools = [{"functionDeclarations": [{"name": "run_shell_command", "parametersJsonSchema": {"type": "object"}}]}]
    contents: list[dict[str, Any]] = [{"role": "user", "parts": [{"text": "go"}]}]
    fake_engine.script.append(Scripted(tool=("run_shell_command", {"command": "ls"}), reasoning="Look first."))
    parts = [p for c in chunks(post(agent, {"contents": contents, "tools": tools}, "streamGenerateContent").text)
             for p in c["candidates"][0]["content"]["parts"]]
    echoed = as_gemini_cli_echoes(parts)
    assert [list(p) for p in echoed] == [["functionCall", "thoughtSignature"]]
    call = echoed[0]["functionCall"]
    contents += [{"role": "model", "parts": echoed},
                 {"role": "user", "parts": [{"functionResponse": {"name": call["name"], "id": call["id"],
                                                                  "response": {"output": "a.txt"}}}]}]
    fake_engine.script.append(Scripted(content="Done."))
    assert post(agent, {"contents": contents, "tools": tools}, "streamGenerateContent").status_code == 200
    t1, t2 = agent.trace().turns
    assert t2.prompt_source == "spliced" and t2.parent_id == t1.node_id and t2.prefix_break is None
    assert t2.prompt_token_ids[:len(t1.sequence)] == t1.sequence
    assert t2.request.messages[1]["reasoning"] == "Look first."
