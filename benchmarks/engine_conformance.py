"""Compare the response *structure* of two vLLM-compatible engines (keys, types, placement).

    .venv/bin/python benchmarks/engine_conformance.py http://127.0.0.1:8000 http://127.0.0.1:18090 \
        [--model-dir DIR]   # also compare sampled logprobs with a local forward pass of DIR
    .venv/bin/python benchmarks/engine_conformance.py --quick   # the embedded engine against itself

Sends the same requests to both (chat, streamed chat, tool calls, completions with token ids,
tokenize/detokenize, models, errors, control routes) and prints every path where the JSON shapes
differ. Sampled values are not compared, only which keys exist, where, and their types; values
both engines must share when serving the same model directory are: prompt token ids, tokenizer
output and parsed tool calls.
To get a tool call out of a random model, the script scripts one on engines that have
`/forced_completions` and asks the others for the same text through vLLM's `structured_outputs`
regex, so both sides parse the same `<tool_call>` text.
"""

import argparse
import asyncio
import json
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import aiohttp
from conventions import load_average, parse_args
from engine_logprobs import CAPTURE, MESSAGES, check_logprobs

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
TOOL_TEXT = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
TOOL_FORCING = {"structured_outputs": {"regex": re.escape(TOOL_TEXT)}}


def shape(value: Any, token_map: bool = False) -> Any:
    """The structure of a JSON value: dict keys → shapes, lists → the union of their items' shapes.

    Completions' `top_logprobs` entries are maps keyed by token (chat's are `{token, logprob, …}`
    objects), so a map's keys become `<token>`.
    """
    if isinstance(value, dict):
        if token_map and "logprob" not in value:
            return {"<token>": merge([shape(item) for item in value.values()])} if value else {}
        return {key: shape(item, token_map=key == "top_logprobs") for key, item in value.items()}
    if isinstance(value, list):
        items = [shape(item, token_map) for item in value]
        return [merge(items)] if items else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if value is None:
        return "null"
    return type(value).__name__


def merge(shapes: list[Any]) -> Any:
    """One shape covering several list items (dict keys unioned, differing scalars joined by |)."""
    if all(isinstance(s, dict) for s in shapes):
        keys = {key: None for s in shapes for key in s}
        return {key: merge([s[key] for s in shapes if key in s]) for key in keys}
    if all(isinstance(s, list) for s in shapes):
        return [merge([item for s in shapes for item in s])] if any(shapes) else []
    names = sorted({json.dumps(s) if not isinstance(s, str) else s for s in shapes})
    return "|".join(names)


def differences(a: Any, b: Any, path: str = "$") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        found = [f"{path}.{key}: only in A" for key in a if key not in b]
        found += [f"{path}.{key}: only in B" for key in b if key not in a]
        for key in a:
            if key in b:
                found += differences(a[key], b[key], f"{path}.{key}")
        return found
    if isinstance(a, list) and isinstance(b, list):
        if a and b:
            return differences(a[0], b[0], f"{path}[]")
        return (
            []
            if not a and not b
            else [f"{path}: {'empty' if not a else 'non-empty'} in A, {'empty' if not b else 'non-empty'} in B"]
        )
    if a != b:
        return [f"{path}: A {json.dumps(a)[:80]} vs B {json.dumps(b)[:80]}"]
    return []


def agreed_values(reply: Any) -> dict[str, Any]:
    """Values both engines must agree on when serving the same model: prompt ids, tokenizer output
    and parsed tool calls (the sampled tokens themselves differ)."""
    if isinstance(reply, list):
        chunks = [c for c in reply if isinstance(c, dict) and c.get("choices")]
        first = chunks[0] if chunks else {}
        calls: dict[int, list[str]] = {}
        for chunk in chunks:
            for call in chunk["choices"][0].get("delta", {}).get("tool_calls") or []:
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += call.get("function", {}).get("name") or ""
                entry[1] += call.get("function", {}).get("arguments") or ""
        prompt = first.get("prompt_token_ids") or first.get("choices", [{}])[0].get("prompt_token_ids")
        return {"prompt_token_ids": prompt, "tool_calls": [tuple(c) for _, c in sorted(calls.items())]}
    if not isinstance(reply, dict):
        return {}
    keys = ("prompt_token_ids", "tokens", "count", "prompt", "token_ids", "sampling_params")
    values = {key: reply[key] for key in keys if key in reply}
    choice = (reply.get("choices") or [{}])[0]
    if choice.get("prompt_token_ids") is not None:
        values["prompt_token_ids"] = choice["prompt_token_ids"]
    calls = (choice.get("message") or {}).get("tool_calls") or []
    values["tool_calls"] = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    return values


