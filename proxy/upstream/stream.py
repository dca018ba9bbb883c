"""The engine's streamed sampling, read step by step, and its parsers reading the answer as it grows.

`SampleStream` reads a streamed `/inference/v1/generate`: every step's ids and logprobs are checked as
they come, and the whole is assembled into the same `Generated` a whole reply gives, checked against the
closing usage. Leaving it early closes the connection, which ends the generation (vLLM aborts a request
whose client went away; so does the embedded engine).

`TextReader` turns the growing answer into reasoning and content deltas with vLLM's streaming derender:
the engine's own parsers decide what is text and what is markup, for any model family. The last read
carries the finish, so the parsers flush what they held back, and the reads together are the answer:
content, reasoning and tool calls, as vLLM's chat route reads a streamed answer (its streaming parsers),
with no read of the whole answer after it. vLLM carries no parser state between reads, so each read
replays the answer so far and rescans the prompt: ids that arrive while a read is under way wait and go
together in the next one; the first read waits 10 ms after the first ids, and later reads are spaced by
`interval_s` and by four times the last read's duration, which keeps the replays to a fifth of the
engine's time however long the answer grows. An answer sampled whole before its first read is not read
here at all: nothing was sent yet, so it is read whole, as a JSON call's answer is, in one engine call
that needs no prompt. Text that could still be the start of a stop string is held back, as vLLM's
detokenizer holds it: the agent never sees what the final answer leaves out. The last read's text is not
emitted: it goes to the agent with the finish, in one send.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from types import TracebackType

import aiohttp
import msgspec

from harness_rl.trace import Reply, ToolCall
from harness_rl.wire import POLICY_VERSION_HEADER
from proxy.errors import ProxyError
from proxy.live import TextKind
from proxy.tokens import ids_array
from proxy.upstream.checks import VLLM_HINT, check_sample, check_usage
from proxy.upstream.client import EngineClient, Generated, Rendered
from proxy.upstream.wire import (
    CHUNK_DECODER,
    DERENDER_STREAM_DECODER,
    NULL,
    DerenderChoice,
    DerenderStreamRequest,
    FunctionDelta,
    GenerateRequest,
    GenerateResponse,
    SamplingParams,
    StreamOptions,
    Usage,
    WeightVersionSpan,
)

log = logging.getLogger(__name__)
_ENCODER = msgspec.json.Encoder()
READ_COST_FACTOR = 4  # reads are spaced by at least this many times the last read's duration
FIRST_READ_S = 0.01  # the first read waits this long after the first ids (little against a 256-token answer's time)


class SampleStream:
    """One streamed generate; `async with` it, iterate `steps()`, then take `sample()` (or `partial()`)."""

    def __init__(self, engine: EngineClient, prompt: Rendered, sampling: SamplingParams) -> None:
        self.engine = engine
        self.prompt = prompt
        self.sampling = sampling
        self.ids: list[int] = []
        self.logps: list[float] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.spans: list[WeightVersionSpan] = []
        self.usage: Usage | None = None
        self.policy_version: int | None = None
        self._response: aiohttp.ClientResponse | None = None

    async def __aenter__(self) -> SampleStream:
        request = GenerateRequest(token_ids=ids_array(self.prompt.text), sampling_params=self.sampling,
                                  model=await self.engine.served_model(), stream=True,
                                  stream_options=StreamOptions(include_usage=True))
        self._response = await self.engine.open_stream("/inference/v1/generate", _ENCODER.encode(request))
        version = self._response.headers.get(POLICY_VERSION_HEADER)
        self.policy_version = int(version) if version and version.isdigit() else None
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        assert self._response is not None
        if self.finish_reason is not None and self.usage is not None:
            self._response.release()  # read to its end: the connection goes back to the pool
        else:
            self._response.close()  # cut short: the engine sees its client leave and stops generating

    async def steps(self) -> AsyncIterator[list[int]]:
        """The new ids as they come (the steps that arrived together, as one), checked: the engine's ids and
        logprobs must describe one sample."""
        url = self.engine.url
        try:
            async for ids in self._read():
                yield ids
        except TimeoutError:
            raise ProxyError(504, f"the engine at {url} did not finish within {self.engine.timeout_s:g} s") from None
        except aiohttp.ClientError as exc:
            raise ProxyError(502, f"the engine at {url} broke off its stream: {exc!r}") from None

    async def _read(self) -> AsyncIterator[list[int]]:
        """The ids of the steps that arrived together (the engine sends a step at a time; a busy proxy reads
        several at once and hands them on as one)."""
        assert self._response is not None
        url, size, limit = self.engine.url, 0, self.engine.max_reply_bytes
        pending = b""
        async for data in self._response.content.iter_any():
            size += len(data)
            if size > limit:
                raise ProxyError(502, f"the engine at {url} streamed more than {limit / 2**20:g} MB (--max-reply-mb)")
            *lines, pending = (pending + data).split(b"\n")
            ids: list[int] | None = None
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                event = line[5:].strip()
                if event == b"[DONE]":
                    if ids is not None:
                        yield ids
                    return
                step = self._step(event)
                if step is not None:
                    ids = step if ids is None else ids + step
            if ids is not None:
                yield ids

    def _step(self, event: bytes) -> list[int] | None:
        """One event's sampled ids, checked and taken in (None for the closing usage)."""
        url = self.engine.url
        try:
            chunk = CHUNK_DECODER.decode(event)
        except msgspec.DecodeError as exc:
            raise ProxyError(502, f"the engine at {url} streamed a chunk this proxy cannot read: {exc}") from None
        if chunk.error is not None:
            raise ProxyError(502, f"the engine at {url} failed while streaming: {chunk.error.message}")
        if not chunk.choices:
            self.usage = chunk.usage or self.usage
            return None
        if len(chunk.choices) != 1:
            raise ProxyError(502, f"the engine at {url} streamed {len(chunk.choices)} choices, expected 1")
        choice = chunk.choices[0]
        ids = choice.token_ids or []
        entries = choice.logprobs.content if choice.logprobs is not None else None
        if ids and entries is None:
            raise ProxyError(502, f"the engine at {url} streamed sampled ids without logprobs; {VLLM_HINT}")
        logps = [e.logprob for e in entries or ()]
        check_sample(url, ids, [e.token_id for e in entries or ()], logps, self.engine.vocab_size)
        self.ids += ids
        self.logps += logps
        if choice.finish_reason is not None:
            self.finish_reason, self.stop_reason = choice.finish_reason, choice.stop_reason
            self.spans = choice.weight_versions or []
        return ids

    def sample(self) -> Generated:
        """The whole sample, once the stream ended: it must have said why it ended, and its usage must agree."""
        url = self.engine.url
        if self.finish_reason is None:
            raise ProxyError(502, f"the engine at {url} ended its stream before its last step")
        if self.usage is None:
            raise ProxyError(502, f"the engine at {url} ended its stream without the usage it was asked for")
        check_usage(url, self.usage, self.prompt.count, len(self.ids))
        return self.partial(self.finish_reason)

    def partial(self, finish_reason: str = "abort") -> Generated:
        """What was sampled so far (a generation cut short ends with "abort")."""
        return Generated(self.ids, self.logps, finish_reason, self.stop_reason, self.spans, self.policy_version, 1)


