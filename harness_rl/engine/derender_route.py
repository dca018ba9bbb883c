"""`POST /v1/chat/completions/derender`: sampled ids (a generate answer) → a `chat.completion`.

As vLLM 0.32 does it with a tool parser configured (this engine always parses hermes tool calls):
`chat_request` is required (its tools and `tool_choice` decide the parsing); the ids are decoded
whole with special tokens kept, so a trailing end-of-turn token shows in the content, and stop
strings are not applied (drop the stop token and cut at the stop string to get the chat route's
text); `finish_reason` and `stop_reason` are passed through as given (no `tool_calls` rewrite);
tool-call ids are 16 hex digits; logprob tokens are decoded text, never `token_id:N`, and each
entry's `top_logprobs` are generate's (the sampled token first). A body with `stream: true` derenders
one generate chunk (`derender_stream`).
"""

import os
import time
from typing import Any

from aiohttp import web

from harness_rl.engine.chat_request import parses_tools
from harness_rl.engine.chat_route import assistant_message
from harness_rl.engine.derender_stream import derender_chunk
from harness_rl.engine.errors import ApiError, validation_error
from harness_rl.engine.hermes import parse_tool_calls
from harness_rl.engine.protocol import decode_body
from harness_rl.engine.request_params import check_model
from harness_rl.engine.server_context import CONTEXT, usage
from harness_rl.engine.token_protocol import (
    ChoiceLogprobs,
    DerenderBody,
    GeneratedChoice,
    GeneratedReply,
    short_id,
)

# vLLM corrects a piece that decodes to an incomplete character with up to this many tokens before it.
PIECE_CONTEXT = 4
REPLACEMENT = "\ufffd"


def token_piece(tokenizer: Any, token_id: int, before: list[int]) -> str:
    """The text one sampled token adds, with a piece that ends mid-character (U+FFFD alone)
    completed from the tokens sampled before it, as vLLM resolves logprob tokens."""
    piece = tokenizer.decode([token_id])
    if not piece.endswith(REPLACEMENT):
        return piece
    for size in range(1, min(PIECE_CONTEXT, len(before)) + 1):
        context = before[-size:]
        whole = tokenizer.decode([*context, token_id])
        if whole.endswith(REPLACEMENT):
            continue
        clean = list(context)
        while clean and tokenizer.decode([clean[-1]]).endswith(REPLACEMENT):
            clean.pop()
        prefix = tokenizer.decode(clean) if clean else ""
        return whole[len(os.path.commonprefix([prefix, whole])) :]
    return ""


def _logprobs(tokenizer: Any, logprobs: ChoiceLogprobs) -> dict[str, Any]:
    """generate's `{token_id, logprob, top_logprobs}` entries as chat's `{token, logprob, bytes, …}`."""
    if logprobs.content is None:
        return {"content": None}

    def entry(token_id: int, logprob: float, before: list[int]) -> dict[str, Any]:
        text = token_piece(tokenizer, token_id, before)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}

    content: list[dict[str, Any]] = []
    before: list[int] = []
    for sampled in logprobs.content:
        content.append(
            {
                **entry(sampled.token_id, sampled.logprob, before),
                "top_logprobs": [entry(top.token_id, top.logprob, before) for top in sampled.top_logprobs],
            }
        )
        before.append(sampled.token_id)
    return {"content": content}


def _check_bounds(generated: GeneratedReply, prompt: list[int] | None, max_model_len: int, vocab_size: int) -> None:
    for choice in generated.choices:
        ids = choice.token_ids or []
        if len(ids) > max_model_len:
            raise ApiError(
                400, f"token_ids length ({len(ids)}) in choice {choice.index} exceeds max_model_len ({max_model_len})."
            )
        entries = choice.logprobs.content if choice.logprobs is not None else None
        if entries and len(entries) > max_model_len:
            raise ApiError(
                400,
                f"logprobs.content length ({len(entries)}) in choice {choice.index} exceeds max_model_len "
                f"({max_model_len}).",
            )
        if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
            bad = min(ids) if min(ids) < 0 else max(ids)
            raise ApiError(400, f"Token id {bad} is out of vocabulary")
    if prompt is not None and len(prompt) > max_model_len:
        raise ApiError(400, f"prompt_token_ids length ({len(prompt)}) exceeds max_model_len ({max_model_len}).")


async def derender_chat_completion(request: web.Request) -> web.Response:
    engine = request.app[CONTEXT].engine
    body = decode_body(await request.read(), DerenderBody)
    if body.stream:
        return derender_chunk(engine, body)
    generated = body.generate_response
    if generated is None:
        raise validation_error("body.generate_response", "missing", "Field required", "<the body>")
    check_model(body.model, engine.served_model_name)
    _check_bounds(generated, body.prompt_token_ids, engine.max_model_len, engine.vocab_size)
    chat = body.chat_request
    if chat is None:
        raise ApiError(
            400,
            "chat_request is required when a tool or reasoning parser is configured because plain "
            "detokenization would leak raw parser markup into content.",
        )
    parse_tools = parses_tools(chat)
    tokenizer = engine.tokenizer
    choices = [_choice(tokenizer, choice, parse_tools, bool(chat.return_token_ids)) for choice in generated.choices]
    completion_tokens = sum(len(c.token_ids or []) for c in generated.choices)
    return web.json_response(
        {
            "id": generated.request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model or engine.served_model_name,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage(body.prompt_tokens or 0, completion_tokens, details=True),
            "prompt_logprobs": generated.prompt_logprobs,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": generated.kv_transfer_params,
            "ec_transfer_params": None,
            "metrics": generated.metrics,
        }
    )


def _choice(tokenizer: Any, choice: GeneratedChoice, parse_tools: bool, with_ids: bool) -> dict[str, Any]:
    if not choice.token_ids:
        raise ApiError(400, f"choice {choice.index} has empty or null token_ids")
    text = tokenizer.decode(choice.token_ids, skip_special_tokens=False)
    parsed = parse_tool_calls(text, new_id=short_id) if parse_tools else None
    content, tool_calls = parsed if parsed else (text, [])
    return {
        "index": choice.index,
        "message": assistant_message(content, tool_calls),
        "logprobs": _logprobs(tokenizer, choice.logprobs) if choice.logprobs is not None else None,
        "finish_reason": choice.finish_reason,
        "stop_reason": choice.stop_reason,
        "token_ids": choice.token_ids if with_ids else None,
        "routed_experts": None,
    }
