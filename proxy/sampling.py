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
from proxy.chat import Knobs
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
