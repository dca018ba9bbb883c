"""The trace contract: what the proxy records and what the learner trusts.

A `TrainingTrace` is one rollout: every model call the agent made, as `Turn`s holding the engine's
exact prompt and completion token ids, behaviour logprobs and a loss mask. It is a strict superset
of OpenEnv's `TrainingTrace` (same names and meanings for the shared fields) and adds the capture
graph (`parent_id`, `role`), the policy version that sampled each turn, how its prompt was made
(`prompt_source`, `prefix_break`), the sampling applied, the parsed reply, and timestamps.

Validation fails closed: `violations()` lists every broken rule by name (OpenEnv's finding names
where the rule is shared) and `validate()` raises `TraceValidationError` holding them all.

One stored form, `StoredTurn`, is used everywhere a turn is written: trace files and the proxy's
session logs. It is delta-encoded against an earlier turn (`base`): only the tokens past the prefix
it shares with the base's prompt+completion, and only the request messages past the base's, so a
trace grows linearly with its turns. `rebuild_turns` restores the full lists. The stored form is
lossless for every trace, valid or not, so a broken file can still be read and diagnosed.

Three file formats, told apart on reading: `delta` (the stored form, the default on disk), `full`
(plain JSON of every `Turn`, readable by any JSON parser) and `openenv` (OpenEnv's exact shape).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

SCHEMA_VERSION = 1
OPENENV_SCHEMA_VERSION = 1
ROLES = ("agent", "auxiliary", "discarded")
Role = Literal["agent", "auxiliary", "discarded"]
PromptSource = Literal["spliced", "rendered"]
TraceFormat = Literal["full", "delta", "openenv"]
FORMATS: tuple[TraceFormat, ...] = ("full", "delta", "openenv")

# Rule names. Shared rules use OpenEnv's finding names (reference/openenv_trace.md §3).
INVALID_TOKEN_ID = "invalid_token_id"
INVALID_LOGPROB = "invalid_logprob"
POSITIVE_LOGPROB = "positive_logprob"
NO_PROMPT_IDS = "no_prompt_ids"
LOGPROB_MISALIGN = "logprob_misalign"
LENGTH_MISMATCH = "length_mismatch"
INVALID_LOSS_MASK = "invalid_loss_mask"
TRAINABLE_PROMPT = "trainable_prompt"
DUPLICATE_NODE_ID = "duplicate_node_id"
MISSING_PARENT = "missing_parent"
PARENT_NOT_PREFIX = "parent_not_prefix"
PARENT_CYCLE = "parent_cycle"
INVALID_ROLE = "invalid_role"
INVALID_NODE_ID = "invalid_node_id"
INVALID_POLICY_VERSION = "invalid_policy_version"
INVALID_SAMPLING = "invalid_sampling"
UNSUPPORTED_SCHEMA = "unsupported_schema"
RULES = (
    INVALID_TOKEN_ID, INVALID_LOGPROB, POSITIVE_LOGPROB, NO_PROMPT_IDS, LOGPROB_MISALIGN,
    LENGTH_MISMATCH, INVALID_LOSS_MASK, TRAINABLE_PROMPT, DUPLICATE_NODE_ID, MISSING_PARENT,
    PARENT_NOT_PREFIX, PARENT_CYCLE, INVALID_ROLE, INVALID_NODE_ID, INVALID_POLICY_VERSION,
    INVALID_SAMPLING, UNSUPPORTED_SCHEMA,
)


class Request(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The conversation as the engine received it (OpenAI chat messages and tools)."""

    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


class ToolCall(msgspec.Struct, kw_only=True, frozen=True):
    id: str
    name: str
    arguments: str  # the JSON text the model produced


class Reply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the model answered, as the engine's parsers read it: text, reasoning and tool calls."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = []


class Sampling(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The sampling the engine applied to a turn, and the knobs the agent had asked for.

    Behaviour logprobs only describe the distribution actually sampled, so the learner checks
    `temperature` against its own and never trains a turn sampled otherwise.
    """

    temperature: float | None = None  # None: the engine's default, 1.0
    max_tokens: int | None = None
    seed: int | None = None
    stop: list[str] = []
    requested: dict[str, Any] = {}  # the agent's own sampling knobs, as sent
    truncation: str | None = None  # how truncating knobs were treated: neutralise | reject


class VersionSpan(msgspec.Struct, kw_only=True, frozen=True):
    """Completion tokens `[start, end)` were sampled by weights of policy `version`.

    A completion that straddled a weight update (the engine paused it, loaded new weights, resumed)
    has several; the learner treats each token with its own version.
    """

    version: int
    start: int
    end: int


class PrefixBreak(msgspec.Struct, kw_only=True, frozen=True):
    """Why a turn that shares messages with an earlier one could not continue its token ids.

    `position` is the first prompt token that differs from the earlier turn's prompt+completion;
    `cause` names why (`retokenized`, `template_dropped`, `rewritten_history`, `special_token`, ...).
    """

    position: int
    cause: str
    against: str | None = None  # the node id of the earlier turn


class Turn(msgspec.Struct, kw_only=True):
    """One engine call, with everything needed to train on it."""

    node_id: str
    parent_id: str | None = None
    role: Role = "agent"
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    per_token_logps: list[float]
    loss_mask: list[int]
    policy_version: int | None = None  # the version that sampled the first completion token
    version_spans: list[VersionSpan] = []  # when several versions sampled the completion; else empty
    finish_reason: str | None = None
    prompt_source: PromptSource | None = None
    prefix_break: PrefixBreak | None = None
    delivered: bool = True  # False: the agent never received this completion (it stays context)
    request: Request = msgspec.field(default_factory=Request)
    reply: Reply | None = None
    sampling: Sampling | None = None
    metadata: dict[str, Any] = {}
    started_at: float | None = None
    finished_at: float | None = None

    @property
    def sequence(self) -> list[int]:
        """Prompt followed by completion: what a child turn's prompt must start with."""
        return self.prompt_token_ids + self.completion_token_ids

    @property
    def completion_mask(self) -> list[int]:
        return self.loss_mask[len(self.prompt_token_ids):]

    @property
    def token_versions(self) -> list[int | None]:
        """The policy version that sampled each completion token."""
        if not self.version_spans:
            return [self.policy_version] * len(self.completion_token_ids)
        out: list[int | None] = [None] * len(self.completion_token_ids)
        for span in self.version_spans:
            out[span.start:span.end] = [span.version] * (span.end - span.start)
        return out


class Violation(msgspec.Struct, frozen=True):
    """One broken rule, located as precisely as the rule allows."""

    rule: str
    message: str
    turn: int | None = None
    node_id: str | None = None
    position: int | None = None

    def __str__(self) -> str:
        where = []
        if self.turn is not None:
            where.append(f"turn {self.turn}")
        if self.node_id is not None:
            where.append(f"node {self.node_id}")
        if self.position is not None:
            where.append(f"position {self.position}")
        return f"{self.rule}: {self.message}" + (f" ({', '.join(where)})" if where else "")


class TraceValidationError(ValueError):
    """A trace broke one or more contract rules; `.violations` names each one."""

    def __init__(self, violations: list[Violation]) -> None:
        self.violations = violations
        self.rules = sorted({v.rule for v in violations})
        shown = "; ".join(str(v) for v in violations[:5])
        more = f" (+{len(violations) - 5} more)" if len(violations) > 5 else ""
        super().__init__(f"invalid trace: {shown}{more}")


class TraceFormatError(ValueError):
    """A file or payload that cannot be read as a trace at all (not JSON, wrong shape, truncated)."""


class TrainingTrace(msgspec.Struct, kw_only=True):
    """One rollout's turns, plus free-form metadata (task, harness, reward bookkeeping)."""

    schema_version: int = SCHEMA_VERSION
    rollout_id: str
    turns: list[Turn] = []
    metadata: dict[str, Any] = {}

    def violations(self) -> list[Violation]:
        return find_violations(self)

    def validate(self) -> TrainingTrace:
        """Raise `TraceValidationError` naming every broken rule; return self when clean."""
        found = find_violations(self)
        if found:
            raise TraceValidationError(found)
        return self

    def turn(self, node_id: str) -> Turn:
        for turn in self.turns:
            if turn.node_id == node_id:
                return turn
        raise KeyError(node_id)

    def to_json(self, format: TraceFormat = "delta") -> bytes:
        """The trace as JSON: `delta` (compact, the file form), `full` (every turn whole) or `openenv`."""
        if format == "full":
            return _JSON_ENCODER.encode(self)
        if format == "openenv":
            return _JSON_ENCODER.encode(to_openenv(self))
        return _JSON_ENCODER.encode(_to_stored(self))

    def to_msgpack(self) -> bytes:
        return _MSGPACK_ENCODER.encode(_to_stored(self))

    @classmethod
    def from_json(cls, data: bytes | str) -> TrainingTrace:
        """Read any of the three JSON formats."""
        kind = _decode(_SNIFF_JSON, data, "JSON")
        if kind.format is not None or kind.rollout_id is None and not kind.turns:
            return _from_stored(_decode(_STORED_JSON, data, "JSON"))
        if kind.rollout_id is not None:
            return _decode(_FULL_JSON, data, "JSON")
        return from_openenv(_decode_json_object(data))

    @classmethod
    def from_msgpack(cls, data: bytes) -> TrainingTrace:
        return _from_stored(_decode(_STORED_MSGPACK, data, "msgpack"))

    def save(self, path: str | Path, format: TraceFormat = "delta") -> None:
        """Write the trace; `.msgpack` / `.mpk` suffixes get the delta form in msgpack, anything else JSON."""
        path = Path(path)
        path.write_bytes(self.to_msgpack() if path.suffix in MSGPACK_SUFFIXES else self.to_json(format))

    @classmethod
    def load(cls, path: str | Path) -> TrainingTrace:
        """Read a trace file in any of our formats or OpenEnv's JSON (named after the file when it has no id)."""
        path = Path(path)
        data = path.read_bytes()
        if path.suffix in MSGPACK_SUFFIXES:
            return cls.from_msgpack(data)
        trace = cls.from_json(data)
        if trace.rollout_id == OPENENV_DEFAULT_ID:
            trace.rollout_id = path.stem
        return trace

    def to_openenv(self) -> dict[str, Any]:
        return to_openenv(self)

    @classmethod
    def from_openenv(cls, data: dict[str, Any], rollout_id: str = "openenv") -> TrainingTrace:
        return from_openenv(data, rollout_id=rollout_id)


MSGPACK_SUFFIXES = (".msgpack", ".mpk")
OPENENV_DEFAULT_ID = "openenv"


# ---------------------------------------------------------------------------------------------
# Validation


def _bad_int_index(values: list[Any]) -> int | None:
    """Index of the first value that is not an int >= 0 (bools are rejected), or None."""
    if set(map(type, values)) <= {int} and (not values or min(values) >= 0):
        return None
    return next(i for i, v in enumerate(values) if type(v) is not int or v < 0)


def _check_logprobs(index: int, turn: Turn, out: list[Violation]) -> None:
    logps = turn.per_token_logps
    if not set(map(type, logps)) <= {float, int}:
        pos = next(i for i, v in enumerate(logps) if type(v) not in (float, int))
        out.append(Violation(INVALID_LOGPROB, f"logprob {logps[pos]!r} is not a real number",
                             index, turn.node_id, pos))
        return
    if not all(map(math.isfinite, logps)):
        pos = next(i for i, v in enumerate(logps) if not math.isfinite(v))
        out.append(Violation(INVALID_LOGPROB, f"logprob {logps[pos]!r} is not finite", index, turn.node_id, pos))
        return
    if logps and max(logps) > 0:
        pos = next(i for i, v in enumerate(logps) if v > 0)
        out.append(Violation(POSITIVE_LOGPROB, f"logprob {logps[pos]!r} is above 0", index, turn.node_id, pos))


def _check_mask(index: int, turn: Turn, out: list[Violation]) -> None:
    mask, n_prompt = turn.loss_mask, len(turn.prompt_token_ids)
    expected = n_prompt + len(turn.completion_token_ids)
    if len(mask) != expected:
        out.append(Violation(LENGTH_MISMATCH, f"loss_mask has {len(mask)} entries, prompt + completion "
                             f"has {expected}", index, turn.node_id))
    # The prompt part is checked by value with one C-level count (0 and False compare equal, and
    # storage writes either as 0); the completion part, the only place 1 is legal, also by type.
    prompt_part, completion_part = mask[:n_prompt], mask[n_prompt:]
    if prompt_part.count(0) != len(prompt_part):
        pos = next(i for i, v in enumerate(prompt_part) if v != 0)
        if type(prompt_part[pos]) is int and prompt_part[pos] == 1:
            out.append(Violation(TRAINABLE_PROMPT, "a prompt position has loss_mask 1", index, turn.node_id, pos))
        else:
            out.append(Violation(INVALID_LOSS_MASK, f"loss_mask value {prompt_part[pos]!r} is not 0 or 1",
                                 index, turn.node_id, pos))
    if not (set(map(type, completion_part)) <= {int} and set(completion_part) <= {0, 1}):
        pos = next(i for i, v in enumerate(completion_part) if type(v) is not int or v not in (0, 1))
        out.append(Violation(INVALID_LOSS_MASK, f"loss_mask value {completion_part[pos]!r} is not 0 or 1",
                             index, turn.node_id, n_prompt + pos))


def _check_spans(index: int, turn: Turn, out: list[Violation]) -> None:
    """Version spans, when present, cover the completion in order, each a version >= 0."""
    spans = turn.version_spans
    if not spans:
        return
    at = 0
    for span in spans:
        if type(span.version) is not int or span.version < 0 or span.start != at or span.end <= span.start:
            out.append(Violation(INVALID_POLICY_VERSION, f"version span {span.version}:[{span.start}, {span.end}) "
                                 f"does not continue at token {at} with a version >= 0", index, turn.node_id))
            return
        at = span.end
    if at != len(turn.completion_token_ids):
        out.append(Violation(INVALID_POLICY_VERSION, f"version spans cover {at} of "
                             f"{len(turn.completion_token_ids)} completion tokens", index, turn.node_id))


def _check_sampling(index: int, turn: Turn, out: list[Violation]) -> None:
    """The recorded sampling must describe a real distribution and a completion that fits it."""
    sampling = turn.sampling
    if sampling is None:
        return
    temperature, max_tokens = sampling.temperature, sampling.max_tokens
    if temperature is not None and not (type(temperature) in (int, float) and math.isfinite(temperature)
                                        and temperature > 0):
        out.append(Violation(INVALID_SAMPLING, f"temperature {temperature!r} is not a finite number > 0",
                             index, turn.node_id))
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        out.append(Violation(INVALID_SAMPLING, f"max_tokens {max_tokens!r} is not an int >= 1", index, turn.node_id))
    elif max_tokens is not None and len(turn.completion_token_ids) > max_tokens:
        out.append(Violation(INVALID_SAMPLING, f"{len(turn.completion_token_ids)} completion tokens exceed "
                             f"max_tokens {max_tokens}", index, turn.node_id))


def _check_turn(index: int, turn: Turn, checked_prefix: int, out: list[Violation]) -> None:
    """Check one turn's own rules; prompt ids before `checked_prefix` were checked in its parent."""
    if type(turn.node_id) is not str or not turn.node_id:
        out.append(Violation(INVALID_NODE_ID, "node_id must be a non-empty string", index))
    if turn.role not in ROLES:
        out.append(Violation(INVALID_ROLE, f"role {turn.role!r} is not one of {', '.join(ROLES)}",
                             index, turn.node_id))
    if turn.policy_version is not None and (type(turn.policy_version) is not int or turn.policy_version < 0):
        out.append(Violation(INVALID_POLICY_VERSION, f"policy_version {turn.policy_version!r} is not an "
                             "int >= 0", index, turn.node_id))
    _check_spans(index, turn, out)
    if not turn.prompt_token_ids:
        out.append(Violation(NO_PROMPT_IDS, "prompt_token_ids is empty", index, turn.node_id))
    bad = _bad_int_index(turn.prompt_token_ids[checked_prefix:])
    if bad is not None:
        pos = checked_prefix + bad
        out.append(Violation(INVALID_TOKEN_ID, f"prompt token {turn.prompt_token_ids[pos]!r} is not an "
                             "int >= 0", index, turn.node_id, pos))
    bad = _bad_int_index(turn.completion_token_ids)
    if bad is not None:
        out.append(Violation(INVALID_TOKEN_ID, f"completion token {turn.completion_token_ids[bad]!r} is "
                             "not an int >= 0", index, turn.node_id, len(turn.prompt_token_ids) + bad))
    if len(turn.per_token_logps) != len(turn.completion_token_ids):
        out.append(Violation(LOGPROB_MISALIGN, f"{len(turn.per_token_logps)} logprobs for "
                             f"{len(turn.completion_token_ids)} completion tokens", index, turn.node_id))
    _check_logprobs(index, turn, out)
    _check_mask(index, turn, out)
    _check_sampling(index, turn, out)


def _parent_chain_has_cycle(node_id: str, parents: dict[str, str | None]) -> bool:
    seen = {node_id}
    current = parents.get(node_id)
    while current is not None and current in parents:
        if current in seen:
            return True
        seen.add(current)
        current = parents[current]
    return False


def find_violations(trace: TrainingTrace) -> list[Violation]:
    """Every broken rule in the trace, in turn order.

    Shared prompt prefixes are checked once: a child's prompt is compared to its parent's sequence
    with one C-level slice comparison, and only its new suffix is scanned token by token.
    """
    out: list[Violation] = []
    if trace.schema_version != SCHEMA_VERSION:
        out.append(Violation(UNSUPPORTED_SCHEMA, f"schema_version {trace.schema_version!r} is not "
                             f"{SCHEMA_VERSION}"))
    by_id: dict[str, Turn] = {}
    for index, turn in enumerate(trace.turns):
        if turn.node_id in by_id:
            out.append(Violation(DUPLICATE_NODE_ID, f"node_id {turn.node_id!r} is used twice",
                                 index, turn.node_id))
        else:
            by_id[turn.node_id] = turn
    parents = {t.node_id: t.parent_id for t in by_id.values()}
    for index, turn in enumerate(trace.turns):
        checked_prefix = 0
        if turn.parent_id is not None:
            parent = by_id.get(turn.parent_id)
            if parent is None:
                out.append(Violation(MISSING_PARENT, f"parent {turn.parent_id!r} is not in the trace",
                                     index, turn.node_id))
            elif _parent_chain_has_cycle(turn.node_id, parents):
                out.append(Violation(PARENT_CYCLE, "following parent_id leads back to this turn",
                                     index, turn.node_id))
            else:
                n = len(parent.prompt_token_ids) + len(parent.completion_token_ids)
                prompt = turn.prompt_token_ids
                if len(prompt) < n or prompt[:n] != parent.sequence:
                    pos = common_prefix_len(parent.sequence, prompt)
                    out.append(Violation(PARENT_NOT_PREFIX, f"parent {turn.parent_id!r} prompt+completion "
                                         "is not a prefix of this prompt", index, turn.node_id, pos))
                else:
                    checked_prefix = n
        _check_turn(index, turn, checked_prefix, out)
    return out


def common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of two sequences, by bisection over C-level slice comparisons."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ---------------------------------------------------------------------------------------------
# The stored form


class StoredTurn(msgspec.Struct, tag="turn", tag_field="kind", kw_only=True, omit_defaults=True):
    """A turn as written to disk, stored against an earlier turn `base` of the same trace.

    Its prompt+completion starts with `shared` tokens of the base's prompt+completion; `tail` is
    the rest, and the first `n_prompt` tokens of the whole are the prompt. The request's first
    `messages_prefix` messages equal the base's, and `tools_inherited` says its tools do too.
    Masks are stored only where they differ from what `delivered` implies (prompt 0; completion 1
    when delivered, else 0). `parent_id` and `role` are left out of proxy session logs, where the
    capture graph decides them when a trace is built.
    """

    node_id: str
    parent_id: str | None = None
    role: str | None = None
    base: str | None = None
    shared: int = 0
    tail: list[int]
    n_prompt: int
    per_token_logps: list[float]
    completion_mask: list[int] | None = None
    prompt_mask: list[int] | None = None
    policy_version: int | None = None
    version_spans: list[VersionSpan] = []
    finish_reason: str | None = None
    prompt_source: PromptSource | None = None
    prefix_break: PrefixBreak | None = None
    delivered: bool = True
    messages_prefix: int = 0
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    tools_inherited: bool = False
    reply: Reply | None = None
    sampling: Sampling | None = None
    metadata: dict[str, Any] = {}
    started_at: float | None = None
    finished_at: float | None = None


class _StoredTrace(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: Literal["harness-rl.trace"]
    schema_version: int
    rollout_id: str
    metadata: dict[str, Any] = {}
    turns: list[StoredTurn]


def store_turn(turn: Turn, base: Turn | None) -> StoredTurn:
    """The stored form of `turn`, delta-encoded against `base` (None: stored whole)."""
    n_prompt = len(turn.prompt_token_ids)
    sequence = turn.sequence
    shared = common_prefix_len(base.sequence, sequence) if base is not None else 0
    prompt_mask = turn.loss_mask[:n_prompt]
    completion_mask = turn.loss_mask[n_prompt:]
    implied = 1 if turn.delivered else 0
    messages = turn.request.messages
    prefix = 0
    if base is not None and messages is not None and base.request.messages is not None:
        prefix = common_prefix_len(base.request.messages, messages)
    tools_inherited = base is not None and turn.request.tools is not None and turn.request.tools == base.request.tools
    return StoredTurn(
        node_id=turn.node_id, parent_id=turn.parent_id, role=turn.role,
        base=base.node_id if base is not None else None, shared=shared, tail=sequence[shared:], n_prompt=n_prompt,
        per_token_logps=turn.per_token_logps,
        completion_mask=completion_mask if (len(completion_mask) != len(turn.completion_token_ids)
                                            or completion_mask.count(implied) != len(completion_mask)
                                            or not set(map(type, completion_mask)) <= {int}) else None,
        prompt_mask=prompt_mask if (len(prompt_mask) != n_prompt or any(prompt_mask)) else None,
        policy_version=turn.policy_version, version_spans=turn.version_spans, finish_reason=turn.finish_reason,
        prompt_source=turn.prompt_source,
        prefix_break=turn.prefix_break, delivered=turn.delivered, messages_prefix=prefix,
        messages=messages[prefix:] if messages is not None else None,
        tools=None if tools_inherited else turn.request.tools, tools_inherited=tools_inherited,
        reply=turn.reply, sampling=turn.sampling, metadata=turn.metadata, started_at=turn.started_at,
        finished_at=turn.finished_at,
    )


def rebuild_turns(stored: list[StoredTurn]) -> list[Turn]:
    """Full turns from their stored forms, in the same order; a base may come before or after its turn.

    Raises `TraceFormatError` when a turn is stored against a base that is missing, shorter than
    claimed, or part of a cycle: such a turn cannot be rebuilt exactly, and is never guessed.
    """
    index_of = {t.node_id: i for i, t in enumerate(stored)}
    built: dict[int, Turn] = {}
    resolving: set[int] = set()

    def build(index: int) -> Turn:
        if index in built:
            return built[index]
        st = stored[index]
        base: Turn | None = None
        if st.shared or st.messages_prefix or st.tools_inherited:
            base_index = index_of.get(st.base) if st.base is not None else None
            if base_index is None:
                raise TraceFormatError(f"turn {index} ({st.node_id}) is stored against {st.base!r}, which is not "
                                       "in the file")
            if index in resolving:
                raise TraceFormatError(f"turn {index} ({st.node_id}) is stored against a cycle of turns")
            resolving.add(index)
            base = build(base_index)
        built[index] = turn = _rebuild(index, st, base)
        return turn

    return [build(i) for i in range(len(stored))]


def _rebuild(index: int, st: StoredTurn, base: Turn | None) -> Turn:
    if base is None:
        sequence = list(st.tail)
    elif st.shared > len(base.prompt_token_ids) + len(base.completion_token_ids):
        raise TraceFormatError(f"turn {index} ({st.node_id}) claims {st.shared} tokens of {st.base}, which holds "
                               "fewer")
    else:
        sequence = base.sequence[:st.shared] + st.tail
    if st.n_prompt > len(sequence):
        raise TraceFormatError(f"turn {index} ({st.node_id}) has a {st.n_prompt}-token prompt in a "
                               f"{len(sequence)}-token sequence")
    prompt, completion = sequence[:st.n_prompt], sequence[st.n_prompt:]
    completion_mask = st.completion_mask if st.completion_mask is not None else \
        [1 if st.delivered else 0] * len(completion)
    prompt_mask = st.prompt_mask if st.prompt_mask is not None else [0] * len(prompt)
    messages = st.messages
    if st.messages_prefix and base is not None:
        messages = (base.request.messages or [])[:st.messages_prefix] + (messages or [])
    tools = base.request.tools if st.tools_inherited and base is not None else st.tools
    return Turn(
        node_id=st.node_id, parent_id=st.parent_id, role=st.role or "agent",  # type: ignore[arg-type]
        prompt_token_ids=prompt, completion_token_ids=completion, per_token_logps=st.per_token_logps,
        loss_mask=prompt_mask + completion_mask, policy_version=st.policy_version, version_spans=st.version_spans,
        finish_reason=st.finish_reason, prompt_source=st.prompt_source, prefix_break=st.prefix_break,
        delivered=st.delivered, request=Request(messages=messages, tools=tools), reply=st.reply,
        sampling=st.sampling, metadata=st.metadata, started_at=st.started_at, finished_at=st.finished_at,
    )


def _to_stored(trace: TrainingTrace) -> _StoredTrace:
    """Each turn stored against its parent (the turn it continues), when that parent is in the trace."""
    by_id = {t.node_id: t for t in trace.turns}
    stored = []
    for turn in trace.turns:
        parent = by_id.get(turn.parent_id) if turn.parent_id is not None else None
        stored.append(store_turn(turn, parent if parent is not turn else None))
    return _StoredTrace(format="harness-rl.trace", schema_version=trace.schema_version,
                        rollout_id=trace.rollout_id, metadata=trace.metadata, turns=stored)


def _from_stored(stored: _StoredTrace) -> TrainingTrace:
    return TrainingTrace(schema_version=stored.schema_version, rollout_id=stored.rollout_id,
                         turns=rebuild_turns(stored.turns), metadata=stored.metadata)


class _Sniff(msgspec.Struct):
    """The top-level keys that tell the three JSON formats apart (everything else is skipped unparsed)."""

    format: str | None = None
    rollout_id: str | None = None
    turns: msgspec.Raw = msgspec.Raw(b"")


_JSON_ENCODER = msgspec.json.Encoder()
_MSGPACK_ENCODER = msgspec.msgpack.Encoder()
_STORED_JSON = msgspec.json.Decoder(_StoredTrace)
_STORED_MSGPACK = msgspec.msgpack.Decoder(_StoredTrace)
_FULL_JSON = msgspec.json.Decoder(TrainingTrace)
_SNIFF_JSON = msgspec.json.Decoder(_Sniff)


def _decode(decoder: Any, data: bytes | str, kind: str) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise TraceFormatError(f"not a harness-rl trace: {exc}") from None
    except msgspec.DecodeError as exc:
        raise TraceFormatError(f"not valid {kind} (or truncated): {exc}") from None


def _decode_json_object(data: bytes | str) -> dict[str, Any]:
    try:
        decoded = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise TraceFormatError(f"not valid JSON (or truncated): {exc}") from None
    if not isinstance(decoded, dict):
        raise TraceFormatError("not a trace: the top level is not a JSON object")
    return decoded


# ---------------------------------------------------------------------------------------------
# OpenEnv interop (reference/openenv_trace.md §9)

OPENENV_TURN_KEYS = ("node_id", "prompt_token_ids", "completion_token_ids", "per_token_logps",
                     "loss_mask", "request", "response", "metadata")
OPENENV_META_KEY = "harness_rl"


class _HarnessRlExtra(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Our fields that OpenEnv has no place for, carried in `metadata["harness_rl"]`."""

    rollout_id: str | None = None
    parent_id: str | None = None
    role: str = "agent"
    policy_version: int | None = None
    version_spans: list[VersionSpan] = []
    finish_reason: str | None = None
    prompt_source: PromptSource | None = None
    prefix_break: PrefixBreak | None = None
    delivered: bool = True
    sampling: Sampling | None = None
    started_at: float | None = None
    finished_at: float | None = None
    completion_mask: list[int] | None = None  # the real mask of a turn exported untrainable


def openai_message(reply: Reply) -> dict[str, Any]:
    """A reply as an OpenAI chat assistant message."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.reasoning is not None:
        message["reasoning"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in reply.tool_calls]
    return message


def _reply_from_openai(response: dict[str, Any]) -> Reply | None:
    """A `Reply` from an OpenAI-shaped response dict, or None when it holds no assistant message."""
    choices = response.get("choices") if isinstance(response, dict) else None
    message = choices[0].get("message") if isinstance(choices, list) and choices and isinstance(choices[0], dict) \
        else None
    if not isinstance(message, dict):
        return None
    calls = [ToolCall(id=str(c.get("id", "")), name=str((c.get("function") or {}).get("name", "")),
                      arguments=str((c.get("function") or {}).get("arguments", "")))
             for c in message.get("tool_calls") or () if isinstance(c, dict)]
    reasoning = message.get("reasoning", message.get("reasoning_content"))
    return Reply(content=message.get("content"), reasoning=reasoning, tool_calls=calls)


def to_openenv(trace: TrainingTrace) -> dict[str, Any]:
    """OpenEnv's exact `TrainingTrace` JSON shape.

    Our extra fields travel under `metadata["harness_rl"]`. Auxiliary and discarded turns are kept
    for context with an all-zero mask (so an OpenEnv consumer never trains them); their own
    completion mask is kept in the namespace so `from_openenv` restores it exactly.
    """
    turns = []
    for turn in trace.turns:
        extra = _HarnessRlExtra(
            rollout_id=trace.rollout_id, parent_id=turn.parent_id, role=turn.role, policy_version=turn.policy_version,
            version_spans=turn.version_spans,
            finish_reason=turn.finish_reason, prompt_source=turn.prompt_source, prefix_break=turn.prefix_break,
            delivered=turn.delivered, sampling=turn.sampling, started_at=turn.started_at,
            finished_at=turn.finished_at)
        mask = turn.loss_mask
        if turn.role != "agent":
            extra.completion_mask = turn.completion_mask
            mask = [0] * len(mask)
        response: dict[str, Any] = {}
        if turn.reply is not None:
            response = {"choices": [{"index": 0, "message": openai_message(turn.reply),
                                     "finish_reason": turn.finish_reason}]}
        turns.append({
            "node_id": turn.node_id,
            "prompt_token_ids": list(turn.prompt_token_ids),
            "completion_token_ids": list(turn.completion_token_ids),
            "per_token_logps": [float(x) for x in turn.per_token_logps],
            "loss_mask": list(mask),
            "request": msgspec.to_builtins(turn.request),
            "response": response,
            "metadata": {**turn.metadata, OPENENV_META_KEY: msgspec.to_builtins(extra)},
        })
    return {"schema_version": OPENENV_SCHEMA_VERSION, "turns": turns}


def from_openenv(data: dict[str, Any], rollout_id: str = OPENENV_DEFAULT_ID) -> TrainingTrace:
    """Read OpenEnv's `TrainingTrace` JSON (as a dict, or a pydantic model's `model_dump()`).

    Fields we added come back from `metadata["harness_rl"]` when present. A trace made by OpenEnv
    itself has none, so parents are rebuilt by longest exact token prefix, every turn is `agent`,
    policy versions stay unknown, and the reply and sampling are read from its OpenAI-shaped
    `response` and its `sampling_params` metadata.
    """
    if not isinstance(data, dict) or "turns" not in data:
        raise TraceFormatError("not an OpenEnv TrainingTrace: expected an object with 'turns'")
    if data.get("schema_version") != OPENENV_SCHEMA_VERSION:
        raise TraceFormatError(f"unsupported OpenEnv schema_version {data.get('schema_version')!r}")
    turns: list[Turn] = []
    any_extra = False
    for i, raw in enumerate(data["turns"]):
        missing = [k for k in OPENENV_TURN_KEYS if k not in raw]
        if missing:
            raise TraceFormatError(f"OpenEnv turn {i} lacks {', '.join(missing)}")
        metadata = dict(raw["metadata"])
        try:
            extra = msgspec.convert(metadata.pop(OPENENV_META_KEY, None) or {}, _HarnessRlExtra)
            request = msgspec.convert(raw["request"] or {}, Request)
        except msgspec.ValidationError as exc:
            raise TraceFormatError(f"OpenEnv turn {i}: {exc}") from None
        any_extra = any_extra or extra.rollout_id is not None
        rollout_id = extra.rollout_id or rollout_id
        mask = list(raw["loss_mask"])
        if extra.completion_mask is not None:
            mask = mask[:len(raw["prompt_token_ids"])] + list(extra.completion_mask)
        reply = _reply_from_openai(raw["response"])
        finish = extra.finish_reason
        sampling = extra.sampling
        if extra.rollout_id is None:
            choices = raw["response"].get("choices") if isinstance(raw["response"], dict) else None
            if isinstance(choices, list) and choices and isinstance(choices[0], dict):
                finish = choices[0].get("finish_reason")
            sampling = _openenv_sampling(metadata)
        turns.append(Turn(
            node_id=raw["node_id"], parent_id=extra.parent_id, role=extra.role,  # type: ignore[arg-type]
            prompt_token_ids=list(raw["prompt_token_ids"]),
            completion_token_ids=list(raw["completion_token_ids"]),
            per_token_logps=list(raw["per_token_logps"]), loss_mask=mask, policy_version=extra.policy_version,
            version_spans=extra.version_spans,
            finish_reason=finish, prompt_source=extra.prompt_source, prefix_break=extra.prefix_break,
            delivered=extra.delivered, request=request, reply=reply, sampling=sampling, metadata=metadata,
            started_at=extra.started_at, finished_at=extra.finished_at,
        ))
    if not any_extra:
        for turn, parent_id in zip(turns, longest_prefix_parents(turns), strict=True):
            turn.parent_id = parent_id
    return TrainingTrace(rollout_id=rollout_id, turns=turns)


def _openenv_sampling(metadata: dict[str, Any]) -> Sampling | None:
    """OpenEnv's `sampling_params` / `requested_sampling_params` metadata as a `Sampling`, when present."""
    applied = metadata.get("sampling_params")
    if not isinstance(applied, dict):
        return None
    requested = metadata.get("requested_sampling_params")
    temperature = applied.get("temperature")
    max_tokens = applied.get("max_tokens")
    return Sampling(temperature=float(temperature) if isinstance(temperature, int | float) else None,
                    max_tokens=max_tokens if type(max_tokens) is int else None,
                    requested=requested if isinstance(requested, dict) else {})


def longest_prefix_parents(turns: list[Turn]) -> list[str | None]:
    """For each turn, the turn whose prompt+completion is the longest exact prefix of its prompt."""
    parents: list[str | None] = []
    for turn in turns:
        best, best_len = None, -1
        prompt = turn.prompt_token_ids
        for other in turns:
            n = len(other.prompt_token_ids) + len(other.completion_token_ids)
            if other is turn or n > len(prompt) or n <= best_len:
                continue
            if prompt[:n] == other.sequence:
                best, best_len = other.node_id, n
        parents.append(best)
    return parents
