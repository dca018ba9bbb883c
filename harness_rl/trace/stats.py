"""What one rollout's trace says about how the agent worked: turns, tokens, and whether its turns chained.

A turn *chains* onto its predecessor (the agent turn of its branch recorded just before it) when its
parent is that turn and its prompt extends that turn's prompt + completion exactly, and the proxy did
not render it from messages (`prompt_source` is `spliced`, or unrecorded by a proxy that does not
splice). A chained conversation is one training row, each sampled token trained once in the context it
was sampled in; a broken chain re-tokenises the model's own words and starts a new row. Each branch (a
subagent's conversation, the one after a compaction) is its own conversation and chains on its own;
a trace without branches is one.
"""

from __future__ import annotations

import msgspec

from harness_rl.trace.training_trace import TrainingTrace
from harness_rl.trace.turn import Turn


class TraceStats(msgspec.Struct, kw_only=True, frozen=True):
    agent_turns: int
    later_turns: int  # agent turns after the first of their branch: the ones that can chain
    chained_turns: int
    spliced_turns: int
    generated_tokens: int  # completion tokens of agent turns


def chains(turn: Turn, predecessor: Turn) -> bool:
    """Whether `turn` continues `predecessor`'s exact tokens (see the module docstring)."""
    sequence = predecessor.sequence
    return (turn.parent_id == predecessor.node_id and turn.prompt_source != "rendered"
            and turn.prompt_token_ids[:len(sequence)] == sequence)


def trace_stats(trace: TrainingTrace) -> TraceStats:
    agents = [turn for turn in trace.turns if turn.role == "agent"]
    branches: dict[int | None, list[Turn]] = {}
    for turn in agents:
        branches.setdefault(turn.branch.id if turn.branch is not None else None, []).append(turn)
    return TraceStats(
        agent_turns=len(agents), later_turns=sum(len(turns) - 1 for turns in branches.values()),
        chained_turns=sum(chains(turn, before) for turns in branches.values()
                          for before, turn in zip(turns, turns[1:], strict=False)),
        spliced_turns=sum(turn.prompt_source == "spliced" for turn in agents),
        generated_tokens=sum(len(turn.completion_token_ids) for turn in agents))
