"""Reward functions for `harness-rl train --reward-fn examples.reward_fns:<name>` (run from the repo root).

Each takes a finished rollout's `RolloutOutcome` (TRL's `HarnessRolloutOutcome` fields) and returns its
reward, or None when the rollout cannot be scored (it is then left out of its group's baseline).
"""

from __future__ import annotations

from harness_rl.outcome import RolloutOutcome

EFFICIENCY_WEIGHT = 0.3
TOOL_CALL_BUDGET = 15


def tool_efficiency(outcome: RolloutOutcome) -> float | None:
    """The verifier's reward, plus up to 0.3 for solving the task in fewer than 15 tool calls (TRL's Harbor
    example). The bonus is only paid when the verifier passed: ungated, an agent that does nothing would
    look efficient. After a timeout the verifier's score of the partial work stands, without a bonus."""
    correctness = outcome.env_reward
    if correctness is None:
        return None
    if outcome.timed_out or correctness < 1.0:
        return correctness
    return correctness + EFFICIENCY_WEIGHT * min(1.0, max(0.0, 1.0 - outcome.tool_call_count / TOOL_CALL_BUDGET))
