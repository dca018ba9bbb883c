"""Anthropic Messages: the body decoded into a `ChatCall`, the `Answer` rendered as a Message
(its SSE events: `proxy.dialects.anthropic_stream`).

The engine has no token capture on its own Messages route, so the proxy terminates the dialect itself:
system blocks become one system message (Claude Code's per-request billing-header block is dropped so
prompts stay exact prefixes of each other), `tool_use` becomes `tool_calls`, `tool_result` becomes
`role: tool`, `thinking` becomes `reasoning`. Decoding is typed:
a missing `max_tokens`, an unknown content block or a malformed tool is a 400 naming the field.

Deliberate leniency: a `role: "system"` message inside `messages` (Claude Code sends one) is accepted
and joins the system prompt, and server tools (web search, ...) are dropped: they mean nothing to the engine.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any, Literal

import msgspec

from harness_rl.trace import ToolCall
from proxy.chat import (
    Answer,
    ChatCall,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDef,
    Knobs,
    MessageToolCall,
    ToolChoice,
    decode_typed,
)
from proxy.errors import ProxyError

BILLING_HEADER_PREFIX = "x-anthropic-billing-header"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}
TOOL_USE_PREFIX = "toolu_"
_ENCODER = msgspec.json.Encoder()


class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ImageBlock(msgspec.Struct, tag="image", tag_field="type"):
    source: Any = None


class DocumentBlock(msgspec.Struct, tag="document", tag_field="type"):
    source: Any = None


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: Any = {}


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: bool = False


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(msgspec.Struct, tag="redacted_thinking", tag_field="type"):
    data: str = ""


Block = TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class Message(msgspec.Struct):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(msgspec.Struct):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ToolChoiceBlock(msgspec.Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesBody(msgspec.Struct, kw_only=True):
    """The fields of a Messages request the proxy acts on."""

    model: str = ""
    messages: list[Message]
    max_tokens: int | None = None
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceBlock | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False


_KNOWN = frozenset(MessagesBody.__struct_fields__)
_BODY = msgspec.json.Decoder(MessagesBody)
_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])


def decode_body(data: bytes, *, accept_images: bool = False,
                count_only: bool = False) -> tuple[MessagesBody, list[str]]:
    """The typed body and the names of its fields the proxy does not act on (`metadata`, `thinking`, ...)."""
    body = decode_typed(_BODY, data)
    ignored = sorted(set(_KEYS.decode(data)) - _KNOWN)
    if body.max_tokens is None and not count_only:
        raise ProxyError(400, "max_tokens: Field required")
    if body.max_tokens is not None and body.max_tokens < 1:
        raise ProxyError(400, "max_tokens: must be at least 1")
    if not accept_images:
        for i, message in enumerate(body.messages):
            if _has_media(message.content):
                raise ProxyError(400, f"messages.{i}.content: the served model takes no images or documents, "
                                      "only text")
    return body, ignored


def _has_media(content: str | list[Block]) -> bool:
    if isinstance(content, str):
        return False
    for block in content:
        if isinstance(block, ImageBlock | DocumentBlock):
            return True
        if isinstance(block, ToolResultBlock) and not isinstance(block.content, str) and any(
                isinstance(b, ImageBlock | DocumentBlock) for b in block.content):
            return True
    return False


def to_call(body: MessagesBody, ignored: list[str]) -> ChatCall:
    return ChatCall(dialect="anthropic_messages", model=body.model, messages=chat_messages(body),
                    tools=chat_tools(body), tool_choice=_tool_choice(body.tool_choice) if body.tools else None,
                    knobs=Knobs(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                max_tokens=body.max_tokens, stop=body.stop_sequences or None),
                    stream=body.stream, ignored=ignored)


def _system_text(system: str | list[TextBlock] | list[Block] | None) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    return "\n".join(b.text for b in system
                     if isinstance(b, TextBlock) and not b.text.startswith(BILLING_HEADER_PREFIX))


def chat_messages(body: MessagesBody) -> list[ChatMessage]:
    """The Messages conversation as chat messages."""
    out: list[ChatMessage] = []
    system = _system_text(body.system)
    if system:
        out.append(ChatMessage(role="system", content=system))
    for message in body.messages:
        if message.role == "system":
            text = _system_text(message.content)
            if text:
                out.append(ChatMessage(role="system", content=text))
        elif message.role == "assistant":
            out.append(_assistant_message(message.content))
        else:
            out.extend(_user_messages(message.content))
    return out


def _assistant_message(content: str | list[Block]) -> ChatMessage:
    if isinstance(content, str):
        return ChatMessage(role="assistant", content=content)
    texts = [b.text for b in content if isinstance(b, TextBlock)]
    reasoning = [b.thinking for b in content if isinstance(b, ThinkingBlock)]
    calls = [MessageToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input,
                                                                                              ensure_ascii=False)))
             for b in content if isinstance(b, ToolUseBlock)]
    return ChatMessage(role="assistant", content="".join(texts) if texts or not calls else None,
                       reasoning="".join(reasoning) if reasoning else None, tool_calls=calls or None)


def _user_messages(content: str | list[Block]) -> list[ChatMessage]:
    """Tool results first (each right after the assistant turn that asked), then the user's own text."""
    if isinstance(content, str):
        return [ChatMessage(role="user", content=content)]
    out: list[ChatMessage] = []
    texts: list[str] = []
    for block in content:
        if isinstance(block, ToolResultBlock):
            text = block.content if isinstance(block.content, str) else \
                "\n".join(b.text for b in block.content if isinstance(b, TextBlock))
            if block.is_error:
                text = f"Error: {text}" if text else "Error"
            out.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=text))
        elif isinstance(block, TextBlock):
            texts.append(block.text)
    if texts:
        out.append(ChatMessage(role="user", content="\n".join(texts)))
    return out


