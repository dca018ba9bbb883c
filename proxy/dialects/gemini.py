"""Google Gemini generateContent: the body decoded into a `ChatCall`, the `Answer` rendered as a
GenerateContentResponse (its SSE chunks: `proxy.dialects.gemini_stream`).

`systemInstruction` becomes the system message, each `user` content its tool results (one tool
message per `functionResponse`, right after the model turn that called) and then its text, each
`model` content one assistant message: thought parts are its reasoning, text parts its content,
`functionCall` parts its tool calls (arguments as JSON text). Function declarations give their
schema as `parametersJsonSchema` (gemini-cli) or as Google's `parameters` Schema, whose upper-case
type names are lowered to JSON Schema's. `generationConfig`'s sampling fields become the knobs;
hosted tools (Google Search, code execution, ...) are dropped and named on the call as ignored.

Answers are rendered so an agent echoing them yields the assistant message the proxy answered with:
each `functionCall` carries the engine's tool-call id, and the reasoning is also sealed into the
`thoughtSignature` of the answer's first call, else its text (`proxy.dialects.opaque_reasoning`), because
gemini-cli drops thought parts from its history but keeps signatures. A call echoed without an id
keeps none (an empty id, which reply matching skips); a `functionResponse` without an id answers
the oldest open call of that name.
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from typing import Any, Literal

import msgspec

from harness_rl.trace import ToolCall
from proxy.chat import (
    Answer,
    ChatCall,
    ChatMessage,
    ChatTool,
    ContentPart,
    FunctionCall,
    FunctionDef,
    ImagePart,
    Knobs,
    MessageToolCall,
    TextPart,
    ToolChoice,
    decode_typed,
)
from proxy.dialects import opaque_reasoning
from proxy.errors import ProxyError, error_body

FINISH_REASONS = {"length": "MAX_TOKENS"}  # every other ending, tool calls included, is STOP in Gemini
_ENCODER = msgspec.json.Encoder()


class Call(msgspec.Struct, omit_defaults=True):
    name: str
    args: dict[str, Any] = {}
    id: str | None = None


class CallResult(msgspec.Struct, omit_defaults=True):
    name: str
    response: dict[str, Any] = {}
    id: str | None = None


class Blob(msgspec.Struct, rename="camel"):
    mime_type: str
    data: str


class FileData(msgspec.Struct, rename="camel"):
    file_uri: str
    mime_type: str | None = None


class Part(msgspec.Struct, rename="camel", kw_only=True):
    """One part: exactly one of its data fields is set (`check_body`)."""

    text: str | None = None
    thought: bool = False
    thought_signature: str | None = None
    function_call: Call | None = None
    function_response: CallResult | None = None
    inline_data: Blob | None = None
    file_data: FileData | None = None
    executable_code: Any = None
    code_execution_result: Any = None


DATA_FIELDS = ("text", "function_call", "function_response", "inline_data", "file_data", "executable_code",
               "code_execution_result")


class Content(msgspec.Struct):
    parts: list[Part] = []
    role: Literal["user", "model", "function"] | None = None


class FunctionDeclaration(msgspec.Struct, rename="camel", kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    parameters_json_schema: dict[str, Any] | None = None


class Tool(msgspec.Struct, rename="camel", kw_only=True):
    function_declarations: list[FunctionDeclaration] | None = None
    google_search: Any = None
    google_search_retrieval: Any = None
    code_execution: Any = None
    url_context: Any = None
    file_search: Any = None
    google_maps: Any = None
    computer_use: Any = None
    retrieval: Any = None
    enterprise_web_search: Any = None


HOSTED_TOOLS = {name: json_name for name, json_name in zip(Tool.__struct_fields__, Tool.__struct_encode_fields__,
                                                            strict=True) if name != "function_declarations"}


class FunctionCallingConfig(msgspec.Struct, rename="camel", kw_only=True):
    mode: Literal["AUTO", "ANY", "NONE", "VALIDATED", "MODE_UNSPECIFIED"] = "AUTO"
    allowed_function_names: list[str] | None = None


class ToolConfig(msgspec.Struct, rename="camel", kw_only=True):
    function_calling_config: FunctionCallingConfig | None = None


class GenerationConfig(msgspec.Struct, rename="camel", kw_only=True):
    """The sampling fields of `generationConfig` the proxy acts on; the rest are named as ignored."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_output_tokens: int | None = None
    stop_sequences: list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    candidate_count: int | None = None


class GenerateBody(msgspec.Struct, rename="camel", kw_only=True):
    """The fields of a generateContent request the proxy acts on."""

    contents: list[Content] = []
    system_instruction: Content | str | None = None
    tools: list[Tool] | None = None
    tool_config: ToolConfig | None = None
    generation_config: GenerationConfig | None = None


class CountBody(GenerateBody, rename="camel", kw_only=True):
    """countTokens: the contents directly, or a whole `generateContentRequest`."""

    generate_content_request: GenerateBody | None = None


class _Keys(msgspec.Struct, rename="camel"):
    generation_config: dict[str, msgspec.Raw] = {}


