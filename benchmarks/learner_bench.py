"""Learner efficiency, measured in one run and printed side by side.

1. Packing: share of micro-batch token budget holding real tokens, first-fit decreasing packing vs
   padding every row to the longest in a fixed-size batch, on a realistic agent row-length mix.
2. Forwarded tokens per rollout: exact-prefix merged rows vs one row per turn, for 10/30/60-turn
   agent traces (target: merged grows linearly, ≥ 10× fewer tokens at 60 turns).
3. Learner throughput on the tiny model: forwarded and trained tokens/s, and wall time per step for
   the same trained tokens with merged rows vs one row per turn.
4. Learning from stale samples: the tiny model in the embedded engine learns a digit reward while
   each group it trains on was sampled `lag` versions earlier; clipping against the behaviour policy
   (TRL's async loss) vs decoupled PPO, mean reward of the last groups.

    .venv/bin/python benchmarks/learner_bench.py [--steps 3] [--staleness-steps 40] [--quick]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from conventions import load_average, parse_args

from harness_rl.learner.packing import plan_bins
from harness_rl.learner.rows import trace_rows
from harness_rl.outcome import RolloutGroup, RolloutOutcome
from harness_rl.trace import TrainingTrace, Turn


def agent_trace(rng: random.Random, turns: int, *, system: int, reply: int, tool: int, vocab: int,
                linked: bool = True, rid: str = "r") -> TrainingTrace:
    """A linear agent chat: a system prompt, then replies and tool outputs of varying length."""
    prompt = [rng.randrange(vocab) for _ in range(system)]
    out = []
    for i in range(turns):
        completion = [rng.randrange(vocab) for _ in range(max(1, int(rng.expovariate(1 / reply))))]
        out.append(Turn(node_id=f"{rid}.{i}", parent_id=f"{rid}.{i - 1}" if linked and i else None,
                        prompt_token_ids=list(prompt), completion_token_ids=completion,
                        per_token_logps=[-1.0] * len(completion),
                        loss_mask=[0] * len(prompt) + [1] * len(completion), policy_version=0))
        prompt = prompt + completion + [rng.randrange(vocab) for _ in range(max(1, int(rng.expovariate(1 / tool))))]
    return TrainingTrace(rollout_id=rid, turns=out)


def packing_report(rng: random.Random, rows: int, budget: int, batch_rows: int) -> None:
    lengths = [min(budget, max(64, int(rng.lognormvariate(8.0, 1.0)))) for _ in range(rows)]
    bins = plan_bins(lengths, budget)
    packed = sum(lengths) / (len(bins) * budget)
    padded_slots = sum(max(lengths[i:i + batch_rows]) * len(lengths[i:i + batch_rows])
                       for i in range(0, rows, batch_rows))
    padded = sum(lengths) / padded_slots
    print(f"1. packing {rows} rows (lognormal lengths, median {sorted(lengths)[rows // 2]}, "
          f"max {max(lengths)}) into {budget}-token micro-batches")
    print(f"   non-padding share: packed {packed:.4f} ({len(bins)} micro-batches) vs padded batches of "
          f"{batch_rows}: {padded:.4f}  -> {packed / padded:.2f}x  (target >= 0.98: "
          f"{'ok' if packed >= 0.98 else 'MISSED'})")


def merging_report(rng: random.Random, lengths: list[int]) -> None:
    print("2. forwarded tokens per rollout (system 2000, reply ~150, tool output ~400 tokens per turn)")
    print(f"   {'turns':>5} {'merged':>10} {'per turn':>12} {'ratio':>7} {'rows':>5} {'trained':>8}")
    for turns in lengths:
        seed = rng.randrange(1 << 30)
        merged = trace_rows(agent_trace(random.Random(seed), turns, system=2000, reply=150, tool=400, vocab=50000))
        split = trace_rows(agent_trace(random.Random(seed), turns, system=2000, reply=150, tool=400, vocab=50000,
                                       linked=False))
        m, s = sum(len(r) for r in merged), sum(len(r) for r in split)
        assert sum(r.n_trained for r in merged) == sum(r.n_trained for r in split)
        print(f"   {turns:>5} {m:>10} {s:>12} {s / m:>6.1f}x {len(merged):>5} {sum(r.n_trained for r in merged):>8}")


def throughput_report(turns: int, steps: int) -> None:
    from harness_rl.engine import build_tiny_model
    from harness_rl.learner.config import LearnerConfig
    from harness_rl.learner.learner import Learner

    model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", seed=0)

    def groups(linked: bool, step: int) -> list[RolloutGroup]:
        rng = random.Random(step)
        outcomes = [RolloutOutcome(rollout_id=f"r{i}", task="t", reward=float(i % 2),
                                   trace=agent_trace(random.Random(step * 100 + i), turns, system=300, reply=40,
                                                     tool=80, vocab=4000, linked=linked, rid=f"r{i}"))
                    for i in range(4)]
        rng.shuffle(outcomes)
        return [RolloutGroup(group_id=step, task="t", outcomes=outcomes)]

    print(f"3. learner on the tiny model (CPU, {turns}-turn rollouts, group of 4, 8192-token micro-batches)")
    results = {}
    for linked in (True, False):
        learner = Learner(model_dir, LearnerConfig(learning_rate=1e-5, token_budget=8192))
        learner.step(groups(linked, 0))  # warm-up
        started, forwarded, trained = time.perf_counter(), 0.0, 0.0
        for step in range(1, steps + 1):
            metrics = learner.step(groups(linked, step))
            forwarded += metrics["batch/forwarded_tokens_per_step"]
            trained += metrics["batch/trained_tokens_per_step"]
        elapsed = time.perf_counter() - started
        results[linked] = elapsed / steps
        name = "merged rows " if linked else "row per turn"
        print(f"   {name}: {forwarded / elapsed:8.0f} forwarded tok/s, {trained / elapsed:6.0f} trained tok/s, "
              f"{elapsed / steps:6.2f} s/step, {forwarded / steps:8.0f} forwarded tokens/step")
    print(f"   same trained tokens, step time: row per turn / merged = {results[False] / results[True]:.1f}x")


def staleness_report(steps: int) -> None:
    import asyncio
    import collections

    import torch
    from transformers import AutoTokenizer

    from harness_rl.engine import Engine, SamplingParams, build_tiny_model
    from harness_rl.learner.config import LearnerConfig, LossConfig
    from harness_rl.learner.learner import Learner
    from harness_rl.learner.weight_sync import InProcessSync

    model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    digits = torch.tensor([tokenizer.decode([i]).strip().isdigit() for i in range(len(tokenizer))])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Count."}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]

    async def group(engine: Engine, step: int) -> RolloutGroup:
        async def one(seed: int) -> RolloutOutcome:
            ids, logps, version = [], [], 0
            async for update in engine.generate(prompt, SamplingParams(max_tokens=16, seed=seed)):
                ids += [t.token_id for t in update.tokens]
                logps += [min(t.logprob, 0.0) for t in update.tokens]
                version = update.policy_version
            turn = Turn(node_id="t", prompt_token_ids=list(prompt), completion_token_ids=ids, per_token_logps=logps,
                        loss_mask=[0] * len(prompt) + [1] * len(ids), policy_version=version)
            reward = float(digits[ids].float().mean()) if ids else 0.0
            return RolloutOutcome(rollout_id=str(seed), task="digits", reward=reward,
                                  trace=TrainingTrace(rollout_id=str(seed), turns=[turn]))

        return RolloutGroup(group_id=step, task="digits", outcomes=list(await asyncio.gather(
            *(one(1000 * step + i) for i in range(8)))))

    async def run(lag: int, decoupled: bool) -> float:
        engine = Engine.from_pretrained(model_dir)
        settings = LearnerConfig(learning_rate=1e-2, max_staleness=None, loss=LossConfig(decoupled=decoupled))
        learner = Learner(model_dir, settings, weight_sync=InProcessSync(engine))
        pipeline: collections.deque[RolloutGroup] = collections.deque()
        sampled = []
        for step in range(steps + lag):
            pipeline.append(await group(engine, step))
            sampled.append(sum(o.reward for o in pipeline[-1].outcomes) / 8)
            if len(pipeline) > lag:
                await asyncio.to_thread(learner.step, [pipeline.popleft()])
        engine.close()
        return sum(sampled[-5:]) / len(sampled[-5:])

    print(f"4. learning from stale samples (tiny model, digit reward, lr 1e-2, {steps} steps, "
          "mean reward of the last 5 groups sampled)")
    print(f"   {'lag':>3} {'clip vs behaviour':>18} {'decoupled':>10}")
    for lag in (0, 2):
        clip, decoupled = asyncio.run(run(lag, False)), asyncio.run(run(lag, True))
        print(f"   {lag:>3} {clip:>18.3f} {decoupled:>10.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--merge-turns", default="10,30,60", help="rollout lengths whose rows are counted")
    parser.add_argument("--turns", type=int, default=20, help="turns per rollout in the throughput run")
    parser.add_argument("--steps", type=int, default=3, help="timed learner steps per row layout")
    parser.add_argument("--staleness-steps", type=int, default=40, help="learner steps per staleness run")
    args = parse_args(parser, {"merge_turns": "10,30", "turns": 2, "steps": 1, "staleness_steps": 3})
    print(load_average())
    rng = random.Random(0)
    packing_report(rng, rows=512, budget=32768, batch_rows=8)
    merging_report(rng, [int(n) for n in args.merge_turns.split(",")])
    throughput_report(args.turns, args.steps)
    staleness_report(args.staleness_steps)
    print(load_average())


if __name__ == "__main__":
    main()