class TextReader:
    """The engine's parsers reading a sample as it grows: `run()` reads while `feed()` adds ids; once `finish()`
    hands over the last ones, it reads them at once, with the finish (the parsers flush what they held back),
    and returns True: `reply()` is then the whole answer, as the engine's streaming parsers read it, and what
    of it `sent` does not hold is still to go to the agent."""

    def __init__(self, engine: EngineClient, chat_request: bytes, prompt: Rendered, stops: list[str],
                 interval_s: float, emit: Callable[[TextKind, str], None]) -> None:
        self.engine = engine
        self.chat_request = msgspec.Raw(chat_request)
        self.prompt = prompt
        self.stops = stops
        self.interval_s = interval_s
        self.emit = emit
        self.sent: dict[TextKind, str] = {"reasoning": "", "content": ""}
        self.reads = 0
        self._read: dict[TextKind, str] = {"reasoning": "", "content": ""}
        self._calls: dict[int, ToolCall] = {}
        self._state = NULL
        self._pending: list[int] = []
        self._finish: str | None = None
        self._finished = asyncio.Event()
        self._more = asyncio.Event()

    def feed(self, ids: list[int]) -> None:
        if ids:
            self._pending += ids
            self._more.set()

    def finish(self, ids: list[int], finish_reason: str) -> None:
        """The sample's last ids (a trailing stop token left out, as the chat route leaves it out of the text)."""
        self._pending += ids
        self._finish = finish_reason
        self._finished.set()
        self._more.set()

    async def run(self) -> bool:
        """Read until the finish is read (True); False when the answer is to be read whole instead: a read failed
        (the reading stops there), or the answer was sampled whole before its first read."""
        loop = asyncio.get_running_loop()
        next_at: float | None = None
        while True:
            await self._more.wait()
            if next_at is None:  # the first read waits a moment: an answer sampled in it is read whole
                next_at = loop.time() + min(self.interval_s, FIRST_READ_S)
            with contextlib.suppress(TimeoutError):  # the finish is read at once
                async with asyncio.timeout_at(next_at):
                    await self._finished.wait()
            self._more.clear()
            ids, self._pending, finish = self._pending, [], self._finish
            if finish is not None and not self.reads:
                return False  # nothing read, nothing sent: one whole reading spares the engine a prompt rescan
            began = loop.time()
            try:
                await self._read_step(ids, finish)
            except ProxyError as exc:
                log.warning("streaming text stopped for this answer: %s", exc.message)
                return False
            if finish is not None:
                return True
            next_at = began + max(self.interval_s, READ_COST_FACTOR * (loop.time() - began))

    def reply(self, stop_reason: str | int | None) -> Reply:
        """The whole answer read (after `run()` returned True); the text cut before a stop string that ended it,
        as the chat route cuts it."""
        content = self._read["content"]
        if isinstance(stop_reason, str) and stop_reason in content:
            content = content[:content.index(stop_reason)]
        calls = [ToolCall(id=call.id, name=call.name, arguments=call.arguments)
                 for _, call in sorted(self._calls.items())]
        return Reply(content=content if content or not calls else None, reasoning=self._read["reasoning"] or None,
                     tool_calls=calls)

    async def _read_step(self, ids: list[int], finish: str | None) -> None:
        request = DerenderStreamRequest(
            generate_chunk=GenerateResponse([DerenderChoice(ids, finish)]), stream_state=self._state,
            chat_request=self.chat_request, prompt_token_ids=ids_array(self.prompt.text),
            prompt_tokens=self.prompt.count,
            model=await self.engine.served_model())
        data, _, _ = await self.engine.post("/v1/chat/completions/derender", _ENCODER.encode(request))
        try:
            reply = DERENDER_STREAM_DECODER.decode(data)
        except msgspec.DecodeError as exc:
            raise ProxyError(502, f"the engine at {self.engine.url} sent a streaming derender reply this proxy "
                                  f"cannot read: {exc}") from None
        self.reads += 1
        self._state = reply.stream_state
        for choice in reply.chunk.choices:
            delta = choice.delta
            self._read["reasoning"] += delta.reasoning or delta.reasoning_content or ""
            self._read["content"] += delta.content or ""
            for piece in delta.tool_calls or ():
                call = self._calls.setdefault(piece.index, ToolCall(id="", name="", arguments=""))
                function = piece.function or FunctionDelta()
                self._calls[piece.index] = ToolCall(id=call.id or piece.id or "",
                                                    name=call.name + (function.name or ""),
                                                    arguments=call.arguments + (function.arguments or ""))
        if finish is not None:
            return  # the last read's text goes out with the finish, in one send
        for kind in ("reasoning", "content"):
            if kind == "reasoning" and self.sent["content"]:
                continue  # reasoning comes before the text; any after it waits for the answer
            text = self._read[kind]
            ready = text[len(self.sent[kind]):_settled(text, self.stops)]
            if ready:
                self.sent[kind] += ready
                self.emit(kind, ready)


def _settled(text: str, stops: list[str]) -> int:
    """How much of `text` is final: all of it but a stop string met in it, or a tail that could begin one."""
    end = len(text)
    for stop in stops:
        found = text.find(stop)
        if found >= 0:
            end = min(end, found)
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                end = min(end, len(text) - size)
                break
    return end
