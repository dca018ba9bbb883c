"""Your own reward: `--reward-fn package.module:function`, TRL's `rollout_reward_fn` contract.

The function is called once per finished rollout with its `RolloutOutcome` (TRL's
`HarnessRolloutOutcome` fields: `env_reward`, the verifier's; `messages`; `tool_call_count`,
`tool_failure_count`, `tool_calls_by_name`; `timed_out`; plus the trace) and returns the rollout's
reward: a float, or None for unscorable (left out of its group's baseline, never counted as 0). It is
not asked about rollouts that could not run at all (no sandbox, no trace): those are unscorable.

A module that cannot be imported or a name that is not a function fails preflight, before anything
starts. A function that raises, or returns anything but a finite number or None, stops the run with
one line naming the function and the rollout: a reward silently turned into "unscorable" would train
on a different objective than the one written. The module is imported with the working directory on
`sys.path`, as `python -m` would, so a file next to the run's config is found.
"""

from __future__ import annotations

import importlib
import math
import numbers
import os
import sys

from harness_rl.outcome import RewardFn, RolloutOutcome
from harness_rl.settings import ConfigError

FLAG = "--reward-fn"


class RewardFnError(RuntimeError):
    """The reward function raised or returned something that is not a reward; the message says which rollout."""


def load_reward_fn(spec: str) -> RewardFn:
    """The function `package.module:function` names (a dotted path after the colon reaches into the module)."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise ConfigError(FLAG, f"{spec!r} is not package.module:function")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(FLAG, f"cannot import {module_name!r} for {spec}: {exc}") from None
    except Exception as exc:  # the module itself failed while importing: say how
        raise ConfigError(FLAG, f"importing {module_name!r} for {spec} raised {type(exc).__name__}: {exc}") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(FLAG, f"{module_name!r} has no {attribute!r} (from {spec})")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(FLAG, f"{spec} is a {type(target).__name__}, not a function")
    return target


def name_of(fn: RewardFn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def score(fn: RewardFn, outcome: RolloutOutcome) -> float | None:
    """`fn(outcome)` checked: a finite float or None, else `RewardFnError` naming the function and the rollout."""
    where = f"rollout {outcome.rollout_id} of task {outcome.task}"
    try:
        reward = fn(outcome)
    except Exception as exc:
        raise RewardFnError(f"{FLAG} {name_of(fn)} raised {type(exc).__name__}: {exc} ({where})") from exc
    if reward is None:
        return None
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise RewardFnError(f"{FLAG} {name_of(fn)} returned {reward!r} ({type(reward).__name__}); expected a finite "
                            f"number or None ({where})")
    return float(reward)
