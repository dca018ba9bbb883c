"""The capture pipeline: one agent call from admission to a durably recorded turn and its `Answer`.

admit against the session's budget → hold while the learner syncs weights → apply the sampling
policy → ask the engine with capture on → check ids, logprobs and usage → append the turn to the
session's log → build the dialect-neutral answer. Only then does a dialect render it to the agent.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import msgspec

from harness_rl.trace import Reply, ToolCall
from proxy.chat import Answer, ChatCall, SampledToken
from proxy.config import ProxyConfig
from proxy.session import Session, TurnCapture
from proxy.upstream import EngineChatRequest, EngineClient

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

    async def pause(self) -> None:
        self._running.clear()
        await self._idle.wait()

    def resume(self) -> None:
        self._running.set()


class CapturePipeline:
    def __init__(self, config: ProxyConfig, engine: EngineClient) -> None:
        self.config = config
        self.engine = engine
        self.gate = Gate()
        self.announced_version: int | None = None  # the learner's latest, for engines that do not stamp replies

    async def capture(self, session: Session, call: ChatCall, harness: dict[str, str]) -> tuple[Answer, str]:
        """Ask the engine, check and record the turn; return the answer and the turn's node id.

        The caller holds the gate (`Gate.enter`) and has admitted the call against the session's budget.
        """
        applied, sampling = self.config.sampling.apply(call.knobs, session.opened.max_tokens_per_turn)
        encoded = [_ENCODER.encode(m) for m in call.messages]
        tools = _ENCODER.encode(call.tools) if call.tools else None
        request = EngineChatRequest.capturing(
            [msgspec.Raw(m) for m in encoded], tools=msgspec.Raw(tools) if tools else None,
            tool_choice=call.tool_choice, temperature=applied.temperature, max_tokens=applied.max_tokens,
            seed=applied.seed, stop=applied.stop, chat_template_kwargs=call.chat_template_kwargs)
        started = time.time()
        result = await self.engine.chat(request)
        finished = time.time()
        choice = result.reply.choices[0]
        message = choice.message
        reply = Reply(content=message.content, reasoning=message.reasoning_text,
                      tool_calls=[ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                                  for c in message.tool_calls or ()])
        ids = choice.token_ids or []
        logps = [e.logprob for e in (choice.logprobs.content if choice.logprobs and choice.logprobs.content else ())]
        finish = choice.finish_reason or "stop"
        metadata: dict[str, Any] = {"dialect": call.dialect, "model": call.model,
                                    "served_model": self.engine.model or None, "stream": call.stream,
                                    "harness": harness, "engine_attempts": result.attempts}
        if call.ignored:
            metadata["ignored_fields"] = call.ignored
        version = result.policy_version if result.policy_version is not None else self.announced_version
        node_id = session.record(TurnCapture(
            prompt_text=result.prompt_text, n_prompt=result.n_prompt, completion_ids=ids, logps=logps,
            messages=encoded, tools=tools, reply=reply, sampling=sampling, metadata=metadata,
            policy_version=version, finish_reason=finish, started_at=started, finished_at=finished))
        answer = Answer(id=result.reply.id or f"chatcmpl-{secrets.token_hex(12)}",
                        created=result.reply.created or int(started), model=call.model, reply=reply,
                        finish_reason=finish, prompt_tokens=result.n_prompt, completion_tokens=len(ids),
                        logprobs=[SampledToken(i, lp) for i, lp in zip(ids, logps, strict=True)]
                        if call.logprobs else None)
        return answer, node_id


def budget_answer(call: ChatCall) -> Answer:
    """The answer given, without asking the engine, once a session's step budget is spent (never recorded)."""
    return Answer(id=f"chatcmpl-budget-{secrets.token_hex(6)}", created=int(time.time()), model=call.model,
                  reply=Reply(content=BUDGET_MESSAGE), finish_reason="stop", prompt_tokens=0, completion_tokens=0)
