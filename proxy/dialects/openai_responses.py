"""OpenAI Responses: the body decoded into a `ChatCall`, the `Answer` rendered as a Response (its typed events:
`proxy.dialects.openai_responses_stream`).

`input` is a string or a list of items. Items are grouped into chat messages: `instructions` and
`developer` messages become system messages (chat templates render no developer role), `message`
items keep their role, a model turn's `reasoning`, assistant `message` and `function_call` items
become one assistant message, and each `function_call_output` a tool message. Tools are flat
function tools; `namespace` tools are flattened into their member functions and hosted tools
(`web_search`, `file_search`, ...) are dropped and named on the call as ignored.

Answers are rendered so that an agent echoing them back yields the very assistant message the
proxy answered with: the function call's `call_id` is the engine's tool-call id and its `arguments`
the engine's string, and a reasoning item carries its text in `encrypted_content`
(`proxy.dialects.opaque_reasoning`), which clients echo even when they drop the text. `previous_response_id`
is resolved within the agent's session (`ResponseMemory`); `store` is not acted on.
"""

from __future__ import annotations

import secrets
import time
import weakref
from typing import Any, Literal

import msgspec

from harness_rl.trace import ToolCall
from proxy.chat import (
    Answer,
    ChatCall,
    ChatMessage,
    ChatTool,
    ContentPart,
    FilePart,
    FunctionCall,
    FunctionDef,
    ImagePart,
    Knobs,
    MessageToolCall,
    TextPart,
    ToolChoice,
    assistant_message,
    decode_typed,
)
from proxy.dialects import opaque_reasoning
from proxy.errors import ProxyError

_ENCODER = msgspec.json.Encoder()


class InputText(msgspec.Struct, tag="input_text", tag_field="type"):
    text: str


class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    text: str


class Refusal(msgspec.Struct, tag="refusal", tag_field="type"):
    refusal: str


class InputImage(msgspec.Struct, tag="input_image", tag_field="type"):
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class InputFile(msgspec.Struct, tag="input_file", tag_field="type"):
    filename: str | None = None
    file_data: str | None = None
    file_id: str | None = None
    file_url: str | None = None


class SummaryText(msgspec.Struct, tag="summary_text", tag_field="type"):
    text: str


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type"):
    text: str


Part = InputText | OutputText | Refusal | InputImage | InputFile | ReasoningText


class Item(msgspec.Struct, kw_only=True):
    """One `input` item. Its kind is `type` (a bare `{role, content}` is a message); `check_body` says
    which fields each kind needs."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[Part] | None = None  # a message's parts, or a reasoning item's reasoning text
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[Part] | None = None
    summary: list[SummaryText] = []
    encrypted_content: str | None = None
    status: str | None = None


class Tool(msgspec.Struct, kw_only=True):
    """A flat function tool, a `namespace` of them, or a hosted tool (dropped)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[Tool] | None = None


class NamedToolChoice(msgspec.Struct):
    type: Literal["function"]
    name: str


class ResponsesBody(msgspec.Struct, kw_only=True):
    """The fields of a Responses request the proxy acts on."""

    model: str = ""
    input: str | list[Item]
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    previous_response_id: str | None = None


_KNOWN = frozenset(ResponsesBody.__struct_fields__)
_BODY = msgspec.json.Decoder(ResponsesBody)
_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_NEEDS = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
          "function_call_output": ("call_id", "output"), "reasoning": ()}


def decode_body(data: bytes, *, accept_images: bool = False) -> tuple[ResponsesBody, list[str]]:
    """The typed body and the names of the fields it carries that the proxy does not act on."""
    body = decode_typed(_BODY, data)
    check_body(body, accept_images=accept_images)
    hosted = sorted({"tools." + t.type for t in _all_tools(body.tools) if t.type != "function"})  # dropped
    return body, sorted(set(_KEYS.decode(data)) - _KNOWN) + hosted


