"""`POST /inference/v1/generate` and `POST /inference/v1/abort_requests`: vLLM 0.32's token-in,
token-out routes, in its exact shapes (JSON and SSE) and with its error statuses and messages.

The answer carries the sampled ids, their logprobs when `sampling_params.logprobs` is set (0: the
sampled token only), and `weight_versions`: contiguous `[start, end)` spans over completion token
indexes naming the weight version that sampled each token. A generation kept across a weight load
(`/pause?mode=keep`) gets one span per version; the tokens after the boundary were chosen from the
new weights' forward pass over the cache the old weights had computed, as in vLLM (this engine
never lends that mixed cache to a later request through its prefix cache).
"""

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import msgspec
from aiohttp import web

from harness_rl.engine.errors import ApiError, validation_error
from harness_rl.engine.forced import forced_token_ids, prompt_has_tools
from harness_rl.engine.generation import GenerationUpdate, SampledToken
from harness_rl.engine.protocol import decode_body
from harness_rl.engine.request_params import check_model, sampling_params
from harness_rl.engine.server_context import (
    CONTEXT,
    LOGPROB_FLOOR,
    ServerContext,
    collect,
    open_sse,
    send_event,
    usage,
)
from harness_rl.engine.token_protocol import AbortBody, GenerateBody
from harness_rl.wire import POLICY_VERSION_HEADER

REQUEST_ID_HEADER = "X-Request-Id"


def check_token_ids(ids: list[int]) -> None:
    """The checks vLLM's request schema makes of `token_ids`, in its words."""
    if not ids:
        raise validation_error(
            "body.token_ids",
            "too_short",
            "List should have at least 1 item after validation, not 0",
            "<list of 0 items>",
            "{'field_type': 'List', 'min_length': 1, 'actual_length': 0}",
        )
    if min(ids) < 0:
        raise validation_error(
            "body.token_ids",
            "value_error",
            "Value error, token_ids must not contain negative values",
            f"<list of {len(ids)} items>",
            "{'error': ValueError('token_ids must not contain negative values')}",
        )


