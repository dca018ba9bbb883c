"""The capture graph's second pass: which conversation (branch) each turn belongs to, and why it began.

Real agents hold several conversations in one rollout: Claude Code hands work to a subagent (a fresh
conversation whose task is the prompt the agent wrote in its Agent/Task tool call) and compacts its
context when it fills (it asks the model for a summary, then goes on in a fresh conversation that
carries it); opencode and codex compact the same way; agents retry, rewrite their history and fire
calls at once. The first pass (`proxy.capture.graph`) links each turn to its parent by exact token prefix
and gives roles; this one reads what the token graph cannot see, the texts:

- a *summary* is a call nobody continued, whose reply (its whole text, or one of its lines of at least
  `MIN_QUOTED` characters) a later new conversation carries in its messages (tool results aside: that
  is where a subagent's report goes); that call's role becomes `summary` and the conversation is a
  `compaction` branch;
- a *subagent* is a new conversation whose first user message holds a string argument (at least
  `MIN_QUOTED` characters) of a tool call the agent made earlier.

Then every turn gets its `Branch`: a turn continues its parent's branch when it is the child that
went on (an agent turn before a summary before an auxiliary call before a discarded retry; then one
the agent continued; the earliest among equals); the same request sent again is a `retry` unless it
is the one the agent went on from; any other turn begins a new branch, and `Branch.reason` says why.
Branches are numbered in the order they began. Only the trace's own turns are read, so the pass is a
function of the set of turns, like the first.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from harness_rl.trace import Branch, BranchReason, Turn

MIN_QUOTED = 24  # characters a quoted line (or tool argument) needs to count as carried over
REWRITING = frozenset({"rewritten_history", "reply_dropped", "reply_edited", "tools_changed"})
_PREFERENCE = {"agent": 0, "summary": 1, "auxiliary": 2, "discarded": 3}


def classify(turns: list[Turn]) -> None:
    """Mark summary calls and set every turn's `branch` (in place)."""
    ordered = sorted(turns, key=lambda t: t.started_at or 0.0)  # stable: arrival order among equal times
    before = {turn.node_id: ordered[:i] for i, turn in enumerate(ordered) if turn.parent_id is None}
    children: dict[str | None, list[Turn]] = {}
    for turn in ordered:
        children.setdefault(turn.parent_id, []).append(turn)  # roots are the children of None
    roots = children.get(None, [])
    carried = {root.node_id: summary for root in roots
               if (summary := _summary_carried(root, before[root.node_id], children)) is not None}
    for summary in carried.values():
        summary.role = "summary"
    branches: dict[str, Branch] = {}
    began = 0
    main_seen = False
    for turn in ordered:
        siblings = children[turn.parent_id]
        retried = [s for s in siblings if s is turn or s.prompt_token_ids == turn.prompt_token_ids]  # itself too
        parent = branches.get(turn.parent_id) if turn.parent_id is not None else None
        reason: BranchReason
        origin: str | None
        if len(retried) > 1 and turn is not _continuing(retried, children):
            reason, origin = "retry", _continuing(retried, children).node_id
        elif parent is not None and turn is _continuing(siblings, children):
            branches[turn.node_id] = parent
            continue
        elif turn.parent_id is None:
            reason, origin = _root_reason(turn, before[turn.node_id], carried.get(turn.node_id), main_seen)
            main_seen = main_seen or reason == "main"
        else:
            reason, origin = _fork_reason(turn)
        branches[turn.node_id] = Branch(id=began, reason=reason, origin=origin)
        began += 1
    for turn in turns:
        turn.branch = branches[turn.node_id]


def _continuing(siblings: list[Turn], children: dict[str | None, list[Turn]]) -> Turn:
    """The child the conversation went on with: by role (an agent turn before a summary before a side call before
    a discarded retry), then one that was itself continued, then the earliest."""
    return min(siblings, key=lambda t: (_PREFERENCE.get(t.role, 4), t.node_id not in children))


def _root_reason(turn: Turn, earlier: list[Turn], summary: Turn | None,
                 main_seen: bool) -> tuple[BranchReason, str | None]:
    against = turn.prefix_break.against if turn.prefix_break is not None else None
    if turn.role == "summary":
        return "summary", against
    if summary is not None:
        return "compaction", summary.node_id
    if turn.role == "auxiliary":
        return "side_call", None
    spawner = _spawned_by(turn, earlier)
    if spawner is not None:
        return "subagent", spawner.node_id
    if not main_seen:
        return "main", None
    if against is not None:
        return "rewritten_history", against
    return "conversation", None


def _fork_reason(turn: Turn) -> tuple[BranchReason, str | None]:
    if turn.role == "summary":
        return "summary", turn.parent_id
    if turn.role == "auxiliary":
        return "side_call", turn.parent_id
    if turn.prefix_break is not None and turn.prefix_break.cause in REWRITING:
        return "rewritten_history", turn.prefix_break.against
    return "fork", turn.parent_id


def _summary_carried(root: Turn, earlier_turns: list[Turn], children: dict[str | None, list[Turn]]) -> Turn | None:
    """The newest earlier call nobody continued whose reply this new conversation carries, if any."""
    messages = root.request.messages or []
    haystack: str | None = None
    for earlier in reversed(earlier_turns):
        text = (earlier.reply.content or "").strip() if earlier.reply is not None else ""
        if (not text or earlier.reply is None or earlier.reply.tool_calls or earlier.node_id in children
                or earlier.role == "discarded"):
            continue
        quoted = [line for line in map(str.strip, text.splitlines()) if len(line) >= MIN_QUOTED]
        if len(text) < MIN_QUOTED // 2 and not quoted:
            continue
        before = earlier.request.messages or []
        if len(messages) > len(before) and messages[:len(before)] == before:
            continue  # this conversation goes on from that call: not a summary carried into a new one
        if haystack is None:
            haystack = "\n".join(_text(m.get("content")) for m in messages if m.get("role") != "tool")
        if text in haystack or any(line in haystack for line in quoted):
            return earlier
    return None


def _spawned_by(root: Turn, earlier_turns: list[Turn]) -> Turn | None:
    """The newest earlier call with a tool call whose string argument this conversation's first user message
    holds: the agent wrote this conversation's task."""
    first_user = next((m for m in root.request.messages or () if m.get("role") == "user"), None)
    if first_user is None:
        return None
    text = _text(first_user.get("content"))
    for earlier in reversed(earlier_turns):
        for call in earlier.reply.tool_calls if earlier.reply is not None else ():
            if any(len(value) >= MIN_QUOTED and value in text for value in _strings(call.arguments)):
                return earlier
    return None


def _strings(arguments: str) -> Iterator[str]:
    """The string values of a tool call's JSON arguments (the raw text when it is not JSON)."""
    try:
        stack: list[Any] = [json.loads(arguments)]
    except ValueError:
        yield arguments
        return
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            yield value.strip()
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "" if content is None else str(content)
