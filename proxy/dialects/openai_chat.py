"""OpenAI Chat Completions: the agent's body decoded into a `ChatCall`, the `Answer` rendered back.

The body is decoded once into typed Structs: a wrong type, an unknown role, content that is neither a
string nor content parts, a malformed tool or a non-boolean `logprobs` is a 400 naming the field, as
OpenAI answers. Fields the proxy does not act on (`user`, `metadata`, `logit_bias`, ...) are not sent
to the engine; their names are kept on the call and recorded with the turn. The answer never carries
the engine's capture fields (token ids) unless the agent asked for logprobs.
"""

from __future__ import annotations

from typing import Any

import msgspec

from proxy.chat import (
    Answer,
    ChatCall,
    ChatMessage,
    ChatTool,
    ImagePart,
    Knobs,
    TextPart,
    ToolChoice,
    decode_typed,
)
from proxy.errors import ProxyError

_ENCODER = msgspec.json.Encoder()


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class _Message(ChatMessage, omit_defaults=True):
    """A chat message as agents send it: `reasoning_content` is accepted as the older name of `reasoning`."""

    reasoning_content: str | None = None


class ChatCompletionsBody(Knobs, kw_only=True):
    """The fields of a Chat Completions request the proxy acts on (the sampling knobs come from `Knobs`)."""

    model: str = ""
    messages: list[_Message]
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None  # type: ignore[assignment]  # OpenAI also takes one string
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None


_KNOWN = frozenset(ChatCompletionsBody.__struct_fields__)
_BODY = msgspec.json.Decoder(ChatCompletionsBody)
_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])


def decode_body(data: bytes, *, accept_images: bool = False) -> tuple[ChatCompletionsBody, list[str]]:
    """The typed body and the names of the fields it carries that the proxy does not act on."""
    body = decode_typed(_BODY, data)
    ignored = sorted(set(_KEYS.decode(data)) - _KNOWN)
    check_body(body, accept_images=accept_images)
    return body, ignored


def check_body(body: ChatCompletionsBody, *, accept_images: bool) -> None:
    """What typing cannot say: each role's required fields, limits, and knobs that need each other."""
    if not body.messages:
        raise ProxyError(400, "messages: must be a non-empty array of message objects")
    for i, message in enumerate(body.messages):
        if message.role in ("system", "developer", "user", "tool") and message.content is None:
            raise ProxyError(400, f"messages[{i}].content: required for role '{message.role}'")
        if message.role == "tool" and not message.tool_call_id:
            raise ProxyError(400, f"messages[{i}].tool_call_id: required for role 'tool'")
        if message.role == "assistant" and message.content is None and not message.tool_calls:
            raise ProxyError(400, f"messages[{i}]: an assistant message needs content or tool_calls")
        if isinstance(message.content, list) and not accept_images and any(
                not isinstance(part, TextPart) for part in message.content):
            kind = "images" if any(isinstance(p, ImagePart) for p in message.content) else "audio or files"
            raise ProxyError(400, f"messages[{i}].content: the served model takes no {kind}, only text")
    if body.tool_choice is not None and not body.tools:
        raise ProxyError(400, "tool_choice: only allowed when tools are specified")
    if body.n is not None and body.n != 1:
        raise ProxyError(400, f"n: {body.n} is not supported; each turn must be one sample (n=1)")
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(body, name)
        if value is not None and value < 1:
            raise ProxyError(400, f"{name}: must be at least 1")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise ProxyError(400, "top_logprobs: must be between 0 and 20")


def to_call(body: ChatCompletionsBody, ignored: list[str]) -> ChatCall:
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    messages = [ChatMessage(role=m.role, content=m.content, name=m.name, tool_calls=m.tool_calls,
                            tool_call_id=m.tool_call_id, reasoning=m.reasoning if m.reasoning is not None
                            else m.reasoning_content) for m in body.messages]
    knobs = Knobs(**{name: getattr(body, name) for name in Knobs.__struct_fields__})
    return ChatCall(
        dialect="openai_chat", model=body.model, messages=messages, tools=body.tools or None,
        tool_choice=body.tool_choice if body.tools else None,
        knobs=msgspec.structs.replace(knobs, max_tokens=max_tokens, stop=stop),
        chat_template_kwargs=body.chat_template_kwargs, stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        logprobs=bool(body.logprobs), ignored=ignored)


def message_dict(answer: Answer) -> dict[str, Any]:
    """The assistant message in OpenAI's shape, reasoning under both names agents read."""
    reply = answer.reply
    out: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.reasoning:
        out["reasoning"] = reply.reasoning
        out["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in reply.tool_calls]
    return out


def logprobs_block(answer: Answer) -> dict[str, Any] | None:
    if answer.logprobs is None:
        return None
    return {"content": [{"token": f"token_id:{t.token_id}", "logprob": t.logprob, "bytes": None, "top_logprobs": []}
                        for t in answer.logprobs]}


def usage(answer: Answer) -> dict[str, int]:
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
            "total_tokens": answer.prompt_tokens + answer.completion_tokens}


def completion(answer: Answer) -> bytes:
    """The non-streaming answer."""
    return _ENCODER.encode({
        "id": answer.id, "object": "chat.completion", "created": answer.created, "model": answer.model,
        "choices": [{"index": 0, "message": message_dict(answer), "logprobs": logprobs_block(answer),
                     "finish_reason": answer.finish_reason}],
        "usage": usage(answer),
    })
