"""Prompt ids rendered in the proxy itself, with the served model's own tokenizer and chat template.

Rendering here saves the engine one round trip on every call (generate → derender, no render first)
and keeps that work out of vLLM's API server, which every agent of a run shares. It follows vLLM 0.32's
chat path: messages as its chat parser hands them to the template (text parts joined, or kept as parts,
by the template's content format; tool-call arguments parsed from their JSON; reasoning as `reasoning`
and `reasoning_content`; tool results' text parts joined), tools as `{type, function: {name,
description, parameters}}`, the template run in transformers' sandboxed jinja environment with the
tokenizer's named special tokens, and the text encoded without special tokens by the `tokenizers`
library: no torch, no transformers.

What it cannot follow exactly it declines (images and other non-text parts, developer messages, a
system prompt carrying Claude Code's billing line), and the engine renders that call. Before its first
use, one probe conversation is rendered by the engine and here, in both content formats: the format
that agrees is the engine's, and when neither agrees (another template, a `--chat-template` or
`--default-chat-template-kwargs` on the server, a tokenizer.json that is not what transformers loads)
the proxy never renders locally. Then a whole conversation rendered here is compared with the engine's
rendering when it has a shape no compared conversation had (`shape_of`: the messages' roles and kinds of
content, next to which others, with which tools and template arguments), else one in `CHECK_EVERY`;
a spliced turn's new messages while the first `WARMUP_CHECKS` renders are made, then as `proxy.capture.prompts`
samples them. One disagreement turns it off. An agent's conversation keeps to a few shapes, so after its
first turns the hot path is two engine calls (generate, derender); the rare sample is there for what a
shape does not show (text the two tokenizers would split differently).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections import OrderedDict
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import msgspec

from proxy.chat import ChatMessage
from proxy.errors import ProxyError
from proxy.tokens import token_text
from proxy.upstream.client import ChatRender, EngineClient, Rendered

log = logging.getLogger(__name__)
ContentFormat = Literal["string", "openai"]
Shape = tuple[Any, ...]  # one message's kinds of content and the one's before it, under the tools and arguments
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
WARMUP_CHECKS = 8
CHECK_EVERY = 256
PIECES_KEPT = 8192  # encoded text pieces (the text between added tokens) kept for reuse
TOOL_LISTS_KEPT = 16  # agents' tool lists kept shaped for the template
BILLING_HEADER = "x-anthropic-billing-header"  # vLLM drops this line from a system prompt
TEMPLATE_ARGUMENTS = frozenset({"tools", "documents", "add_generation_prompt", "continue_final_message"})
_PROBE_CALL = {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": '{"at": "x"}'}}
# Renders differently by content format wherever a template tests an empty text (`""` stays a one-part list).
_PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Look."},
          {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
          {"role": "tool", "tool_call_id": "call_1", "content": "seen"},
          {"role": "assistant", "content": "Seen.", "reasoning": "first look"}, {"role": "user", "content": "More."}]
_PROBE_TOOLS = [{"type": "function", "function": {"name": "look", "description": "Look at a thing.",
                                                  "parameters": {"type": "object",
                                                                 "properties": {"at": {"type": "string"}}}}}]
# For a template that refuses tool messages (Gemma 3's: roles must alternate user and assistant): no tools.
_PLAIN_PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Look."},
                {"role": "assistant", "content": ""}, {"role": "user", "content": "More."}]


class LocalTemplateError(Exception):
    """The directory holds no tokenizer or chat template this proxy can run."""


class LocalTemplate:
    """A model directory's tokenizer (`tokenizer.json`) and chat template, ready to render."""

    def __init__(self, tokenizer: Any, templates: dict[str, str], special_tokens: dict[str, str]) -> None:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox

        self.tokenizer = tokenizer
        self.special_tokens = special_tokens
        self._pieces = _added_token_splitter(tokenizer)
        self._encode_piece = functools.lru_cache(maxsize=PIECES_KEPT)(self._encode_text)
        environment = _sandbox()(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        self._tools = _Tools(TOOL_LISTS_KEPT)
        environment.filters["tojson"] = self._tools.tojson
        environment.globals["raise_exception"] = _raise
        environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._compiled = {name: environment.from_string(text) for name, text in templates.items()}
        self._variables = {name: _undeclared(environment, text) for name, text in templates.items()}

    @classmethod
    def load(cls, model_dir: str | Path) -> LocalTemplate:
        """Read `tokenizer.json`, the chat template (`chat_template.jinja`, else `tokenizer_config.json`'s) and the
        named special tokens; a clear `LocalTemplateError` when something is missing or `tokenizers`/`jinja2` are
        not installed."""
        directory = Path(model_dir)
        try:
            import jinja2  # noqa: F401
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise LocalTemplateError(f"rendering in the proxy needs `tokenizers` and `jinja2` ({exc.name} is not "
                                     "installed): pip install tokenizers jinja2") from None
        if not (directory / "tokenizer.json").is_file():
            raise LocalTemplateError(f"{directory} holds no tokenizer.json")
        config: dict[str, Any] = {}
        if (directory / "tokenizer_config.json").is_file():
            config = json.loads((directory / "tokenizer_config.json").read_text())
        templates = _templates(directory, config.get("chat_template"))
        if not templates:
            raise LocalTemplateError(f"{directory} holds no chat template")
        special = {name: value["content"] if isinstance(value, dict) else value
                   for name in SPECIAL_TOKENS if isinstance(value := config.get(name), str | dict)}
        return cls(Tokenizer.from_file(str(directory / "tokenizer.json")), templates, special)

    def render(self, request: ChatRender, content_format: ContentFormat) -> Rendered | None:
        """The prompt ids vLLM would render for this request, or None when this renderer declines it."""
        messages = [_message(msgspec.json.decode(m), content_format) for m in request.messages]
        if not messages or None in messages:
            return None
        tools = self._tools.shaped(bytes(request.tools)) if request.tools else None
        name = "tool_use" if tools is not None and "tool_use" in self._compiled else "default"
        if name not in self._compiled:
            return None
        given = request.chat_template_kwargs or {}
        if TEMPLATE_ARGUMENTS & given.keys():  # what vLLM hands to transformers, not to the template
            return None
        arguments = {key: value for key, value in given.items() if key in self._variables[name]}
        try:
            text = self._compiled[name].render(**{**self.special_tokens, **arguments, "messages": messages,
                                                  "tools": tools, "documents": None,
                                                  "add_generation_prompt": request.add_generation_prompt})
        except Exception as exc:  # the template refused these messages: the engine will say how, as a 400
            log.debug("the chat template declined a conversation: %s", exc)
            return None
        ids = self.encode(text)
        return Rendered(token_text(ids), len(ids)) if ids else None

    def encode(self, text: str) -> list[int]:
        """The text's ids without special tokens added. The tokenizer matches its added tokens first and encodes
        the text between them piece by piece, so pieces seen before (a system prompt, the tools, earlier
        messages) are encoded once; a tokenizer whose added tokens strip or match whole words is run whole."""
        if self._pieces is None:
            return self._encode_text(text)
        ids: list[int] = []
        for piece in self._pieces.split(text):
            if piece:
                ids += self._encode_piece(piece)
        return ids

    def _encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)


