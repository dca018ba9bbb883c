"""`POST /v1/completions`: a text prompt, or token ids used verbatim (the splice path).

Ids and prompt ids sit inside the choice, as in vLLM; `logprobs: N` gives the legacy
`{tokens, token_logprobs, top_logprobs, text_offset}` block.
"""

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from aiohttp import web

from harness_rl.engine.errors import ApiError
from harness_rl.engine.generation import GenerationUpdate
from harness_rl.engine.protocol import CompletionRequest, decode_body
from harness_rl.engine.request_params import check_model, sampling_params
from harness_rl.engine.server_context import (
    CONTEXT,
    LOGPROB_FLOOR,
    SYSTEM_FINGERPRINT,
    ServerContext,
    collect,
    end_stream,
    open_sse,
    request_id,
    send_event,
    usage,
)
from harness_rl.wire import POLICY_VERSION_HEADER

DEFAULT_MAX_TOKENS = 16


def _prompt_ids(ctx: ServerContext, prompt: Any) -> list[int]:
    """One prompt: text (encoded with special tokens, like vLLM) or a list of ids, verbatim."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return ctx.engine.tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        vocab = len(ctx.engine.tokenizer)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"Token id {bad[0]} is out of vocabulary (size {vocab}).", param="prompt")
        return list(prompt)
    raise ApiError(
        400, "prompt must be one text or one non-empty list of token ids (batches are not supported).", param="prompt"
    )


def _logprobs_block(ctx: ServerContext, tokens, text_start: int, as_ids: bool) -> dict[str, Any]:
    strings = [ctx.token_string(t.token_id, as_ids) for t in tokens]
    offsets, position = [], text_start
    for token in tokens:
        offsets.append(position)
        position += len(ctx.engine.tokenizer.decode([token.token_id], skip_special_tokens=True))
    return {
        "text_offset": offsets,
        "token_logprobs": [max(t.logprob, LOGPROB_FLOOR) for t in tokens],
        "tokens": strings,
        "top_logprobs": [
            {
                **{ctx.token_string(i, as_ids): max(lp, LOGPROB_FLOOR) for i, lp in t.top_logprobs},
                s: max(t.logprob, LOGPROB_FLOOR),
            }
            for t, s in zip(tokens, strings, strict=True)
        ],
    }


async def completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    engine = ctx.engine
    body = decode_body(await request.read(), CompletionRequest)
    check_model(body.model, engine.served_model_name)
    if body.echo:
        raise ApiError(400, "echo is not supported by this engine.", param="echo")
    prompt_ids = _prompt_ids(ctx, body.prompt)
    params = sampling_params(
        body,
        stream=bool(body.stream),
        prompt_len=len(prompt_ids),
        max_model_len=engine.max_model_len,
        max_tokens=body.max_tokens,
        default_max_tokens=DEFAULT_MAX_TOKENS,
        logprobs=body.logprobs,
    )
    as_ids = ctx.tokens_as_ids if body.return_tokens_as_token_ids is None else body.return_tokens_as_token_ids
    header = {
        "id": request_id("cmpl"),
        "object": "text_completion",
        "created": ctx.created,
        "model": engine.served_model_name,
    }
    async with aclosing(engine.generate(prompt_ids, params)) as updates:
        return await _respond(request, ctx, body, prompt_ids, as_ids, header, updates)


async def _respond(
    request: web.Request,
    ctx: ServerContext,
    body: CompletionRequest,
    prompt_ids: list[int],
    as_ids: bool,
    header: dict[str, Any],
    updates: AsyncIterator[GenerationUpdate],
) -> web.StreamResponse:
    with_ids = bool(body.return_token_ids)
    if not body.stream:
        done = await collect(updates)
        choice = {
            "index": 0,
            "text": done.text,
            "logprobs": _logprobs_block(ctx, done.tokens, 0, as_ids) if body.logprobs is not None else None,
            "finish_reason": done.finish_reason,
            "stop_reason": done.stop_reason,
            "token_ids": done.token_ids if with_ids else None,
            "prompt_logprobs": ctx.prompt_logprobs(done.prompt_logprobs),
            "prompt_token_ids": prompt_ids if with_ids else None,
            "routed_experts": None,
        }
        reply = {
            **header,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage(len(prompt_ids), len(done.tokens), details=True),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        return web.json_response(reply, headers={POLICY_VERSION_HEADER: str(done.policy_version)})
    first = await anext(updates)
    response = await open_sse(request, first.policy_version)
    with_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
    produced, text_length, update = 0, 0, first
    while True:
        chunk_choice: dict[str, Any] = {
            "index": 0,
            "text": update.text,
            "logprobs": _logprobs_block(ctx, update.tokens, text_length, as_ids) if body.logprobs is not None else None,
            "finish_reason": update.finish_reason,
            "stop_reason": update.stop_reason,
            "prompt_token_ids": prompt_ids if with_ids and produced == 0 else None,
            "token_ids": [t.token_id for t in update.tokens] if with_ids else None,
        }
        produced += len(update.tokens)
        text_length += len(update.text)
        chunk = {**header, "choices": [chunk_choice]}
        final = update.finish_reason is not None
        if final and not with_usage:
            chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
        await send_event(response, chunk)
        if final:
            break
        update = await anext(updates)
    return await end_stream(response, header, usage(len(prompt_ids), produced) if with_usage else None)
