"""Branches: an agent's conversations (main, subagent, summary, after a compaction) captured through the proxy,
told apart by what they carry, trained as their own rows with the rollout's one advantage, and the loss by hand."""

from __future__ import annotations

import json
import math
import threading
from typing import Any

import httpx
import pytest
import torch
from fake_engine import FakeEngine, Scripted
from proxy_agent import Agent

from harness_rl.learner.config import LossConfig
from harness_rl.learner.grpo import grpo_loss
from harness_rl.learner.packing import pack
from harness_rl.learner.rows import trace_rows, trained_share
from harness_rl.learner.samples import build_samples
from harness_rl.outcome import RolloutGroup, RolloutOutcome
from harness_rl.trace import Branch, Request, TrainingTrace, Turn
from harness_rl.trace.stats import trace_stats
from proxy.capture.branches import classify
from proxy.server.app import RunningProxy

SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}, "prompt": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": name, "description": name, "parameters": SCHEMA}}
         for name in ("Agent", "bash")]
TASK = "Read mathlib.py and report what total(n) returns for n = 3."
SUMMARY = "SUMMARY: a subagent read mathlib.py; total(n) sums range(n), so it is off by one."


def step(agent: Agent, messages: list[dict[str, Any]], tools: list[Any] | None = TOOLS) -> dict[str, Any]:
    reply = agent.chat(messages, **({"tools": tools} if tools else {}))
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]


def answered(messages: list[dict[str, Any]], reply: dict[str, Any], result: str) -> list[dict[str, Any]]:
    """The conversation with the reply and, for its tool call, the tool's result."""
    follow = [{"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": result}] \
        if reply.get("tool_calls") else [{"role": "user", "content": result}]
    return [*messages, reply, *follow]


def claude_code_like_rollout(agent: Agent, fake: FakeEngine, summary_tools: bool) -> None:
    """The shape Claude Code gave on the real CLI: a subagent from a tool call, then a compaction whose summary
    call repeats the conversation (with or without tools) and whose fresh conversation carries the summary."""
    fake.script.extend([
        Scripted(tool=("Agent", {"description": "inspect", "prompt": TASK})),
        Scripted(tool=("bash", {"cmd": "cat mathlib.py"})),
        Scripted(content="total(n) returns sum(range(n)): 3 for n = 3."),
        Scripted(tool=("bash", {"cmd": "seq 1 100"})),
        Scripted(content=SUMMARY),
        Scripted(tool=("bash", {"cmd": "sed -i s/n)/n + 1)/ mathlib.py"})),
        Scripted(content="Fixed."),
    ])
    main = [{"role": "system", "content": "You are the main agent."}, {"role": "user", "content": "Fix total(n)."}]
    call = step(agent, main)
    sub = [{"role": "system", "content": "You are a subagent."},
           {"role": "user", "content": f"<system-reminder>today</system-reminder>\n\n{TASK}"}]
    sub_call = step(agent, sub)
    report = step(agent, answered(sub, sub_call, "def total(n): return sum(range(n))"))
    main = answered(main, call, report["content"])
    step(agent, main)  # seq 1 100: the context fills here
    step(agent, [*main, {"role": "user", "content": "Summarise the conversation so far. Text only."}],
         TOOLS if summary_tools else None)
    fresh = [{"role": "system", "content": "You are the main agent."},
             {"role": "user", "content": f"This session continues an earlier one.\n\n{SUMMARY}\n\nGo on."}]
    fix = step(agent, fresh)
    step(agent, answered(fresh, fix, ""))


