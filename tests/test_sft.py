"""`harness-rl sft`: rejection-sampling fine-tuning on the trained tokens of captured traces.

The traces are built as the proxy builds them, from the tiny model's own tokenizer: each prompt is
a chat rendered by its chat template, and each later prompt is the earlier prompt + the sampled
completion + the template's closing and the new messages, tokenised piece by piece (as the proxy
splices). Every trace also holds what must never be trained: a tool-less auxiliary turn (a title
call) and a discarded retry, both with mask 1 on their completions, and an agent turn with a
partial mask.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness_rl.cli import main
from harness_rl.learner.config import SftConfig
from harness_rl.learner.sft import SUMMARY_FILE, SftError, sft, sft_batches, trace_files
from harness_rl.trace import TrainingTrace, Turn

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run one shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
SYSTEM = {"role": "system", "content": "You are a shell agent. Use the bash tool."}
TASKS = {
    "fix-typo": (["cat notes.txt", "sed -i 's/helo/hello/' notes.txt"], ["helo world", ""]),
    "make-script": (["printf 'echo hi\\n' > hi.sh", "chmod +x hi.sh"], ["", ""]),
    "count-lines": (["wc -l data.txt", "wc -l < data.txt > count.txt"], ["7 data.txt", ""]),
}
PARTIAL_MASKED = 3  # completion tokens masked 0 in the middle of the last agent turn


def call(command: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": command})}}]}


def agent_turns(tokenizer, task: str, commands: list[str], outputs: list[str]) -> list[Turn]:
    """A chain of agent turns: one tool call per command, then a final answer; each prompt spliced."""
    def render(messages: list[dict], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                             add_generation_prompt=generation_prompt)

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    messages = [SYSTEM, {"role": "user", "content": task}]
    prompt = ids(render(messages, True))
    replies = [call(c) for c in commands] + [{"role": "assistant", "content": "Done: the task is solved."}]
    turns: list[Turn] = []
    for index, reply in enumerate(replies):
        before = render(messages, True)
        messages.append(reply)
        after = render(messages, False)
        assert after.startswith(before) and after.endswith("<|im_end|>\n")
        completion = ids(after[len(before):-1])  # the sampled reply, up to and including <|im_end|>
        mask = [1] * len(completion)
        if index == len(replies) - 1:
            assert len(completion) > PARTIAL_MASKED + 2
            mask[1:1 + PARTIAL_MASKED] = [0] * PARTIAL_MASKED
        turns.append(Turn(node_id=f"a{index}", parent_id=turns[-1].node_id if turns else None,
                          prompt_token_ids=prompt, completion_token_ids=completion,
                          per_token_logps=[-1.0] * len(completion), loss_mask=[0] * len(prompt) + mask,
                          finish_reason="tool_calls" if reply.get("tool_calls") else "stop"))
        if index < len(commands):
            messages.append({"role": "tool", "tool_call_id": "c", "content": outputs[index]})
            prompt = prompt + completion + ids("\n" + render(messages, True)[len(after):])
    return turns


def side_turns(tokenizer, task: str, first: Turn) -> list[Turn]:
    """A title call (auxiliary) and a retry of the first call (discarded), masks 1 as the proxy records them."""
    title_prompt = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"A title for: {task}"}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)
    title = tokenizer.encode(f"Task {task}<|im_end|>", add_special_tokens=False)
    retry = tokenizer.encode("I will look first.<|im_end|>", add_special_tokens=False)
    return [
        Turn(node_id="title", prompt_token_ids=list(title_prompt), completion_token_ids=title,
             per_token_logps=[-1.0] * len(title), loss_mask=[0] * len(title_prompt) + [1] * len(title),
             role="auxiliary"),
        Turn(node_id="retry", prompt_token_ids=first.prompt_token_ids, completion_token_ids=retry,
             per_token_logps=[-1.0] * len(retry), loss_mask=[0] * len(first.prompt_token_ids) + [1] * len(retry),
             role="discarded"),
    ]


def make_trace(tokenizer, task: str, reward: float | None) -> TrainingTrace:
    commands, outputs = TASKS[task]
    agents = agent_turns(tokenizer, task, commands, outputs)
    metadata = {"task": task} if reward is None else {"task": task, "reward": reward}
    return TrainingTrace(rollout_id=f"{task}-{reward}", turns=[*side_turns(tokenizer, task, agents[0]), *agents],
                         metadata=metadata).validate()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def traces_dir(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three passing traces, one failing, one unscorable, one that is not a trace."""
    root = tmp_path_factory.mktemp("traces")
    for task in TASKS:
        make_trace(tokenizer, task, 1.0).save(root / f"{task}-pass.json")
    make_trace(tokenizer, "fix-typo", 0.0).save(root / "fix-typo-fail.json")
    make_trace(tokenizer, "count-lines", None).save(root / "count-lines-unscored.json")
    (root / "broken.json").write_text("{not a trace")
    (root / "notes.txt").write_text("not a trace file")
    return root


