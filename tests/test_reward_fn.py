"""`--reward-fn package.module:function`: TRL's rollout_reward_fn contract, and one clear line when it is wrong."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fake_engine import Scripted
from test_rollouts import DIGITS, scheduler

from harness_rl.cli import main
from harness_rl.outcome import RolloutOutcome
from harness_rl.run.reward_fn import RewardFnError, load_reward_fn, score
from harness_rl.settings import ConfigError
from proxy.client import ProxyClient

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples.reward_fns:tool_efficiency"  # importable from the repository root, as a user's module is


@pytest.fixture
async def client(fake_proxy):
    async with ProxyClient(fake_proxy.url, fake_proxy.admin_token) as proxy_client:
        yield proxy_client


def raising(outcome: RolloutOutcome) -> float:
    return 1 / 0


def wordy(outcome: RolloutOutcome) -> str:
    return "great"


NOT_A_FUNCTION = 3


def test_tool_efficiency_pays_its_bonus_only_when_the_verifier_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    tool_efficiency = load_reward_fn(EXAMPLE)

    def outcome(env_reward: float | None, calls: int, timed_out: bool = False) -> RolloutOutcome:
        return RolloutOutcome(rollout_id="r", task="t", env_reward=env_reward, tool_call_count=calls,
                              timed_out=timed_out)

    assert tool_efficiency(outcome(1.0, 3)) == pytest.approx(1.0 + 0.3 * (1 - 3 / 15))
    assert tool_efficiency(outcome(1.0, 0)) == pytest.approx(1.3)
    assert tool_efficiency(outcome(1.0, 30)) == 1.0  # past the budget: no bonus, never a penalty
    assert tool_efficiency(outcome(0.0, 1)) == 0.0  # doing little is not efficient when it failed
    assert tool_efficiency(outcome(0.5, 1)) == 0.5
    assert tool_efficiency(outcome(1.0, 1, timed_out=True)) == 1.0
    assert tool_efficiency(outcome(None, 1)) is None


@pytest.mark.anyio
async def test_the_configured_reward_fn_scores_every_rollout(client, fake_engine,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    fake_engine.script.extend(Scripted(content=text) for text in ["1234", "12ab"])
    group = await scheduler(client, num_generations=2, reward_fn=EXAMPLE).run_group(DIGITS, 0)
    assert sorted((o.env_reward, o.reward) for o in group.outcomes) == [(0.5, 0.5), (1.0, pytest.approx(1.3))]


@pytest.mark.anyio
@pytest.mark.parametrize(("function", "says"), [
    ("raising", "raised ZeroDivisionError: division by zero"),
    ("wordy", "returned 'great' (str); expected a finite number or None")])
async def test_a_bad_reward_stops_the_group_naming_the_function_and_the_rollout(client, fake_engine, function: str,
                                                                                 says: str) -> None:
    fake_engine.script.extend(Scripted(content="1234") for _ in range(2))
    runner = scheduler(client, num_generations=2, reward_fn=f"test_reward_fn:{function}")
    with pytest.raises(RewardFnError) as caught:
        await runner.run_group(DIGITS, 3)
    message = str(caught.value)
    assert message.startswith(f"--reward-fn test_reward_fn:{function} {says} (rollout g3-r")
    assert message.endswith("of task harness-rl/digits)") and "\n" not in message


@pytest.mark.parametrize("value", [float("nan"), True, [1.0]])
def test_only_finite_numbers_or_none_are_rewards(value: object) -> None:
    outcome = RolloutOutcome(rollout_id="r", task="t", env_reward=1.0)
    with pytest.raises(RewardFnError, match="expected a finite number or None"):
        score(lambda o: value, outcome)  # type: ignore[arg-type, return-value]
    assert score(lambda o: 2, outcome) == 2.0 and score(lambda o: None, outcome) is None


@pytest.mark.parametrize(("spec", "says"), [
    ("no_such_module:reward", "cannot import 'no_such_module' for no_such_module:reward: No module named "
                              "'no_such_module'"),
    ("test_reward_fn:missing", "'test_reward_fn' has no 'missing' (from test_reward_fn:missing)"),
    ("test_reward_fn:NOT_A_FUNCTION", "test_reward_fn:NOT_A_FUNCTION is a int, not a function"),
    ("test_reward_fn", "'test_reward_fn' is not package.module:function")])
def test_a_reward_fn_that_cannot_load_is_one_line_before_anything_starts(spec: str, says: str,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        load_reward_fn(spec)
    assert str(caught.value) == f"--reward-fn: {says}"
    assert main(["train", "--reward-fn", spec, "--max-steps", "1"]) == 2
    assert capsys.readouterr().err == f"harness-rl train: --reward-fn: {says}\n"


@pytest.mark.slow
def test_a_run_whose_reward_fn_returns_text_stops_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "my_rewards.py").write_text("def wordy(outcome):\n    return 'great'\n")
    done = subprocess.run([sys.executable, "-m", "harness_rl.cli", "train", "--reward-fn", "my_rewards:wordy",
                           "--max-steps", "2", "--output-dir", str(tmp_path / "run")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("harness-rl train:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[0].startswith("harness-rl train: stopped: --reward-fn my_rewards:wordy returned 'great' (str); "
                               "expected a finite number or None (rollout g")


def test_train_roles_and_reward_fn_are_settings_that_load_back(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from harness_rl.run.config import load_file, resolve

    assert main(["train", "--print-config", "--train-roles", "agent", "--train-roles", "summary",
                 "--reward-fn", EXAMPLE]) == 0
    printed = capsys.readouterr().out
    assert "train_roles = [" in printed and f'reward_fn = "{EXAMPLE}"' in printed
    (tmp_path / "run.toml").write_text(printed)
    config = resolve(load_file(tmp_path / "run.toml"))
    assert config.learner.train_roles == ["agent", "summary"] and config.rollouts.reward_fn == EXAMPLE
    assert resolve({}).learner.train_roles == ["agent"]
    with pytest.raises(ConfigError, match="--train-roles"):
        resolve({"learner": {"train_roles": []}})
    with pytest.raises(SystemExit):
        main(["train", "--print-config", "--train-roles", "discarded"])
    assert "invalid choice: 'discarded'" in capsys.readouterr().err