@pytest.mark.parametrize("summary_tools", [True, False], ids=["summary-with-tools", "tool-less-summary"])
def test_subagent_summary_and_compaction_are_branches(fake_proxy: RunningProxy, fake_engine: FakeEngine,
                                                      summary_tools: bool) -> None:
    agent = Agent(fake_proxy)
    claude_code_like_rollout(agent, fake_engine, summary_tools)
    trace = agent.trace()
    main1, sub1, sub2, main2, summary, post1, post2 = trace.turns
    assert [t.role for t in trace.turns] == ["agent", "agent", "agent", "agent", "summary", "agent", "agent"]
    assert [(t.branch.id, t.branch.reason, t.branch.origin) for t in trace.turns] == [
        (0, "main", None), (1, "subagent", main1.node_id), (1, "subagent", main1.node_id), (0, "main", None),
        (2, "summary", summary.branch.origin), (3, "compaction", summary.node_id), (3, "compaction", summary.node_id)]
    # It repeats main2's request, not main2's reply: with the agent's tools a fork off main1; without them the
    # template renders another prompt, a new root that broke from the main conversation.
    assert summary.parent_id == (main1.node_id if summary_tools else None)
    assert summary.branch.origin in (main1.node_id, main2.node_id)
    stats = trace_stats(trace)
    assert (stats.later_turns, stats.chained_turns) == (3, 3)  # main, subagent and compaction each chain

    rows = trace_rows(trace)
    assert [(r.branch.reason, r.node_ids) for r in rows] == [
        ("main", [main1.node_id, main2.node_id]), ("subagent", [sub1.node_id, sub2.node_id]),
        ("compaction", [post1.node_id, post2.node_id])]
    sampled = {t.node_id: len(t.completion_token_ids) for t in trace.turns}
    assert [r.n_trained for r in rows] == [sampled[main1.node_id] + sampled[main2.node_id],
                                           sampled[sub1.node_id] + sampled[sub2.node_id],
                                           sampled[post1.node_id] + sampled[post2.node_id]]
    share = trained_share(trace, rows)
    assert share[("summary", "summary")] == (sampled[summary.node_id], 0)
    assert share[("agent", "subagent")] == (sampled[sub1.node_id] + sampled[sub2.node_id],) * 2

    with_summary = trace_rows(trace, ("agent", "summary"))
    assert len(with_summary) == 4
    summary_row = next(r for r in with_summary if r.branch.reason == "summary")
    assert summary_row.node_ids == [summary.node_id]
    assert summary_row.tokens == summary.prompt_token_ids + summary.completion_token_ids
    assert summary_row.mask == [0] * len(summary.prompt_token_ids) + [1] * len(summary.completion_token_ids)
    assert summary_row.logprobs[len(summary.prompt_token_ids):] == summary.per_token_logps

    other = RolloutOutcome(rollout_id="b", task="t", reward=0.0, trace=TrainingTrace(rollout_id="b", turns=[main1]))
    group = RolloutGroup(group_id=0, task="t", outcomes=[
        RolloutOutcome(rollout_id="a", task="t", reward=1.0, trace=trace), other])
    samples, metrics = build_samples([group], policy_version=0, max_staleness=None, normalization="token",
                                     train_roles=("agent", "summary"))
    mine = [s for s in samples if s.rollout_key == "0/a"]
    assert len(mine) == 4 and len({s.advantage for s in mine}) == 1 and mine[0].advantage == pytest.approx(1.0)
    assert metrics["rollout/branches_mean"] == 2.5  # four branches, and one in the other rollout


def test_retry_and_rewritten_history_begin_their_own_branches(fake_proxy: RunningProxy,
                                                              fake_engine: FakeEngine) -> None:
    agent = Agent(fake_proxy)
    fake_engine.script.extend([Scripted(tool=("bash", {"cmd": "ls"})), Scripted(tool=("bash", {"cmd": "ls -a"})),
                               Scripted(content="done"), Scripted(content="done again")])
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "list"}]
    first = step(agent, messages)
    retried = step(agent, messages)  # the agent sent the same request again and went on from the second
    step(agent, answered(messages, retried, "a b"))
    rewritten = [{"role": "system", "content": "s"}, {"role": "user", "content": "list (edited)"}]
    step(agent, rewritten)
    trace = agent.trace()
    assert first["tool_calls"][0]["function"]["arguments"] != retried["tool_calls"][0]["function"]["arguments"]
    t1, t2, t3, t4 = trace.turns
    assert [t.role for t in trace.turns] == ["discarded", "agent", "agent", "agent"]
    assert [(t.branch.id, t.branch.reason) for t in trace.turns] == [
        (0, "retry"), (1, "main"), (1, "main"), (2, "rewritten_history")]
    assert t1.branch.origin == t2.node_id and t3.parent_id == t2.node_id and t4.branch.origin is not None


