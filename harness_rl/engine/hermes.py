"""Hermes tool calls (`<tool_call>{"name": …, "arguments": …}</tool_call>`), parsed as vLLM's
`hermes` parser does: content is the text before the first call (or null), arguments are
re-serialised JSON, and a completion whose calls do not parse is plain content."""

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

START = "<tool_call>"
END = "</tool_call>"


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _parse_call(body: str, new_id: Callable[[], str] = new_tool_call_id) -> dict | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return {
        "id": new_id(),
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False)},
    }


def _call_bodies(text: str) -> list[str]:
    """The JSON bodies of every call; a last call cut off before its end tag counts too."""
    bodies = []
    rest = text[text.find(START) :]
    while rest.startswith(START):
        rest = rest[len(START) :]
        end = rest.find(END)
        if end < 0:
            bodies.append(rest)
            break
        bodies.append(rest[:end])
        rest = rest[end + len(END) :]
        next_start = rest.find(START)
        if next_start < 0:
            break
        rest = rest[next_start:]
    return bodies


def parse_tool_calls(
    text: str, new_id: Callable[[], str] = new_tool_call_id
) -> tuple[str | None, list[dict]] | None:
    """`(content, tool_calls)` when `text` holds calls that all parse, else None (plain content)."""
    if START not in text:
        return None
    parsed = [_parse_call(body, new_id) for body in _call_bodies(text)]
    calls = [call for call in parsed if call is not None]
    if not calls or len(calls) != len(parsed):
        return None
    content = text[: text.find(START)]
    return (content or None), calls


@dataclass
class HermesStream:
    """Turns streamed text into one chat delta per token: content until the first `<tool_call>`;
    after that, each call as one `{index, id, type, function: {name, arguments}}` entry once its
    `</tool_call>` arrives (or at the end, for a last call left open)."""

    calls_sent: int = 0
    _bodies_done: int = 0
    _pending: str = ""
    _in_calls: bool = False
    _calls_text: str = field(default="", repr=False)

    def feed(self, text: str, final: bool = False) -> dict:
        """The delta for this token's text: `{"content": …}`, `{"content": None, "tool_calls": […]}`,
        both, or `{}` when the text is held back."""
        delta: dict = {}
        if not self._in_calls:
            self._pending += text
            start = self._pending.find(START)
            if start < 0:
                keep = 0 if final else _partial_tag_length(self._pending)
                cut = len(self._pending) - keep
                head, self._pending = self._pending[:cut], self._pending[cut:]
                return {"content": head} if head else {}
            self._in_calls = True
            head, self._calls_text, self._pending = self._pending[:start], self._pending[start:], ""
            if head:
                delta["content"] = head
        else:
            self._calls_text += text
        bodies = _call_bodies(self._calls_text)
        finished = len(bodies) if final else self._calls_text.count(END)
        calls = []
        for body in bodies[self._bodies_done : finished]:
            self._bodies_done += 1
            call = _parse_call(body)
            if call is not None:
                calls.append(
                    {"id": call["id"], "type": "function", "index": self.calls_sent, "function": call["function"]}
                )
                self.calls_sent += 1
        if calls:
            delta.setdefault("content", None)
            delta["tool_calls"] = calls
        return delta


def _partial_tag_length(text: str) -> int:
    """Length of the longest suffix of `text` that could still grow into `<tool_call>`."""
    for size in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-size:]):
            return size
    return 0
