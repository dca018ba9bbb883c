"""The teacher prototype end to end: the real mini-swe-agent replays two tasks' solve.sh through the
proxy with forced completions, each rollout scores 1, the traces chain their turns and hold exactly
the scripted replies as trained tokens, and `harness-rl sft` learns from them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from adapters.tasks import load_task
from harness_rl.cli import main
from harness_rl.trace import TrainingTrace

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TASKS = [ROOT / "examples" / "agent-tasks" / "train" / name for name in ("make-script", "fix-typo")]


def test_teacher_traces_replay_the_solutions_and_train(tiny_model_dir: Path, tmp_path: Path) -> None:
    tasks_dir, out = tmp_path / "tasks", tmp_path / "teacher"
    for task in TASKS:
        shutil.copytree(task, tasks_dir / task.name)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "teacher_traces.py"), "--tasks", str(tasks_dir),
                          "--output-dir", str(out), "--model", str(tiny_model_dir)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().splitlines()[-1].startswith("teacher: 2/2 rollouts solved")
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert [(r["reward"], r["unused_replies"], r["turns"]) for r in records] == [(1.0, 0, 3)] * 2

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for record, task_dir in zip(records, sorted(TASKS), strict=True):
        trace = TrainingTrace.load(out / record["trace"]).validate()
        assert trace.metadata["reward"] == 1.0 and trace.metadata["task"] == record["task"]
        agents = [t for t in trace.turns if t.role == "agent"]
        assert len(agents) == len(trace.turns) == 3
        for parent, child in zip(agents, agents[1:], strict=False):
            assert child.parent_id == parent.node_id
            assert child.prompt_token_ids[:len(parent.sequence)] == parent.sequence
        texts = [str(tokenizer.decode(t.completion_token_ids)) for t in agents]
        commands = [json.loads(text.split("\n")[1])["arguments"]["command"] for text in texts]
        assert commands[:-1] == load_task(task_dir).solution_steps
        assert all(t.completion_mask == [1] * len(t.completion_token_ids) for t in agents)

    model = tmp_path / "sft"
    assert main(["sft", "--traces", str(out / "traces"), "--model", str(tiny_model_dir), "--output-dir", str(model),
                 "--epochs", "3", "--learning-rate", "3e-3"]) == 0
    summary = json.loads((model / "sft.json").read_text())
    assert summary["rows"] == 2 and summary["trained_tokens"] == sum(
        len(t.completion_token_ids) for r in records for t in TrainingTrace.load(out / r["trace"]).turns)
    assert summary["epoch_loss"][-1] < summary["epoch_loss"][0] and summary["final_loss"] < summary["initial_loss"]
