"""The engine's HTTP surface answers in vLLM's shapes and statuses."""

import json
from pathlib import Path

import httpx
import pytest

MESSAGES = [{"role": "system", "content": "You are a coder."}, {"role": "user", "content": "List the files."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]
CAPTURE = {"logprobs": True, "top_logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}
TOOL_TEXT = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, **body}, timeout=60)


def sse_events(response: httpx.Response) -> list[dict | str]:
    events = []
    for block in response.text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: ")
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def script(url: str, tools: list[str] = (), no_tools: list[str] = ()) -> None:
    httpx.delete(f"{url}/forced_completions").raise_for_status()
    httpx.post(f"{url}/forced_completions", json={"tools": list(tools), "no_tools": list(no_tools)}).raise_for_status()


def test_chat_reply_has_vllm_capture_fields(engine_url: str) -> None:
    response = chat(engine_url, seed=4, max_tokens=12, **CAPTURE)
    assert response.status_code == 200
    assert response.headers["x-policy-version"] == "0"
    body = response.json()
    choice = body["choices"][0]
    prompt = httpx.post(f"{engine_url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert body["prompt_token_ids"] == prompt
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(choice["token_ids"]),
        "total_tokens": len(prompt) + len(choice["token_ids"]),
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(e["top_logprobs"] == [] and e["logprob"] <= 0 for e in entries)
    assert choice["finish_reason"] in ("stop", "length")
    assert choice["message"]["role"] == "assistant" and "tool_calls" not in choice["message"]
    text = httpx.post(f"{engine_url}/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]
    assert text.replace("<|im_end|>", "") == choice["message"]["content"]


def test_same_seed_same_answer_and_stream_concatenates_to_it(engine_url: str) -> None:
    request = {"seed": 21, "max_tokens": 40, "temperature": 0.8, "top_k": 50, **CAPTURE}
    whole = chat(engine_url, **request).json()
    assert chat(engine_url, **request).json()["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"]
    streamed = httpx.post(
        f"{engine_url}/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": MESSAGES,
            **request,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=60,
    )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.headers["x-policy-version"] == "0"
    events = sse_events(streamed)
    assert events[-1] == "[DONE]"
    first, *chunks, usage_chunk, _ = events
    assert first["prompt_token_ids"] == whole["prompt_token_ids"]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {k: v for k, v in whole["usage"].items() if not k.endswith("_details")}
    choice = whole["choices"][0]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == choice["message"]["content"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    streamed_logprobs = [
        e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert streamed_logprobs == choice["logprobs"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]


def test_forced_tool_call_is_parsed_with_its_real_ids(engine_url: str) -> None:
    script(engine_url, tools=[TOOL_TEXT])
    body = chat(engine_url, tools=TOOLS, **CAPTURE).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look.\n"
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "bash"
    assert json.loads(call["function"]["arguments"]) == {"command": "ls -la"}
    expected = httpx.post(f"{engine_url}/tokenize", json={"prompt": TOOL_TEXT + "<|im_end|>"}).json()["tokens"]
    assert choice["token_ids"] == expected
    assert len(choice["logprobs"]["content"]) == len(expected)
    assert httpx.get(f"{engine_url}/forced_completions").json() == {"tools": [], "no_tools": []}


def test_forced_tool_call_streams_as_vllm_deltas(engine_url: str) -> None:
    script(engine_url, tools=[TOOL_TEXT])
    response = httpx.post(
        f"{engine_url}/v1/chat/completions",
        json={"messages": MESSAGES, "tools": TOOLS, "stream": True, **CAPTURE},
        timeout=60,
    )
    chunks = [e for e in sse_events(response)[1:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me look.\n"
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "bash"
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("chatcmpl-tool-")
    assert json.loads(calls[0]["function"]["arguments"]) == {"command": "ls -la"}
    assert [c["choices"][0]["delta"].get("content", "") for c in chunks].count(None) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    expected = httpx.post(f"{engine_url}/tokenize", json={"prompt": TOOL_TEXT + "<|im_end|>"}).json()["tokens"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == expected


def test_tool_less_request_takes_the_no_tools_queue(engine_url: str) -> None:
    script(engine_url, tools=[TOOL_TEXT], no_tools=["A short title"])
    body = chat(engine_url, **CAPTURE).json()
    assert body["choices"][0]["message"]["content"] == "A short title"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert httpx.get(f"{engine_url}/forced_completions").json() == {"tools": [TOOL_TEXT], "no_tools": []}
    httpx.delete(f"{engine_url}/forced_completions")


def test_tool_choice_none_leaves_the_call_as_content(engine_url: str) -> None:
    script(engine_url, tools=[TOOL_TEXT])
    choice = chat(engine_url, tools=TOOLS, tool_choice="none").json()["choices"][0]
    assert choice["message"]["content"] == TOOL_TEXT and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


def test_completions_use_token_ids_verbatim(engine_url: str) -> None:
    prompt = [1, 358, 201, 90, 2, 201]
    body = httpx.post(
        f"{engine_url}/v1/completions",
        json={
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 6,
            "logprobs": 0,
            "seed": 3,
            "ignore_eos": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        },
    ).json()
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == prompt and "prompt_token_ids" not in body
    assert len(choice["token_ids"]) == 6 == body["usage"]["completion_tokens"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert [list(d) for d in choice["logprobs"]["top_logprobs"]] == [[t] for t in choice["logprobs"]["tokens"]]
    assert choice["finish_reason"] == "length"


def test_tokenize_detokenize_models_health_version(engine_url: str) -> None:
    text = httpx.post(f"{engine_url}/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert set(text) == {"count", "max_model_len", "tokens", "token_strs"}
    assert text["count"] == len(text["tokens"]) == len(text["token_strs"]) and text["max_model_len"] == 65536
    assert httpx.post(f"{engine_url}/detokenize", json={"tokens": text["tokens"]}).json() == {"prompt": "hello world"}
    rendered = httpx.post(f"{engine_url}/tokenize", json={"messages": MESSAGES, "tools": TOOLS}).json()
    prompt_ids = chat(engine_url, tools=TOOLS, max_tokens=1, return_token_ids=True).json()["prompt_token_ids"]
    assert rendered["token_strs"] is None and rendered["tokens"] == prompt_ids
    models = httpx.get(f"{engine_url}/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 65536
    assert (Path(models["data"][0]["root"]) / "tokenizer.json").is_file()  # where a proxy here finds the tokenizer
    health = httpx.get(f"{engine_url}/health")
    assert health.status_code == 200 and health.headers["x-policy-version"] == "0"
    assert "version" in httpx.get(f"{engine_url}/version").json()
    assert httpx.get(f"{engine_url}/weight_info").json() == {"weight_version": "0"}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"messages": MESSAGES, "n": 2}, 400, "n"),
        ({"messages": MESSAGES, "model": "gpt-4"}, 404, "model"),
        ({"messages": MESSAGES, "max_tokens": 65537}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x " * 70000}]}, 400, "input_tokens"),
        ({"messages": "hello"}, 400, "body.messages"),
        ({"messages": []}, 400, None),
        ({"messages": MESSAGES, "repetition_penalty": 1.1}, 400, "repetition_penalty"),
        ({"messages": MESSAGES, "logit_bias": {"5": 3.0}}, 400, "logit_bias"),
        ({"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
        ({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}, 400, "tool_choice"),
    ],
)
def test_errors_have_openai_shape_and_vllm_status(engine_url: str, body: dict, status: int, param) -> None:
    response = httpx.post(f"{engine_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    if param:
        assert error["param"] == param
    assert response.headers["x-policy-version"] == "0"


def test_neutral_values_of_unsupported_knobs_are_accepted(engine_url: str) -> None:
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0, "logit_bias": {}}
    assert chat(engine_url, max_tokens=2, **neutral).status_code == 200


def test_malformed_json_and_unknown_route(engine_url: str) -> None:
    bad = httpx.post(
        f"{engine_url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "Bad Request"
    missing = httpx.get(f"{engine_url}/v2/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404


def test_openai_sdk_talks_to_the_engine(engine_url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{engine_url}/v1", api_key="unused")
    script(engine_url, tools=[TOOL_TEXT])
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, logprobs=True, top_logprobs=0)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert reply.choices[0].message.tool_calls[0].function.name == "bash"
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=10, seed=1, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == sum(1 for c in chunks if c.choices and c.choices[0].delta.role is None)
    assert [m.id for m in client.models.list()] == ["tiny"]
    completion = client.completions.create(model="tiny", prompt="def f():", max_tokens=5, seed=0)
    assert completion.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MESSAGES)


def test_generation_is_capped_by_the_context_left(tiny_model_dir) -> None:
    from harness_rl.engine import Engine, serve_in_thread

    engine = Engine.from_pretrained(tiny_model_dir, max_model_len=40, served_model_name="tiny")
    try:
        with serve_in_thread(engine) as server:
            body = chat(server.url, max_tokens=30, ignore_eos=True, return_token_ids=True).json()
            assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == 40
            assert body["choices"][0]["finish_reason"] == "length"
            assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"] == 40
            too_long = chat(server.url, messages=[{"role": "user", "content": "x " * 40}])
            assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "input_tokens"
    finally:
        engine.close()


def test_prompt_logprobs_rescore_a_sampled_completion(engine_url: str) -> None:
    sampled = chat(engine_url, seed=6, max_tokens=10, ignore_eos=True, **CAPTURE).json()
    prompt, choice = sampled["prompt_token_ids"], sampled["choices"][0]
    ids = prompt + choice["token_ids"]
    for temperature in (1.0, 0.5):
        body = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 1, "temperature": temperature}
        scored = httpx.post(f"{engine_url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        positions = scored["prompt_logprobs"]
        assert positions[0] is None and len(positions) == len(ids)
        for position, token in zip(positions[1:], ids[1:], strict=True):
            entry = position[str(token)]
            assert set(entry) == {"logprob", "rank", "decoded_token"} and entry["rank"] >= 1
            ranks = sorted(e["rank"] for e in position.values())
            assert ranks == ([1] if entry["rank"] == 1 else [1, entry["rank"]])
        rescored = [positions[len(prompt) + k][str(t)]["logprob"] for k, t in enumerate(choice["token_ids"])]
        sampled_logprobs = [e["logprob"] for e in choice["logprobs"]["content"]]
        assert max(abs(a - b) for a, b in zip(rescored, sampled_logprobs, strict=True)) < 1e-4
    streamed = httpx.post(f"{engine_url}/v1/completions", json={"prompt": ids, "prompt_logprobs": 0, "stream": True})
    assert streamed.status_code == 400
