"""Scoring a sandbox with the task's own verifier, and reading the reward it leaves.

The verifier (`tests/test.sh`) runs inside the sandbox after the agent and writes
`/logs/verifier/reward.json` (a flat map of numbers) or `/logs/verifier/reward.txt` (one number);
JSON wins when both exist. A reward we cannot read (no file, an empty file, not a number, NaN/inf,
no usable key) is `None`, meaning unscorable: it must never be mistaken for a 0 reward, and
`Verification.problem` says why in one line, with how the verifier ended and the end of its output,
so a broken task is diagnosed from the run's own messages.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from adapters.sandboxes.base import Sandbox
from adapters.tasks import Task

REWARD_DIR = "/logs/verifier"  # as the task's verifier sees it (the local sandbox may keep it elsewhere)
REWARD_JSON = f"{REWARD_DIR}/reward.json"
REWARD_TXT = f"{REWARD_DIR}/reward.txt"
OUTPUT_TAIL_CHARS = 200  # of the verifier's output, in an unscorable rollout's one-line reason


@dataclass(frozen=True)
class Reward:
    """What the verifier's files said. `value` is None when the rollout is unscorable, and `error` says why."""

    value: float | None
    rewards: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def parse_reward(json_text: str | None, txt_text: str | None, reward_key: str | None = None) -> Reward:
    """Harbor's reward files → one number, or None with the reason.

    `reward.json` wins over `reward.txt`. From the JSON map, `reward_key` (a comma-separated
    preference list) picks; without it, the only key, else `reward`. Non-finite entries are dropped.
    """
    if json_text is not None:
        return _parse_reward_json(json_text, reward_key)
    if txt_text is None:
        return Reward(None, error=f"the verifier wrote neither reward.json nor reward.txt in {REWARD_DIR}")
    if not txt_text.strip():
        return Reward(None, error=f"{REWARD_TXT} is empty")
    try:
        value = float(txt_text.strip())
    except ValueError:
        return Reward(None, error=f"{REWARD_TXT} does not hold a number: {txt_text.strip()[:80]!r}")
    if not math.isfinite(value):
        return Reward(None, error=f"{REWARD_TXT} holds a non-finite number: {value}")
    return Reward(value, {"reward": value})


def _parse_reward_json(text: str, reward_key: str | None) -> Reward:
    if not text.strip():
        return Reward(None, error=f"{REWARD_JSON} is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        return Reward(None, error=f"{REWARD_JSON} is not JSON: {error}")
    if not isinstance(data, dict):
        return Reward(None, error=f"{REWARD_JSON} must be a flat map of numbers")
    rewards = {
        str(k): float(v)
        for k, v in data.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
    if reward_key:
        wanted = [key.strip() for key in reward_key.split(",") if key.strip()]
        chosen = next((key for key in wanted if key in rewards), None)
        if chosen is None:
            return Reward(None, rewards, f"{REWARD_JSON} has no finite value for {reward_key!r} (keys: {sorted(data)})")
    elif len(data) == 1:
        chosen = next(iter(data))
    elif "reward" in data:
        chosen = "reward"
    else:
        return Reward(None, rewards, f"{REWARD_JSON} has several keys {sorted(data)}: choose one with reward_key")
    if chosen not in rewards:
        return Reward(None, rewards, f"{REWARD_JSON}'s {chosen!r} is not a finite number: {data[chosen]!r}")
    return Reward(rewards[chosen], rewards)


@dataclass(frozen=True)
class Verification:
    """The verifier's run and the reward it left."""

    reward: Reward
    exit_code: int | None
    timed_out: bool
    output: str
    timeout_s: float

    @property
    def problem(self) -> str | None:
        """Why there is no reward, in one line: what the reward files said, how the verifier ended (its exit
        code, or its time limit), and the end of its output; None when there is one."""
        if self.reward.value is not None:
            return None
        ended = (f"the verifier timed out after {self.timeout_s:g}s (task.toml verifier.timeout_sec)" if self.timed_out
                 else f"the verifier exited {self.exit_code}")
        tail = " ".join(self.output.split())[-OUTPUT_TAIL_CHARS:]
        return f"{self.reward.error}; {ended}" + (f"; its output ends: {tail}" if tail else "; it printed nothing")


async def verify(task: Task, sandbox: Sandbox, reward_key: str | None = None) -> Verification:
    """Copy the task's tests into the sandbox, run `tests/test.sh`, and read the reward files."""
    verifier_dir = str(PurePosixPath(sandbox.logs_dir) / "verifier")
    await sandbox.exec(["mkdir", "-p", verifier_dir, sandbox.tests_dir], timeout=30)
    await sandbox.exec(["rm", "-f", f"{verifier_dir}/reward.json", f"{verifier_dir}/reward.txt"], timeout=30)
    await sandbox.upload(task.tests_dir, sandbox.tests_dir)
    run = await sandbox.exec(
        ["bash", str(PurePosixPath(sandbox.tests_dir) / "test.sh")],
        env=task.verifier_env,
        timeout=task.verifier_timeout_s,
        cwd=sandbox.workdir,
    )
    reward = parse_reward(
        await sandbox.read_text(f"{verifier_dir}/reward.json"),
        await sandbox.read_text(f"{verifier_dir}/reward.txt"),
        reward_key,
    )
    return Verification(reward, run.exit_code, run.timed_out, (run.stdout + run.stderr)[-4000:],
                        task.verifier_timeout_s)
