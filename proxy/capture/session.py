"""Capture sessions: one per rollout, each with its own key, capture graph, budget and log.

In memory a session keeps, per turn, only its encoded log line (delta-encoded, a few KB) plus the
capture graph's new tokens, so a long rollout costs memory in proportion to what it adds. Full
`TrainingTrace`s are built on demand when the trace is fetched.

What a damaged line costs is bounded: every turn written as a delta rests on a turn written whole
(its anchor), and once `whole_turn_every` turns rest on one anchor the next is written whole instead
(memory keeps its delta). A linear session thus stores a whole turn every `whole_turn_every` turns,
and a damaged or missing log line costs at most `whole_turn_every` turns, however long the session.
Recovery (`proxy.capture.recovery`) rebuilds every turn whose stored form does not depend on a damaged or
missing line; a turn that cannot be rebuilt exactly is counted lost and left out, never guessed.
Once a session is closed or deleted nothing more is written: a call still in flight then is
answered with an error and its turn is not recorded.
"""

from __future__ import annotations

import hmac
import math
import re
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
from proxy.capture.branches import classify
from proxy.capture.graph import CaptureGraph, Node
from proxy.capture.store import (
    BudgetStop,
    Closed,
    SessionLog,
    SessionOpened,
    Undelivered,
    decode_turn,
    encode_line,
    key_digest,
    private_dir,
)
from proxy.capture.tito import (
    CONTINUING,
    DIGEST,
    Remembered,
    ReplyIndex,
    common_messages,
    digests,
    ended_by_stop_token,
)
from proxy.control_api import Recovery, SessionSummary
from proxy.errors import ProxyError
from proxy.tokens import SEP, offset_after, token_ids, token_text


@dataclass(slots=True)
class CapturedTurn:
    line: bytes
    anchor: str  # the turn written whole that this one's logged form rests on (its own id: written whole)
    delivered: bool = True


@dataclass(slots=True)
class TurnCapture:
    """Everything recorded about one engine call, as the dialect handler hands it over."""

    prompt_text: bytes  # the engine's prompt ids as token text (proxy.tokens)
    n_prompt: int
    completion_ids: list[int]
    logps: list[float]
    messages: list[bytes]  # each forwarded message, JSON-encoded
    message_digests: bytes  # proxy.capture.tito.digests(messages)
    tools: bytes | None  # the forwarded tools list, JSON-encoded
    reply: Reply
    sampling: Sampling
    rendered: tuple[int, int] | None  # proxy.capture.tito.fingerprint of the template's rendering of the conversation
    metadata: dict[str, Any]
    policy_version: int | None
    version_spans: list[VersionSpan]
    finish_reason: str | None
    started_at: float
    finished_at: float
    prompt_source: PromptSource | None = None
    prefix_break: PrefixBreak | None = None