def check_body(body: ResponsesBody, *, accept_images: bool) -> None:
    """What typing cannot say: each item kind's required fields, media the model cannot take, limits."""
    items = [] if isinstance(body.input, str) else body.input
    if not items and not isinstance(body.input, str) and body.previous_response_id is None:
        raise ProxyError(400, "input: must be a string or a non-empty array of items")
    for i, item in enumerate(items):
        for name in _NEEDS[item.type]:
            if getattr(item, name) is None:
                raise ProxyError(400, f"input[{i}].{name}: required for a {item.type} item")
        parts = [*(item.content if isinstance(item.content, list) else ()),
                 *(item.output if isinstance(item.output, list) else ())]
        if not accept_images and any(isinstance(p, InputImage | InputFile) for p in parts):
            raise ProxyError(400, f"input[{i}]: the served model takes no images or files, only text")
    if any(tool.type == "function" and not tool.name for tool in _all_tools(body.tools)):
        raise ProxyError(400, "tools: every function tool needs a name")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise ProxyError(400, "max_output_tokens: must be at least 1")


def _all_tools(tools: list[Tool] | None) -> list[Tool]:
    """Every tool, a namespace's members in its place."""
    out: list[Tool] = []
    for tool in tools or ():
        out.extend(_all_tools(tool.tools) if tool.type == "namespace" else [tool])
    return out


def to_call(body: ResponsesBody, ignored: list[str],
            history: list[ChatMessage]) -> tuple[ChatCall, list[ChatMessage]]:
    """The neutral call, and the conversation it continues without `instructions` (which, as OpenAI
    defines them, do not carry over to a later `previous_response_id`)."""
    conversation = history + chat_messages(body.input)
    system = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    tools = [ChatTool(function=FunctionDef(name=t.name or "", description=t.description, parameters=t.parameters,
                                           strict=t.strict))
             for t in _all_tools(body.tools) if t.type == "function"]
    choice: ToolChoice | None = body.tool_choice if isinstance(body.tool_choice, str) else \
        {"type": "function", "function": {"name": body.tool_choice.name}} if body.tool_choice else None
    call = ChatCall(dialect="openai_responses", model=body.model, messages=system + conversation, tools=tools or None,
                    tool_choice=choice if tools else None, stream=body.stream, ignored=ignored,
                    knobs=Knobs(temperature=body.temperature, top_p=body.top_p, max_tokens=body.max_output_tokens))
    return call, conversation


def chat_messages(input: str | list[Item]) -> list[ChatMessage]:
    """The items as chat messages: a model turn's consecutive reasoning, text and calls make one message."""
    if isinstance(input, str):
        return [ChatMessage(role="user", content=input)]
    out: list[ChatMessage] = []
    turn: ChatMessage | None = None  # the assistant message being assembled
    for item in input:
        if item.type == "function_call_output":
            turn = None
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=_content(item.output)))
        elif item.type == "message" and item.role != "assistant":
            turn = None
            out.append(ChatMessage(role="system" if item.role == "developer" else item.role or "user",
                                   content=_content(item.content)))
        else:  # a model turn's item: a new turn starts unless it is a call following the turn's text or calls
            if turn is None or (item.type != "function_call" and (turn.content is not None or turn.tool_calls)):
                turn = ChatMessage(role="assistant")
                out.append(turn)
            _add_to_turn(turn, item)
    return out


def _add_to_turn(turn: ChatMessage, item: Item) -> None:
    if item.type == "reasoning":
        text = opaque_reasoning.unwrap(item.encrypted_content)
        if text is None:  # not ours: the raw reasoning if the client kept it, else its summary
            parts = item.content if isinstance(item.content, list) and item.content else item.summary
            text = "".join(p.text for p in parts if isinstance(p, ReasoningText | SummaryText)) or None
        if text is not None:
            turn.reasoning = (turn.reasoning or "") + text
    elif item.type == "message":
        turn.content = _text(item.content)
    else:
        call = MessageToolCall(id=item.call_id or "", function=FunctionCall(name=item.name or "",
                                                                            arguments=item.arguments or ""))
        turn.tool_calls = [*(turn.tool_calls or ()), call]


def _text(content: str | list[Part] | None) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    return "".join(p.text if isinstance(p, InputText | OutputText) else p.refusal if isinstance(p, Refusal) else ""
                   for p in content)


def _content(content: str | list[Part] | None) -> str | list[ContentPart]:
    """User, system and tool content: a string, or the parts as chat content parts (one text part is a string)."""
    if isinstance(content, str) or content is None:
        return content or ""
    parts: list[ContentPart] = []
    for p in content:
        if isinstance(p, InputText | OutputText | ReasoningText):
            parts.append(TextPart(p.text))
        elif isinstance(p, Refusal):
            parts.append(TextPart(p.refusal))
        elif isinstance(p, InputImage):
            parts.append(ImagePart({"url": p.image_url, "detail": p.detail or "auto"}))
        else:
            parts.append(FilePart({k: v for k, v in msgspec.structs.asdict(p).items() if v is not None}))
    if len(parts) == 1 and isinstance(parts[0], TextPart):
        return parts[0].text
    return parts


