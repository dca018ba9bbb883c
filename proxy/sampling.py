"""The proxy's sampling policy: behaviour logprobs only tell the truth about the distribution sampled.

Temperature is pinned (a training run samples at one temperature), and knobs that truncate or
reshape the distribution (top_p, top_k, min_p, penalties) are either neutralised (not sent) or
refused. `apply` never edits the call: it returns what the engine gets and the `Sampling` record
the turn keeps (what was applied and what the agent asked for).
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

import msgspec

from harness_rl.trace import Sampling
from proxy.chat import ChatCall, Dialect, Knobs
from proxy.errors import ProxyError

# Knob -> the value at which it leaves the distribution untouched.
NEUTRAL = {
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}
Truncation = Literal["neutralise", "reject"]
# Where each dialect's agent set its output budget, for the error that names it.
MAX_TOKENS_FIELDS: dict[Dialect, str] = {
    "openai_chat": "max_tokens", "anthropic_messages": "max_tokens", "openai_responses": "max_output_tokens",
    "google_gemini": "generationConfig.maxOutputTokens",
}
CONTEXT_CEILING = 2**31 - 1  # no engine's context is longer; the bound when an engine does not say its own


class Applied(msgspec.Struct, kw_only=True, frozen=True):
    """The sampling fields sent to the engine."""

    temperature: float | None
    max_tokens: int | None
    seed: int | None
    stop: list[str] | None


class SamplingPolicy(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    temperature: Annotated[Annotated[float, msgspec.Meta(gt=0)] | None, msgspec.Meta(
        description="sampling temperature pinned at the proxy; none passes each agent's own through")] = 1.0
    truncation: Annotated[Truncation, msgspec.Meta(
        description="what to do with knobs that truncate the distribution (top_p, top_k, min_p, penalties)")] \
        = "neutralise"

    def apply(self, knobs: Knobs, session_cap: int | None, seed: int | None = None) -> tuple[Applied, Sampling]:
        """What the engine gets for these knobs, and the record of it; a refused knob is a 400. `seed` is
        the session's seed for this call (`call_seed`), used when the agent sends none."""
        requested = msgspec.structs.asdict(knobs)
        requested = {k: v for k, v in requested.items() if v is not None}
        for knob, neutral in NEUTRAL.items():
            value = requested.get(knob)
            if value is not None and value != neutral and self.truncation == "reject":
                raise ProxyError(400, f"{knob}={value!r} would truncate the sampling distribution and make "
                                      f"behaviour logprobs lie; this proxy refuses it (leave {knob} unset)")
        temperature = self.temperature if self.temperature is not None else knobs.temperature
        caps = [c for c in (knobs.max_tokens, session_cap) if c is not None]
        applied = Applied(temperature=temperature, max_tokens=min(caps) if caps else None,
                          seed=knobs.seed if knobs.seed is not None else seed, stop=knobs.stop)
        record = Sampling(temperature=temperature, max_tokens=applied.max_tokens, seed=applied.seed,
                          stop=knobs.stop or [], requested=requested, truncation=self.truncation)
        return applied, record


def call_seed(session_seed: int, call: int) -> int:
    """The sampling seed of a session's `call`-th engine call (1-based), stable across runs and machines
    (31 bits, which every engine takes)."""
    digest = hashlib.sha256(f"{session_seed}/{call}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1


def check_max_tokens(call: ChatCall, context: int | None, session_cap: int | None = None) -> None:
    """Refuse (400) an output budget no engine could honour: longer than the engine's whole context
    (`context`; None: unknown, then longer than any context).

    vLLM's chat route refuses such a request; its token-in generate route clamps it silently, so the
    proxy refuses it before anything is sent or recorded, as the agent's API would. A session the run
    capped (`session_cap`) asks the engine for at most its cap, so an agent's larger request within any
    context (kimi-code asks for 131,072 tokens whatever the model) is capped there, not refused.
    """
    requested = call.knobs.max_tokens
    if requested is None:
        return
    capped = min(requested, session_cap) if session_cap is not None and requested <= CONTEXT_CEILING else requested
    limit = context if context is not None else CONTEXT_CEILING
    if capped > limit:
        where = f"the engine's {context}-token context" if context is not None else f"{limit} tokens"
        raise ProxyError(400, f"{MAX_TOKENS_FIELDS[call.dialect]}: {requested} is more than {where} (prompt and "
                              "completion together); request fewer output tokens")