class Session:
    def __init__(self, opened: SessionOpened, log: SessionLog, *, whole_turn_every: int | None = None) -> None:
        self.opened = opened
        self.log = log
        self.whole_turn_every = whole_turn_every
        self.graph = CaptureGraph()
        self.turns: dict[str, CapturedTurn] = {}
        self.resting: dict[str, int] = {}  # per anchor: the logged turns resting on it, itself included
        self.replies = ReplyIndex()
        self.continued: set[str] = set()  # turns the agent went on from although no prompt extends them
        self.closed = False
        self.deleted = False
        self.calls = 0
        self.budget_stops = 0

    @property
    def id(self) -> str:
        return self.opened.id

    def accepts(self, presented: str) -> bool:
        """Whether `presented` is this session's key (compared in constant time, as digests)."""
        return hmac.compare_digest(key_digest(presented), self.opened.key_digest)

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
        if self.log.sealed:
            return
        self.budget_stops += 1
        self.log.append(encode_line(BudgetStop(time.time())))

    def record(self, capture: TurnCapture) -> str:
        """Add a turn to the graph and append it to the log; return its node id.

        Refused (nothing recorded) once the session is closed or deleted, even for a call that was
        already at the engine then: a closed session's trace never changes.
        """
        if self.deleted:
            raise ProxyError(404, f"session {self.id} was deleted while this call was in flight; its turn was not "
                                  "recorded")
        if self.closed:
            raise ProxyError(409, f"session {self.id} was closed while this call was in flight; its turn was not "
                                  "recorded")
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
        stored = StoredTurn(
            node_id=node_id, base=base.node_id, shared=sequence.count(SEP, 0, base.shared),
            tail=token_ids(sequence[base.shared:]), n_prompt=capture.n_prompt, per_token_logps=capture.logps,
            policy_version=capture.policy_version, version_spans=capture.version_spans,
            finish_reason=capture.finish_reason,
            prompt_source=capture.prompt_source, prefix_break=capture.prefix_break, messages_prefix=prefix,
            messages=[msgspec.Raw(m) for m in capture.messages[prefix:]],
            tools=None if inherit_tools or capture.tools is None else msgspec.Raw(capture.tools),  # type: ignore[arg-type]
            tools_inherited=inherit_tools, reply=capture.reply, sampling=capture.sampling, metadata=capture.metadata,
            started_at=capture.started_at, finished_at=capture.finished_at,
        )
        line = encode_line(stored)
        anchor = self._anchor(node_id, stored)
        if anchor == node_id and stored.base:  # the log gets this turn whole, memory its delta
            self.log.append(encode_line(msgspec.structs.replace(
                stored, base=None, shared=0, tail=token_ids(sequence), messages_prefix=0,
                messages=[msgspec.Raw(m) for m in capture.messages], tools_inherited=False,
                tools=None if capture.tools is None else msgspec.Raw(capture.tools))))
        else:
            self.log.append(line)
        self.turns[node_id] = CapturedTurn(line, anchor)
        self.replies.add(node_id, Remembered(message_digests, tools_digest, capture.reply, capture.rendered,
                                             ended_by_stop_token(capture.finish_reason, capture.sampling)))
        self._note_continuation(capture.prefix_break)
        return node_id

    def _anchor(self, node_id: str, stored: StoredTurn) -> str:
        """The anchor of a turn about to be logged as `stored`: its base's, unless that one holds enough already
        (or it rests on nothing); then the turn itself, to be logged whole."""
        depends = stored.base and (stored.shared or stored.messages_prefix or stored.tools_inherited)
        anchor = self.turns[stored.base].anchor if depends and stored.base else node_id
        if anchor != node_id and self.whole_turn_every is not None and self.resting[anchor] >= self.whole_turn_every:
            anchor = node_id
        self.resting[anchor] = self.resting.get(anchor, 0) + 1
        return anchor

    def mark_undelivered(self, node_id: str) -> None:
        if self.log.sealed:
            return  # closed or deleted meanwhile: its trace no longer changes
        self.log.append(encode_line(Undelivered(node_id)))
        self.turns[node_id].delivered = False

    def close(self) -> None:
        """Refuse further agent calls and seal the log: nothing is written after this line."""
        if not self.closed:
            self.closed = True
            if not self.log.sealed:
                self.log.append(encode_line(Closed(time.time())))
            self.log.seal()

    def replay(self, line: Any, raw: bytes) -> Problem | None:
        """Rebuild state from one log line (recovery after a restart); what is wrong with it, or None."""
        if isinstance(line, StoredTurn):
            return self._replay_turn(line, raw)
        if isinstance(line, SessionOpened):
            return Problem("a second session line", damaged=True)
        if isinstance(line, Undelivered) and line.node_id in self.turns:
            self.turns[line.node_id].delivered = False
        elif isinstance(line, Closed):
            self.closed = True
            self.log.seal()
        elif isinstance(line, BudgetStop):
            self.budget_stops += 1
        return None

    def _replay_turn(self, line: StoredTurn, raw: bytes) -> Problem | None:
        """Put one logged turn back into the graph, only if it can be rebuilt exactly."""
        if line.node_id in self.turns:
            return Problem(f"turn {line.node_id} is logged twice with different contents", damaged=True)
        wrong = _own_problem(line)
        if wrong is not None:
            return Problem(f"turn {line.node_id}: {wrong}", damaged=True)
        depends = bool(line.shared or line.messages_prefix or line.tools_inherited)
        base = self.replies.calls.get(line.base) if depends and line.base else None
        if depends and base is None:
            return Problem(f"turn {line.node_id} is stored against {line.base!r}, which is missing or lost")
        base_sequence = self.graph.sequence(line.base) if base is not None and line.base else b""
        if base is not None and (base_sequence.count(SEP) < line.shared
                                 or len(base.message_digests) < line.messages_prefix * DIGEST):
            return Problem(f"turn {line.node_id} claims more of {line.base} than it holds")
        sequence = base_sequence[:offset_after(base_sequence, line.shared)] + token_text(line.tail)
        n_tokens = line.shared + len(line.tail)
        if not line.n_prompt <= n_tokens or len(line.per_token_logps) != n_tokens - line.n_prompt:
            return Problem(f"turn {line.node_id}: {len(line.per_token_logps)} logprobs for a "
                           f"{n_tokens}-token sequence with a {line.n_prompt}-token prompt", damaged=True)
        prompt_len = offset_after(sequence, line.n_prompt)
        own = digests([msgspec.json.encode(m) for m in line.messages or ()])
        message_digests = (base.message_digests[:line.messages_prefix * DIGEST] if base else b"") + own
        tools_digest = base.tools_digest if line.tools_inherited and base else (
            hash(msgspec.json.encode(line.tools)) if line.tools is not None else None)
        node = Node(line.node_id, prompt_len, len(sequence) - prompt_len, tools_digest is not None,
                    line.started_at or 0.0, request_key=_request_key(message_digests, tools_digest),
                    tokens=sequence.count(SEP))
        self.graph.add(node, sequence)
        anchor = self.turns[line.base].anchor if base is not None and line.base else line.node_id
        self.resting[anchor] = self.resting.get(anchor, 0) + 1
        self.turns[line.node_id] = CapturedTurn(raw + b"\n", anchor)
        self.replies.add(line.node_id, Remembered(message_digests, tools_digest, line.reply,
                                                  stopped=ended_by_stop_token(line.finish_reason, line.sampling)))
        self._note_continuation(line.prefix_break)
        self.calls += 1
        return None

    def _note_continuation(self, prefix_break: PrefixBreak | None) -> None:
        if prefix_break is not None and prefix_break.against and prefix_break.cause in CONTINUING:
            self.continued.add(prefix_break.against)

    def summary(self) -> SessionSummary:
        return SessionSummary(id=self.id, created_at=self.opened.created_at, closed=self.closed,
                              turns=len(self.turns), calls=self.calls, budget_stops=self.budget_stops,
                              max_turns=self.opened.max_turns, max_tokens_per_turn=self.opened.max_tokens_per_turn,
                              seed=self.opened.seed,
                              metadata=self.opened.metadata)

    def snapshot(self) -> TraceSnapshot:
        """What a trace is built from, copied out of the live session (cheap: no decoding)."""
        parents, roles = self.graph.roles(self.continued)
        rows = [(node_id, c.line, c.delivered) for node_id, c in self.turns.items()]
        metadata = {**self.opened.metadata, "closed": self.closed, "budget_stops": self.budget_stops}
        return TraceSnapshot(self.id, parents, roles, rows, metadata)

    def trace(self) -> TrainingTrace:
        """The session's `TrainingTrace`, with parents, roles and branches from the capture graph (not validated
        here)."""
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
        turns = rebuild_turns(stored)
        classify(turns)
        return TrainingTrace(rollout_id=self.rollout_id, turns=turns, metadata=self.metadata)