class LocalRendering:
    """A `LocalTemplate` in use: which content format the engine's template gets, learned once from the engine;
    `off` says why it is not used (it is then never used again)."""

    def __init__(self, template: LocalTemplate, engine: EngineClient) -> None:
        self.template = template
        self.engine = engine
        self.format: ContentFormat | None = None
        self.off: str | None = None
        self.checked = 0  # renders found equal to the engine's
        self._wholes = 0
        self._shapes: set[Shape] = set()  # of the whole conversations found equal to the engine's renders

    async def ready(self) -> bool:
        """Whether local renders can be used: the probe conversation, rendered by the engine, decides once."""
        if self.off is None and self.format is None:
            refused: list[str] = []
            for messages, tools in ((_PROBE, _PROBE_TOOLS), (_PLAIN_PROBE, None)):
                probe = ChatRender(messages=[msgspec.Raw(msgspec.json.encode(m)) for m in messages],
                                   tools=msgspec.Raw(msgspec.json.encode(tools)) if tools else None,
                                   add_generation_prompt=True)
                try:
                    engine = await self.engine.render(probe)
                    break
                except ProxyError as exc:
                    if exc.status >= 500:
                        raise
                    refused.append(exc.message)
            else:
                self.turn_off(f"the engine cannot render the probe conversations: {'; '.join(refused)}")
                return False
            formats: tuple[ContentFormat, ...] = ("string", "openai")
            agreeing = [f for f in formats if (ours := self.template.render(probe, f)) is not None and ours == engine]
            if agreeing:
                self.format = agreeing[0]
            else:
                self.turn_off("its rendering of a probe conversation differs from the engine's (another template, "
                              "or template arguments set on the server?)")
        return self.off is None

    @property
    def usable(self) -> bool:
        return self.off is None and self.format is not None

    def render(self, request: ChatRender) -> Rendered | None:
        return self.template.render(request, self.format) if self.usable and self.format else None

    @property
    def warming(self) -> bool:
        """The first renders made here are all checked against the engine's."""
        return self.checked < WARMUP_CHECKS

    def check_due(self, shape: frozenset[Shape]) -> bool:
        """Whether a whole conversation rendered here is checked: when its shape is new, else one in `CHECK_EVERY`
        (a spliced turn's new messages are checked with the splice, on `splice_check_tokens`)."""
        self._wholes += 1
        return not shape <= self._shapes or self._wholes % CHECK_EVERY == 0

    def agreed(self, shape: frozenset[Shape] = frozenset()) -> None:
        """A render made here was found equal to the engine's."""
        self.checked += 1
        self._shapes |= shape

    def turn_off(self, why: str) -> None:
        if self.off is None:
            self.off = why
            log.warning("prompts are rendered by the engine from now on, not in the proxy: %s", why)