def passing(traces_dir: Path) -> list[TrainingTrace]:
    return [TrainingTrace.load(traces_dir / f"{task}-pass.json") for task in TASKS]


def teacher_targets(traces: list[TrainingTrace]) -> Counter:
    """(context, token) of every completion token with mask 1 in an agent turn: what SFT must train."""
    wanted: Counter = Counter()
    for trace in traces:
        for turn in (t for t in trace.turns if t.role == "agent"):
            ids = turn.completion_token_ids
            for i, m in enumerate(turn.completion_mask):
                if m:
                    wanted[(tuple(turn.prompt_token_ids + ids[:i]), ids[i])] += 1
    return wanted


def teacher_logprob(model, traces: list[TrainingTrace]) -> float:
    """Mean logprob of the teacher's trained tokens: each agent turn forwarded whole on its own (no packing)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for turn in (t for trace in traces for t in trace.turns if t.role == "agent"):
            logps = torch.log_softmax(model(input_ids=torch.tensor([turn.sequence])).logits[0].float(), -1)
            start = len(turn.prompt_token_ids)
            for i, (token, m) in enumerate(zip(turn.completion_token_ids, turn.completion_mask, strict=True)):
                if m:
                    total += float(logps[start + i - 1, token])
                    count += 1
    return total / count


def test_selection_keeps_traces_at_or_above_min_reward(traces_dir: Path) -> None:
    from harness_rl.learner.sft import select_traces

    files = trace_files(str(traces_dir))
    assert [f.name for f in files] == sorted(p.name for p in traces_dir.glob("*.json"))
    traces, selection = select_traces(files, min_reward=1.0)
    assert sorted(t.metadata["task"] for t in traces) == sorted(TASKS)
    assert (selection.below_min_reward, selection.no_reward, selection.invalid) == (1, 1, 1)
    _, lenient = select_traces(files, min_reward=0.0)
    assert (len(lenient.kept), lenient.below_min_reward, lenient.no_reward) == (4, 0, 1)
    assert [f.name for f in trace_files(str(traces_dir / "*-pass.json"))] == sorted(f"{t}-pass.json" for t in TASKS)
    with pytest.raises(SftError, match="no trace files match"):
        trace_files(str(traces_dir / "*.msgpack"))


@pytest.mark.parametrize("token_budget", [100_000, 300])
def test_exactly_the_masked_agent_tokens_are_trained(traces_dir: Path, token_budget: int) -> None:
    traces = passing(traces_dir)
    batches = sft_batches(traces, token_budget)
    trained: Counter = Counter()
    for batch in batches:
        ids, starts = batch.input_ids[0].tolist(), [0]
        for length in batch.row_lengths:
            starts.append(starts[-1] + length)
        for index, token in zip(batch.target_index.tolist(), batch.target_ids.tolist(), strict=True):
            start = max(s for s in starts if s <= index)
            assert ids[index + 1] == token and index + 1 < starts[starts.index(start) + 1]
            trained[(tuple(ids[start:index + 1]), token)] += 1
    wanted = teacher_targets(traces)
    assert trained == wanted
    agents = [t for trace in traces for t in trace.turns if t.role == "agent"]
    all_completion = sum(len(t.completion_token_ids) for t in agents)
    assert sum(trained.values()) == all_completion - PARTIAL_MASKED * len(traces)
    sides = [t for trace in traces for t in trace.turns if t.role != "agent"]
    side_keys = {(tuple(t.prompt_token_ids), t.completion_token_ids[0]) for t in sides}
    assert side_keys.isdisjoint(trained) and all(sum(t.completion_mask) for t in sides)
    assert len(batches) == (1 if token_budget > 10_000 else len(traces))


def test_the_loss_is_the_nll_of_exactly_those_tokens(traces_dir: Path, tiny_model_dir: Path) -> None:
    from harness_rl.learner.sft import batch_nll

    traces = passing(traces_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batches = sft_batches(traces, 100_000)
    with torch.no_grad():
        packed = sum(float(batch_nll(model, b)) for b in batches) / sum(b.n_trained for b in batches)
    assert packed == pytest.approx(-teacher_logprob(model, traces), rel=1e-4)


@pytest.fixture(scope="module")
def trained(traces_dir: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("sft") / "model"
    config = SftConfig(traces=str(traces_dir), model=str(tiny_model_dir), output_dir=str(out), epochs=4,
                       learning_rate=3e-3, token_budget=300, seed=1)
    return config, sft(config, progress=False)


def test_the_loss_falls_and_the_teachers_tokens_become_likelier(trained, traces_dir: Path,
                                                                tiny_model_dir: Path) -> None:
    config, summary = trained
    losses = summary.epoch_loss
    assert len(losses) == 4 and all(a > b for a, b in zip(losses, losses[1:], strict=False))
    assert summary.final_loss < summary.initial_loss - 2.0
    assert summary.steps == 4 * 3 and summary.selection.kept and summary.trained_tokens
    traces = passing(traces_dir)
    before = teacher_logprob(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), traces)
    after = teacher_logprob(AutoModelForCausalLM.from_pretrained(config.output_dir).eval(), traces)
    assert after > before + 2.0
    assert after == pytest.approx(-summary.final_loss, abs=1e-3)


def test_the_output_is_a_complete_model_dir_the_engine_serves(trained) -> None:
    from harness_rl.engine import Engine

    config, summary = trained
    output_dir = Path(config.output_dir)
    names = {p.name for p in output_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", SUMMARY_FILE} <= names
    assert json.loads((output_dir / SUMMARY_FILE).read_text())["final_loss"] == summary.final_loss
    engine = Engine.from_pretrained(config.output_dir, served_model_name="sft")
    try:
        assert engine.tokenizer.chat_template and engine.eos_token_id is not None
    finally:
        engine.close()


def test_same_seed_same_weights(traces_dir: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    def weights(out: Path, seed: int) -> dict[str, torch.Tensor]:
        sft(SftConfig(traces=str(traces_dir), model=str(tiny_model_dir), output_dir=str(out), epochs=1,
                      learning_rate=3e-3, token_budget=300, seed=seed), progress=False)
        return AutoModelForCausalLM.from_pretrained(out).state_dict()

    first, again, other = weights(tmp_path / "a", 0), weights(tmp_path / "b", 0), weights(tmp_path / "c", 5)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)  # the seed orders the batches


def test_cli_prints_one_summary_line(traces_dir: Path, tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "model"
    code = main(["sft", "--traces", str(traces_dir / "*.json"), "--min-reward", "0.5", "--model",
                 str(tiny_model_dir), "--output-dir", str(out), "--epochs", "1", "--learning-rate", "1e-3"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and len(lines) == 1
    assert lines[0].startswith("sft: 3 traces kept (1 below 0.5, 1 without reward, 1 invalid)")
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize(("flags", "message"), [
    (["--traces", "{tmp}/nothing-here/*.json"], "no trace files match"),
    (["--min-reward", "2"], "none of the traces passes --min-reward 2"),
    (["--model", "{tmp}/no-model"], "not a model directory"),
    (["--output-dir", "{traces}"], "already exists and is not empty"),
    (["--epochs", "0"], "--epochs: Expected `int` >= 1"),
])
def test_cli_bad_input_is_one_line_and_exit_2(flags: list[str], message: str, traces_dir: Path,
                                              tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    base = {"--traces": str(traces_dir), "--model": str(tiny_model_dir), "--output-dir": str(tmp_path / "m")}
    given = dict(zip(flags[::2], (f.format(tmp=tmp_path, traces=traces_dir) for f in flags[1::2]), strict=True))
    argv = ["sft", *(item for pair in {**base, **given}.items() for item in pair)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("harness-rl sft: ") and message in err
    assert not (tmp_path / "m").exists()