def chat_tools(body: MessagesBody) -> list[ChatTool] | None:
    """Client tools as chat function tools (server tools such as web search have no engine meaning)."""
    tools = [ChatTool(function=FunctionDef(name=t.name, description=t.description or "",
                                           parameters=t.input_schema or {"type": "object"}))
             for t in body.tools or () if t.type in (None, "custom") and t.input_schema is not None]
    return tools or None


def _tool_choice(choice: ToolChoiceBlock | None) -> ToolChoice | None:
    if choice is None:
        return None
    if choice.type == "any":
        return "required"
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return choice.type


def signature_for(reasoning: str) -> str:
    """A stable stand-in for Anthropic's thinking signature, so clients can send thinking back."""
    return "hrl-" + hashlib.sha256(reasoning.encode()).hexdigest()[:32]


def tool_use_id(call: ToolCall) -> str:
    """The engine's tool-call id in Anthropic's `toolu_` form (`same_tool_call_id` undoes it)."""
    return call.id if call.id.startswith(TOOL_USE_PREFIX) else TOOL_USE_PREFIX + call.id


def tool_input(arguments: str) -> Any:
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {"raw_arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


def stop_reason(answer: Answer) -> str:
    return "tool_use" if answer.reply.tool_calls else STOP_REASONS.get(answer.finish_reason, "end_turn")


def message_dict(answer: Answer) -> dict[str, Any]:
    """The answer as a Messages API message."""
    reply = answer.reply
    blocks: list[dict[str, Any]] = []
    if reply.reasoning:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": signature_for(reply.reasoning)})
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    for call in reply.tool_calls:
        blocks.append({"type": "tool_use", "id": tool_use_id(call), "name": call.name,
                       "input": tool_input(call.arguments)})
    return {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": answer.model,
            "content": blocks, "stop_reason": stop_reason(answer), "stop_sequence": None,
            "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


def message(answer: Answer) -> bytes:
    return _ENCODER.encode(message_dict(answer))