def at_once(agent: Agent, calls: dict[str, tuple[list[dict[str, Any]], list[Any] | None]]) -> dict[str, Any]:
    """Send the calls from threads at the same time; their replies by name."""
    replies: dict[str, dict[str, Any]] = {}
    threads = [threading.Thread(target=lambda k=k, m=m, t=t: replies.__setitem__(k, step(agent, m, t)))
               for k, (m, t) in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return replies


def test_calls_at_once_keep_their_chains(fake_proxy: RunningProxy, fake_engine: FakeEngine) -> None:
    """opencode's title call and its first call leave together; later a main call and a side call (with the
    agent's tools, so it extends the same turn) leave together. The main conversation still chains turn after
    turn; the title is a side call and the other child of the shared turn a fork of its own."""
    agent = Agent(fake_proxy)
    fake_engine.script.extend([Scripted(delay_s=0.2)] * 4)  # default answers, slow enough to overlap
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "list"}]
    title = [{"role": "system", "content": "title"}, {"role": "user", "content": "list"}]
    first = at_once(agent, {"title": (title, None), "main": (messages, TOOLS)})
    main = answered(messages, first["main"], "go on")
    side = [*main, {"role": "user", "content": "note anything odd"}]
    second = at_once(agent, {"main": (main, TOOLS), "side": (side, TOOLS)})
    step(agent, answered(main, second["main"], "and then?"))
    trace = agent.trace()
    by_reason: dict[str, list[Turn]] = {}
    for turn in trace.turns:
        by_reason.setdefault(turn.branch.reason, []).append(turn)
    assert sorted(by_reason) == ["fork", "main", "side_call"]
    chain = by_reason["main"]
    assert [t.role for t in chain] == ["agent"] * 3
    assert all(b.parent_id == a.node_id and b.prompt_source == "spliced"
               for a, b in zip(chain, chain[1:], strict=False))
    (fork,) = by_reason["fork"]
    assert fork.parent_id == chain[0].node_id == fork.branch.origin and fork.role == "agent"
    assert [t.role for t in by_reason["side_call"]] == ["auxiliary"]
    assert trace_stats(trace).chained_turns == 2
    assert [r.branch.reason for r in trace_rows(trace)] == ["main", "fork"]


def test_parallel_tool_calls_chain_through_the_real_engine(engine_url: str, tmp_path) -> None:
    """A reply with two tool calls, answered with both results, is spliced onto its exact tokens."""
    from harness_rl.run.stack import serve_proxy
    from proxy.config import ProxyConfig

    two = "".join(f"<tool_call>\n{json.dumps({'name': 'bash', 'arguments': {'cmd': c}})}\n</tool_call>\n"
                  for c in ("ls", "pwd")).strip()
    httpx.delete(f"{engine_url}/forced_completions").raise_for_status()
    httpx.post(f"{engine_url}/forced_completions", json={"tools": [two, "Both done."], "no_tools": []}
               ).raise_for_status()
    try:
        with serve_proxy(ProxyConfig(upstream=engine_url, store_dir=str(tmp_path), max_tokens_per_turn=96)) as proxy:
            agent = Agent(proxy)
            messages = [{"role": "user", "content": "where am I and what is here?"}]
            reply = step(agent, messages, TOOLS)
            assert [c["function"]["name"] for c in reply["tool_calls"]] == ["bash", "bash"]
            results = [{"role": "tool", "tool_call_id": c["id"], "content": out}
                       for c, out in zip(reply["tool_calls"], ("a b", "/app"), strict=True)]
            step(agent, [*messages, reply, *results], TOOLS)
            trace = agent.trace()
    finally:
        httpx.delete(f"{engine_url}/forced_completions").raise_for_status()
    first, second = trace.turns
    assert second.parent_id == first.node_id and second.prompt_source == "spliced"
    assert second.prompt_token_ids[:len(first.sequence)] == first.sequence
    assert first.branch == second.branch == Branch(id=0, reason="main")
    assert trace_rows(trace)[0].n_trained == len(first.completion_token_ids) + len(second.completion_token_ids)


# --- the loss of a rollout with a subagent and a compaction, by hand ---------------------------------------------


