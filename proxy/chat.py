"""The dialect-neutral model call: every dialect's request becomes a `ChatCall`, every answer is one `Answer`.

The neutral form is OpenAI Chat Completions, the language the engine speaks: messages, tools and the
sampling knobs the agent asked for, decoded once into Structs at the edge. Each dialect module
(`openai_chat`, `anthropic`, `openai_responses`, `gemini`) turns its own body into a `ChatCall` and renders
the one `Answer` back.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from harness_rl.trace import Reply
from proxy.errors import ProxyError

Role = Literal["system", "developer", "user", "assistant", "tool"]


class TextPart(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ImagePart(msgspec.Struct, tag="image_url", tag_field="type"):
    image_url: Any


class AudioPart(msgspec.Struct, tag="input_audio", tag_field="type"):
    input_audio: Any


class FilePart(msgspec.Struct, tag="file", tag_field="type"):
    file: Any


ContentPart = TextPart | ImagePart | AudioPart | FilePart


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str = ""


class MessageToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, omit_defaults=True):
    """One message as the engine's chat template receives it."""

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None


class FunctionDef(msgspec.Struct, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True):
    """A tool as the template renders it: `type` first, as every agent sends it."""

    type: Literal["function"] = "function"
    function: FunctionDef


ToolChoice = Literal["auto", "none", "required"] | dict[str, Any]


class Knobs(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The sampling knobs an agent may send; the proxy's sampling policy decides what reaches the engine."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None = None  # a 64-bit signed int, as OpenAI's
    stop: list[str] | None = None


Dialect = Literal["openai_chat", "anthropic_messages", "openai_responses", "google_gemini"]


class ChatCall(msgspec.Struct, kw_only=True):
    """One agent model call, dialect-neutral: what goes to the engine and how the agent wants its answer."""

    dialect: Dialect
    model: str  # the name the agent used; answers carry it back
    messages: list[ChatMessage]
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    knobs: Knobs = msgspec.field(default_factory=Knobs)
    chat_template_kwargs: dict[str, Any] | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    ignored: list[str] = []  # fields of the agent's body the proxy does not act on (named on the turn)


class SampledToken(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class Answer(msgspec.Struct, kw_only=True):
    """The one answer every dialect renders: the parsed reply, why it ended, and its exact token counts."""

    id: str
    created: int
    model: str
    reply: Reply
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[SampledToken] | None = None  # only when the agent asked for them


def assistant_message(reply: Reply) -> ChatMessage:
    """A reply as the assistant message an agent sends back: no content beside tool calls when it was empty."""
    calls = [MessageToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in reply.tool_calls]
    content = reply.content if reply.content or not calls else None
    return ChatMessage(role="assistant", content=content, tool_calls=calls or None, reasoning=reply.reasoning or None)


def text_of(content: str | list[ContentPart] | None) -> str:
    """A message's text: the string itself, or its text parts joined (other parts have no text)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content if isinstance(part, TextPart))


def decode_typed(decoder: msgspec.json.Decoder, data: bytes) -> Any:
    """Decode an agent's JSON body; a syntax or type error is a 400 naming the field (`messages[0].content`)."""
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise ProxyError(400, f"invalid request: {_readable(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise ProxyError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ProxyError(400, "the request's JSON is nested too deeply") from None


def _readable(message: str) -> str:
    """msgspec's "Expected `str`, got `int` - at `$.messages[0].content`" as "messages[0].content: expected ..."."""
    text, _, where = message.partition(" - at `$")
    text = text.replace("`", "")
    text = text[:1].lower() + text[1:]
    return f"{where.rstrip('`').lstrip('.')}: {text}" if where else text