_KNOWN = frozenset(GenerateBody.__struct_encode_fields__)
_CONFIG_KNOWN = frozenset(GenerationConfig.__struct_encode_fields__)
_BODY = msgspec.json.Decoder(GenerateBody)
_COUNT = msgspec.json.Decoder(CountBody)
_TOP_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_CONFIG_KEYS = msgspec.json.Decoder(_Keys)
SNAKE_CASE = {"system_instruction": "systemInstruction", "generation_config": "generationConfig",
              "tool_config": "toolConfig"}


def decode_body(data: bytes, *, accept_images: bool = False) -> tuple[GenerateBody, list[str]]:
    """The typed body and the names of its fields the proxy does not act on (`safetySettings`,
    `generationConfig.thinkingConfig`, hosted tools as `tools.googleSearch`, ...)."""
    body = decode_typed(_BODY, data)
    keys = set(_TOP_KEYS.decode(data))
    for snake, camel in SNAKE_CASE.items():
        if snake in keys:
            raise ProxyError(400, f"{snake}: send it as {camel} (the proxy reads the camelCase JSON names)")
    check_body(body, accept_images=accept_images)
    config = sorted("generationConfig." + k for k in set(_CONFIG_KEYS.decode(data).generation_config) - _CONFIG_KNOWN)
    hosted = sorted({"tools." + json_name for tool in body.tools or () for name, json_name in HOSTED_TOOLS.items()
                     if getattr(tool, name) is not None})
    return body, sorted(keys - _KNOWN) + config + hosted


def decode_count_body(data: bytes, *, accept_images: bool = False) -> GenerateBody:
    body: CountBody = decode_typed(_COUNT, data)
    inner = body.generate_content_request or GenerateBody(
        contents=body.contents, system_instruction=body.system_instruction, tools=body.tools)
    check_body(inner, accept_images=accept_images)
    return inner


def check_body(body: GenerateBody, *, accept_images: bool) -> None:
    """What typing cannot say: one data field per part, media the model cannot take, one candidate."""
    if not body.contents:
        raise ProxyError(400, "contents: must be a non-empty array of contents")
    for i, content in enumerate(body.contents):
        for j, part in enumerate(content.parts):
            present = [name for name in DATA_FIELDS if getattr(part, name) is not None]
            where = f"contents[{i}].parts[{j}]"
            if len(present) != 1:
                raise ProxyError(400, f"{where}: a part holds exactly one of text, functionCall, functionResponse, "
                                      f"inlineData or fileData (found {len(present) or 'none'})")
            if present[0] in ("executable_code", "code_execution_result"):
                raise ProxyError(400, f"{where}: code execution is not served by this model")
            if present[0] in ("inline_data", "file_data") and not accept_images:
                raise ProxyError(400, f"{where}: the served model takes no images or files, only text")
    config = body.generation_config
    if config is not None and config.candidate_count not in (None, 1):
        raise ProxyError(400, f"generationConfig.candidateCount: {config.candidate_count} is not supported; "
                              "each turn must be one sample")
    if config is not None and config.max_output_tokens is not None and config.max_output_tokens < 1:
        raise ProxyError(400, "generationConfig.maxOutputTokens: must be at least 1")


def to_call(body: GenerateBody, ignored: list[str], *, model: str, stream: bool) -> ChatCall:
    config = body.generation_config or GenerationConfig()
    tools = chat_tools(body)
    knobs = Knobs(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                  max_tokens=config.max_output_tokens, stop=config.stop_sequences or None, seed=config.seed,
                  presence_penalty=config.presence_penalty, frequency_penalty=config.frequency_penalty)
    return ChatCall(dialect="google_gemini", model=model, messages=chat_messages(body), tools=tools,
                    tool_choice=_tool_choice(body.tool_config) if tools else None, knobs=knobs, stream=stream,
                    ignored=ignored)


def chat_messages(body: GenerateBody) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    system = body.system_instruction
    text = system if isinstance(system, str) else "\n".join(p.text for p in system.parts if p.text) if system else ""
    if text:
        out.append(ChatMessage(role="system", content=text))
    open_calls: defaultdict[str, deque[str]] = defaultdict(deque)  # unanswered call ids by function name
    for content in body.contents:
        if content.role == "model":
            message = _assistant_message(content.parts)
            for call in message.tool_calls or ():
                open_calls[call.function.name].append(call.id)
            out.append(message)
        else:
            out.extend(_user_messages(content.parts, open_calls))
    return out


def _assistant_message(parts: list[Part]) -> ChatMessage:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[MessageToolCall] = []
    for part in parts:
        if part.text is not None:
            (thoughts if part.thought else texts).append(part.text)
        elif part.function_call is not None:
            call = part.function_call
            function = FunctionCall(call.name, json.dumps(call.args, ensure_ascii=False))
            calls.append(MessageToolCall(id=call.id or "", function=function))  # no id: none to match on
    sealed = (opaque_reasoning.unwrap(p.thought_signature) for p in parts)
    reasoning = "".join(thoughts) if thoughts else next((r for r in sealed if r is not None), None)
    return ChatMessage(role="assistant", content="".join(texts) if texts or not calls else None,
                       reasoning=reasoning or None, tool_calls=calls or None)


