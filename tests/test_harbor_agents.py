"""Harbor's own agents, through the Harbor bridge, each solving a shipped task against the embedded engine.

Each bridged agent runs as Harbor's agent class in the 3.12 runner over the local sandbox (installed
once by scripts/install_agents.sh, or on first use), pointed at the proxy in its dialect, while the
engine answers with forced completions: a tool call that writes the task's file, one that reads it
back, and a final answer (terminus-2, whose tool is its JSON `commands`, confirms completion
instead). For every agent: reward 1 from the task's verifier, the file in the sandbox, a valid trace
whose agent turns form one chain with every turn after the first spliced onto the one before, and
the capture cross-checked against Harbor's ATIF trajectory: each model call the trajectory records
has its captured agent turn, with the same text and tool calls.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapters.harbor_bridge.atif import AtifStep, AtifTrajectory, read_trajectory
from adapters.harbor_bridge.catalog import CATALOG
from adapters.harbor_bridge.install import InstallError, ensure_installed
from adapters.harnesses import create_harness
from adapters.sandboxes.local import default_tools_dir
from adapters.tasks import load_task
from harness_rl.outcome import RolloutOutcome
from harness_rl.run.rollouts import RolloutConfig, RolloutScheduler
from harness_rl.trace import TrainingTrace, Turn
from proxy.client import ProxyClient
from proxy.server.app import RunningProxy

pytestmark = [pytest.mark.slow, pytest.mark.anyio]
ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "examples" / "tasks" / "write-greeting"
GREETING = "printf 'hello harness-rl\\n' > greeting.txt"


def tool_call(name: str, arguments: dict[str, object]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def terminus(keystrokes: list[str], complete: bool) -> str:
    commands = [{"keystrokes": k, "duration": 0.5} for k in keystrokes]
    return json.dumps({"analysis": "Looking at the terminal.", "plan": "Write the greeting, then check it.",
                       "commands": commands, "task_complete": complete})


def shell_script(tool: str, **defaults: object) -> list[str]:
    """Write the greeting, read it back, finish. `defaults`: the arguments the agent fills in itself when it sends
    the call back (code-puppy re-serialises its tool calls with every field), so the reply it returns is the one
    the model gave."""
    return [tool_call(tool, {"command": GREETING, **defaults}), tool_call(tool, {"command": "cat greeting.txt",
                                                                                 **defaults}), "Done."]


# what each agent's model answers, in order: (tool-carrying calls, tool-less calls)
SCRIPTS: dict[str, tuple[list[str], list[str]]] = {
    "terminus-2": ([], [terminus([GREETING + "\n"], False), terminus(["cat greeting.txt\n"], True),
                        terminus([], True)]),
    "kimi-cli": (shell_script("Shell"), []),
    "kimi-code": (shell_script("Bash"), []),
    "vibe": (shell_script("bash"), []),
    "hermes": (shell_script("terminal"), []),
    "openhands-sdk": (shell_script("terminal"), []),
    "code-puppy": (shell_script("shell", cwd=None, timeout=60, background=False), []),
    "openhands": ([*shell_script("execute_bash")[:2], tool_call("finish", {"message": "Done."})], []),
}


@pytest.fixture(scope="module")
def proxy_settings() -> dict[str, Any]:
    """This module's `proxy` (tests/conftest.py) in front of the embedded engine."""
    return {"max_tokens_per_turn": 256, "max_turns": 12}


@pytest.fixture(autouse=True)
def clear_forced_after(engine_url: str) -> Iterator[None]:
    yield
    httpx.delete(f"{engine_url}/forced_completions").raise_for_status()


def installed(name: str) -> None:
    """Harbor and the agent's CLI in the tools dir (a no-op once scripts/install_agents.sh ran)."""
    try:
        ensure_installed(default_tools_dir(), CATALOG[name])
    except InstallError as error:
        pytest.skip(f"cannot install Harbor's {name} here: {error}")


async def run_bridged(proxy: RunningProxy, name: str, logs_dir: Path) -> RolloutOutcome:
    agent = CATALOG[name]
    options = dict(agent.sandbox) if agent.sandbox else ({"network": "proxy-only"} if shutil.which("bwrap") else {})
    config = RolloutConfig(harness=f"harbor:{name}", num_generations=1, agent_timeout_s=300,
                           sandbox_options=options)
    harness = create_harness(f"harbor:{name}", logs_dir=logs_dir)
    task = load_task(TASK)
    async with ProxyClient(proxy.url, proxy.admin_token) as client:
        return await RolloutScheduler([task], client, config, harness=harness).run_rollout(task, 0, 0)


def reply_text(turn: Turn) -> str:
    return (turn.reply.content or "") if turn.reply is not None else ""


def answers(turn: Turn, step: AtifStep) -> bool:
    """Whether a captured turn is the model call a trajectory step records: the same tool calls (every argument
    the model gave, with its value; converters may add the defaults the agent filled in) and the same text (where
    the model wrote any: converters put a placeholder such as "(tool use)" in a call-only step)."""
    calls = turn.reply.tool_calls if turn.reply is not None else []
    if [call.name for call in calls] != [call.function_name for call in step.tool_calls or ()]:
        return False
    for call, recorded in zip(calls, step.tool_calls or (), strict=True):
        given = json.loads(call.arguments)
        if {key: recorded.arguments.get(key) for key in given} != given:
            return False
    text = reply_text(turn).strip()
    return text == step.text.strip() if text or not calls else True