class ResponseMemory:
    """Each session's answered responses by id, with the conversation each one ended on, so that a later
    request can continue from `previous_response_id`. Held weakly per session: it goes with the session."""

    def __init__(self) -> None:
        self._by_session: weakref.WeakKeyDictionary[object, dict[str, list[ChatMessage]]] = \
            weakref.WeakKeyDictionary()

    def history(self, session: object, response_id: str | None) -> list[ChatMessage]:
        if response_id is None:
            return []
        found = self._by_session.get(session, {}).get(response_id)
        if found is None:
            raise ProxyError(404, f"previous_response_id: no response {response_id!r} in this session")
        return list(found)

    def remember(self, session: object, conversation: list[ChatMessage], answer: Answer) -> None:
        """Keep the conversation an answer completes under the answer's id (a `new_response_id`)."""
        self._by_session.setdefault(session, {})[answer.id] = [*conversation, assistant_message(answer.reply)]


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(16)


# ---------------------------------------------------------------------------------------------- rendering


def reasoning_item(key: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{key}", "summary": [{"type": "summary_text", "text": text}],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": opaque_reasoning.wrap(text)}


def message_item(key: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{key}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(key: str, index: int, call: ToolCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{key}_{index}", "status": status, "call_id": call.id,
            "name": call.name, "arguments": call.arguments}


def output_items(answer: Answer) -> list[dict[str, Any]]:
    """The answer's output items: reasoning, then the message, then each function call."""
    reply, key = answer.reply, answer.id.removeprefix("resp_")
    status = "incomplete" if answer.finish_reason == "length" else "completed"
    items = [reasoning_item(key, reply.reasoning)] if reply.reasoning else []
    if reply.content or not (reply.tool_calls or reply.reasoning):
        items.append(message_item(key, reply.content or "", status))
    return items + [call_item(key, i, call, status) for i, call in enumerate(reply.tool_calls)]


def response_dict(answer: Answer, call: ChatCall, output: list[dict[str, Any]] | None = None,
                  status: str | None = None) -> dict[str, Any]:
    """The Response object; `output` and `status` override the finished answer's (for the opening events)."""
    incomplete = answer.finish_reason == "length"
    done = status is None
    choice = call.tool_choice
    return {
        "id": answer.id, "object": "response", "created_at": answer.created,
        "status": status or ("incomplete" if incomplete else "completed"), "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete and done else None,
        "instructions": None, "max_output_tokens": call.knobs.max_tokens, "model": answer.model,
        "output": output_items(answer) if output is None else output, "parallel_tool_calls": True,
        "previous_response_id": None, "reasoning": None, "store": False,
        "temperature": call.knobs.temperature, "top_p": call.knobs.top_p, "text": {"format": {"type": "text"}},
        "tool_choice": choice["function"] | {"type": "function"} if isinstance(choice, dict) else choice or "auto",
        "tools": [{"type": "function", **msgspec.to_builtins(t.function)} for t in call.tools or ()],
        "truncation": "disabled", "metadata": {}, "user": None,
        "usage": {"input_tokens": answer.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": answer.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": answer.prompt_tokens + answer.completion_tokens} if done else None,
    }


def response(answer: Answer, call: ChatCall) -> bytes:
    """The non-streaming answer."""
    return _ENCODER.encode(response_dict(answer, call))


def stream_error(exc: ProxyError) -> bytes:
    """A failure after the stream opened: `response.failed`, whose error codex turns into its own
    (rate limits are retried, the rest end the turn)."""
    code = "rate_limit_exceeded" if exc.status == 429 else "server_error" if exc.status >= 500 else "invalid_prompt"
    failed = {"id": new_response_id(), "object": "response", "created_at": int(time.time()),
              "status": "failed",
              "error": {"code": code, "message": exc.message}, "incomplete_details": None, "output": [],
              "usage": None}
    body = {"type": "response.failed", "sequence_number": 0, "response": failed}
    return b"event: response.failed\ndata: " + _ENCODER.encode(body) + b"\n\n"
