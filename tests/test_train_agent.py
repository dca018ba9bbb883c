"""A shortened `make train-agent`: tiny-agent evaluated, trained 3 GRPO steps through the real mini-swe-agent,
and evaluated again from the run's own configuration, to the end: every rollout scorable, every later agent
turn chained onto its predecessor, the run's files readable by `harness-rl sft`.

tiny-agent is the build the repository ships (`examples/models/tiny-agent`; `test_tiny_agent` checks it is the
current recipe's), so this test never spends the 25 minutes of building it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "harness_rl.cli"]
SPLITS = ["--tasks", str(ROOT / "examples" / "agent-tasks" / "train" / "copy-into-13"),
          "--tasks", str(ROOT / "examples" / "agent-tasks" / "heldout")]


def run(*args: str, timeout: float = 900) -> str:
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_a_short_train_agent_runs_to_the_end_with_chained_scorable_rollouts(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert run("build-model", "tiny-agent").strip() == str(ROOT / "examples" / "models" / "tiny-agent")
    run("eval", "--model", "tiny-agent", *SPLITS, "--num-samples", "1", "--output-dir", str(out / "eval-before"))
    printed = run("train", "--harness", "mini-swe-agent", "--model", "tiny-agent", "--tasks",
                  str(ROOT / "examples" / "agent-tasks" / "train"), "--max-steps", "3", "--num-generations", "2",
                  "--groups-per-step", "2", "--report-to", "none", "--output-dir", str(out))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and (out / "training.png").is_file()
    assert summary["chained_turns_share"] is not None and summary["chained_turns_share"] >= 0.95, summary
    assert "of later agent turns chained" in printed
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 2 * 2 and all(r["reward"] is not None and r["error"] is None for r in records)
    # a reply without a tool call ends a rollout (the agent preset), so now and then one makes none (about 1 in 80)
    assert sum(r["tool_call_count"] >= 1 for r in records) >= 0.75 * len(records)

    after = run("eval", "--config", str(out / "config.toml"), "--model", str(out), *SPLITS, "--num-samples", "1",
                "--output-dir", str(out / "eval-after"), "--baseline", str(out / "eval-before"))
    report = json.loads((out / "eval-after" / "eval.json").read_text())
    assert report["harness"] == "mini-swe-agent"
    assert [s["split"] for s in report["splits"]] == ["copy-into-13", "heldout"]
    assert all(s["scorable"] == s["samples"] for s in report["splits"])
    assert "success before" in after
    run("traces", "validate", *map(str, sorted((out / "traces").glob("*.json"))))