def assert_matches_trajectory(agents: list[Turn], trajectory: AtifTrajectory) -> None:
    """Every model call in Harbor's trajectory has its captured agent turn, in order."""
    steps = trajectory.model_calls
    assert steps, "Harbor's trajectory records no model call"
    captured = iter(agents)
    for step in steps:
        assert any(answers(turn, step) for turn in captured), f"no captured turn is the trajectory's step {step}"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
async def test_bridged_agent_solves_a_task(name: str, proxy: RunningProxy, engine_url: str, tmp_path: Path) -> None:
    installed(name)
    tools, no_tools = SCRIPTS[name]
    httpx.delete(f"{engine_url}/forced_completions").raise_for_status()
    httpx.post(f"{engine_url}/forced_completions", json={"tools": tools, "no_tools": no_tools}).raise_for_status()
    outcome = await run_bridged(proxy, name, tmp_path / "logs")
    assert outcome.error is None, outcome.error
    assert outcome.exit_code == 0 and not outcome.timed_out
    assert outcome.env_reward == 1.0 and outcome.reward == 1.0  # the verifier found the file the tool call wrote
    trace = outcome.trace.validate()
    agents = [t for t in trace.turns if t.role == "agent"]
    assert len(agents) >= 3
    for turn in trace.turns:
        assert turn.loss_mask == [0] * len(turn.prompt_token_ids) + [1] * len(turn.completion_token_ids)
    for parent, child in zip(agents, agents[1:], strict=False):  # token in, token out: one chain
        assert child.parent_id == parent.node_id and child.prompt_source == "spliced"
        assert child.prompt_token_ids[:len(parent.sequence)] == parent.sequence
    trajectories = list((tmp_path / "logs").glob("*/trajectory.json"))
    if CATALOG[name].atif:
        assert len(trajectories) == 1, "Harbor converts this agent's logs to ATIF, but no trajectory was written"
        assert_matches_trajectory(agents, read_trajectory(trajectories[0]))


async def test_openclaw_runs_but_rewrites_its_history(proxy: RunningProxy, engine_url: str, tmp_path: Path) -> None:
    """openclaw solves the task through the bridge, but ends every request with a transient context message that
    the next request drops: each turn is rendered anew against the one before (why it is not proven here)."""
    installed("openclaw")
    httpx.delete(f"{engine_url}/forced_completions").raise_for_status()
    httpx.post(f"{engine_url}/forced_completions", json={"tools": shell_script("exec"), "no_tools": []}
               ).raise_for_status()
    outcome = await run_bridged(proxy, "openclaw", tmp_path / "logs")
    assert outcome.error is None and outcome.exit_code == 0 and outcome.env_reward == 1.0
    agents = [t for t in outcome.trace.validate().turns if t.role == "agent"]
    assert len(agents) == 3 and {t.prompt_source for t in agents} == {"rendered"}
    for parent, child in zip(agents, agents[1:], strict=False):
        assert child.prefix_break is not None and child.prefix_break.cause == "rewritten_history"
        assert child.prefix_break.against == parent.node_id
        assert "BEGIN_OPENCLAW_INTERNAL_CONTEXT" in json.dumps(parent.request.messages[-1])


# Every agent is proven above; a whole training step (about 36 s each) runs for Harbor's own agent, which needs its
# own turn limit, and for one installed from npm, so the suite fits CI's 90 minutes.
TRAINED = ("kimi-code", "terminus-2")


@pytest.mark.parametrize("name", TRAINED)
def test_train_one_step_with_a_bridged_agent(name: str, tmp_path: Path) -> None:
    """`harness-rl train --harness harbor:<name> --max-steps 1` with the tiny model sampling freely: every rollout
    ends scored, with a valid trace holding the agent's calls."""
    installed(name)
    agent = CATALOG[name]
    config = tmp_path / "run.toml"
    options = "".join(f'{key} = "{value}"\n' for key, value in agent.sandbox.items())
    # terminus-2 keeps asking after the proxy's turn budget answers (its own limit is a million episodes), until
    # the agent's time limit: Harbor's `max_turns` option stops it with the run's
    own = "[rollouts.harness_options]\nmax_turns = 3\n" if name == "terminus-2" else ""
    config.write_text("[rollouts]\nnum_generations = 2\nmax_concurrent_rollouts = 2\nmax_turns = 3\n"
                      f"agent_timeout_s = 300\n{own}[rollouts.sandbox_options]\n{options}")
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "harness_rl.cli", "train", "--config", str(config), "--harness",
                           f"harbor:{name}", "--model", "tiny", "--max-steps", "1", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 2 and all(r["error"] is None and r["reward"] is not None for r in rollouts)
    for rollout in rollouts:
        trace = TrainingTrace.from_json((out / rollout["trace"]).read_bytes()).validate()
        assert any(turn.role == "agent" for turn in trace.turns)