def _turn(node_id: str, prompt: list[int], completion: list[int], branch: Branch, *, parent: str | None = None,
          role: str = "agent") -> Turn:
    return Turn(node_id=node_id, parent_id=parent, role=role, prompt_token_ids=prompt,  # type: ignore[arg-type]
                completion_token_ids=completion, per_token_logps=[-0.5] * len(completion),
                loss_mask=[0] * len(prompt) + [1] * len(completion), branch=branch, policy_version=0)


def three_branch_rollout() -> TrainingTrace:
    main, sub = Branch(id=0, reason="main"), Branch(id=1, reason="subagent", origin="m1")
    summary, after = Branch(id=2, reason="summary", origin="m2"), Branch(id=3, reason="compaction", origin="sm")
    return TrainingTrace(rollout_id="a", turns=[
        _turn("m1", [1, 2], [10, 11], main),
        _turn("s1", [5, 6], [20, 21, 22], sub),
        _turn("m2", [1, 2, 10, 11, 3], [12], main, parent="m1"),
        _turn("sm", [1, 2, 10, 11, 3, 12, 3, 7], [30], summary, parent="m2", role="summary"),
        _turn("c1", [1, 8, 30], [40, 41], after),
    ]).validate()


@pytest.mark.parametrize(("train_roles", "expected"), [
    (("agent",), -0.8 / 1.0), (("agent", "summary"), -(0.8 * 10 + 1.5) / 11)])
def test_three_branches_train_three_rows_with_one_advantage_and_the_loss_by_hand(
        train_roles: tuple[str, ...], expected: float) -> None:
    """Rollout a (reward 1): main (3 trained tokens), subagent (3), after the compaction (2), and the summary (1)
    when summaries train; rollout b (reward 0): 2 tokens. Advantages ±0.5/(0.5 + 1e-8); every token weighs 1/N.
    The learner's ratios are set per row: main 1.5, subagent 0.5, compaction 4 (truncated to the cap, 3),
    summary 1.5, b 2. Decoupled loss per token: −min(r, 3)·A, so with N = 10
    L = A/10 · (−1.5·3 − 0.5·3 − 3·2 + 2·2) = −0.8·A, and with the summary (N = 11) L = −(8 + 1.5)·A/11."""
    other = TrainingTrace(rollout_id="b", turns=[_turn("b1", [1, 2], [10, 13], Branch(id=0, reason="main"))])
    group = RolloutGroup(group_id=0, task="t", outcomes=[
        RolloutOutcome(rollout_id="a", task="t", reward=1.0, trace=three_branch_rollout()),
        RolloutOutcome(rollout_id="b", task="t", reward=0.0, trace=other)])
    samples, _ = build_samples([group], policy_version=0, max_staleness=None, normalization="token",
                               train_roles=train_roles)
    mine = [s for s in samples if s.rollout_key == "0/a"]
    assert [s.row.branch.reason for s in mine] == ["main", *(["summary"] if "summary" in train_roles else []),
                                                   "subagent", "compaction"]
    advantage = 0.5 / (0.5 + 1e-8)
    assert len({s.advantage for s in mine}) == 1 and mine[0].advantage == pytest.approx(advantage, abs=1e-12)
    ratio = {"main": 1.5, "subagent": 0.5, "compaction": 4.0, "summary": 1.5}
    loss = torch.tensor(0.0, dtype=torch.float64)
    for sample in samples:  # one micro-batch per row; the learner sums micro-batches the same way
        (batch,) = pack([sample], token_budget=64)
        r = ratio[sample.row.branch.reason] if sample.rollout_key == "0/a" else 2.0
        logps = batch.behaviour_logps + math.log(r)
        value, _ = grpo_loss(logps, batch.behaviour_logps, batch.advantages, batch.weights, LossConfig())
        loss = loss + value.double()
    assert float(loss) == pytest.approx(expected * advantage, abs=1e-6)


def test_classify_is_idempotent_and_leaves_no_turn_without_a_branch() -> None:
    turns = [Turn(node_id=f"t{i}", prompt_token_ids=[i + 1], completion_token_ids=[9], per_token_logps=[-1.0],
                  loss_mask=[0, 1], request=Request(messages=[{"role": "user", "content": f"task {i}"}]))
             for i in range(3)]
    classify(turns)
    first = [t.branch for t in turns]
    classify(turns)
    assert [t.branch for t in turns] == first
    assert [b.reason for b in first] == ["main", "conversation", "conversation"]
