"""OpenAI Chat Completions streamed: `chat.completion.chunk`s as the engine samples, ending with `[DONE]`.

The role first, then one chunk per reasoning or content delta; once the turn is recorded, each tool
call's header and its arguments, the finish reason (with the sampled tokens' logprobs when the agent
asked for them) and, when asked, the usage chunk (choices empty).
"""

from __future__ import annotations

from typing import Any

import msgspec

from proxy.chat import Answer
from proxy.dialects.openai_chat import logprobs_block, usage
from proxy.live import AnswerHead, TextKind

_ENCODER = msgspec.json.Encoder()


class ChatStream:
    def __init__(self, head: AnswerHead, include_usage: bool) -> None:
        self.base = {"id": head.id, "object": "chat.completion.chunk", "created": head.created, "model": head.model}
        self.include_usage = include_usage

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        body = {**self.base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        return b"data: " + _ENCODER.encode(body) + b"\n\n"

    def open(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def text(self, kind: TextKind, text: str) -> bytes:
        if not text:
            return b""
        return self._chunk({"content": text} if kind == "content" else {"reasoning": text, "reasoning_content": text})

    def finish(self, answer: Answer) -> bytes:
        out = []
        for i, call in enumerate(answer.reply.tool_calls):
            out.append(self._chunk({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                                    "function": {"name": call.name, "arguments": ""}}]}))
            if call.arguments:
                out.append(self._chunk({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]}))
        out.append(self._chunk({}, answer.finish_reason, logprobs_block(answer)))
        if self.include_usage:
            out.append(b"data: " + _ENCODER.encode({**self.base, "choices": [], "usage": usage(answer)}) + b"\n\n")
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)
