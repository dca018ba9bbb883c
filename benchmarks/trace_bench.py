"""Trace storage and validation, ours vs OpenEnv's pydantic `TrainingTrace`, side by side in one run.

1. decode + validate a 100-turn agent trace whose context grows to 32k tokens: our delta-encoded file
   (JSON and msgpack) through `TrainingTrace.from_json(...).validate()`, against OpenEnv's JSON of
   the same trace through `TrainingTrace.model_validate_json` (pydantic, strict, its own checks).
2. bytes on disk of a 50-turn agent trace: our delta encoding vs OpenEnv's JSON.

Run: `.venv/bin/python benchmarks/trace_bench.py [--turns 100] [--context 32000] [--disk-turns 50] [--quick]`
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from conventions import load_average, parse_args
from openenv.core.harness.training import TrainingTrace as OpenEnvTrace

from harness_rl.trace import Reply, Request, Sampling, ToolCall, TrainingTrace, Turn

TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": "d" * 300,
                                          "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
         for i in range(10)]


def agent_trace(n_turns: int, context_tokens: int, seed: int = 0) -> TrainingTrace:
    """A linear tool-calling rollout: system prompt, then (completion, tool result) per turn."""
    rng = random.Random(seed)
    system = 5000
    per_turn = max(1, (context_tokens - system) // n_turns)
    completion_len = max(1, per_turn * 3 // 10)
    tool_len = per_turn - completion_len
    prompt = [rng.randrange(32000) for _ in range(system)]
    messages: list[dict] = [{"role": "system", "content": "s" * 16000}, {"role": "user", "content": "fix it"}]
    turns = []
    for i in range(n_turns):
        completion = [rng.randrange(32000) for _ in range(completion_len)]
        reply = {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": "tool_1", "arguments": '{"x": "ls"}'}}]}
        turns.append(Turn(
            node_id=f"{i:012x}", parent_id=f"{i - 1:012x}" if i else None,
            prompt_token_ids=list(prompt), completion_token_ids=completion,
            per_token_logps=[-rng.random() * 3 for _ in completion],
            loss_mask=[0] * len(prompt) + [1] * completion_len, policy_version=i // 10,
            finish_reason="tool_calls", request=Request(messages=list(messages), tools=TOOLS),
            reply=Reply(tool_calls=[ToolCall(id=f"call_{i}", name="tool_1", arguments='{"x": "ls"}')]),
            sampling=Sampling(temperature=1.0, requested={"top_p": 1.0}), metadata={"turn": i},
        ))
        tool_output = [rng.randrange(32000) for _ in range(tool_len)]
        prompt = prompt + completion + tool_output
        messages = messages + [reply, {"role": "tool", "tool_call_id": f"call_{i}", "content": "o" * tool_len * 3}]
    return TrainingTrace(rollout_id="bench", turns=turns).validate()


def best_of(fn: Callable[[], object], repeat: int = 11) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    import msgspec

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=100, help="turns of the trace decoded and validated")
    parser.add_argument("--context", type=int, default=32_000, help="tokens its context grows to")
    parser.add_argument("--disk-turns", type=int, default=50, help="turns of the trace whose bytes are counted")
    parser.add_argument("--repeats", type=int, default=11, help="timings per figure; the best is printed")
    args = parse_args(parser, {"turns": 20, "context": 8000, "disk_turns": 10, "repeats": 2})
    print(load_average())
    big = agent_trace(args.turns, args.context)
    ours_json, ours_msgpack = big.to_json(), big.to_msgpack()
    theirs_json = msgspec.json.encode(big.to_openenv())
    n_prompt = sum(len(t.prompt_token_ids) for t in big.turns)
    print(f"{args.turns}-turn trace: context {len(big.turns[-1].sequence):,} tokens, {n_prompt:,} prompt ids over all "
          "turns")

    t_json = best_of(lambda: TrainingTrace.from_json(ours_json).validate(), args.repeats)
    t_msgpack = best_of(lambda: TrainingTrace.from_msgpack(ours_msgpack).validate(), args.repeats)
    t_openenv = best_of(lambda: OpenEnvTrace.model_validate_json(theirs_json), args.repeats)
    t_validate_only = best_of(lambda: big.validate(), args.repeats)
    print(f"decode+validate  OpenEnv pydantic JSON   {t_openenv * 1e3:8.1f} ms")
    print(f"decode+validate  ours, delta JSON        {t_json * 1e3:8.1f} ms   {t_openenv / t_json:6.1f}x faster")
    print(f"decode+validate  ours, delta msgpack     {t_msgpack * 1e3:8.1f} ms   {t_openenv / t_msgpack:6.1f}x faster")
    print(f"validate only    ours, in memory         {t_validate_only * 1e3:8.1f} ms")

    medium = agent_trace(args.disk_turns, 20_000 * args.disk_turns // 50, seed=1)
    sizes = {"OpenEnv JSON": len(msgspec.json.encode(medium.to_openenv())),
             "ours, delta JSON": len(medium.to_json()), "ours, delta msgpack": len(medium.to_msgpack())}
    base = sizes["OpenEnv JSON"]
    print(f"\n{args.disk_turns}-turn agent trace on disk")
    for name, size in sizes.items():
        ratio = "" if name.startswith("OpenEnv") else f"   {base / size:6.1f}x smaller"
        print(f"  {name:<22} {size / 1024:10.1f} KiB{ratio}")
    counts = (10, 20, 40)
    growth = [len(agent_trace(n, 5000 + 270 * n, seed=2).to_json()) for n in counts]
    first, second = (growth[1] - growth[0]) / 10, (growth[2] - growth[1]) / 20
    print(f"\nours, bytes per added turn: 10->20 turns {first:,.0f}, 20->40 turns {second:,.0f} (linear growth)")
    print(load_average())


if __name__ == "__main__":
    main()
