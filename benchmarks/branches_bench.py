"""Real agent CLIs as they really run: subagents and compactions, and what of their sampled tokens trains.

Each CLI runs through the proxy in front of the embedded engine (the tiny random model) with forced
completions, as the CLI tests do, and a context limit small enough that it really compacts:

- Claude Code 2.1.197 (`fix-off-by-one`): hands the reading to a subagent (its Agent tool), runs a
  command whose output (`seq 1 1500`) fills its context past `CLAUDE_AUTOCOMPACT_PCT_OVERRIDE` of a
  100k window, asks for a summary (a call that repeats its conversation, tools and all) and goes on
  in a fresh conversation carrying it, where it fixes the bug;
- opencode 1.18.33 (`write-greeting`), 16k context: a title call, then the same overflow, its
  summarisation agent's call, and a fresh session that starts from the summary;
- codex 0.171.0 (`fix-off-by-one`), `model_auto_compact_token_limit = 14000`: the same, with codex's
  handoff summary.

Every rollout's trace is checked (valid, every branch's later turns chained onto their predecessor)
and its rows built twice, with the default `--train-roles agent` and with `agent summary`. Printed per
CLI: rows per rollout, the branches and why they began, later turns chained, and the share of sampled
tokens that train, by role and branch; then the machine's load average. Side by side, the reference:
TRL 1.16's harness trainer turning the same captured turns (OpenEnv's export, as it fetches them) into
rows with its reconciler (`_chain_to_sequences`, lossless: any drift forks), which reads a rollout's
turns as one line: rows and forwarded tokens for the same trained tokens.

    python benchmarks/branches_bench.py [--rollouts 3] [--only claude-code]
    python benchmarks/branches_bench.py --quick   # one rollout of codex alone (unless --only names others)

Rollouts run one after another: the forced completions are one queue, taken in call order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from conventions import load_average, parse_args

from adapters.harnesses import create_harness
from adapters.tasks import load_task
from harness_rl.engine import Engine, build_tiny_model, serve_in_thread
from harness_rl.learner.rows import trace_rows, trained_share
from harness_rl.outcome import RolloutOutcome
from harness_rl.run.rollouts import RolloutConfig, RolloutScheduler
from harness_rl.run.stack import serve_proxy
from harness_rl.trace import TrainingTrace
from harness_rl.trace.stats import trace_stats
from proxy.client import ProxyClient
from proxy.config import ProxyConfig

TASKS = Path(__file__).resolve().parents[1] / "examples" / "tasks"
FIX = "sed -i 's/range(n)/range(n + 1)/' mathlib.py"
GREETING = "printf 'hello harness-rl\\n' > greeting.txt"
FILL = "seq 1 1500"  # about 4,800 tokens of output: past each CLI's compaction limit below
SUBAGENT_TASK = "Read mathlib.py and report what total(n) returns."
SUMMARY = "SUMMARY: the task is an off-by-one in total(n) of mathlib.py; a subagent read the file."


def tool_call(name: str, arguments: dict[str, str]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@dataclass(frozen=True)
class Scenario:
    """One CLI's run: its task, harness options and the completions forced in call order."""

    harness: str
    task: str
    options: dict[str, Any]
    tools: list[str]  # for calls that carry tools
    no_tools: list[str] = field(default_factory=list)  # for tool-less calls (titles, some summaries)
    reasons: tuple[str, ...] = ()  # the branches each rollout must have, in order


