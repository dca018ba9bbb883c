"""Capture sessions: one per rollout, each with its own key, capture graph, budget and log.

In memory a session keeps, per turn, only its encoded log line (delta-encoded, a few KB) plus the
capture graph's new tokens, so a long rollout costs memory in proportion to what it adds. Full
`TrainingTrace`s are built on demand when the trace is fetched.
"""

from __future__ import annotations

import os
import secrets
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from harness_rl.trace import (
    PrefixBreak,
    PromptSource,
    Reply,
    Sampling,
    StoredTurn,
    TrainingTrace,
    VersionSpan,
    rebuild_turns,
)
from proxy.capture import SEP, CaptureGraph, Node, offset_after, token_ids, token_text
from proxy.control_api import SessionSummary
from proxy.store import (
    BudgetStop,
    Closed,
    SessionLog,
    SessionOpened,
    Undelivered,
    decode_turn,
    encode_line,
    read_log,
)
from proxy.tito import CONTINUING, DIGEST, Remembered, ReplyIndex, common_messages, digests


@dataclass(slots=True)
class CapturedTurn:
    line: bytes
    delivered: bool = True


@dataclass(slots=True)
class TurnCapture:
    """Everything recorded about one engine call, as the dialect handler hands it over."""

    prompt_text: bytes  # the engine's prompt ids as token text (proxy.capture)
    n_prompt: int
    completion_ids: list[int]
    logps: list[float]
    messages: list[bytes]  # each forwarded message, JSON-encoded
    message_digests: bytes  # proxy.tito.digests(messages)
    tools: bytes | None  # the forwarded tools list, JSON-encoded
    reply: Reply
    sampling: Sampling
    rendered: tuple[int, int] | None  # proxy.tito.fingerprint of the template's rendering of the conversation
    metadata: dict[str, Any]
    policy_version: int | None
    version_spans: list[VersionSpan]
    finish_reason: str | None
    started_at: float
    finished_at: float
    prompt_source: PromptSource | None = None
    prefix_break: PrefixBreak | None = None


