"""The control API's requests and replies, shared by the server (`control_routes`) and `ProxyClient`."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec


class SessionCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    metadata: dict[str, Any] = {}
    max_turns: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_tokens_per_turn: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # Each engine call of the session that sends no seed of its own is sampled with one derived from this
    # and the call's number (`proxy.sampling.call_seed`), so a rollout can be sampled again exactly.
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None


class SessionInfo(msgspec.Struct, kw_only=True, frozen=True):
    """What an agent needs to reach its capture session."""

    id: str
    key: str
    openai_base_url: str
    anthropic_base_url: str
    gemini_base_url: str  # Google's SDKs append /v1beta/models/{model}:{method} to it


class SessionSummary(msgspec.Struct, kw_only=True):
    id: str
    created_at: float
    closed: bool
    turns: int
    calls: int
    budget_stops: int
    max_turns: int | None
    max_tokens_per_turn: int | None
    seed: int | None
    metadata: dict[str, Any]


class SessionList(msgspec.Struct):
    sessions: list[SessionSummary]


class Deleted(msgspec.Struct):
    deleted: str


class Paused(msgspec.Struct):
    paused: bool
    in_flight: int = 0


class PolicyVersion(msgspec.Struct, forbid_unknown_fields=True):
    version: Annotated[int, msgspec.Meta(ge=0)]


class Recovery(msgspec.Struct, kw_only=True):
    """What the proxy's start-up read back from its store, and what it could not."""

    sessions: int = 0
    turns: int = 0  # turns rebuilt exactly
    lost_turns: int = 0  # logged turns that could not be rebuilt exactly (never served, never guessed)
    quarantined_lines: int = 0  # damaged lines skipped; their bytes are kept under STORE/quarantine/
    duplicate_lines: int = 0  # lines logged twice, counted once
    unreadable_files: int = 0  # files that are not a session log (left untouched)


class EngineHealth(msgspec.Struct, kw_only=True):
    """One engine behind the proxy: `serving`, `stale` (alive, waiting for the run's weights) or `down`."""

    url: str
    state: str
    version: str | None  # the weight version it reported last
    reason: str | None  # why it is not serving
    open_sessions: int  # open sessions bound to it
    sessions: int  # sessions ever bound to it
    samples: int  # samples it answered
    data_parallel: int = 1  # its data-parallel copies (vLLM's --data-parallel-size), each a place sessions stay


class Health(msgspec.Struct, kw_only=True):
    status: str  # "ok" (HTTP 200), or "unavailable" (503: no call can be served now, and `reason` says why)
    sessions: int
    paused: bool
    in_flight: int
    policy_version: int | None
    engines: list[EngineHealth]
    recovery: Recovery = msgspec.field(default_factory=Recovery)
    connections: int = 0
    connections_refused: int = 0  # closed at accept: over a budget with no idle unknown connection to close
    connections_evicted: int = 0  # idle connections no key owns, closed to make room for a new one
    reason: str | None = None  # waiting for the engine at start, or no engine serving


class ErrorDetail(msgspec.Struct):
    message: str
    type: str = "api_error"


class ErrorReply(msgspec.Struct):
    error: ErrorDetail