class Client:
    def __init__(self, session: aiohttp.ClientSession, url: str, model: str | None) -> None:
        self.session, self.url, self.model = session, url.rstrip("/"), model

    async def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, Any, dict]:
        if (
            body is not None
            and self.model
            and "model" not in body
            and path.startswith(("/v1", "/tok", "/detok", "/inf"))
        ):
            body = {"model": self.model, **body}
        async with self.session.request(method, self.url + path, json=body) as response:
            text = await response.text()
            headers = {k.lower(): v for k, v in response.headers.items()}
            if headers.get("content-type", "").startswith("text/event-stream"):
                events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
                return response.status, [e if e == "[DONE]" else json.loads(e) for e in events], headers
            try:
                return response.status, json.loads(text) if text else None, headers
            except json.JSONDecodeError:
                return response.status, text, headers

    async def script_tool_call(self) -> None:
        await self.call("DELETE", "/forced_completions")
        await self.call("POST", "/forced_completions", {"tools": [TOOL_TEXT]})


def stream_shape(events: list[Any]) -> dict[str, Any]:
    """A stream as roles: opening chunk, content chunks, the finishing chunk, usage chunk, [DONE]."""
    chunks = [e for e in events if isinstance(e, dict)]
    usage = [c for c in chunks if c.get("choices") == []]
    body = [c for c in chunks if c.get("choices")]
    finishing = [c for c in body if c["choices"][0].get("finish_reason")]
    middle = body[1:-1] if len(body) > 2 else []
    return {
        "opening": shape(body[0]) if body else None,
        "middle": merge([shape(c) for c in middle]) if middle else None,
        "finishing": shape(finishing[-1]) if finishing else None,
        "usage": shape(usage[-1]) if usage else None,
        "ends_with_done": events[-1] == "[DONE]" if events else False,
    }


CASES: list[tuple[str, str, str, dict | None, bool]] = [
    (
        "chat (capture fields)",
        "POST",
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 6, "seed": 1, **CAPTURE},
        False,
    ),
    (
        "chat (top_logprobs 2)",
        "POST",
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 4, "seed": 1, **CAPTURE, "top_logprobs": 2},
        False,
    ),
    ("chat (plain)", "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}, False),
    (
        "chat stream",
        "POST",
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "max_tokens": 6,
            "seed": 1,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **CAPTURE,
        },
        False,
    ),
    (
        "chat tool call",
        "POST",
        "/v1/chat/completions",
        {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 64, **CAPTURE, **TOOL_FORCING},
        True,
    ),
    (
        "chat tool call stream",
        "POST",
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "tools": TOOLS,
            "max_tokens": 64,
            "stream": True,
            "stream_options": {"include_usage": True},
            **CAPTURE,
            **TOOL_FORCING,
        },
        True,
    ),
    (
        "completions (token ids)",
        "POST",
        "/v1/completions",
        {
            "prompt": [1, 358, 201, 90, 2, 201],
            "max_tokens": 4,
            "logprobs": 0,
            "seed": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        },
        False,
    ),
    (
        "completions (text, logprobs 2)",
        "POST",
        "/v1/completions",
        {"prompt": "def main():", "max_tokens": 4, "logprobs": 2, "return_token_ids": True},
        False,
    ),
    (
        "completions stream",
        "POST",
        "/v1/completions",
        {
            "prompt": [1, 358, 201],
            "max_tokens": 4,
            "ignore_eos": True,
            "logprobs": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        },
        False,
    ),
    (
        "completions (prompt_logprobs 1)",
        "POST",
        "/v1/completions",
        {"prompt": [1, 358, 201, 90, 2, 201], "max_tokens": 2, "prompt_logprobs": 1, "return_token_ids": True},
        False,
    ),
    (
        "chat (prompt_logprobs 0)",
        "POST",
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 0, **CAPTURE},
        False,
    ),
    ("tokenize (text)", "POST", "/tokenize", {"prompt": "hello world", "return_token_strs": True}, False),
    ("tokenize (chat + tools)", "POST", "/tokenize", {"messages": MESSAGES, "tools": TOOLS}, False),
    ("detokenize", "POST", "/detokenize", {"tokens": [1, 358, 201]}, False),
    ("models", "GET", "/v1/models", None, False),
    ("error: n=2", "POST", "/v1/chat/completions", {"messages": MESSAGES, "n": 2, "max_tokens": 2}, False),
    ("error: unknown model", "POST", "/v1/chat/completions", {"model": "no-such-model", "messages": MESSAGES}, False),
    ("error: too long", "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 10_000_000}, False),
    ("error: malformed", "POST", "/v1/chat/completions", {"messages": "hello"}, False),
    ("pause", "POST", "/pause", None, False),
    ("is_paused", "GET", "/is_paused", None, False),
    ("resume", "POST", "/resume", None, False),
    ("reset_prefix_cache", "POST", "/reset_prefix_cache", None, False),
    ("weight_info", "GET", "/weight_info", None, False),
    ("health", "GET", "/health", None, False),
]