SCENARIOS = {
    "claude-code": Scenario(
        "claude-code", "fix-off-by-one",
        {"disallowed_tools": ["WebFetch", "WebSearch"],
         "env": {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000", "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "39"}},
        tools=[tool_call("Agent", {"description": "Read the code", "prompt": SUBAGENT_TASK,
                                   "subagent_type": "general-purpose"}),
               tool_call("Bash", {"command": "cat mathlib.py", "description": "Read it"}),
               "total(n) returns sum(range(n)), which leaves out n itself.",
               tool_call("Bash", {"command": FILL, "description": "Count"}),
               tool_call("Bash", {"command": "wc -l mathlib.py", "description": "Size"}),
               SUMMARY,
               tool_call("Bash", {"command": FIX, "description": "Fix the off-by-one"}),
               "Fixed the bug."],
        reasons=("main", "subagent", "summary", "compaction")),
    "opencode": Scenario(
        "opencode", "write-greeting", {"context_tokens": 16000, "output_tokens": 2048},
        tools=[tool_call("bash", {"command": FILL, "description": "Count"}),
               tool_call("bash", {"command": GREETING, "description": "Write the greeting"}),
               tool_call("bash", {"command": "cat greeting.txt", "description": "Check it"}),
               "Done."],
        no_tools=["Greeting file", SUMMARY],
        reasons=("side_call", "main", "summary", "compaction")),
    "codex": Scenario(
        "codex", "fix-off-by-one", {"auto_compact_tokens": 14000},
        tools=[tool_call("exec_command", {"cmd": FILL}), tool_call("exec_command", {"cmd": FIX}),
               tool_call("exec_command", {"cmd": "cat mathlib.py"}), "Finished the task."],
        no_tools=[SUMMARY],
        reasons=("main", "summary", "compaction")),
}


@dataclass
class Tally:
    """What the rollouts of one CLI trained on."""

    rollouts: int = 0
    seconds: float = 0.0
    rewards: list[float | None] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # per rollout, default train roles
    rows_with_summary: list[int] = field(default_factory=list)
    reasons: list[tuple[str, ...]] = field(default_factory=list)  # each rollout's branches, in order
    later: int = 0
    chained: int = 0
    share: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (role, branch): [sampled, trained]
    share_with_summary: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    forwarded: int = 0  # tokens of our rows (default train roles)
    trained: int = 0
    trl: list[int] = field(default_factory=list)  # TRL's reconciler on the same turns: rows, forwarded, trained
    problems: list[str] = field(default_factory=list)

    def add(self, outcome: RolloutOutcome, seconds: float, leftover: dict[str, list[str]]) -> None:
        self.rollouts += 1
        self.seconds += seconds
        self.rewards.append(outcome.reward)
        if outcome.error is not None or outcome.trace is None:
            self.problems.append(f"{outcome.rollout_id}: {outcome.error}")
            return
        if leftover["tools"] or leftover["no_tools"]:
            self.problems.append(f"{outcome.rollout_id}: forced completions left over: {leftover}")
        trace = outcome.trace.validate()
        stats = trace_stats(trace)
        self.later, self.chained = self.later + stats.later_turns, self.chained + stats.chained_turns
        first: dict[int, str] = {}
        for turn in trace.turns:
            if turn.branch is not None:
                first.setdefault(turn.branch.id, turn.branch.reason)
        self.reasons.append(tuple(reason for _, reason in sorted(first.items())))
        rows = trace_rows(trace)
        self.forwarded += sum(len(row) for row in rows)
        self.trained += sum(row.n_trained for row in rows)
        reference = trl_rows(trace)
        if reference is not None:
            self.trl = [a + b for a, b in zip(self.trl or [0, 0, 0], reference, strict=True)]
        for roles, rows_list, share in ((("agent",), self.rows, self.share),
                                        (("agent", "summary"), self.rows_with_summary, self.share_with_summary)):
            rows = trace_rows(trace, roles)
            rows_list.append(len(rows))
            for key, (sampled, trained) in trained_share(trace, rows, roles).items():
                entry = share.setdefault(key, [0, 0])
                entry[0] += sampled
                entry[1] += trained


def trl_rows(trace: TrainingTrace) -> tuple[int, int, int] | None:
    """TRL 1.16's rows for the trace's turns (rows, forwarded tokens, trained tokens); None without TRL."""
    try:
        from trl.experimental.async_grpo.async_rollout_worker import TurnRecord, _chain_to_sequences
    except ImportError:
        return None
    turns = [TurnRecord(t["prompt_token_ids"], t["completion_token_ids"], t["per_token_logps"],
                        t["loss_mask"][len(t["prompt_token_ids"]):]) for t in trace.to_openenv()["turns"]]
    sequences, _ = _chain_to_sequences(turns, trace.rollout_id, 0)
    return len(sequences), sum(len(s.input_ids) for s in sequences), sum(sum(s.completion_mask) for s in sequences)


