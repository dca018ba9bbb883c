"""Teacher traces without a model hub: mini-swe-agent solving shipped tasks, captured as ordinary traces.

The real mini-swe-agent CLI runs each task in the local sandbox through the intercept proxy; the
embedded engine serves the tiny model in forced-completion mode and answers each of the agent's
model calls with the next scripted reply: one bash tool call per line of the task's
`solution/solve.sh`, then mini-swe-agent's submit command. The CLI runs the commands itself, the
task's verifier scores the sandbox, and the proxy's trace (the tiny tokenizer's real ids, the model's
logprobs of the forced tokens, masks) is written to `OUT/traces/<rollout_id>.json` with
`metadata["reward"]`, ready for `harness-rl sft --traces OUT/traces`.

A prototype for issue 14's teacher (a `tiny-agent` builder would call it, then `harness-rl sft`).
Rollouts run one at a time: the engine's forced replies are one global queue.

    python scripts/teacher_traces.py --tasks examples/agent-tasks/train --output-dir runs/teacher
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

import aiohttp

from adapters.harnesses import create_harness
from adapters.harnesses.mini_swe_agent import SUBMIT_COMMAND
from adapters.tasks import Task, load_tasks
from harness_rl.background import serve_proxy
from harness_rl.config import RolloutConfig
from harness_rl.engine import Engine, build_tiny_model, default_cache_dir, serve_in_thread
from harness_rl.rollouts import RolloutScheduler
from proxy.client import ProxyClient
from proxy.config import ProxyConfig

HARNESS = "mini-swe-agent"
MAX_TOKENS_PER_TURN = 256  # a forced reply is never cut: the longest solution line is well under this


def bash_call(command: str) -> str:
    """A Hermes tool call, as the tiny model's chat template writes one."""
    return f"<tool_call>\n{json.dumps({'name': 'bash', 'arguments': {'command': command}})}\n</tool_call>"


def script_for(task: Task) -> list[str]:
    if not task.solution_steps:
        raise SystemExit(f"teacher: {task.path} has no solution/solve.sh")
    return [bash_call(step) for step in task.solution_steps] + [bash_call(f"echo {SUBMIT_COMMAND}")]


async def force(http: aiohttp.ClientSession, engine_url: str, replies: list[str]) -> None:
    async with http.delete(f"{engine_url}/forced_completions") as cleared:
        cleared.raise_for_status()
    async with http.post(f"{engine_url}/forced_completions", json={"tools": replies, "no_tools": []}) as added:
        added.raise_for_status()


async def unused(http: aiohttp.ClientSession, engine_url: str) -> int:
    async with http.get(f"{engine_url}/forced_completions") as reply:
        left = await reply.json()
    return len(left["tools"]) + len(left["no_tools"])


async def teach(tasks: list[Task], proxy_url: str, admin_token: str, engine_url: str, out: Path,
                repeats: int) -> int:
    """Run every task `repeats` times; write traces and one JSON line per rollout; return the failures."""
    traces_dir = out / "traces"
    traces_dir.mkdir(parents=True, exist_ok=True)
    sandbox_options = {"network": "proxy-only"} if shutil.which("bwrap") else {}
    config = RolloutConfig(harness=HARNESS, num_generations=1, max_concurrent_rollouts=1, agent_timeout_s=240,
                           sandbox_options=sandbox_options, max_tokens_per_turn=MAX_TOKENS_PER_TURN)
    failures = 0
    async with ProxyClient(proxy_url, admin_token) as proxy, aiohttp.ClientSession() as http:
        scheduler = RolloutScheduler(tasks, proxy, config, harness=create_harness(HARNESS))
        with (out / "rollouts.jsonl").open("a") as log:
            for group_id, task in enumerate(t for t in tasks for _ in range(repeats)):
                replies = script_for(task)
                await force(http, engine_url, replies)
                started = time.monotonic()
                outcome = await scheduler.run_rollout(task, group_id, 0)
                left = await unused(http, engine_url)
                record = {"task": task.name, "rollout_id": outcome.rollout_id, "reward": outcome.reward,
                          "error": outcome.error, "tool_calls": outcome.tool_call_count,
                          "turns": len(outcome.trace.turns) if outcome.trace else 0, "unused_replies": left,
                          "seconds": round(time.monotonic() - started, 2), "trace": None}
                if outcome.trace is not None:
                    outcome.trace.metadata["reward"] = outcome.reward
                    path = traces_dir / f"{outcome.rollout_id}.json"
                    outcome.trace.save(path)
                    record["trace"] = str(path.relative_to(out))
                if outcome.reward != 1.0 or left:
                    failures += 1
                log.write(json.dumps(record) + "\n")
                print(f"{task.name:<32} reward {outcome.reward} | {record['turns']} turns | "
                      f"{record['seconds']:.1f}s" + (f" | {outcome.error}" if outcome.error else ""), flush=True)
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", required=True, help="a Harbor task dir, or a dir of them, with solution/solve.sh")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--model", default="tiny", help="tiny (default) or a model dir; its tokenizer makes the ids")
    parser.add_argument("--repeats", type=int, default=1, help="rollouts per task (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="the tiny model's seed")
    args = parser.parse_args(argv)
    tasks = load_tasks(args.tasks)
    model_dir = build_tiny_model(default_cache_dir(args.seed), seed=args.seed) if args.model == "tiny" else args.model
    started = time.monotonic()
    engine = Engine.from_pretrained(model_dir, served_model_name="policy")
    try:
        with serve_in_thread(engine, forced_completions=True) as server, serve_proxy(
                ProxyConfig(upstream=server.url, store_dir=str(args.output_dir / "proxy"))) as proxy:
            failures = asyncio.run(teach(tasks, proxy.url, proxy.admin_token, server.url, args.output_dir,
                                         args.repeats))
    finally:
        engine.close()
    total = len(tasks) * args.repeats
    print(f"teacher: {total - failures}/{total} rollouts solved with every reply used | "
          f"{time.monotonic() - started:.1f}s | traces in {args.output_dir / 'traces'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