TOKEN_IN_CASES: list[tuple[str, str, dict]] = [
    ("render", "/v1/chat/completions/render", {"messages": MESSAGES}),
    (
        "render (capture fields)",
        "/v1/chat/completions/render",
        {"messages": MESSAGES, "max_tokens": 8, "temperature": 0.7, "seed": 3, **CAPTURE},
    ),
    ("render (tools)", "/v1/chat/completions/render", {"messages": MESSAGES, "tools": TOOLS}),
    (
        "render (no generation prompt)",
        "/v1/chat/completions/render",
        {"messages": MESSAGES, "add_generation_prompt": False},
    ),
    (
        "render (continue final message)",
        "/v1/chat/completions/render",
        {
            "messages": [*MESSAGES, {"role": "assistant", "content": "Sure"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ),
    (
        "render (stream, top_k, stop)",
        "/v1/chat/completions/render",
        {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}, "top_k": 20, "stop": ["x"]},
    ),
    (
        "render (max_tokens 16, top_k -1)",
        "/v1/chat/completions/render",
        {"messages": MESSAGES, "max_tokens": 16, "top_k": -1},
    ),
    (
        "render (greedy, prompt_logprobs)",
        "/v1/chat/completions/render",
        {"messages": MESSAGES, "temperature": 0, "top_k": 5, "top_p": 0.5, "ignore_eos": True, "prompt_logprobs": 1},
    ),
    (
        "error: render top_logprobs without logprobs",
        "/v1/chat/completions/render",
        {"messages": MESSAGES, "top_logprobs": 3},
    ),
    (
        "generate (max_tokens above the context)",
        "/inference/v1/generate",
        {"token_ids": [1, 358, 201], "sampling_params": {"max_tokens": 10_000_000, "seed": 1}},
    ),
    ("error: generate out-of-vocab id", "/inference/v1/generate", {"token_ids": [1, 99999], "sampling_params": {}}),
    ("error: generate negative id", "/inference/v1/generate", {"token_ids": [-1], "sampling_params": {}}),
    ("error: generate no ids", "/inference/v1/generate", {"token_ids": [], "sampling_params": {}}),
    ("error: generate no sampling_params", "/inference/v1/generate", {"token_ids": [1, 358, 201]}),
    ("error: generate too long", "/inference/v1/generate", {"token_ids": [5] * 70_000, "sampling_params": {}}),
    (
        "error: generate unknown model",
        "/inference/v1/generate",
        {"model": "no-such-model", "token_ids": [1], "sampling_params": {}},
    ),
    (
        "error: derender without chat_request",
        "/v1/chat/completions/derender",
        {"generate_response": {"choices": [{"index": 0, "token_ids": [53], "finish_reason": "stop"}]}},
    ),
    (
        "error: derender empty ids",
        "/v1/chat/completions/derender",
        {
            "generate_response": {"choices": [{"index": 0, "token_ids": [], "finish_reason": "stop"}]},
            "chat_request": {"messages": MESSAGES},
        },
    ),
]

Reply = tuple[int, Any, dict]


async def token_in_chain(client: Client) -> list[tuple[str, Reply]]:
    """render → generate (whole, streamed, logprobs 2, text mode) → derender, each from the engine's
    own previous answer; and the derender of one fixed tool-call text (same ids on both sides)."""
    replies: list[tuple[str, Reply]] = []
    body = {"messages": MESSAGES, "seed": 5, "max_tokens": 12, **CAPTURE}
    rendered = await client.call("POST", "/v1/chat/completions/render", body)
    request = {**rendered[1], "return_token_ids": True}
    generated = await client.call("POST", "/inference/v1/generate", request)
    replies.append(("generate (from render)", generated))
    sampling = {**request["sampling_params"], "logprobs": 2, "max_tokens": 4}
    replies.append(
        (
            "generate (logprobs 2)",
            await client.call("POST", "/inference/v1/generate", {**request, "sampling_params": sampling}),
        )
    )
    replies.append(
        (
            "generate (text mode)",
            await client.call("POST", "/inference/v1/generate", {**request, "output_mode": "text"}),
        )
    )
    streamed = {**request, "stream": True, "stream_options": {"include_usage": True}}
    streamed["sampling_params"] = {**request["sampling_params"], "ignore_eos": True, "max_tokens": 6}
    replies.append(("generate stream", await client.call("POST", "/inference/v1/generate", streamed)))
    derender = {"generate_response": generated[1], "chat_request": body, "prompt_tokens": len(request["token_ids"])}
    replies.append(
        ("derender (generate's answer)", await client.call("POST", "/v1/chat/completions/derender", derender))
    )
    tokens = await client.call("POST", "/tokenize", {"prompt": TOOL_TEXT, "add_special_tokens": False})
    tool_sample = {"choices": [{"index": 0, "token_ids": tokens[1]["tokens"], "finish_reason": "stop"}]}
    tool_chat = {"messages": MESSAGES, "tools": TOOLS}
    replies.append(
        (
            "derender (tool call)",
            await client.call(
                "POST", "/v1/chat/completions/derender", {"generate_response": tool_sample, "chat_request": tool_chat}
            ),
        )
    )
    return replies


def judge(reply_a: Reply, reply_b: Reply, tool_call: bool) -> list[str]:
    """Every difference in status, structure and agreed values between two replies to one request."""
    (status_a, body_a, headers_a), (status_b, body_b, _) = reply_a, reply_b
    streamed = isinstance(body_a, list) or isinstance(body_b, list)
    found = [] if status_a == status_b else [f"status: A {status_a} vs B {status_b}"]
    if streamed:
        shape_a = stream_shape(body_a) if isinstance(body_a, list) else shape(body_a)
        shape_b = stream_shape(body_b) if isinstance(body_b, list) else shape(body_b)
    else:
        shape_a, shape_b = shape(body_a), shape(body_b)
    found += differences(shape_a, shape_b)
    values_a, values_b = agreed_values(body_a), agreed_values(body_b)
    found += [
        f"value of {key} differs: A {json.dumps(values_a[key])[:60]} vs B {json.dumps(values_b[key])[:60]}"
        for key in values_a
        if key in values_b and values_a[key] != values_b[key]
    ]
    if "x-policy-version" not in headers_a:
        found.append("A: no x-policy-version header")
    if found and tool_call and not streamed and isinstance(body_b, dict):
        message = (body_b.get("choices") or [{}])[0].get("message", {})
        found.append(f"(B replied content={json.dumps(message.get('content'))[:60]})")
    return found


async def compare(url_a: str, url_b: str, model_a: str | None, model_b: str | None) -> int:
    results: list[tuple[str, list[str]]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        a, b = Client(session, url_a, model_a), Client(session, url_b, model_b)
        for name, method, path, body, tool_call in CASES:
            replies = []
            for client in (a, b):
                if tool_call:
                    await client.script_tool_call()
                replies.append(await client.call(method, path, body))
            results.append((name, judge(replies[0], replies[1], tool_call)))
        for name, path, body in TOKEN_IN_CASES:
            results.append((name, judge(await a.call("POST", path, body), await b.call("POST", path, body), False)))
        for (name, reply_a), (_, reply_b) in zip(await token_in_chain(a), await token_in_chain(b), strict=True):
            results.append((name, judge(reply_a, reply_b, False)))
    for name, found in results:
        print(f"{'OK  ' if not found else 'DIFF'} {name}")
        for line in found:
            print(f"       {line}")
    failures = sum(bool(found) for _, found in results)
    print(
        f"\n{len(results) - failures}/{len(results)} requests identical in structure "
        "(and in prompt ids, sampling params, tokenizer output, tool calls)"
    )
    return failures


@contextmanager
def embedded_pair() -> Iterator[tuple[str, str, str]]:
    """Two embedded engines serving one tiny model, built offline: (url A, url B, the model directory)."""
    from harness_rl.engine import Engine, build_tiny_model, serve_in_thread

    with tempfile.TemporaryDirectory(prefix="conformance-") as work, ExitStack() as stack:
        model_dir = build_tiny_model(Path(work) / "tiny", seed=0)
        engines = [Engine.from_pretrained(model_dir, served_model_name="tiny") for _ in range(2)]
        for engine in engines:
            stack.callback(engine.close)
        a, b = (stack.enter_context(serve_in_thread(e, forced_completions=True)).url for e in engines)
        yield a, b, str(model_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url_a", nargs="?", help="first engine, e.g. the embedded engine")
    parser.add_argument("url_b", nargs="?", help="second engine, e.g. vLLM")
    parser.add_argument("--model-a", default="tiny")
    parser.add_argument("--model-b", default="tiny")
    parser.add_argument("--model-dir", help="the model directory both serve: also check logprob values")
    args = parse_args(parser, {}, what="no URLs: two embedded engines of one tiny model compared, logprobs too")
    if (args.url_a is None or args.url_b is None) and not args.quick:
        parser.error("give the two engines' URLs (or --quick: the embedded engine against itself)")
    with embedded_pair() if args.url_a is None or args.url_b is None else nullcontext() as pair:
        a, b, model_dir = pair or (args.url_a, args.url_b, args.model_dir)
        failures = asyncio.run(compare(a, b, args.model_a, args.model_b))
        if model_dir:
            asyncio.run(check_logprobs([a, b], [args.model_a, args.model_b], model_dir))
    print(load_average())
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