async def run_rollout(proxy: Any, scenario: Scenario) -> RolloutOutcome:
    async with ProxyClient(proxy.url, proxy.admin_token) as client:
        config = RolloutConfig(harness=scenario.harness, num_generations=1, agent_timeout_s=420, max_turns=24)
        task = load_task(TASKS / scenario.task)
        harness = create_harness(scenario.harness, **scenario.options)
        return await RolloutScheduler([task], client, config, harness=harness).run_rollout(task, 0, 0)


def run(engine_url: str, names: list[str], rollouts: int, store: str) -> dict[str, Tally]:
    tallies: dict[str, Tally] = {}
    config = ProxyConfig(upstream=engine_url, store_dir=store, max_tokens_per_turn=128)
    with serve_proxy(config) as proxy:
        for name in names:
            scenario, tally = SCENARIOS[name], tallies.setdefault(name, Tally())
            for _ in range(rollouts):
                httpx.delete(f"{engine_url}/forced_completions").raise_for_status()
                httpx.post(f"{engine_url}/forced_completions",
                           json={"tools": scenario.tools, "no_tools": scenario.no_tools}).raise_for_status()
                started = time.monotonic()
                outcome = asyncio.run(run_rollout(proxy, scenario))
                leftover = httpx.get(f"{engine_url}/forced_completions").json()
                tally.add(outcome, time.monotonic() - started, leftover)
            httpx.delete(f"{engine_url}/forced_completions").raise_for_status()
    return tallies


def report(tallies: dict[str, Tally]) -> None:
    for name, tally in tallies.items():
        rewards = [r for r in tally.rewards if r is not None]
        print(f"\n{name}: {tally.rollouts} rollouts, {tally.seconds / max(tally.rollouts, 1):.0f} s each, "
              f"reward {sum(rewards) / max(len(rewards), 1):.2f}")
        for reasons, count in Counter(tally.reasons).items():
            print(f"  branches {' · '.join(reasons)}  (x{count})")
        print(f"  rows per rollout: {tally.rows} (agent), {tally.rows_with_summary} (agent + summary)")
        print(f"  later turns chained onto their branch's previous turn: {tally.chained}/{tally.later}")
        if tally.trl:
            rows, forwarded, trained = tally.trl
            print(f"  ours: {sum(tally.rows)} rows, {tally.forwarded:,} forwarded tokens for {tally.trained} trained; "
                  f"TRL 1.16 reconciler: {rows} rows, {forwarded:,} forwarded for {trained} trained "
                  f"({forwarded / max(tally.forwarded, 1):.2f}x the tokens)")
        for label, share in (("agent", tally.share), ("agent + summary", tally.share_with_summary)):
            sampled = sum(s for s, _ in share.values())
            trained = sum(t for _, t in share.values())
            print(f"  --train-roles {label}: {trained}/{sampled} sampled tokens train "
                  f"({trained / max(sampled, 1):.1%})")
            for (role, reason), (s, t) in sorted(share.items()):
                print(f"    {role:<10} {reason:<12} {t:>6}/{s:<6} {t / max(s, 1):>7.1%}")
        for problem in tally.problems:
            print(f"  PROBLEM {problem}")
    print(f"\n{load_average()}")


def main(argv: list[str] | None = None, engine_url: str | None = None) -> dict[str, Tally]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=3, help="rollouts per CLI")
    parser.add_argument("--only", action="append", choices=sorted(SCENARIOS), help="run only these CLIs")
    args = parse_args(parser, {"rollouts": 1}, argv, what="one rollout of codex alone, unless --only names others")
    names = args.only or (["codex"] if args.quick else list(SCENARIOS))
    print(f"at start: {load_average()}")
    with tempfile.TemporaryDirectory() as store:
        if engine_url is not None:  # a test's engine with forced completions already serving
            tallies = run(engine_url, names, args.rollouts, store)
        else:
            engine = Engine.from_pretrained(build_tiny_model(Path.home() / ".cache" / "harness-rl" / "tiny-0"),
                                            served_model_name="tiny")
            try:
                with serve_in_thread(engine, forced_completions=True) as server:
                    tallies = run(server.url, names, args.rollouts, store)
            finally:
                engine.close()
    report(tallies)
    return tallies


if __name__ == "__main__":
    main()
