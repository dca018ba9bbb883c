"""Merge a trace's turns into training rows, so a long agent chat is forwarded once, not once per turn.

A turn joins the row that holds its parent while its prompt extends that row's tokens exactly: the
prompt's new tail is appended as context (mask 0) and its completion with the turn's own completion
mask. Otherwise (a rewritten history, or the second child of a fork, whose parent's row has already
been extended by the first child) a new row starts, seeded with the turn's full prompt as context.
The trace is a tree; it is walked depth first from every root, children in recorded order, so every
path is covered and a shared prefix is trained in exactly one row (the others see it as context).

A trace whose turns carry their branch (each conversation of the agent: its main one, a subagent's,
the one after a compaction) keeps branches apart: a turn joins its parent's row only within the same
branch, so each branch trains as its own rows, all of them with the rollout's one advantage.

Which roles train is the caller's choice (`train_roles`; by default the agent's own turns, as TRL
trains them): a compaction's `summary` call or `auxiliary` side calls (titles) can be trained on the
task's reward too. Discarded turns never train. Untrained turns stay in a row as context only when a
later trained turn extends them; a subtree with nothing to train (a discarded retry, a title request)
is skipped entirely, so it neither costs tokens nor breaks the row its siblings continue. Tokens after
a row's last trained token are cut: a causal model never needs them.

Each trained token carries the behaviour logprob and the policy version of the turn that sampled it
(version -1 when unknown); context positions carry 0.0 and -1.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from harness_rl.trace import Branch, TrainingTrace, Turn

NO_VERSION = -1
AGENT_ONLY = frozenset({"agent"})


@dataclass(slots=True)
class Row:
    """One forward sequence: tokens and, per token, whether it is trained and how it was sampled."""

    rollout_id: str
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    node_ids: list[str] = field(default_factory=list)
    branch: Branch | None = None  # the branch of the turns it holds (None: the trace has no branches)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_trained(self) -> int:
        return sum(self.mask)

    def add_context(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        self.mask.extend([0] * len(tokens))
        self.logprobs.extend([0.0] * len(tokens))
        self.versions.extend([NO_VERSION] * len(tokens))

    def add_completion(self, turn: Turn, train_roles: Collection[str] = AGENT_ONLY) -> None:
        mask = completion_mask(turn, train_roles)
        self.tokens.extend(turn.completion_token_ids)
        self.mask.extend(mask)
        self.logprobs.extend(lp if m else 0.0 for lp, m in zip(turn.per_token_logps, mask, strict=True))
        self.versions.extend(NO_VERSION if not m or v is None else v
                             for v, m in zip(turn.token_versions, mask, strict=True))
        self.node_ids.append(turn.node_id)

    def trim_context_tail(self) -> None:
        """Drop the positions after the last trained token."""
        end = len(self.mask)
        while end and not self.mask[end - 1]:
            end -= 1
        for values in (self.tokens, self.mask, self.logprobs, self.versions):
            del values[end:]


def completion_mask(turn: Turn, train_roles: Collection[str] = AGENT_ONLY) -> list[int]:
    """The turn's trainable completion positions: its own mask when its role trains, none otherwise."""
    if turn.role not in train_roles or turn.role == "discarded":
        return [0] * len(turn.completion_token_ids)
    return turn.completion_mask


def trace_rows(trace: TrainingTrace, train_roles: Collection[str] = AGENT_ONLY) -> list[Row]:
    """The rows of one trace, in depth-first order; every masked completion token is in exactly one."""
    by_id = {turn.node_id: turn for turn in trace.turns}
    children: dict[str | None, list[Turn]] = {}
    for turn in trace.turns:
        parent = turn.parent_id if turn.parent_id in by_id and turn.parent_id != turn.node_id else None
        children.setdefault(parent, []).append(turn)
    useful = _turns_with_training_below(children, train_roles)

    rows: list[Row] = []
    row_of: dict[str, Row] = {}
    stack: list[tuple[str | None, Turn]] = [(None, turn) for turn in reversed(children.get(None, []))]
    while stack:
        parent_id, turn = stack.pop()
        if turn.node_id not in useful:
            continue
        prompt = turn.prompt_token_ids
        row = row_of.get(parent_id) if parent_id is not None else None
        if (row is None or len(row.tokens) > len(prompt) or prompt[:len(row.tokens)] != row.tokens
                or _branch_id(row.branch) != _branch_id(turn.branch)):
            row = Row(rollout_id=trace.rollout_id, branch=turn.branch)
            rows.append(row)
        row.add_context(prompt[len(row.tokens):])
        row.add_completion(turn, train_roles)
        row_of[turn.node_id] = row
        stack.extend((turn.node_id, child) for child in reversed(children.get(turn.node_id, [])))
    for row in rows:
        row.trim_context_tail()
    return rows


def trained_share(trace: TrainingTrace, rows: list[Row],
                  train_roles: Collection[str] = AGENT_ONLY) -> dict[tuple[str, str], tuple[int, int]]:
    """Sampled and trained completion tokens of a trace and its rows, by (role, branch reason)."""
    in_rows = {node_id for row in rows for node_id in row.node_ids}
    share: dict[tuple[str, str], tuple[int, int]] = {}
    for turn in trace.turns:
        key = (turn.role, turn.branch.reason if turn.branch is not None else "-")
        sampled, trained = share.get(key, (0, 0))
        mask = completion_mask(turn, train_roles) if turn.node_id in in_rows else []
        share[key] = (sampled + len(turn.completion_token_ids), trained + sum(mask))
    return share


def _branch_id(branch: Branch | None) -> int | None:
    return branch.id if branch is not None else None


def _turns_with_training_below(children: dict[str | None, list[Turn]], train_roles: Collection[str]) -> set[str]:
    """Node ids whose own completion or some descendant's has a trained token."""
    useful: set[str] = set()
    order: list[Turn] = []
    stack = list(children.get(None, []))
    while stack:
        turn = stack.pop()
        order.append(turn)
        stack.extend(children.get(turn.node_id, []))
    for turn in reversed(order):
        if any(completion_mask(turn, train_roles)) or any(c.node_id in useful for c in children.get(turn.node_id, [])):
            useful.add(turn.node_id)
    return useful