def _request_key(message_digests: bytes, tools_digest: int | None) -> bytes:
    """Equal for two calls with the same messages and tools: the second is a retry of the first."""
    return message_digests + (array("q", [tools_digest]).tobytes() if tools_digest is not None else b"")


@dataclass(frozen=True, slots=True)
class Problem:
    """Why a log line was not replayed; `damaged` lines are quarantined, the others are only lost."""

    reason: str
    damaged: bool = False


def _own_problem(turn: StoredTurn) -> str | None:
    """What is wrong with a stored turn on its own (ids, logprobs, counts), or None."""
    if turn.tail and min(turn.tail) < 0:
        return "a negative token id"
    logps = turn.per_token_logps
    if logps and (not all(map(math.isfinite, logps)) or max(logps) > 0):
        return "a positive or non-finite logprob"
    if min(turn.shared, turn.n_prompt, turn.messages_prefix) < 0:
        return "a negative count"
    return None


SESSION_ID = re.compile(r"s[0-9a-f]{24}")  # what `SessionRegistry.create` names a session (and its log file)


class SessionRegistry:
    """Every session of one proxy, by id and by key digest, backed by one log file each under `store_dir`.

    The store is private to its owner (0700, files 0600).
    """

    def __init__(self, store_dir: Path, *, fsync: bool = False, whole_turn_every: int | None = None) -> None:
        self.store_dir = private_dir(store_dir)
        self.fsync = fsync
        self.whole_turn_every = whole_turn_every
        self.by_id: dict[str, Session] = {}
        self.by_key: dict[str, Session] = {}  # by key digest
        self.recovery = Recovery()

    def create(self, metadata: dict[str, Any] | None = None, max_turns: int | None = None,
               max_tokens_per_turn: int | None = None, seed: int | None = None) -> tuple[Session, str]:
        """A new session and its key (the only time the key exists in the clear)."""
        key = "hrl-" + secrets.token_urlsafe(24)
        opened = SessionOpened(id="s" + secrets.token_hex(12), key_sha256=key_digest(key), created_at=time.time(),
                               metadata=metadata or {}, max_turns=max_turns, max_tokens_per_turn=max_tokens_per_turn,
                               seed=seed)
        session = Session(opened, SessionLog(self._path(opened.id), fsync=self.fsync),
                          whole_turn_every=self.whole_turn_every)
        session.log.append(encode_line(opened))
        self.add(session)
        return session, key

    def by_presented_key(self, presented: str) -> Session | None:
        return self.by_key.get(key_digest(presented))

    def delete(self, session: Session) -> None:
        """Forget the session and remove its log; a call still in flight is answered with an error."""
        self.by_id.pop(session.id, None)
        self.by_key.pop(session.opened.key_digest, None)
        session.deleted = True
        session.log.delete()

    def close_all(self) -> None:
        for session in self.by_id.values():
            session.log.seal()

    def add(self, session: Session) -> None:
        self.by_id[session.id] = session
        self.by_key[session.opened.key_digest] = session

    def _path(self, session_id: str) -> Path:
        return self.store_dir / f"{session_id}.jsonl"