class Session:
    def __init__(self, opened: SessionOpened, log: SessionLog) -> None:
        self.opened = opened
        self.log = log
        self.graph = CaptureGraph()
        self.turns: dict[str, CapturedTurn] = {}
        self.replies = ReplyIndex()
        self.continued: set[str] = set()  # turns the agent went on from although no prompt extends them
        self.closed = False
        self.calls = 0
        self.budget_stops = 0

    @property
    def id(self) -> str:
        return self.opened.id

    @property
    def key(self) -> str:
        return self.opened.key

    def admit(self) -> bool:
        """Count one engine call against the step budget; False once the budget is spent."""
        if self.opened.max_turns is not None and self.calls >= self.opened.max_turns:
            return False
        self.calls += 1
        return True

    def release(self) -> None:
        """Give back an admitted call that produced no turn (the engine failed)."""
        self.calls -= 1

    def record_budget_stop(self) -> None:
        self.budget_stops += 1
        self.log.append(encode_line(BudgetStop(time.time())))

    def record(self, capture: TurnCapture) -> str:
        """Add a turn to the graph and append it to the log; return its node id."""
        node_id = secrets.token_hex(6)
        while node_id in self.turns:
            node_id = secrets.token_hex(6)
        completion_text = token_text(capture.completion_ids)
        sequence = capture.prompt_text + completion_text
        message_digests = capture.message_digests
        tools_digest = hash(capture.tools) if capture.tools is not None else None
        node = Node(node_id, len(capture.prompt_text), len(completion_text), capture.tools is not None,
                    capture.started_at, request_key=_request_key(message_digests, tools_digest),
                    tokens=capture.n_prompt + len(capture.completion_ids))
        base = self.graph.add(node, sequence)
        base_turn = self.replies.calls.get(base.node_id) if base.node_id else None
        prefix = common_messages(base_turn.message_digests, message_digests) if base_turn else 0
        inherit_tools = base_turn is not None and tools_digest is not None and base_turn.tools_digest == tools_digest
        line = encode_line(StoredTurn(
            node_id=node_id, base=base.node_id, shared=sequence.count(SEP, 0, base.shared),
            tail=token_ids(sequence[base.shared:]), n_prompt=capture.n_prompt, per_token_logps=capture.logps,
            policy_version=capture.policy_version, version_spans=capture.version_spans,
            finish_reason=capture.finish_reason,
            prompt_source=capture.prompt_source, prefix_break=capture.prefix_break, messages_prefix=prefix,
            messages=[msgspec.Raw(m) for m in capture.messages[prefix:]],
            tools=None if inherit_tools or capture.tools is None else msgspec.Raw(capture.tools),  # type: ignore[arg-type]
            tools_inherited=inherit_tools, reply=capture.reply, sampling=capture.sampling, metadata=capture.metadata,
            started_at=capture.started_at, finished_at=capture.finished_at,
        ))
        self.log.append(line)
        self.turns[node_id] = CapturedTurn(line)
        self.replies.add(node_id, Remembered(message_digests, tools_digest, capture.reply, capture.rendered))
        self._note_continuation(capture.prefix_break)
        return node_id

    def mark_undelivered(self, node_id: str) -> None:
        self.log.append(encode_line(Undelivered(node_id)))
        self.turns[node_id].delivered = False

    def close(self) -> None:
        """Refuse further agent calls; the log's file is released (a late in-flight turn reopens it)."""
        if not self.closed:
            self.closed = True
            self.log.append(encode_line(Closed(time.time())))
            self.log.close()

    def replay(self, line: Any, raw: bytes) -> None:
        """Rebuild state from one log line (recovery after a restart)."""
        if isinstance(line, StoredTurn):
            base = self.replies.calls.get(line.base) if line.base else None
            base_sequence = self.graph.sequence(line.base) if base and line.base else b""
            sequence = base_sequence[:offset_after(base_sequence, line.shared)] + token_text(line.tail)
            prompt_len = offset_after(sequence, line.n_prompt)
            own = digests([msgspec.json.encode(m) for m in line.messages or ()])
            message_digests = (base.message_digests[:line.messages_prefix * DIGEST] if base else b"") + own
            tools_digest = base.tools_digest if line.tools_inherited and base else (
                hash(msgspec.json.encode(line.tools)) if line.tools is not None else None)
            node = Node(line.node_id, prompt_len, len(sequence) - prompt_len, tools_digest is not None,
                        line.started_at or 0.0, request_key=_request_key(message_digests, tools_digest),
                        tokens=sequence.count(SEP))
            self.graph.add(node, sequence)
            self.turns[line.node_id] = CapturedTurn(raw + b"\n")
            self.replies.add(line.node_id, Remembered(message_digests, tools_digest, line.reply))
            self._note_continuation(line.prefix_break)
            self.calls += 1
        elif isinstance(line, Undelivered) and line.node_id in self.turns:
            self.turns[line.node_id].delivered = False
        elif isinstance(line, Closed):
            self.closed = True
        elif isinstance(line, BudgetStop):
            self.budget_stops += 1

    def _note_continuation(self, prefix_break: PrefixBreak | None) -> None:
        if prefix_break is not None and prefix_break.against and prefix_break.cause in CONTINUING:
            self.continued.add(prefix_break.against)

    def summary(self) -> SessionSummary:
        return SessionSummary(id=self.id, created_at=self.opened.created_at, closed=self.closed,
                              turns=len(self.turns), calls=self.calls, budget_stops=self.budget_stops,
                              max_turns=self.opened.max_turns, max_tokens_per_turn=self.opened.max_tokens_per_turn,
                              metadata=self.opened.metadata)

    def snapshot(self) -> TraceSnapshot:
        """What a trace is built from, copied out of the live session (cheap: no decoding)."""
        parents, roles = self.graph.roles(self.continued)
        rows = [(node_id, c.line, c.delivered) for node_id, c in self.turns.items()]
        metadata = {**self.opened.metadata, "closed": self.closed, "budget_stops": self.budget_stops}
        return TraceSnapshot(self.id, parents, roles, rows, metadata)

    def trace(self) -> TrainingTrace:
        """The session's `TrainingTrace`, with parents and roles from the capture graph (not validated here)."""
        return self.snapshot().build()


