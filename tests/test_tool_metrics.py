"""Tool metrics under TRL's names: counted from the captured requests by TRL's rules, by hand, on TensorBoard."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from harness_rl.outcome import RolloutGroup, RolloutOutcome
from harness_rl.run.metrics import MetricsLogger, console_line, rollout_metrics
from harness_rl.trace import Branch, Reply, Request, ToolCall, TrainingTrace, Turn
from harness_rl.trace.tools import tool_usage

TRACEBACK = "Traceback (most recent call last):\n  File \"x.py\", line 1\nNameError: name 'y' is not defined"


def call(call_id: str, name: str, **arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def result(call_id: str, content: object) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def turn(node_id: str, messages: list[dict], calls: list[tuple[str, str]], *, role: str = "agent",
         branch: Branch | None = None) -> Turn:
    reply = Reply(tool_calls=[ToolCall(id=i, name=n, arguments="{}") for i, n in calls], content=None if calls
                  else "done")
    return Turn(node_id=node_id, role=role, prompt_token_ids=[1], completion_token_ids=[2],  # type: ignore[arg-type]
                per_token_logps=[-0.5], loss_mask=[0, 1], request=Request(messages=messages), reply=reply,
                branch=branch)


def fixture_trace() -> TrainingTrace:
    """A main conversation, a subagent's, a summary call and a title call.

    Main: bash (a traceback), read (fine), bash (ERROR), bash again failing with the very same traceback (the same
    tool and first 200 characters: counted once), then done. The subagent: grep ("command failed"), then done.
    The summary and the title are not agent turns: their calls and requests do not count.
    """
    main, sub = Branch(id=0, reason="main"), Branch(id=1, reason="subagent", origin="m1")
    m1 = [{"role": "user", "content": "fix it"}]
    m2 = [*m1, {"role": "assistant", "content": None, "tool_calls": [call("a", "bash", cmd="python x.py"),
                                                                     call("b", "read", path="x.py")]},
          result("a", TRACEBACK), result("b", [{"type": "text", "text": "print(y)"}])]
    m3 = [*m2, {"role": "assistant", "content": None, "tool_calls": [call("c", "bash", cmd="rm /")]},
          result("c", "ERROR: permission denied")]
    m4 = [*m3, {"role": "assistant", "content": None, "tool_calls": [call("d", "bash", cmd="python x.py")]},
          result("d", TRACEBACK)]
    s1 = [{"role": "user", "content": "find y"}]
    s2 = [*s1, {"role": "assistant", "content": None, "tool_calls": [call("e", "grep", pattern="y")]},
          result("e", "grep: command failed")]
    summary = [*m4, {"role": "tool", "tool_call_id": "z", "name": "bash", "content": "Exception in summary"}]
    return TrainingTrace(rollout_id="r", turns=[
        turn("m1", m1, [("a", "bash"), ("b", "read")], branch=main),
        turn("s1", s1, [("e", "grep")], branch=sub),
        turn("s2", s2, [], branch=sub),
        turn("m2", m2, [("c", "bash")], branch=main),
        turn("m3", m3, [("d", "bash")], branch=main),
        turn("m4", m4, [], branch=main),
        turn("sm", summary, [("q", "bash")], role="summary"),
        turn("ti", [{"role": "user", "content": "title"}], [("t", "title_tool")], role="auxiliary"),
    ]).validate()


def test_tool_usage_equals_a_hand_count() -> None:
    usage = tool_usage(fixture_trace())
    assert usage.calls_by_name == {"bash": 3, "read": 1, "grep": 1}
    assert usage.failures_by_name == {"bash": 2, "grep": 1}
    assert (usage.call_count, usage.failure_count) == (5, 3)


def test_one_conversation_counts_exactly_as_trls_harness_trainer() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "you are importing from trl.experimental"
        harness = pytest.importorskip("trl.experimental.async_grpo.openenv_harness")
    trace = fixture_trace()
    trace.turns = [t for t in trace.turns if t.branch is not None and t.branch.reason == "main"]
    entries = trace.to_openenv()["turns"]  # OpenEnv's trace entries: request and OpenAI-shaped response
    usage = tool_usage(trace)
    assert usage.calls_by_name == harness._tool_call_counts_by_name(entries)
    assert usage.failures_by_name == harness._tool_failures_by_name(entries)


def outcome(rid: str, calls: dict[str, int], failures: dict[str, int],
            env_reward: float | None = 1.0) -> RolloutOutcome:
    return RolloutOutcome(rollout_id=rid, task="t", env_reward=env_reward, reward=env_reward,
                          tool_calls_by_name=calls, tool_call_count=sum(calls.values()),
                          tool_failures_by_name=failures, tool_failure_count=sum(failures.values()))


def groups() -> list[RolloutGroup]:
    """Group 0: rollouts with 4 calls (1 failed), 2 calls (2 failed) and none; group 1: no tool calls at all."""
    return [RolloutGroup(group_id=0, task="t", outcomes=[
                outcome("a", {"bash": 3, "read": 1}, {"bash": 1}), outcome("b", {"bash": 2}, {"bash": 2}, 0.0),
                outcome("c", {}, {}, None)]),
            RolloutGroup(group_id=1, task="t", outcomes=[outcome("d", {}, {}, 0.5), outcome("e", {}, {}, 0.0)])]


def test_step_metrics_by_hand() -> None:
    """TRL's rules: per rollout its calls and its failure share (0 without calls), averaged over the rollouts of
    groups that called a tool (group 1 called none and is left out); per tool, sums."""
    metrics = rollout_metrics(groups(), custom_reward=True)
    assert metrics == {
        "tools/call_frequency": pytest.approx((4 + 2 + 0) / 3),
        "tools/failure_frequency": pytest.approx((1 / 4 + 2 / 2 + 0) / 3),
        "tools/bash/call_total": 5.0, "tools/read/call_total": 1.0, "tools/bash/failure_total": 3.0,
        "rollout/correctness_mean": pytest.approx((1.0 + 0.0 + 0.5 + 0.0) / 4),
        "rollouts/scored": 4.0, "rollouts/unscorable": 1.0,  # "c" has no reward
    }
    assert "rollout/correctness_mean" not in rollout_metrics(groups(), custom_reward=False)
    assert "tools 2.0 | tool fail 0.42" in console_line(1, metrics)


def test_tensorboard_shows_the_tool_metrics_under_trls_names(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, console=False, report_to="jsonl,tensorboard")
    logger.log(1, rollout_metrics(groups(), custom_reward=True))
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/tools/call_frequency", "train/tools/failure_frequency", "train/tools/bash/call_total",
            "train/tools/bash/failure_total", "train/tools/read/call_total", "train/rollout/correctness_mean"} <= tags
    assert events.Scalars("train/tools/call_frequency")[0].value == pytest.approx(2.0)
    assert events.Scalars("train/tools/bash/failure_total")[0].step == 1
