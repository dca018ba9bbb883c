"""The teacher end to end: the real mini-swe-agent replays two tasks' solve.sh through the proxy with
forced completions, each rollout scores 1 (an early stop scores 0), the traces chain their turns and
hold exactly the scripted replies as trained tokens, a replay gives the same tokens again, and
`harness-rl sft` learns from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from adapters.tasks import load_task
from harness_rl.cli import main
from harness_rl.demo.teacher import Demo, TeacherError, script_for, teacher_traces
from harness_rl.demo.tiny_agent import SHIPPED
from harness_rl.run.presets import AGENT_HARNESS_OPTIONS, AGENT_INSTANCE_TEMPLATE
from harness_rl.trace import TrainingTrace

ROOT = Path(__file__).resolve().parents[1]
TASKS = [ROOT / "examples" / "agent-tasks" / "train" / name for name in ("copy-into-13", "count-lines-13")]


def test_the_script_is_one_bash_call_per_solution_line_then_the_submit() -> None:
    task = load_task(TASKS[0])

    def commands(demo: Demo) -> list[str]:
        replies = script_for(demo, "mini-swe-agent")
        return [json.loads(reply.split("\n")[1])["arguments"]["command"] for reply in replies]

    submit = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
    assert commands(Demo(task)) == ["cat values.txt", "mkdir labels", "cp values.txt labels/", submit]
    assert commands(Demo(task, 1)) == ["cat values.txt", submit]
    assert Demo(task).name == "harness-rl__copy-into-13" and Demo(task, 1).name == "harness-rl__copy-into-13__first-1"
    with pytest.raises(TeacherError, match="no teacher script for opencode"):
        script_for(Demo(task), "opencode")


@pytest.mark.slow
def test_teacher_traces_replay_the_solutions_the_same_way_twice_and_train(tiny_model_dir: Path,
                                                                          tmp_path: Path) -> None:
    tasks = [load_task(path) for path in TASKS]
    demos = [Demo(tasks[0]), Demo(tasks[1]), Demo(tasks[0], 1)]
    records = teacher_traces(demos, tiny_model_dir, tmp_path / "teacher", harness_options=AGENT_HARNESS_OPTIONS)
    assert [(r.reward, r.unused_replies, r.turns, r.replayed) for r in records] == [
        (1.0, 0, 4, True), (1.0, 0, 3, True), (0.0, 0, 2, True)]
    assert [r.trace for r in records] == ["traces/harness-rl__copy-into-13.json",
                                          "traces/harness-rl__count-lines-13.json",
                                          "traces/harness-rl__copy-into-13__first-1.json"]
    logged = [json.loads(line) for line in (tmp_path / "teacher" / "rollouts.jsonl").read_text().splitlines()]
    assert [line["demo"] for line in logged] == [d.name for d in demos]
    records = records[:2]

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    traces = [TrainingTrace.load(tmp_path / "teacher" / str(r.trace)).validate() for r in records]
    for trace, task in zip(traces, tasks, strict=True):
        assert trace.metadata["reward"] == 1.0 and trace.metadata["task"] == task.name
        agents = [t for t in trace.turns if t.role == "agent"]
        assert len(agents) == len(trace.turns) == len(task.solution_steps) + 1
        for parent, child in zip(agents, agents[1:], strict=False):
            assert child.parent_id == parent.node_id
            assert child.prompt_token_ids[:len(parent.sequence)] == parent.sequence
        texts = [str(tokenizer.decode(t.completion_token_ids)) for t in agents]
        commands = [json.loads(text.split("\n")[1])["arguments"]["command"] for text in texts]
        assert commands[:-1] == task.solution_steps
        assert all(t.completion_mask == [1] * len(t.completion_token_ids) for t in agents)
        prompt = str(tokenizer.decode(agents[0].prompt_token_ids))
        task_prompt = AGENT_INSTANCE_TEMPLATE.replace("{{task}}", task.instruction)  # the demo's, not mini's own
        assert f"<|im_start|>user\n{task_prompt}<|im_end|>\n<|im_start|>assistant\n" in prompt

    again = teacher_traces(demos[:1], tiny_model_dir, tmp_path / "again", harness_options=AGENT_HARNESS_OPTIONS)
    replay = TrainingTrace.load(tmp_path / "again" / str(again[0].trace))
    assert [t.sequence for t in replay.turns] == [t.sequence for t in traces[0].turns]
    for record in records:  # the shipped tiny-agent learned from exactly these tokens
        shipped = TrainingTrace.load(SHIPPED / "teacher" / str(record.trace))
        made = TrainingTrace.load(tmp_path / "teacher" / str(record.trace))
        assert [(t.sequence, t.loss_mask) for t in shipped.turns] == [(t.sequence, t.loss_mask) for t in made.turns]

    model = tmp_path / "sft"  # the early stop scores 0: --min-reward 1 (the default) leaves it out
    assert main(["sft", "--traces", str(tmp_path / "teacher" / "traces"), "--model", str(tiny_model_dir),
                 "--output-dir", str(model), "--epochs", "3", "--learning-rate", "3e-3"]) == 0
    summary = json.loads((model / "sft.json").read_text())
    assert summary["rows"] == 2 and summary["trained_tokens"] == sum(
        len(t.completion_token_ids) for trace in traces for t in trace.turns)
    assert summary["epoch_loss"][-1] < summary["epoch_loss"][0] and summary["final_loss"] < summary["initial_loss"]
