"""Gemini streamGenerateContent (`alt=sse`): one `data:` chunk per delta, as Google streams (no `[DONE]`).

Each reasoning delta is a thought part, each content delta a text part; the last chunk, sent once the
turn is recorded, holds the function calls (the first one carrying the reasoning's signature), or an
empty text part carrying it, with the finish reason and the exact token counts.
"""

from __future__ import annotations

from typing import Any

import msgspec

from proxy.chat import Answer
from proxy.dialects import opaque_reasoning
from proxy.dialects.gemini import call_part, chunk
from proxy.live import AnswerHead, TextKind

_ENCODER = msgspec.json.Encoder()


class GeminiStream:
    def __init__(self, head: AnswerHead) -> None:
        self.head = head

    def _send(self, body: dict[str, Any]) -> bytes:
        return b"data: " + _ENCODER.encode(body) + b"\n\n"

    def open(self) -> bytes:
        return b""

    def text(self, kind: TextKind, text: str) -> bytes:
        if not text:
            return b""
        part: dict[str, Any] = {"text": text, "thought": True} if kind == "reasoning" else {"text": text}
        return self._send(chunk(self.head.id, self.head.model, [part]))

    def finish(self, answer: Answer) -> bytes:
        reply = answer.reply
        parts = [call_part(c) for c in reply.tool_calls] or [{"text": ""}]
        if reply.reasoning:
            parts[0]["thoughtSignature"] = opaque_reasoning.wrap(reply.reasoning)
        return self._send(chunk(answer.id, answer.model, parts, answer))