def check_prompt_fits(ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """The checks vLLM makes after the model check: vocabulary, then length."""
    if max(ids) >= vocab_size:
        raise ApiError(400, f"Token id {max(ids)} is out of vocabulary")
    if len(ids) > max_model_len:
        raise ApiError(
            400,
            f"The decoder prompt (length {len(ids)}) is longer than the maximum model length of {max_model_len}. "
            "Make sure that `max_model_len` is no smaller than the number of text tokens.",
        )
    if len(ids) == max_model_len:
        raise ApiError(
            400,
            f"The decoder prompt (length {len(ids)}) plus the number of requested output tokens (at least 1) is "
            f"longer than the maximum model length of {max_model_len}. Make sure that `max_model_len` is no "
            "smaller than the number of text tokens (prompt + requested output tokens).",
        )


def weight_spans(tokens: list[SampledToken]) -> list[dict[str, Any]]:
    """`[{"version", "start", "end"}]`: the runs of equal weight versions over the completion."""
    spans: list[dict[str, Any]] = []
    for index, token in enumerate(tokens):
        version = str(token.version)
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": version, "start": index, "end": index + 1})
    return spans


class _Reply:
    """The pieces of one generate answer, shared by the whole and the streamed forms."""

    def __init__(
        self, ctx: ServerContext, body: GenerateBody, prompt_ids: list[int], request_id: str, logprobs: int | None
    ) -> None:
        self.ctx = ctx
        self.body = body
        self.prompt_ids = prompt_ids
        self.request_id = request_id
        self.logprobs = logprobs
        self.text_mode = body.output_mode == "text"

    def _entry(self, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        value = max(logprob, LOGPROB_FLOOR)
        if not self.text_mode:
            return {"token_id": token_id, "logprob": value, "rank": rank}
        if self.ctx.tokens_as_ids:
            return {"token": f"token_id:{token_id}", "logprob": value, "bytes": None}
        text = self.ctx.engine.tokenizer.decode([token_id])
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8", errors="replace"))}

    def logprobs_block(self, tokens: list[SampledToken] | tuple[SampledToken, ...]) -> dict[str, Any] | None:
        """The sampled token first, then the best alternatives, `max(logprobs, 1)` entries in all."""
        if self.logprobs is None:
            return None
        content = []
        for token in tokens:
            top = [self._entry(token.token_id, token.logprob, token.rank)]
            top += [
                self._entry(i, lp, rank) for rank, (i, lp) in enumerate(token.top_logprobs, 1) if i != token.token_id
            ]
            content.append({**top[0], "top_logprobs": top[: max(self.logprobs, 1)]})
        return {"content": content}

    def choice(
        self,
        tokens: list[SampledToken] | tuple[SampledToken, ...],
        finish_reason: str | None,
        stop_reason: int | str | None,
        spans: list[dict[str, Any]] | None,
        text: str,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
            "token_ids": [t.token_id for t in tokens],
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": spans,
        }
        if self.text_mode:
            choice["text"] = text
        choice["logprobs"] = self.logprobs_block(tokens)
        return choice


async def generate(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    engine = ctx.engine
    raw = await request.read()
    body = decode_body(raw, GenerateBody)
    for name, value in (("token_ids", body.token_ids), ("sampling_params", body.sampling_params)):
        if value is None:
            given = f"<dict of {len(msgspec.json.decode(raw))} items>"
            raise validation_error(f"body.{name}", "missing", "Field required", given)
    assert body.token_ids is not None and body.sampling_params is not None
    check_token_ids(body.token_ids)
    check_model(body.model, engine.served_model_name)
    if body.features is not None or body.content_parts:
        raise ApiError(400, "Multimodal inputs (features, content_parts) are not supported by the embedded engine.")
    sampling = body.sampling_params
    if body.output_mode == "text" and not sampling.detokenize:
        raise ApiError(400, "output_mode='text' requires sampling_params.detokenize to be true")
    check_prompt_fits(body.token_ids, engine.vocab_size, engine.max_model_len)
    params = sampling_params(
        sampling,
        stream=bool(body.stream),
        prompt_len=len(body.token_ids),
        max_model_len=engine.max_model_len,
        # vLLM's generate caps any max_tokens at the room left (the chat route refuses one above the context)
        max_tokens=None if sampling.max_tokens is None else min(sampling.max_tokens, engine.max_model_len),
        default_max_tokens=None,
        logprobs=sampling.logprobs,
    )
    forced = None
    if ctx.forced is not None:
        text = ctx.forced.pop(has_tools=prompt_has_tools(engine.tokenizer, body.token_ids))
        forced = forced_token_ids(engine.tokenizer, text) if text is not None else None
    request_id = f"generate-tokens-{request.headers.get(REQUEST_ID_HEADER) or body.request_id}"
    reply = _Reply(ctx, body, body.token_ids, request_id, params.logprobs)
    async with aclosing(engine.generate(body.token_ids, params, forced, request_id=request_id)) as updates:
        if body.stream:
            return await _stream(request, reply, updates)
        done = await collect(updates)
    answer = {
        "request_id": request_id,
        "model": engine.served_model_name,
        "created": int(time.time()),
        "usage": usage(len(body.token_ids), len(done.tokens), details=True),
        "prompt_logprobs": ctx.prompt_logprobs(done.prompt_logprobs),
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": body.token_ids if body.return_token_ids else None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": body.output_mode,
        "choices": [
            reply.choice(done.tokens, done.finish_reason, done.stop_reason, weight_spans(done.tokens), done.text)
        ],
    }
    return web.json_response(answer, headers={POLICY_VERSION_HEADER: str(done.policy_version)})


async def _stream(request: web.Request, reply: _Reply, updates: AsyncIterator[GenerationUpdate]) -> web.StreamResponse:
    """One chunk per engine step with the step's new ids; the prompt ids (when asked) on the first,
    the spans on the final one; then the usage chunk when asked, and `[DONE]`."""
    body = reply.body
    options = body.stream_options
    with_usage = options is not None and bool(options.include_usage)
    continuous = with_usage and options is not None and bool(options.continuous_usage_stats)
    prompt_len = len(reply.prompt_ids)
    first = await anext(updates)
    response = await open_sse(request, first.policy_version)
    produced: list[SampledToken] = []
    update = first
    while True:
        produced.extend(update.tokens)
        final = update.finish_reason is not None
        chunk: dict[str, Any] = {
            "request_id": reply.request_id,
            "usage": usage(prompt_len, len(produced), details=True) if continuous else None,
        }
        if body.return_token_ids and update is first:
            chunk["prompt_token_ids"] = reply.prompt_ids
        chunk["output_mode"] = body.output_mode
        spans = weight_spans(produced) if final else None
        chunk["choices"] = [reply.choice(update.tokens, update.finish_reason, update.stop_reason, spans, update.text)]
        await send_event(response, chunk)
        if final:
            break
        update = await anext(updates)
    if with_usage:
        tail = {
            "request_id": reply.request_id,
            "usage": usage(prompt_len, len(produced)),
            "output_mode": body.output_mode,
            "choices": [],
        }
        await send_event(response, tail)
    await send_event(response, "[DONE]")
    await response.write_eof()
    return response


async def abort_requests(request: web.Request) -> web.Response:
    """End running or waiting generations by the `request_id` generate answered with, or the one the
    caller gave it (200, empty)."""
    body = decode_body(await request.read(), AbortBody)
    request.app[CONTEXT].engine.abort({*body.request_ids, *(f"generate-tokens-{i}" for i in body.request_ids)})
    return web.Response(status=200)
