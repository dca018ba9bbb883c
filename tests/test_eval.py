"""`harness-rl eval`: the chain rule, the per-task and per-split figures, the configuration, and the
command end to end on the embedded engine (its output is a training run's, so `harness-rl sft` reads it)."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import msgspec
import pytest

from harness_rl.cli import main
from harness_rl.demo import models
from harness_rl.outcome import RolloutOutcome
from harness_rl.run.config import resolve, resolve_eval, to_toml
from harness_rl.run.evaluate import EvalReport, comparison, measure, split_labels
from harness_rl.run.preflight import check_eval
from harness_rl.run.presets import AGENT_HARNESS_OPTIONS
from harness_rl.run.rollouts import rollout_seed
from harness_rl.settings import ConfigError
from harness_rl.trace import TrainingTrace, Turn
from harness_rl.trace.stats import trace_stats

ROOT = Path(__file__).resolve().parents[1]
AGENT_TASKS = ROOT / "examples" / "agent-tasks"


def turn(node_id: str, prompt: list[int], completion: list[int], *, parent: str | None = None,
         role: str = "agent", source: str | None = None) -> Turn:
    return Turn(node_id=node_id, parent_id=parent, prompt_token_ids=prompt, completion_token_ids=completion,
                per_token_logps=[-0.5] * len(completion), loss_mask=[0] * len(prompt) + [1] * len(completion),
                role=role, prompt_source=source)  # type: ignore[arg-type]


def trace(*turns: Turn) -> TrainingTrace:
    return TrainingTrace(rollout_id="r", turns=list(turns)).validate()


def test_a_turn_chains_only_onto_the_agent_turn_just_before_it_exactly() -> None:
    stats = trace_stats(trace(
        turn("a", [1, 2], [3]),
        turn("t", [7], [8], role="auxiliary"),  # a title call: not an agent turn, never a predecessor
        turn("b", [1, 2, 3, 4], [5, 6], parent="a", source="spliced"),  # chains onto a
        turn("c", [1, 2, 3, 4, 5, 6, 9], [10], parent="b", source="rendered"),  # extends b, but re-tokenised
        turn("d", [1, 2, 3, 4, 5, 6, 9, 10, 11], [12], parent="c"),  # chains onto c (no source recorded)
        turn("e", [1, 2, 3, 4, 5, 6, 20], [13], parent="b"),  # continues b, not d: a rewritten history
    ))
    assert (stats.agent_turns, stats.later_turns, stats.chained_turns, stats.spliced_turns) == (5, 4, 2, 1)
    assert stats.generated_tokens == 1 + 2 + 1 + 1 + 1


def outcome(reward: float | None, turns: list[Turn] | None, tools: int = 0) -> RolloutOutcome:
    return RolloutOutcome(rollout_id="r", task="t", reward=reward, env_reward=reward, tool_call_count=tools,
                          trace=trace(*turns) if turns else None)


def test_measures_count_unscorable_rollouts_as_failures_but_average_rewards_over_scorable_ones() -> None:
    chained = [turn("a", [1], [2, 3]), turn("b", [1, 2, 3, 4], [5], parent="a")]
    broken = [turn("a", [1], [2]), turn("b", [1, 9], [5, 6, 7])]  # a new root: the history was rewritten
    m = measure([outcome(1.0, chained, tools=2), outcome(0.5, broken, tools=1), outcome(None, None)], 1.0)
    assert (m.samples, m.scorable, m.successes) == (3, 2, 1)
    assert m.success_rate == pytest.approx(1 / 3) and m.mean_reward == pytest.approx(0.75)
    assert m.mean_turns == pytest.approx(4 / 3) and m.mean_tool_calls == pytest.approx(1.0)
    assert m.mean_generated_tokens == pytest.approx((3 + 4) / 3)
    assert (m.later_turns, m.chained_turns, m.chained_share) == (2, 1, 0.5)
    assert measure([outcome(None, None)], 1.0).mean_reward is None


def test_splits_are_labelled_by_their_folder_and_kept_apart() -> None:
    assert split_labels(["examples/agent-tasks/train", "examples/agent-tasks/heldout/", "hf://org/tasks",
                         "other/train"]) == ["train", "heldout", "tasks", "train-2"]


def test_sampling_seeds_depend_on_seed_group_task_and_sample_only() -> None:
    seeds = {rollout_seed(s, g, t, i) for s in (0, 1) for g in (0, 1) for t in ("a", "b") for i in (0, 1)}
    assert len(seeds) == 16 and all(0 <= s < 2**31 for s in seeds)
    assert rollout_seed(0, 0, "a", 1) == rollout_seed(0, 0, "a", 1) == 298535312


def test_eval_takes_a_runs_settings_and_its_preset() -> None:
    config = resolve_eval({"engine": {"model": "tiny-agent"}, "tasks": [str(AGENT_TASKS / "heldout")]})
    assert config.preset == "agent" and config.rollouts.harness == "mini-swe-agent"
    assert config.rollouts.harness_options == AGENT_HARNESS_OPTIONS and config.rollouts.max_tokens_per_turn == 64
    assert config.tasks == [str(AGENT_TASKS / "heldout")]
    assert resolve_eval({"engine": {"model": "tiny-agent"}}).tasks == [str(AGENT_TASKS / "train")]
    assert config.run_config().engine.weight_sync == "none"


def test_eval_reads_a_runs_config_file_without_its_learner_and_output_sections(tmp_path: Path) -> None:
    from harness_rl.run.config import load_file

    run = resolve({"engine": {"model": "tiny-agent"}, "rollouts": {"max_tokens_per_turn": 80},
                   "output": {"output_dir": str(tmp_path / "run")}})
    (tmp_path / "config.toml").write_text(to_toml(run))
    config = resolve_eval(load_file(tmp_path / "config.toml"), {"engine": {"model": str(tmp_path / "ckpt")}})
    assert config.rollouts == run.rollouts and config.proxy == msgspec.structs.replace(run.proxy)
    assert config.engine.model == str(tmp_path / "ckpt") and config.output_dir is None


def test_a_presets_harness_options_stay_with_its_harness() -> None:
    assert resolve({"engine": {"model": "tiny-agent"}}).rollouts.harness_options == AGENT_HARNESS_OPTIONS
    other = resolve({"engine": {"model": "tiny-agent"}, "rollouts": {"harness": "opencode"}})
    assert other.rollouts.harness == "opencode" and other.rollouts.harness_options == {}


@pytest.mark.parametrize(("settings", "flag"), [
    ({"engine": {"model": "tiny"}, "tasks": ["no/such/dir"]}, "--tasks"),
    ({"engine": {"model": "tiny", "engine": "http://127.0.0.1:9"}}, "--engine"),  # tiny is served there; none is
    ({"engine": {"model": "tiny-agent"}, "rollouts": {"harness": "opencode"}}, "--model"),
])
def test_bad_eval_settings_name_their_flag(settings: dict, flag: str) -> None:
    config = resolve_eval(settings)
    with pytest.raises(ConfigError) as caught:
        check_eval(config)  # the run level's checks, then the demo's (a built model and its harness)
        models.check(config.engine.model, config.rollouts.harness)
    assert caught.value.setting == flag


def test_tasks_repeat_and_train_only_flags_are_not_offered(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = capsys.readouterr().out
    assert "--tasks" in text and "--num-samples" in text and "--harness" in text
    assert "--num-generations" not in text and "--learning-rate" not in text
    assert "--max-steps" not in text


def test_eval_on_the_embedded_engine_writes_a_runs_files_that_sft_reads(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "eval"
    digits = ROOT / "examples" / "tasks" / "digits"
    families = tmp_path / "families"  # two copies of digits, each of its own category (a family of tasks)
    for name in ("odd", "even"):
        shutil.copytree(digits, families / name)
        config = (families / name / "task.toml").read_text()
        config = config.replace('name = "harness-rl/digits"', f'name = "harness-rl/{name}"')
        (families / name / "task.toml").write_text(config.replace("[metadata]\n", f'[metadata]\ncategory = "{name}"\n'))
    own_handler = signal.getsignal(signal.SIGTERM)
    assert main(["eval", "--model", "tiny", "--tasks", str(digits), "--tasks", str(digits), "--tasks", str(families),
                 "--num-samples", "3", "--output-dir", str(out)]) == 0
    assert signal.getsignal(signal.SIGTERM) is own_handler  # a command run in-process leaves no handler behind
    printed = capsys.readouterr().out
    report = json.loads((out / "eval.json").read_text())
    assert [s["split"] for s in report["splits"]] == ["digits", "digits-2", "families"]
    assert [(t["split"], t["samples"]) for t in report["tasks"]] == [("digits", 3), ("digits-2", 3), ("families", 3),
                                                                     ("families", 3)]
    by_task = {t["task"]: t for t in report["tasks"]}
    categories = {c["category"]: c for c in report["categories"]}
    assert sorted(categories) == ["even", "odd"] and all(c["split"] == "families" for c in categories.values())
    for name, category in categories.items():  # a category of one task measures what that task measures
        assert (category["tasks"], category["samples"]) == (1, 3)
        assert category["successes"] == by_task[f"harness-rl/{name}"]["successes"]
    assert "odd (1 tasks)" in printed and "even (1 tasks)" in printed
    before = msgspec.json.decode((out / "eval.json").read_bytes(), type=EvalReport)
    compared = comparison(before, before).splitlines()
    odd = next(line for line in compared if "odd (1 tasks)" in line)
    rate = f"{categories['odd']['success_rate']:.1%}"
    assert odd.split()[-4:-2] == [rate, rate]
    assert report["harness"] == "echo" and report["num_samples"] == 3 and report["model"] == "tiny"
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 12 and {r["step"] for r in records} == {0}
    rewards = sorted(r["reward"] for r in records)
    assert sum(split["scorable"] for split in report["splits"]) == 12
    assert "digits-2" in printed and "success" in printed
    traces = sorted((out / "traces").glob("*.json"))
    assert len(traces) == 12
    assert sorted(TrainingTrace.load(t).metadata["reward"] for t in traces) == rewards
    assert main(["sft", "--traces", str(out / "traces"), "--min-reward", str(rewards[0]), "--model", "tiny",
                 "--output-dir", str(tmp_path / "sft"), "--epochs", "1"]) == 0


def test_an_evaluation_is_never_overwritten(tmp_path: Path) -> None:
    (tmp_path / "eval.json").write_text("{}")
    with pytest.raises(ConfigError, match="already holds an evaluation"):
        check_eval(resolve_eval({"engine": {"model": "tiny"}, "output_dir": str(tmp_path)}))