def shape_of(messages: list[ChatMessage], request: ChatRender, tools_digest: int | None) -> frozenset[Shape]:
    """What a template's output depends on besides the text: each message's role and kinds of content, with the
    one before it (first and last marked), under the tools and template arguments; text alone is left out."""
    context = (tools_digest, request.add_generation_prompt,
               msgspec.json.encode(request.chat_template_kwargs) if request.chat_template_kwargs else None)
    kinds = [_message_shape(m) for m in messages]
    return frozenset((context, before, after) for before, after in zip([None, *kinds], [*kinds, None], strict=True))


def _message_shape(message: ChatMessage) -> Shape:
    content = message.content
    parts = None if content is None else -1 if isinstance(content, str) else min(len(content), 2)
    return (message.role, parts, bool(content), min(len(message.tool_calls or ()), 2), message.reasoning is not None,
            bool(message.reasoning), message.name is not None, message.tool_call_id is not None)


def _added_token_splitter(tokenizer: Any) -> re.Pattern[str] | None:
    """A pattern that cuts text around the tokenizer's added tokens (kept as pieces), longest first; None when an
    added token strips whitespace or matches only whole words (pieces would then not encode independently)."""
    added = list(tokenizer.get_added_tokens_decoder().values())
    if not added or any(token.lstrip or token.rstrip or token.single_word for token in added):
        return None
    contents = sorted({token.content for token in added}, key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, contents)) + ")")


def _templates(directory: Path, configured: Any) -> dict[str, str]:
    """The chat templates by name ("default", "tool_use", ...), as transformers finds them."""
    if (directory / "chat_template.jinja").is_file():
        return {"default": (directory / "chat_template.jinja").read_text()}
    if isinstance(configured, str):
        return {"default": configured}
    if isinstance(configured, list):
        return {item["name"]: item["template"] for item in configured if isinstance(item, dict)}
    return {}


