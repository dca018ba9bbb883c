"""Teacher traces without a model hub: a real agent CLI replaying each task's reference solution.

The real CLI (mini-swe-agent) runs each task in the local sandbox through the intercept proxy,
exactly as in a training rollout. The model behind the proxy is an embedded engine that this module
starts for itself, with forced completions: each model call the agent makes is answered with the
next scripted reply (one bash tool call per line of the task's `solution/solve.sh`, then the agent's
submit command), returned with the tokenizer's real ids and the model's own logprobs. The CLI runs
the commands, the task's verifier scores the sandbox, and the proxy's trace is an ordinary trace:
`OUT/traces/<demo>.json` with `metadata["reward"]`, ready for `harness-rl sft --traces OUT/traces`.

A demonstration may also stop early (`Demo.steps`): the first few solution lines, then the submit.
The verifier scores it 0, and it is recorded like any other: an imperfect teacher's mistake.

Forced completions exist only on this private engine (never on one a training run samples from:
`harness-rl train` cannot enable them, `tests/test_engine_forced_guard.py`). Rollouts run one at a
time, since the forced replies are one queue. Trace file names are the task names, so the same
tasks give the same files in the same order (the `tiny-agent` build depends on it).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from adapters.harnesses import create_harness
from adapters.harnesses.mini_swe_agent import SUBMIT_COMMAND
from adapters.tasks import Task
from harness_rl.run.config import RunConfig
from harness_rl.run.engines import EngineConfig
from harness_rl.run.rollouts import RolloutConfig, RolloutScheduler

HARNESSES = ("mini-swe-agent",)  # the CLIs a teacher script is written for
MAX_TOKENS_PER_TURN = 256  # a forced reply is never cut: the longest is 44 tokens of the tiny tokenizer
AGENT_TIMEOUT_S = 240.0


class TeacherError(RuntimeError):
    """A teacher that cannot run (no solution, unsupported harness) or whose replay failed."""


@dataclass(frozen=True)
class Demo:
    """One demonstration: a task solved by its reference solution's first `steps` lines (all: None), then
    the submit."""

    task: Task
    steps: int | None = None

    @property
    def name(self) -> str:
        base = self.task.name.replace("/", "__")
        return base if self.steps is None else f"{base}__first-{self.steps}"


class TeacherRollout(msgspec.Struct, kw_only=True):
    """One replayed demonstration (a line of `OUT/rollouts.jsonl`)."""

    task: str
    demo: str
    reward: float | None
    turns: int
    unused_replies: int  # scripted replies the agent never asked for: the replay went off script
    error: str | None
    trace: str | None  # relative to the output dir
    seconds: float

    @property
    def replayed(self) -> bool:
        """The agent asked for every scripted reply and no more, and the trace was captured."""
        return self.unused_replies == 0 and self.trace is not None and self.error is None


def bash_call(command: str) -> str:
    """A Hermes tool call, as the tiny model's chat template writes one."""
    return f"<tool_call>\n{json.dumps({'name': 'bash', 'arguments': {'command': command}})}\n</tool_call>"


def script_for(demo: Demo, harness: str) -> list[str]:
    """The replies of a demonstration with `harness`: one tool call per solution line used, then the submit."""
    if harness not in HARNESSES:
        raise TeacherError(f"no teacher script for {harness}; teachers exist for {', '.join(HARNESSES)}")
    steps = demo.task.solution_steps
    if not steps:
        raise TeacherError(f"{demo.task.path} has no solution/solve.sh to replay")
    return [bash_call(step) for step in steps[:demo.steps]] + [bash_call(f"echo {SUBMIT_COMMAND}")]


def teacher_traces(demos: Sequence[Demo], model_dir: Path, output_dir: Path, *, harness: str = "mini-swe-agent",
                   harness_options: dict[str, Any] | None = None,
                   on_rollout: Callable[[TeacherRollout], None] | None = None) -> list[TeacherRollout]:
    """Replay every demonstration with `harness` against `model_dir`'s tokenizer and weights; write the
    traces and `rollouts.jsonl` under `output_dir`; return one record per demonstration."""
    from harness_rl.run.stack import Stack

    scripts = [script_for(demo, harness) for demo in demos]
    options = harness_options or {}
    sandbox_options = {"network": "proxy-only"} if shutil.which("bwrap") else {}
    config = RunConfig(engine=EngineConfig(engine=["embedded"], weight_sync="none"), rollouts=RolloutConfig(
        harness=harness, num_generations=2, max_concurrent_rollouts=1, agent_timeout_s=AGENT_TIMEOUT_S,
        sandbox_options=sandbox_options, max_tokens_per_turn=MAX_TOKENS_PER_TURN, harness_options=options))
    with Stack.start(config, model_dir, output_dir, [d.task for d in demos], harness=create_harness(harness, **options),
                     served_model_name="policy", forced_completions=True, name="harness-rl-teacher") as stack:
        return stack.loop.run(_replay(demos, scripts, stack.scheduler, stack.engine.url, output_dir, harness,
                                      on_rollout))


async def _replay(demos: Sequence[Demo], scripts: list[list[str]], scheduler: RolloutScheduler, engine_url: str,
                  out: Path, harness: str, on_rollout: Callable[[TeacherRollout], None] | None) -> list[TeacherRollout]:
    (out / "traces").mkdir(parents=True, exist_ok=True)
    records: list[TeacherRollout] = []
    async with aiohttp.ClientSession() as http:
        for group_id, (demo, replies) in enumerate(zip(demos, scripts, strict=True)):
            await _force(http, engine_url, replies)
            started = time.monotonic()
            outcome = await scheduler.run_rollout(demo.task, group_id, 0)
            path = None
            if outcome.trace is not None:
                outcome.trace.metadata.update({"reward": outcome.reward, "task": demo.task.name, "teacher": harness,
                                               "demo": demo.name})
                path = f"traces/{demo.name}.json"
                outcome.trace.save(out / path)
            record = TeacherRollout(
                task=demo.task.name, demo=demo.name, reward=outcome.reward,
                turns=len(outcome.trace.turns) if outcome.trace else 0,
                unused_replies=await _unused(http, engine_url), error=outcome.error, trace=path,
                seconds=round(time.monotonic() - started, 2))
            records.append(record)
            if on_rollout is not None:
                on_rollout(record)
    (out / "rollouts.jsonl").write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in records))
    return records


async def _force(http: aiohttp.ClientSession, engine_url: str, replies: list[str]) -> None:
    async with http.delete(f"{engine_url}/forced_completions") as cleared:
        cleared.raise_for_status()
    async with http.post(f"{engine_url}/forced_completions", json={"tools": replies, "no_tools": []}) as added:
        added.raise_for_status()


async def _unused(http: aiohttp.ClientSession, engine_url: str) -> int:
    async with http.get(f"{engine_url}/forced_completions") as reply:
        left = await reply.json()
    return len(left["tools"]) + len(left["no_tools"])
