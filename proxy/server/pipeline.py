"""The capture pipeline: one agent call from admission to a durably recorded turn and its `Answer`.

hold while the learner syncs weights → apply the sampling policy → make the prompt ids (spliced onto
the earlier turn the agent continues, else rendered: `proxy.capture.prompts`) → sample from them (`generate`)
→ check ids, logprobs and usage → read the answer with the engine's own parsers (`derender`) →
append the turn to the session's log → build the dialect-neutral answer. Only then does a dialect
render it to the agent.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import msgspec

from harness_rl.trace import Reply, Sampling, ToolCall, VersionSpan
from proxy.capture.prompts import Prompt, PromptMaker
from proxy.capture.session import Session, TurnCapture
from proxy.capture.tito import digests
from proxy.chat import Answer, ChatCall, SampledToken
from proxy.config import ProxyConfig
from proxy.sampling import call_seed
from proxy.upstream.client import ChatRender, EngineClient, Generated
from proxy.upstream.pool import sampled_by
from proxy.upstream.wire import SamplingParams, WeightVersionSpan

BUDGET_MESSAGE = "Step budget exhausted; stopping."
_ENCODER = msgspec.json.Encoder()


class Gate:
    """Holds new engine calls while paused; `pause()` returns once every call already at the engine is recorded."""

    def __init__(self) -> None:
        self._running = asyncio.Event()
        self._running.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.in_flight = 0

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    async def enter(self) -> None:
        await self._running.wait()
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def pause(self, drain: bool = True) -> None:
        self._running.clear()
        if drain:
            await self._idle.wait()

    def resume(self) -> None:
        self._running.set()


class Prepared(msgspec.Struct, frozen=True, kw_only=True):
    """One call made ready for the engine: its prompt ids, what it samples with, and what its turn records."""

    prompt: Prompt
    params: SamplingParams
    stops: list[str]  # stop strings (the engine stops after them; the agent never sees them)
    sampling: Sampling
    parsing: bytes  # the chat body the engine's parsers read the answer against (its last message only)
    messages: list[bytes]
    message_digests: bytes
    tools: bytes | None
    started: float
    version_at_start: int | None


class CapturePipeline:
    def __init__(self, config: ProxyConfig, engine: EngineClient) -> None:
        self.config = config
        self.engine = engine
        self.gate = Gate()
        self.prompts = PromptMaker(engine, tito=config.tito, check_tokens=config.splice_check_tokens,
                                   local_render=config.local_render)
        self.announced_version: int | None = None  # the learner's latest, for engines that do not stamp replies

    async def capture(self, session: Session, call: ChatCall, harness: dict[str, str],
                      answer_id: str | None = None) -> tuple[Answer, str]:
        """Ask the engine, check and record the turn; return the answer and the turn's node id.

        The caller holds the gate (`Gate.enter`) and has admitted the call against the session's budget.
        """
        prepared = await self.prepare(session, call)
        sample = await self.engine.generate(prepared.prompt.ids, prepared.params)
        reply = await self.read(prepared, sample)
        return self.record(session, call, harness, prepared, sample, reply, answer_id)

    async def prepare(self, session: Session, call: ChatCall) -> Prepared:
        """The sampling the policy allows and the prompt ids (spliced or rendered)."""
        seed = call_seed(session.opened.seed, session.calls) if session.opened.seed is not None else None
        applied, sampling = self.config.sampling.apply(call.knobs, session.opened.max_tokens_per_turn, seed)
        encoded = [_ENCODER.encode(m) for m in call.messages]
        tools = _ENCODER.encode(call.tools) if call.tools else None
        conversation = conversation_of(call, encoded, tools)
        message_digests = digests(encoded)
        started, version_at_start = time.time(), self.announced_version
        prompt = await self.prompts.make(session, call, conversation, message_digests, hash(tools) if tools else None)
        params = SamplingParams.capturing(temperature=applied.temperature, max_tokens=applied.max_tokens,
                                          seed=applied.seed, stop=applied.stop)
        # The parsers read the request's tools, tool choice and template kwargs, never its history: sending the
        # last message alone keeps derender's cost flat however long the conversation grows.
        parsing = msgspec.structs.replace(conversation, messages=conversation.messages[-1:])
        return Prepared(prompt=prompt, params=params, stops=applied.stop or [], sampling=sampling,
                        parsing=_ENCODER.encode(parsing), messages=encoded,
                        message_digests=message_digests, tools=tools, started=started,
                        version_at_start=version_at_start)

    async def read(self, prepared: Prepared, sample: Generated) -> Reply:
        """The reply in the sampled ids, read by the engine's own parsers."""
        message = await self.engine.derender(sample, prepared.parsing, prepared.prompt.ids)
        return Reply(content=message.content, reasoning=message.reasoning_text,
                     tool_calls=[ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                                 for c in message.tool_calls or ()])

    def record(self, session: Session, call: ChatCall, harness: dict[str, str], prepared: Prepared,
               sample: Generated, reply: Reply, answer_id: str | None = None) -> tuple[Answer, str]:
        """Append the turn to the session's log; the answer to give (under `answer_id`, if the dialect chose one)."""
        finished = time.time()
        finish = "tool_calls" if reply.tool_calls and sample.finish_reason == "stop" else sample.finish_reason
        metadata: dict[str, Any] = {"dialect": call.dialect, "model": call.model,
                                    "served_model": self.engine.model or None, "stream": call.stream,
                                    "harness": harness, "engine_attempts": sample.attempts,
                                    "engine": sampled_by() or self.engine.url}
        if call.ignored:
            metadata["ignored_fields"] = call.ignored
        prompt = prepared.prompt
        metadata["rendered_by"] = prompt.rendered_by
        if prompt.render_note is not None:
            metadata["render"] = prompt.render_note
        if prompt.render_mismatch is not None:
            metadata["render_mismatch"] = prompt.render_mismatch
        spans = _version_spans(sample.spans, prepared.version_at_start)
        version = spans[0].version if spans else sample.policy_version if sample.policy_version is not None \
            else self.announced_version
        node_id = session.record(TurnCapture(
            prompt_text=prompt.ids.text, n_prompt=prompt.ids.count, completion_ids=sample.ids, logps=sample.logps,
            messages=prepared.messages, message_digests=prepared.message_digests, tools=prepared.tools, reply=reply,
            sampling=prepared.sampling, rendered=prompt.rendered,
            metadata=metadata, policy_version=version, version_spans=spans if len(spans) > 1 else [],
            finish_reason=finish, started_at=prepared.started,
            finished_at=finished, prompt_source=prompt.source, prefix_break=prompt.prefix_break))
        answer = Answer(id=answer_id or new_answer_id(), created=int(prepared.started), model=call.model,
                        reply=reply, finish_reason=finish, prompt_tokens=prompt.ids.count,
                        completion_tokens=len(sample.ids),
                        logprobs=[SampledToken(i, lp) for i, lp in zip(sample.ids, sample.logps, strict=True)]
                        if call.logprobs else None)
        return answer, node_id


