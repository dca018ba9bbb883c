"""`POST /v1/chat/completions/derender` with `stream: true`: one generate chunk → one `chat.completion.chunk`.

As vLLM 0.32 does it with a parser configured (this engine always parses hermes tool calls): stateless,
the caller carries the state (`DerenderStreamState`) from call to call; `chat_request` and the whole
prompt's ids are required; at most one choice per chunk. Each call rebuilds the parser and replays every
earlier output id through it, call by call as they arrived, then reads the new ids: content until the
first `<tool_call>` (a tail that could still grow into one held back), tool calls after it. Text is
decoded with special tokens kept; the role goes out on the first chunk; a finishing chunk flushes a last
call left open and says `tool_calls` when any call went out; `logprobs` are always null on this path.
One difference in granularity, as on this engine's chat route: a tool call goes out whole once its
`</tool_call>` arrives, where vLLM sends its name first and then argument fragments.
"""

import time
from typing import Any

from aiohttp import web

from harness_rl.engine.chat_request import parses_tools
from harness_rl.engine.errors import ApiError, validation_error
from harness_rl.engine.hermes import HermesStream
from harness_rl.engine.request_params import check_model
from harness_rl.engine.server_context import usage
from harness_rl.engine.token_protocol import DerenderBody, StreamState

REPLACEMENT = "\ufffd"


def derender_chunk(engine: Any, body: DerenderBody) -> web.Response:
    generated = body.generate_chunk
    if generated is None:
        raise validation_error("body.generate_chunk", "missing", "Field required", "<the body>")
    check_model(body.model, engine.served_model_name)
    chat = body.chat_request
    if chat is None:
        raise ApiError(
            400,
            "chat_request is required when a tool or reasoning parser is configured because plain "
            "detokenization would leak raw parser markup into content.",
        )
    prompt = body.prompt_token_ids
    if prompt is None:
        raise ApiError(
            400,
            "prompt_token_ids is required when a tool or reasoning parser is configured. Without it parse_delta "
            "cannot tell whether the prompt left reasoning open (e.g. a chat template that pre-opens <think>) and "
            "would misclassify reasoning content as plain content.",
        )
    if len(generated.choices) > 1:
        raise ApiError(
            400, f"derender_chat_stream expects at most one choice per chunk (got {len(generated.choices)})."
        )
    state = body.stream_state or StreamState()
    new = sum(len(c.token_ids or ()) for c in generated.choices)
    if len(prompt) + len(state.output_token_ids) + new > engine.max_model_len:
        raise ApiError(
            400,
            f"prompt_token_ids length ({len(prompt)}) plus output_token_ids length ({len(state.output_token_ids)}) "
            f"plus delta ({new}) exceeds max_model_len ({engine.max_model_len}).",
        )
    if sum(state.output_chunk_lens) != len(state.output_token_ids) or min(state.output_chunk_lens, default=1) < 1:
        raise ApiError(400, "invalid stream_state: derender failed")
    parse_tools = parses_tools(chat)
    text = _Text(engine.tokenizer, state.output_token_ids)
    parser = HermesStream() if parse_tools else None
    done = 0
    for size in state.output_chunk_lens:  # replay: rebuild the parser as it stood after the last call
        done += size
        replayed = text.upto(done)
        if parser is not None:
            parser.feed(replayed)
    choices = []
    if generated.choices:
        choice = generated.choices[0]
        ids = choice.token_ids or []
        finished = choice.finish_reason is not None
        text.extend(ids)
        piece = text.upto(len(text.ids), final=finished)
        delta: dict[str, Any] = parser.feed(piece, final=finished) if parser is not None else {"content": piece}
        calls = delta.get("tool_calls") or []
        pinned = list(state.last_tool_call_ids)
        for call in calls:  # a call that already went out keeps the id it went out with
            if call["index"] < len(pinned):
                call["id"] = pinned[call["index"]]
            else:
                pinned.append(call["id"])
        message = {
            "role": None if state.role_sent else "assistant",
            "content": delta.get("content") or None,
            "reasoning": None,
        }
        if calls:
            message["tool_calls"] = calls
        finish = "tool_calls" if finished and (state.tools_streamed or calls) else choice.finish_reason
        choices.append(
            {
                "index": choice.index,
                "delta": message,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": choice.stop_reason,
                "token_ids": ids if chat.return_token_ids else None,
            }
        )
        state = StreamState(
            **{
                **_fields(state),
                "role_sent": True,
                "output_token_ids": [*state.output_token_ids, *ids],
                "output_chunk_lens": [*state.output_chunk_lens, len(ids)] if ids else state.output_chunk_lens,
                "tools_streamed": state.tools_streamed or bool(calls),
                "last_tool_call_ids": pinned,
            }
        )
    counted = None
    if generated.usage is not None:
        prompt_tokens = body.prompt_tokens if body.prompt_tokens is not None else generated.usage.prompt_tokens or 0
        counted = usage(prompt_tokens, generated.usage.completion_tokens or 0)
    chunk = {
        "id": generated.request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": body.model or engine.served_model_name,
        "choices": choices,
        "usage": counted,
        "system_fingerprint": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "metrics": None,
    }
    return web.json_response({"chunk": chunk, "stream_state": _fields(state)})


def _fields(state: StreamState) -> dict[str, Any]:
    return {name: getattr(state, name) for name in state.__struct_fields__}


class _Text:
    """The output's text as the ids grow, an unfinished character held back until its last byte arrives."""

    def __init__(self, tokenizer: Any, ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(ids)
        self.sent = 0  # characters handed out

    def extend(self, ids: list[int]) -> None:
        self.ids += ids

    def upto(self, count: int, final: bool = False) -> str:
        """The text the first `count` ids add since the last call."""
        decoded = self.tokenizer.decode(self.ids[:count], skip_special_tokens=False)
        if not final:
            decoded = decoded.rstrip(REPLACEMENT)
        piece = decoded[self.sent :]
        self.sent = max(self.sent, len(decoded))
        return piece
