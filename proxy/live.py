"""A streamed answer, dialect-neutral: what an agent's stream is made of while the engine samples.

The head is known as soon as the engine starts answering; then come text deltas (reasoning before
content, each exactly as the engine's own parsers read the answer so far); then the finished `Answer`,
sent only once its turn is checked and recorded. Each dialect writes these three as its own events
(`LiveStream`); a finished answer streamed whole is the same three at once (`whole_stream`).
"""

from __future__ import annotations

from typing import Literal, Protocol

import msgspec

from proxy.chat import Answer

TextKind = Literal["reasoning", "content"]


class AnswerHead(msgspec.Struct, frozen=True, kw_only=True):
    """What an answer's opening events carry: its id, time, the agent's model name and the prompt's size."""

    id: str
    created: int
    model: str
    prompt_tokens: int


class Opened(msgspec.Struct, frozen=True):
    head: AnswerHead


class Text(msgspec.Struct, frozen=True):
    kind: TextKind
    text: str


class Finished(msgspec.Struct, frozen=True):
    answer: Answer
    node_id: str | None  # the recorded turn (None: an answer never recorded, such as the budget's)


StreamEvent = Opened | Text | Finished


class LiveStream(Protocol):
    """One dialect's writer for one streamed answer; each call returns the bytes to send (maybe none)."""

    def open(self) -> bytes: ...

    def text(self, kind: TextKind, text: str) -> bytes: ...

    def finish(self, answer: Answer) -> bytes: ...


def head_of(answer: Answer) -> AnswerHead:
    return AnswerHead(id=answer.id, created=answer.created, model=answer.model, prompt_tokens=answer.prompt_tokens)


def whole_stream(stream: LiveStream, answer: Answer) -> bytes:
    """A finished answer as its dialect's stream: opened, its reasoning and content, finished."""
    reply = answer.reply
    return b"".join((stream.open(), stream.text("reasoning", reply.reasoning or ""),
                     stream.text("content", reply.content or ""), stream.finish(answer)))
