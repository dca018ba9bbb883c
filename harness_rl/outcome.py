"""What a finished rollout hands the learner: its trace, its reward, and how the agent behaved.

The shape follows TRL's `HarnessRolloutOutcome` so a `rollout_reward_fn` written for TRL reads the
same fields here (`env_reward`, `tool_call_count`, `tool_failure_count`, `tool_calls_by_name`,
`timed_out`; TRL's `completion` message list is `messages`, since `completion` here is the agent's
final text). A reward of `None` means unscorable (the sandbox never started, the verifier
wrote nothing): such a rollout is left out of its group's baseline and never trained, never
treated as 0; its `error` says why, and `unscorable_cause` sums those reasons up in one line.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from harness_rl.trace import TrainingTrace, openai_message


class RolloutOutcome(msgspec.Struct, kw_only=True):
    """One rollout: one agent run on one task in its own sandbox and proxy session."""

    rollout_id: str
    task: str
    env_reward: float | None = None
    reward: float | None = None
    trace: TrainingTrace | None = None
    completion: str = ""
    tool_call_count: int = 0
    tool_failure_count: int = 0
    tool_calls_by_name: dict[str, int] = {}
    tool_failures_by_name: dict[str, int] = {}
    timed_out: bool = False
    exit_code: int | None = None
    error: str | None = None
    config_error: bool = False  # failed for a reason of the run's setup (sandbox, harness install), not the task
    duration_s: float = 0.0

    @property
    def scorable(self) -> bool:
        return self.reward is not None

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The last agent call's request messages and its reply (TRL's `completion`): the conversation as it ended."""
        agents = [turn for turn in self.trace.turns if turn.role == "agent"] if self.trace is not None else []
        if not agents:
            return []
        last = agents[-1]
        reply = [openai_message(last.reply)] if last.reply is not None else []
        return [*(last.request.messages or []), *reply]


class RolloutGroup(msgspec.Struct, kw_only=True):
    """G rollouts of the same task, scored against each other (GRPO's group)."""

    group_id: int
    task: str
    outcomes: list[RolloutOutcome]


RewardFn = Callable[[RolloutOutcome], "float | None"]


def default_reward(outcome: RolloutOutcome) -> float | None:
    """The verifier's reward as is; `None` stays unscorable."""
    return outcome.env_reward


def unscorable_cause(outcomes: Sequence[RolloutOutcome]) -> str:
    """The commonest reason among the unscorable outcomes (at least one), and how many it is of them all: one line,
    for a run that must stop because nothing could be scored."""
    reasons = Counter((o.error or "the reward function returned None").removeprefix("unscorable: ")
                      for o in outcomes if not o.scorable)
    reason, count = reasons.most_common(1)[0]
    return f"{reason} ({count} of {len(outcomes)} rollouts)"