def _user_messages(parts: list[Part], open_calls: defaultdict[str, deque[str]]) -> list[ChatMessage]:
    """Tool results first (each right after the model turn that called), then the user's own parts."""
    out: list[ChatMessage] = []
    own: list[ContentPart] = []
    for part in parts:
        result = part.function_response
        if result is not None:
            pending = open_calls[result.name]
            call_id = result.id or (pending[0] if pending else "")
            if call_id in pending:
                pending.remove(call_id)
            out.append(ChatMessage(role="tool", tool_call_id=call_id, content=_result_text(result.response)))
        elif part.text is not None:
            own.append(TextPart(part.text))
        elif part.inline_data is not None:
            own.append(ImagePart({"url": f"data:{part.inline_data.mime_type};base64,{part.inline_data.data}"}))
        elif part.file_data is not None:
            own.append(ImagePart({"url": part.file_data.file_uri}))
    if own:
        only = own[0] if len(own) == 1 else None
        out.append(ChatMessage(role="user", content=only.text if isinstance(only, TextPart) else own))
    return out


def _result_text(response: dict[str, Any]) -> str:
    """A function's result as the tool message's text: its lone `output` (or `error`) string, else its JSON."""
    if len(response) == 1 and isinstance(response.get("output"), str):
        return str(response["output"])
    if len(response) == 1 and isinstance(response.get("error"), str):
        return f"Error: {response['error']}"
    return json.dumps(response, ensure_ascii=False)


def chat_tools(body: GenerateBody) -> list[ChatTool] | None:
    tools = [ChatTool(function=FunctionDef(
        name=d.name, description=d.description,
        parameters=d.parameters_json_schema if d.parameters_json_schema is not None
        else _json_schema(d.parameters) if d.parameters is not None else {"type": "object", "properties": {}}))
        for tool in body.tools or () for d in tool.function_declarations or ()]
    return tools or None


def _json_schema(schema: Any) -> Any:
    """Google's OpenAPI-style Schema as JSON Schema: type names lower-cased, everything else kept."""
    if isinstance(schema, list):
        return [_json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            out[key] = value.lower()
        elif key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {name: _json_schema(s) for name, s in value.items()}
        elif key in ("items", "anyOf", "oneOf", "allOf", "additionalProperties", "not"):
            out[key] = _json_schema(value)
        else:
            out[key] = value
    return out


def _tool_choice(config: ToolConfig | None) -> ToolChoice | None:
    calling = config.function_calling_config if config else None
    if calling is None:
        return None
    if calling.mode == "NONE":
        return "none"
    if calling.mode == "ANY":
        names = calling.allowed_function_names or []
        return {"type": "function", "function": {"name": names[0]}} if len(names) == 1 else "required"
    return "auto"


# ---------------------------------------------------------------------------------------------- rendering


def _arguments(arguments: str) -> dict[str, Any]:
    """`args` must be an object: the engine's JSON text, or that text under `raw_arguments` when it is not one."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {"raw_arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


def call_part(call: ToolCall) -> dict[str, Any]:
    return {"functionCall": {"id": call.id, "name": call.name, "args": _arguments(call.arguments)}}


def answer_parts(answer: Answer) -> list[dict[str, Any]]:
    """The reply as parts: a thought, the text, each function call. The reasoning is also the signature of
    the first call (where Gemini puts one, and gemini-cli keeps it), else of the text, else of the thought."""
    reply = answer.reply
    thought: list[dict[str, Any]] = [{"text": reply.reasoning, "thought": True}] if reply.reasoning else []
    text: list[dict[str, Any]] = [{"text": reply.content}] if reply.content else []
    calls = [call_part(c) for c in reply.tool_calls]
    if reply.reasoning:
        (calls or text or thought)[0]["thoughtSignature"] = opaque_reasoning.wrap(reply.reasoning)
    return thought + text + calls


def chunk(response_id: str, model: str, parts: list[dict[str, Any]], last: Answer | None = None) -> dict[str, Any]:
    """One GenerateContentResponse; the last of a stream (or the whole answer) says why it ended and its usage."""
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    out: dict[str, Any] = {"candidates": [candidate]}
    if last is not None:
        candidate["finishReason"] = FINISH_REASONS.get(last.finish_reason, "STOP")
        out["usageMetadata"] = {"promptTokenCount": last.prompt_tokens, "candidatesTokenCount": last.completion_tokens,
                                "totalTokenCount": last.prompt_tokens + last.completion_tokens}
    out["modelVersion"] = model
    out["responseId"] = response_id
    return out


def response(answer: Answer) -> bytes:
    """The non-streaming answer."""
    return _ENCODER.encode(chunk(answer.id, answer.model, answer_parts(answer), answer))


def stream_error(exc: ProxyError) -> bytes:
    """A failure after the stream opened, as Google sends one and both SDKs raise it: the bare error object."""
    return _ENCODER.encode(error_body("google", exc.status, exc.message)) + b"\n"