def conversation_of(call: ChatCall, encoded: list[bytes] | None = None, tools: bytes | None = None) -> ChatRender:
    """The call's conversation as the engine renders it (its messages and tools JSON-encoded, unless given)."""
    encoded = [_ENCODER.encode(m) for m in call.messages] if encoded is None else encoded
    tools = (_ENCODER.encode(call.tools) if call.tools else None) if tools is None else tools
    return ChatRender(messages=[msgspec.Raw(m) for m in encoded], add_generation_prompt=True,
                      tools=msgspec.Raw(tools) if tools else None, tool_choice=call.tool_choice,
                      chat_template_kwargs=call.chat_template_kwargs)


def new_answer_id() -> str:
    return f"chatcmpl-{secrets.token_hex(12)}"


def budget_answer(call: ChatCall, answer_id: str | None = None) -> Answer:
    """The answer given, without asking the engine, once a session's step budget is spent (never recorded)."""
    return Answer(id=answer_id or f"chatcmpl-budget-{secrets.token_hex(6)}", created=int(time.time()), model=call.model,
                  reply=Reply(content=BUDGET_MESSAGE), finish_reason="stop", prompt_tokens=0, completion_tokens=0)


def _version_spans(spans: list[WeightVersionSpan], version_at_start: int | None) -> list[VersionSpan]:
    """The engine's spans as policy versions. vLLM names the weights it started with "default"; that can
    only be the first span, sampled before any sync of this request landed, so it is the version announced
    when the request began. Unknown versions leave the turn to the announced one (no spans)."""
    def version(name: str) -> int | None:
        return int(name) if name.isdigit() else version_at_start if name == "default" else None

    versions = [version(s.version) for s in spans]
    return [VersionSpan(version=v, start=s.start, end=s.end) for v, s in zip(versions, spans, strict=True)
            if v is not None] if None not in versions else []