def _message(message: dict[str, Any], content_format: ContentFormat) -> dict[str, Any] | None:
    """A neutral message as vLLM's chat parser hands it to the template; None for what it would treat otherwise."""
    role = message.get("role")
    content = message.get("content")
    if role not in ("system", "user", "assistant", "tool"):
        return None
    if content is None:
        texts: list[str] = []
    elif isinstance(content, str):
        texts = [content]
    elif all(isinstance(part, dict) and part.get("type") == "text" for part in content):
        texts = [part.get("text", "") for part in content]
    else:
        return None
    if role == "system" and any(text.startswith(BILLING_HEADER) for text in texts):
        return None
    shaped: dict[str, Any] = {"role": role, "content": [{"type": "text", "text": text} for text in texts]
                              if content_format == "openai" else "\n".join(texts)}
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls:
            shaped["tool_calls"] = [{**call, "function": {**call["function"], "arguments": _arguments(
                call["function"].get("arguments"))}} for call in calls]
        if message.get("reasoning") is not None:
            shaped["reasoning"] = shaped["reasoning_content"] = message["reasoning"]
    elif role == "tool":
        if "tool_call_id" in message:
            shaped["tool_call_id"] = message["tool_call_id"]
        shaped["content"] = "\n".join(texts)
    if isinstance(message.get("name"), str):
        shaped["name"] = message["name"]
    return shaped


def _arguments(arguments: Any) -> dict[str, Any]:
    """Tool-call arguments as the template gets them: the JSON object parsed; anything else an empty object."""
    if isinstance(arguments, dict):
        return arguments
    if not arguments or not isinstance(arguments, str):
        return {}
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


class _Tools:
    """The last tool lists seen, shaped as vLLM hands them to the template, each tool's `tojson` made once: an agent
    sends the same tools every call. The template gets plain dicts, shared between renders (the sandbox keeps it
    from changing them); a tool's JSON is found by identity while its list is kept."""

    def __init__(self, kept: int) -> None:
        self._kept = kept
        self._lists: OrderedDict[bytes, list[dict[str, Any]]] = OrderedDict()
        self._json: dict[int, str] = {}

    def shaped(self, raw: bytes) -> list[dict[str, Any]]:
        tools = self._lists.get(raw)
        if tools is None:
            tools = self._lists[raw] = [_tool(tool) for tool in msgspec.json.decode(raw)]
            self._json.update((id(tool), json.dumps(tool, ensure_ascii=False)) for tool in tools)
            if len(self._lists) > self._kept:
                for tool in self._lists.popitem(last=False)[1]:
                    del self._json[id(tool)]
        else:
            self._lists.move_to_end(raw)
        return list(tools)

    def tojson(self, value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        """transformers' `tojson` filter."""
        if not (ensure_ascii or indent or separators or sort_keys) and (made := self._json.get(id(value))):
            return made
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function") or {}
    shaped = {"name": function.get("name"), "description": function.get("description"),
              "parameters": function.get("parameters")}
    if function.get("strict") is not None:
        shaped["strict"] = function["strict"]
    return {"type": tool.get("type", "function"), "function": shaped}


@functools.cache
def _sandbox() -> type:
    """transformers' sandbox (`ImmutableSandboxedEnvironment`), with its two most frequent reads made direct:
    `message.role` on a plain dict, which the sandbox answers with the key after a failed attribute lookup, and
    `loop.last` and the like. Both read data, never a method, so what the template sees is unchanged; every
    other read goes through the sandbox's checks."""
    import jinja2.sandbox
    from jinja2.runtime import LoopContext

    dict_names = frozenset(dir(dict))
    loop_names = frozenset({"first", "last", "index", "index0", "revindex", "revindex0", "length", "depth", "depth0",
                            "previtem", "nextitem"})

    class Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
        def getattr(self, obj: Any, attribute: str) -> Any:
            kind = type(obj)
            if kind is dict and attribute not in dict_names:
                return obj[attribute] if attribute in obj else self.undefined(obj=obj, name=attribute)
            if kind is LoopContext and attribute in loop_names:
                return getattr(obj, attribute)
            return super().getattr(obj, attribute)

    return Sandbox


def _raise(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _undeclared(environment: Any, text: str) -> frozenset[str]:
    """The variables a template reads that it does not set itself (the template arguments it accepts)."""
    import jinja2.meta

    return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(text)))
