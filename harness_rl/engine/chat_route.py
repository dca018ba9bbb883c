"""`POST /v1/chat/completions`, answered in vLLM's exact shapes (JSON and SSE)."""

from contextlib import aclosing
from typing import Any

from aiohttp import web

from harness_rl.engine.chat_request import prepare_chat
from harness_rl.engine.forced import forced_token_ids
from harness_rl.engine.hermes import HermesStream, parse_tool_calls
from harness_rl.engine.protocol import ChatCompletionRequest, decode_body
from harness_rl.engine.server_context import (
    CONTEXT,
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


async def chat_completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    engine = ctx.engine
    body = decode_body(await request.read(), ChatCompletionRequest)
    chat = await prepare_chat(engine, body)
    forced_text = ctx.forced.pop(has_tools=bool(body.tools)) if ctx.forced is not None else None
    forced = forced_token_ids(engine.tokenizer, forced_text) if forced_text is not None else None
    as_ids = ctx.tokens_as_ids if body.return_tokens_as_token_ids is None else body.return_tokens_as_token_ids
    reply = _ChatReply(ctx, body, chat.prompt_ids, chat.parse_tools, as_ids, chat.top_logprobs)
    async with aclosing(engine.generate(chat.prompt_ids, chat.params, forced)) as updates:
        if body.stream:
            return await reply.stream(request, updates)
        completion = await collect(updates)
    return web.json_response(reply.full(completion), headers={POLICY_VERSION_HEADER: str(completion.policy_version)})


def assistant_message(content: str | None, tool_calls: list[dict]) -> dict[str, Any]:
    """A whole reply's `message`, key for key as vLLM 0.32 writes it (`tool_calls` only when any)."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    if tool_calls:
        message["tool_calls"] = tool_calls
    message["reasoning"] = None
    return message


class _ChatReply:
    """Builds the reply of one chat request, whole or as a stream of chunks."""

    def __init__(
        self,
        ctx: ServerContext,
        body: ChatCompletionRequest,
        prompt_ids: list[int],
        parse_tools: bool,
        as_ids: bool,
        top: int,
    ) -> None:
        self.ctx = ctx
        self.body = body
        self.prompt_ids = prompt_ids
        self.parse_tools = parse_tools
        self.as_ids = as_ids
        self.top = top
        self.id = request_id("chatcmpl")
        self.model = ctx.engine.served_model_name

    def _logprobs(self, tokens) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        return {"content": [self.ctx.chat_logprob(t, self.as_ids, self.top) for t in tokens]}

    def _header(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.ctx.created, "model": self.model}

    def full(self, completion) -> dict[str, Any]:
        parsed = parse_tool_calls(completion.text) if self.parse_tools else None
        content, tool_calls = parsed if parsed else (completion.text, [])
        finish = "tool_calls" if parsed else completion.finish_reason
        choice = {
            "index": 0,
            "message": assistant_message(content, tool_calls),
            "logprobs": self._logprobs(completion.tokens),
            "finish_reason": finish,
            "stop_reason": completion.stop_reason,
            "token_ids": completion.token_ids if self.body.return_token_ids else None,
            "routed_experts": None,
        }
        return {
            **self._header("chat.completion"),
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage(len(self.prompt_ids), len(completion.tokens), details=True),
            "prompt_logprobs": self.ctx.prompt_logprobs(completion.prompt_logprobs),
            "prompt_token_ids": self.prompt_ids if self.body.return_token_ids else None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _chunk(self, delta: dict, tokens, finish: str | None, stop_reason) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": self._logprobs(tokens) if tokens else None,
            "finish_reason": finish,
        }
        if finish is not None:
            choice["stop_reason"] = stop_reason
        choice["token_ids"] = [t.token_id for t in tokens] if self.body.return_token_ids else None
        return {**self._header("chat.completion.chunk"), "choices": [choice]}

    async def stream(self, request: web.Request, updates) -> web.StreamResponse:
        """One chunk per sampled token, like vLLM; tool calls arrive whole in the chunk of the
        token that closes them (`</tool_call>`), as one delta with id, type, name and arguments."""
        first = await anext(updates)
        response = await open_sse(request, first.policy_version)
        opening = {
            **self._header("chat.completion.chunk"),
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ],
            "prompt_token_ids": self.prompt_ids if self.body.return_token_ids else None,
            "prompt_text": None,
        }
        await send_event(response, opening)
        options = self.body.stream_options
        with_usage = options is not None and bool(options.include_usage)
        parser = HermesStream() if self.parse_tools else None
        produced = 0
        update = first
        while True:
            produced += len(update.tokens)
            final = update.finish_reason is not None
            if parser is not None:
                delta = parser.feed(update.text, final=final)
            else:
                delta = {"content": update.text} if update.text else {}
            finish = None
            if final:
                finish = "tool_calls" if parser is not None and parser.calls_sent else update.finish_reason
            chunk = self._chunk(delta, update.tokens, finish, update.stop_reason)
            if final and not with_usage:
                chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
            await send_event(response, chunk)
            if final:
                break
            update = await anext(updates)
        return await end_stream(
            response,
            self._header("chat.completion.chunk"),
            usage(len(self.prompt_ids), produced) if with_usage else None,
        )
