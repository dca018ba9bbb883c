"""One streamed agent call: the engine's tokens become the agent's text as they are sampled.

The pipeline's steps, streamed: the prompt is made as for any call; the engine samples with
`stream: true`; the engine's own parsers read the growing answer (`TextReader`) and each reasoning
or content delta goes to the agent at once. When the engine is done, the sample is checked as a whole
(ids against logprobs, counts against the closing usage), the parsers read its last ids with the finish,
and what they read in all is the reply (as vLLM's chat route answers a streaming request), unless it lost
what one whole reading of the answer, made beside that last read, holds: a tool call, or the end of its text
(the streamed reasoning and content each begin the whole reading's, and fall short of it). vLLM streams a
token at a time, and some families' parsers (DeepSeek-V3's) lose a tool call, or the text before it, when
a read brings several ids at once. The turn is recorded, and only then do the text not yet sent, the tool calls
and the finish go out, in one send. An answer the engine finished before its first read, and a streaming read
that fails, leave the answer to one whole reading: concatenated, the streamed text is the recorded
reply, always, so text the parsers let out early that the whole reading disagrees with fails the call
(the turn stays, with mask 0).

The call runs on its own task, apart from the agent's connection. When the agent leaves, `left` is set:
the generation is cut short (the engine stops generating when its stream is closed) and what was sampled
is recorded as context the agent never received (mask 0).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from harness_rl.trace import Reply
from proxy.capture.session import Session
from proxy.capture.tito import same_arguments
from proxy.chat import ChatCall
from proxy.errors import ProxyError
from proxy.live import AnswerHead, Finished, Opened, StreamEvent, Text, TextKind
from proxy.server.pipeline import CapturePipeline, new_answer_id
from proxy.upstream.stream import SampleStream, TextReader

Emit = Callable[[StreamEvent], None]


async def capture_streamed(pipeline: CapturePipeline, session: Session, call: ChatCall, harness: dict[str, str],
                           emit: Emit, left: asyncio.Event, answer_id: str | None = None) -> None:
    """Sample, record and answer one call, emitting its events as they happen; `Finished` comes last, after
    the turn is on disk (also when the agent has left: whoever takes it marks the turn undelivered).

    The caller holds the gate and has admitted the call, as for `CapturePipeline.capture`.
    """
    prepared = await pipeline.prepare(session, call)
    engine, prompt = pipeline.engine, prepared.prompt.ids
    answer_id = answer_id or new_answer_id()
    reader = TextReader(engine, prepared.parsing, prompt, prepared.stops, pipeline.config.stream_read_s,
                        lambda kind, text: emit(Text(kind, text)))
    reading = asyncio.ensure_future(reader.run())
    whole: asyncio.Future[Reply] | None = None
    reads_hold_all = False
    try:
        async with SampleStream(engine, prompt, prepared.params) as stream:
            emit(Opened(AnswerHead(id=answer_id, created=int(prepared.started), model=call.model,
                                   prompt_tokens=prompt.count)))
            cut, last = await _follow(stream, reader, left)
        if cut and not stream.ids:
            raise ProxyError(499, "the agent left before the engine sampled a token; nothing was recorded")
        sample = stream.partial() if cut else stream.sample()
        whole = asyncio.ensure_future(pipeline.read(prepared, sample))  # beside the last streaming read
        if not cut:
            reader.finish(last[:-1] if sample.ends_with_stop_token else last, sample.finish_reason)
            reads_hold_all = await reading
        whole_reply = await whole
    finally:
        for task in (reading, whole):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    # when the streaming reads stopped short, never began or the agent left, the answer is read whole
    streamed = reader.reply(sample.stop_reason) if not cut and reads_hold_all else None
    reply = final_reply(streamed, whole_reply)
    rest = {"reasoning": _rest(reader.sent["reasoning"], reply.reasoning), "content": _rest(reader.sent["content"],
                                                                                          reply.content)}
    answer, node_id = pipeline.record(session, call, harness, prepared, sample, reply, answer_id)
    if not cut and (None in rest.values() or (rest["reasoning"] and reader.sent["content"])):
        session.mark_undelivered(node_id)
        raise ProxyError(502, "the engine's parsers streamed text that their reading of the whole answer does not "
                              "hold; the turn is kept as context the agent never received")
    kind: TextKind
    for kind in ("reasoning", "content"):
        text = rest[kind]
        if text:
            emit(Text(kind, text))
    emit(Finished(answer, node_id))


async def _follow(stream: SampleStream, reader: TextReader, left: asyncio.Event) -> tuple[bool, list[int]]:
    """Hand the new ids to the reader as they come until the stream ends: (True when the agent left first, the
    last ids, those that came with the finish, which the reader gets once the sample is checked)."""
    async def feed() -> list[int]:
        last: list[int] = []
        async for ids in stream.steps():
            if stream.finish_reason is None:
                reader.feed(ids)
            else:
                last = ids
        return last

    feeding = asyncio.ensure_future(feed())
    leaving = asyncio.ensure_future(left.wait())
    try:
        await asyncio.wait((feeding, leaving), return_when=asyncio.FIRST_COMPLETED)
        if not feeding.done():
            feeding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feeding
            return True, []
        return False, feeding.result()
    finally:
        leaving.cancel()
        feeding.cancel()


def final_reply(streamed: Reply | None, whole: Reply) -> Reply:
    """The streaming reads' reply, unless it lost what the whole reading holds: a tool call, or the end of its text
    (a parser fed several ids in one read can drop either, where vLLM's per-token stream keeps them). A whole
    reading that the streamed text falls short of still begins with all of it, so with all that was sent."""
    if streamed is None or not _same_calls(streamed, whole) or _falls_short(streamed, whole):
        return whole
    return streamed


def _falls_short(part: Reply, whole: Reply) -> bool:
    """`part`'s reasoning and content each begin `whole`'s, and not all of it."""
    pairs = [(part.reasoning or "", whole.reasoning or ""), (part.content or "", whole.content or "")]
    return all(w.startswith(p) for p, w in pairs) and any(len(w) > len(p) for p, w in pairs)


def _same_calls(a: Reply, b: Reply) -> bool:
    """The same tool calls, by name and arguments (ids are the engine's to draw)."""
    return len(a.tool_calls) == len(b.tool_calls) and all(
        x.name == y.name and same_arguments(x.arguments, y.arguments)
        for x, y in zip(a.tool_calls, b.tool_calls, strict=True))


def _rest(sent: str, final: str | None) -> str | None:
    """What of `final` is still to send after `sent`; None when `sent` is not where `final` begins."""
    final = final or ""
    return final[len(sent):] if final.startswith(sent) else None
