"""The trace contract's types and its validation: what the proxy records and what the learner trusts.

A `Turn` is one engine call: the engine's exact prompt and completion token ids, behaviour logprobs
and a loss mask, its place in the capture graph (`parent_id`, `role`), and what it records besides
(`TurnRecord`: the policy version that sampled it, how its prompt was made, the sampling applied,
the branch it belongs to, timestamps). Validation fails closed: `find_violations` lists every broken
rule by name (OpenEnv's finding names where the rule is shared); `TrainingTrace.validate()` raises
`TraceValidationError` holding them all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

SCHEMA_VERSION = 1
OPENENV_SCHEMA_VERSION = 1
# agent: the agent's own calls; summary: a call whose reply the agent carried into a new conversation (a
# compaction's summary); auxiliary: other side calls (titles); discarded: abandoned retries.
ROLES = ("agent", "summary", "auxiliary", "discarded")
Role = Literal["agent", "summary", "auxiliary", "discarded"]
PromptSource = Literal["spliced", "rendered"]
BRANCH_REASONS = ("main", "subagent", "summary", "compaction", "rewritten_history", "retry", "fork", "side_call",
                  "conversation")
BranchReason = Literal["main", "subagent", "summary", "compaction", "rewritten_history", "retry", "fork", "side_call",
                       "conversation"]

# Rule names. Shared rules use the finding names of OpenEnv's trace validator (openenv.core.harness).
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
INVALID_BRANCH = "invalid_branch"
UNSUPPORTED_SCHEMA = "unsupported_schema"
RULES = (
    INVALID_TOKEN_ID, INVALID_LOGPROB, POSITIVE_LOGPROB, NO_PROMPT_IDS, LOGPROB_MISALIGN,
    LENGTH_MISMATCH, INVALID_LOSS_MASK, TRAINABLE_PROMPT, DUPLICATE_NODE_ID, MISSING_PARENT,
    PARENT_NOT_PREFIX, PARENT_CYCLE, INVALID_ROLE, INVALID_NODE_ID, INVALID_POLICY_VERSION,
    INVALID_SAMPLING, INVALID_BRANCH, UNSUPPORTED_SCHEMA,
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


class Branch(msgspec.Struct, kw_only=True, frozen=True):
    """The conversation a turn belongs to and why it began: each conversation an agent holds (its main one, a
    subagent's, the one it went on with after compacting its context) trains as its own row.

    `id` numbers a trace's branches in the order they began (0 first). Within a branch each turn continues
    the one before it. `reason` says why the branch began: `main` (the agent's first conversation with
    tools), `subagent` (a fresh conversation whose task the agent wrote in a tool call), `summary` (a call
    asking for a summary of the conversation), `compaction` (a fresh conversation carrying such a summary),
    `rewritten_history` (the agent rewrote earlier messages), `retry` (the same request again), `fork`
    (another call continuing a turn that was already continued: calls at once), `side_call` (a title or
    other auxiliary call) or `conversation` (none of these). `origin` is the turn it began from: the call
    whose tool call started the subagent, the summary a compaction carries, the turn a fork continues, the
    request retried or rewritten.
    """

    id: int
    reason: BranchReason
    origin: str | None = None


class TurnRecord(msgspec.Struct, kw_only=True):
    """What a turn records besides its tokens, its place in the capture graph and its messages: the one list
    of these fields, shared by `Turn`, its stored form and its OpenEnv form (which carry them as they are)."""

    policy_version: int | None = None  # the version that sampled the first completion token
    version_spans: list[VersionSpan] = []  # when several versions sampled the completion; else empty
    finish_reason: str | None = None
    prompt_source: PromptSource | None = None
    prefix_break: PrefixBreak | None = None
    delivered: bool = True  # False: the agent never received this completion (it stays context)
    sampling: Sampling | None = None
    branch: Branch | None = None  # None: not classified (a trace made elsewhere, or before branches existed)
    started_at: float | None = None
    finished_at: float | None = None


def record_of(turn: TurnRecord) -> dict[str, Any]:
    """The `TurnRecord` fields of a turn (or of its stored or OpenEnv form), to carry into another form."""
    return {name: getattr(turn, name) for name in TurnRecord.__struct_fields__}


class Turn(TurnRecord, kw_only=True):
    """One engine call, with everything needed to train on it."""

    node_id: str
    parent_id: str | None = None
    role: Role = "agent"
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    per_token_logps: list[float]
    loss_mask: list[int]
    request: Request = msgspec.field(default_factory=Request)
    reply: Reply | None = None
    metadata: dict[str, Any] = {}

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
    branch = turn.branch
    if branch is not None and (type(branch.id) is not int or branch.id < 0 or branch.reason not in BRANCH_REASONS):
        out.append(Violation(INVALID_BRANCH, f"branch {branch.id!r} ({branch.reason!r}) needs an int id >= 0 and one "
                             f"of {', '.join(BRANCH_REASONS)}", index, turn.node_id))
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


def find_violations(turns: list[Turn], schema_version: int = SCHEMA_VERSION) -> list[Violation]:
    """Every broken rule in a trace's turns, in turn order.

    Shared prompt prefixes are checked once: a child's prompt is compared to its parent's sequence
    with one C-level slice comparison, and only its new suffix is scanned token by token.
    """
    out: list[Violation] = []
    if schema_version != SCHEMA_VERSION:
        out.append(Violation(UNSUPPORTED_SCHEMA, f"schema_version {schema_version!r} is not {SCHEMA_VERSION}"))
    by_id: dict[str, Turn] = {}
    for index, turn in enumerate(turns):
        if turn.node_id in by_id:
            out.append(Violation(DUPLICATE_NODE_ID, f"node_id {turn.node_id!r} is used twice",
                                 index, turn.node_id))
        else:
            by_id[turn.node_id] = turn
    parents = {t.node_id: t.parent_id for t in by_id.values()}
    for index, turn in enumerate(turns):
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