@dataclass(slots=True)
class TraceSnapshot:
    """A session's turns frozen at one moment; `build()` may run off the event loop."""

    rollout_id: str
    parents: dict[str, str | None]
    roles: dict[str, str]
    rows: list[tuple[str, bytes, bool]]  # node id, log line, delivered
    metadata: dict[str, Any]

    def build(self) -> TrainingTrace:
        stored = []
        for node_id, raw, delivered in self.rows:
            turn = decode_turn(raw)
            turn.parent_id, turn.role, turn.delivered = self.parents[node_id], self.roles[node_id], delivered
            stored.append(turn)
        return TrainingTrace(rollout_id=self.rollout_id, turns=rebuild_turns(stored), metadata=self.metadata)


def _request_key(message_digests: bytes, tools_digest: int | None) -> bytes:
    """Equal for two calls with the same messages and tools: the second is a retry of the first."""
    return message_digests + (array("q", [tools_digest]).tobytes() if tools_digest is not None else b"")


def trace_from_log(path: Path) -> TrainingTrace:
    """The trace of one session log file, rebuilt as the proxy would serve it (read-only)."""
    lines, _ = read_log(path)
    if not lines or not isinstance(lines[0][0], SessionOpened):
        raise ValueError(f"{path} is not a proxy session log (no session line first)")
    session = Session(lines[0][0], SessionLog(path, fsync=False))
    for line, raw in lines[1:]:
        session.replay(line, raw)
    return session.trace()


class SessionRegistry:
    """Every session of one proxy, by id and by key, backed by one log file each under `store_dir`."""

    def __init__(self, store_dir: Path, *, fsync: bool = False) -> None:
        self.store_dir = store_dir
        self.fsync = fsync
        self.by_id: dict[str, Session] = {}
        self.by_key: dict[str, Session] = {}
        store_dir.mkdir(parents=True, exist_ok=True)

    def create(self, metadata: dict[str, Any] | None = None, max_turns: int | None = None,
               max_tokens_per_turn: int | None = None) -> Session:
        opened = SessionOpened(id="s" + secrets.token_hex(12), key="hrl-" + secrets.token_urlsafe(24),
                               created_at=time.time(), metadata=metadata or {}, max_turns=max_turns,
                               max_tokens_per_turn=max_tokens_per_turn)
        session = Session(opened, SessionLog(self._path(opened.id), fsync=self.fsync))
        session.log.append(encode_line(opened))
        self._add(session)
        return session

    def delete(self, session: Session) -> None:
        self.by_id.pop(session.id, None)
        self.by_key.pop(session.key, None)
        session.log.delete()

    def recover(self) -> int:
        """Load every session log under the store; return how many turns came back."""
        restored = 0
        for path in sorted(self.store_dir.glob("s*.jsonl")):
            lines, good = read_log(path)
            if not lines or not isinstance(lines[0][0], SessionOpened):
                continue
            if good < path.stat().st_size:
                os.truncate(path, good)
            session = Session(lines[0][0], SessionLog(path, fsync=self.fsync))
            for line, raw in lines[1:]:
                session.replay(line, raw)
            restored += len(session.turns)
            self._add(session)
        return restored

    def close_all(self) -> None:
        for session in self.by_id.values():
            session.log.close()

    def _add(self, session: Session) -> None:
        self.by_id[session.id] = session
        self.by_key[session.key] = session

    def _path(self, session_id: str) -> Path:
        return self.store_dir / f"{session_id}.jsonl"
