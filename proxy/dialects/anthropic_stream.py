"""Anthropic Messages streamed: `message_start`, content blocks as the engine samples, `message_stop`.

A thinking block holds the reasoning deltas and is closed (with its signature) when the text starts;
a text block holds the content deltas; once the turn is recorded, each tool call comes as a whole
`tool_use` block, then `message_delta` with the stop reason and the exact output token count.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import msgspec

from proxy.chat import Answer
from proxy.dialects.anthropic import signature_for, stop_reason, tool_input, tool_use_id
from proxy.live import AnswerHead, TextKind

_ENCODER = msgspec.json.Encoder()
_START = {"reasoning": {"type": "thinking", "thinking": "", "signature": ""}, "content": {"type": "text", "text": ""}}


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _ENCODER.encode(data) + b"\n\n"


class MessagesStream:
    def __init__(self, head: AnswerHead) -> None:
        self.head = head
        self.index = -1  # the open block's index
        self.kind: TextKind | None = None  # the open block's kind
        self.thinking = ""  # the open thinking block's text, signed when it closes

    def open(self) -> bytes:
        head = self.head
        usage = {"input_tokens": head.prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": 0}
        message: dict[str, Any] = {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant",
                                   "model": head.model, "content": [], "stop_reason": None, "stop_sequence": None,
                                   "usage": usage}
        return _event("message_start", {"type": "message_start", "message": message}) + _event("ping", {"type": "ping"})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _start(self, block: dict[str, Any]) -> bytes:
        self.index += 1
        return _event("content_block_start", {"type": "content_block_start", "index": self.index,
                                              "content_block": block})

    def _close(self) -> bytes:
        if self.kind is None:
            return b""
        out = b""
        if self.kind == "reasoning":
            out = self._delta({"type": "signature_delta", "signature": signature_for(self.thinking)})
            self.thinking = ""
        self.kind = None
        return out + _event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def text(self, kind: TextKind, text: str) -> bytes:
        if not text:
            return b""
        out = b""
        if self.kind != kind:
            out = self._close() + self._start(_START[kind])
            self.kind = kind
        if kind == "reasoning":
            self.thinking += text
            return out + self._delta({"type": "thinking_delta", "thinking": text})
        return out + self._delta({"type": "text_delta", "text": text})

    def finish(self, answer: Answer) -> bytes:
        out = [self._close()]
        for call in answer.reply.tool_calls:
            out.append(self._start({"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": {}}))
            arguments = json.dumps(tool_input(call.arguments), ensure_ascii=False)
            out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
            out.append(_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        out.append(_event("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": stop_reason(answer), "stop_sequence": None},
                                            "usage": {"output_tokens": answer.completion_tokens}}))
        out.append(_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)
