"""The tiny-agent's cache key: it changes with everything the build depends on, and nothing machine-specific;
and the repository ships the build of the current recipe, so no clone (and no CI run) spends 25 minutes on it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest

from harness_rl.demo.tiny_agent import (
    COMPLETE,
    EARLY_STOP_STEPS,
    HABIT,
    SHIPPED,
    TINY_AGENT_SEED,
    TRAIN_TASKS,
    WARMUP_TASKS,
    TinyAgentError,
    build_tiny_agent,
    default_cache_dir,
    recipe,
    tasks_digest,
)
from harness_rl.run.config import resolve
from harness_rl.run.presets import AGENT_HARNESS_OPTIONS


def test_the_task_digest_follows_every_file_of_the_tasks(tmp_path: Path) -> None:
    copy = tmp_path / "train"
    shutil.copytree(TRAIN_TASKS, copy)
    assert tasks_digest(WARMUP_TASKS, copy) == tasks_digest(WARMUP_TASKS, TRAIN_TASKS)
    solution = copy / "copy-into-13" / "solution" / "solve.sh"
    solution.write_text(solution.read_text().replace("mkdir labels", "mkdir -p labels"))
    changed = tasks_digest(WARMUP_TASKS, copy)
    assert changed != tasks_digest(WARMUP_TASKS, TRAIN_TASKS)
    (copy / "copy-into-13" / "solution" / "README").write_text("")
    assert tasks_digest(WARMUP_TASKS, copy) != changed
    assert tasks_digest(copy, WARMUP_TASKS) != tasks_digest(WARMUP_TASKS, copy)


def test_the_recipe_names_its_inputs_and_keys_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.metadata

    built = recipe(0)
    assert built.harness == "mini-swe-agent" and built.harness_version == importlib.metadata.version("mini-swe-agent")
    assert built.harness_options == AGENT_HARNESS_OPTIONS
    assert built.sft == [{"min_reward": p.min_reward, "epochs": p.epochs, "learning_rate": p.learning_rate,
                          "token_budget": p.token_budget, "weight_decay": p.weight_decay,
                          "max_grad_norm": p.max_grad_norm} for p in (COMPLETE, HABIT)]
    # the complete demonstrations (reward 1) first, then all of them, the early stops (reward 0) included
    assert COMPLETE.min_reward == 1.0 and HABIT.min_reward == 0.0 and built.early_stop_steps == EARLY_STOP_STEPS
    assert recipe(0).key == built.key and recipe(1).key != built.key
    for change in ({"harness_version": "0"}, {"tasks_sha256": "0"}, {"sft": built.sft[::-1]},
                   {"harness_options": {}}, {"tiny_recipe": "0"}, {"early_stop_steps": 2}):
        assert msgspec.structs.replace(built, **change).key != built.key
    monkeypatch.setenv("HARNESS_RL_CACHE", str(tmp_path))
    assert default_cache_dir(built) == tmp_path / f"tiny-agent-0-{built.key}"


def test_tiny_agent_is_built_for_mini_swe_agent_only() -> None:
    with pytest.raises(TinyAgentError, match="built for mini-swe-agent, not opencode"):
        recipe(0, "opencode")


def test_the_agent_preset_runs_tiny_agent_with_the_teachers_harness_options() -> None:
    config = resolve({"engine": {"model": "tiny-agent"}})
    assert config.preset == "agent" and config.rollouts.harness == "mini-swe-agent"
    assert config.rollouts.harness_options == recipe(0).harness_options
    assert config.rollouts.max_tokens_per_turn is not None and config.rollouts.max_tokens_per_turn >= 64


def test_the_repository_ships_the_build_of_the_current_recipe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from harness_rl.engine.tiny_model import is_cached

    expected = json.loads(msgspec.json.encode(recipe(TINY_AGENT_SEED)))
    assert is_cached(SHIPPED, expected), (
        f"{SHIPPED} is the build of another recipe than the current one ({recipe(TINY_AGENT_SEED).key}): rebuild it "
        "(`harness-rl build-model tiny-agent --rebuild`, about 25 min) and copy the directory it prints over it")
    monkeypatch.setenv("HARNESS_RL_CACHE", str(tmp_path))  # found without building, without touching the cache
    assert build_tiny_agent(TINY_AGENT_SEED) == SHIPPED and list(tmp_path.iterdir()) == []
    traces = sorted(p.name for p in (SHIPPED / "teacher" / "traces").glob("*.json"))
    shown = sorted(p.name for root in (WARMUP_TASKS, TRAIN_TASKS) for p in root.iterdir() if p.is_dir())
    assert traces == sorted([f"harness-rl__{name}.json" for name in shown] +
                            [f"harness-rl__{name}__first-{EARLY_STOP_STEPS}.json" for name in shown])
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "sft.json"):
        assert (SHIPPED / name).is_file(), name
