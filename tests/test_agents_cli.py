"""Real agent CLIs end to end: opencode, Claude Code, mini-swe-agent, codex (OpenAI Responses),
gemini-cli (Google Gemini), qwen-coder, pi and aider each solve a shipped task.

Each runs in the local sandbox (bubblewrap with `network="proxy-only"` when bubblewrap is
installed: the agent can reach the proxy and nothing else) through the proxy and the embedded
engine in forced-completion mode: the engine answers with one scripted tool call that solves the
task, then a final answer (opencode's tool-less title call gets a scripted title). The CLI runs
the tool itself; the task's verifier gives reward 1; the trace validates and holds the expected
turns, roles and masks; the learner turns it into training rows.

The CLIs are installed by scripts/install_agents.sh (npm into .tools/npm; mini-swe-agent comes
from PyPI with the dev extra). Real CLI prompts are long (~10k tokens for opencode, ~26k for
Claude Code), which the tiny engine's 64k context handles on CPU in seconds.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapters.harnesses import create_harness
from adapters.tasks import Task, load_task
from harness_rl.learner.rows import trace_rows
from harness_rl.learner.samples import build_samples
from harness_rl.outcome import RolloutGroup, RolloutOutcome
from harness_rl.run.rollouts import RolloutConfig, RolloutScheduler
from proxy.client import ProxyClient
from proxy.server.app import RunningProxy

pytestmark = [pytest.mark.slow, pytest.mark.anyio]
ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "tasks"
GREETING = "printf 'hello harness-rl\\n' > greeting.txt"
FIX = "sed -i 's/range(n)/range(n + 1)/' mathlib.py"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


@pytest.fixture(scope="session")
def agent_clis() -> Path:
    """Install opencode, Claude Code (and bubblewrap when root) once; skip only when npm/node are absent."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("npm/node are not installed: opencode and Claude Code cannot be installed")
    subprocess.run([str(ROOT / "scripts" / "install_agents.sh")], check=True, capture_output=True, timeout=900)
    return ROOT / ".tools"


@pytest.fixture(scope="module")
def proxy_settings() -> dict[str, Any]:
    """This module's `proxy` (tests/conftest.py) in front of the embedded engine."""
    return {"max_tokens_per_turn": 64, "max_turns": 12}


@pytest.fixture(autouse=True)
def clear_forced_after(engine_url: str) -> Iterator[None]:
    """Leave no scripted answer behind for the tests that share the engine."""
    yield
    httpx.delete(f"{engine_url}/forced_completions").raise_for_status()


def tool_call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def force(engine_url: str, tools: list[str], no_tools: list[str] = ()) -> None:
    httpx.delete(f"{engine_url}/forced_completions").raise_for_status()
    httpx.post(f"{engine_url}/forced_completions", json={"tools": tools, "no_tools": list(no_tools)}
               ).raise_for_status()


async def run_once(proxy: RunningProxy, harness: str, task: Task) -> RolloutOutcome:
    async with ProxyClient(proxy.url, proxy.admin_token) as client:
        sandbox_options = {"network": "proxy-only"} if shutil.which("bwrap") else {}
        config = RolloutConfig(harness=harness, num_generations=1, agent_timeout_s=240, sandbox_options=sandbox_options)
        return await RolloutScheduler([task], client, config, harness=create_harness(harness)).run_rollout(task, 0, 0)


def assert_sampled_by_the_engine(engine_url: str, outcome: RolloutOutcome, forced: list[str]) -> None:
    """Each agent turn's completion and logprobs are what the engine gives for the turn's prompt (rendered
    for the first, spliced after) and its forced text."""
    agents = [t for t in outcome.trace.turns if t.role == "agent"]
    for turn, text in zip(agents, forced, strict=True):
        has_tools = bool(turn.request.tools)
        force(engine_url, tools=[text] if has_tools else [], no_tools=[] if has_tools else [text])
        body = {"token_ids": turn.prompt_token_ids, "sampling_params": {
            "temperature": turn.sampling.temperature, "max_tokens": turn.sampling.max_tokens, "logprobs": 0,
            "skip_special_tokens": False}}
        got = httpx.post(f"{engine_url}/inference/v1/generate", json=body, timeout=300).json()["choices"][0]
        assert turn.completion_token_ids == got["token_ids"]
        assert turn.per_token_logps == pytest.approx([e["logprob"] for e in got["logprobs"]["content"]], abs=1e-4)


def assert_trainable(outcome: RolloutOutcome, agent_turns: int) -> None:
    """Reward 1, a valid trace with `agent_turns` linked agent turns, exact masks, and rows the learner takes."""
    assert outcome.error is None, outcome.error
    assert outcome.env_reward == 1.0 and outcome.reward == 1.0 and not outcome.timed_out
    assert outcome.exit_code == 0
    trace = outcome.trace.validate()
    agents = [t for t in trace.turns if t.role == "agent"]
    assert len(agents) == agent_turns
    for turn in trace.turns:
        assert turn.loss_mask == [0] * len(turn.prompt_token_ids) + [1] * len(turn.completion_token_ids)
    assert agents[0].finish_reason == "tool_calls" and agents[0].request.tools
    for parent, child in zip(agents, agents[1:], strict=False):  # token in, token out: one chain
        assert child.parent_id == parent.node_id and child.prompt_source == "spliced"
        assert child.prompt_token_ids[:len(parent.sequence)] == parent.sequence
    rows = trace_rows(trace)
    assert sum(row.n_trained for row in rows) == sum(len(t.completion_token_ids) for t in agents)
    failed = RolloutOutcome(rollout_id="other", task=outcome.task, env_reward=0.0, reward=0.0, trace=trace)
    samples, metrics = build_samples([RolloutGroup(group_id=0, task=outcome.task, outcomes=[outcome, failed])],
                                     policy_version=0, max_staleness=None, normalization="token")
    assert metrics["reward"] == 0.5 and metrics["sample/invalid_traces_total"] == 0
    assert {s.advantage > 0 for s in samples} == {True, False}


async def test_opencode_solves_write_greeting(agent_clis: Path, proxy: RunningProxy, engine_url: str) -> None:
    force(engine_url, tools=[tool_call("bash", {"command": GREETING, "description": "Write the greeting"}),
                             tool_call("bash", {"command": "cat greeting.txt", "description": "Check it"}), "Done."],
          no_tools=["Greeting file"] * 3)
    outcome = await run_once(proxy, "opencode", load_task(TASKS / "write-greeting"))
    assert_trainable(outcome, agent_turns=3)
    assert outcome.tool_calls_by_name == {"bash": 2} and outcome.tool_failure_count == 0
    assert outcome.completion == "Done."
    assert sorted(t.role for t in outcome.trace.turns) == ["agent", "agent", "agent", "auxiliary"]
    title = next(t for t in outcome.trace.turns if t.role == "auxiliary")
    assert not title.request.tools and title.parent_id is None


async def test_claude_code_solves_fix_off_by_one(agent_clis: Path, proxy: RunningProxy, engine_url: str) -> None:
    force(engine_url, tools=[tool_call("Bash", {"command": "cat mathlib.py", "description": "Read the code"}),
                             tool_call("Bash", {"command": FIX, "description": "Fix the off-by-one"}),
                             "Fixed the bug."])
    outcome = await run_once(proxy, "claude-code", load_task(TASKS / "fix-off-by-one"))
    assert_trainable(outcome, agent_turns=3)
    assert outcome.tool_calls_by_name == {"Bash": 2} and outcome.tool_failure_count == 0
    assert outcome.completion == "Fixed the bug."
    assert [t.role for t in outcome.trace.turns] == ["agent", "agent", "agent"]
    request = outcome.trace.turns[0].request
    assert request.messages[0]["role"] == "system" and "billing-header" not in json.dumps(request.messages)


async def test_mini_swe_agent_solves_fix_off_by_one(agent_clis: Path, proxy: RunningProxy, engine_url: str) -> None:
    force(engine_url, tools=[tool_call("bash", {"command": "cat mathlib.py"}), tool_call("bash", {"command": FIX}),
                             tool_call("bash", {"command": SUBMIT})])
    outcome = await run_once(proxy, "mini-swe-agent", load_task(TASKS / "fix-off-by-one"))
    assert_trainable(outcome, agent_turns=3)
    assert outcome.tool_calls_by_name == {"bash": 3} and outcome.tool_failure_count == 0
    assert outcome.completion == "Submitted"
    assert [t.role for t in outcome.trace.turns] == ["agent", "agent", "agent"]


@pytest.mark.parametrize(("harness", "tool", "argument", "dialect"), [
    ("codex", "exec_command", "cmd", "openai_responses"),
    ("gemini-cli", "run_shell_command", "command", "google_gemini")])
async def test_responses_and_gemini_clis_solve_a_task(agent_clis: Path, proxy: RunningProxy, engine_url: str,
                                                      harness: str, tool: str, argument: str, dialect: str) -> None:
    forced = [tool_call(tool, {argument: "cat mathlib.py"}), tool_call(tool, {argument: FIX}), "Finished the task."]
    force(engine_url, tools=forced)
    outcome = await run_once(proxy, harness, load_task(TASKS / "fix-off-by-one"))
    assert_trainable(outcome, agent_turns=3)
    assert outcome.tool_calls_by_name == {tool: 2} and outcome.tool_failure_count == 0  # counted from the trace
    assert outcome.completion == "Finished the task."
    assert [t.role for t in outcome.trace.turns] == ["agent", "agent", "agent"]
    assert {t.metadata["dialect"] for t in outcome.trace.turns} == {dialect}
    assert_sampled_by_the_engine(engine_url, outcome, forced)


@pytest.mark.parametrize(("harness", "tool", "failures"), [("qwen-coder", "run_shell_command", 2), ("pi", "bash", 0)])
async def test_chat_clis_solve_a_task(agent_clis: Path, proxy: RunningProxy, engine_url: str, harness: str,
                                      tool: str, failures: int) -> None:
    """Tool failures follow TRL's word rule, so qwen-coder's results, which always end with a line
    `Error: (none)`, count as failed exactly as TRL counts them."""
    forced = [tool_call(tool, {"command": GREETING}), tool_call(tool, {"command": "cat greeting.txt"}), "Done."]
    force(engine_url, tools=forced)
    outcome = await run_once(proxy, harness, load_task(TASKS / "write-greeting"))
    assert_trainable(outcome, agent_turns=3)
    assert outcome.tool_calls_by_name == {tool: 2} and outcome.tool_failure_count == failures
    assert [t.role for t in outcome.trace.turns] == ["agent", "agent", "agent"]
    assert_sampled_by_the_engine(engine_url, outcome, forced)


async def test_aider_solves_write_greeting(agent_clis: Path, proxy: RunningProxy, engine_url: str) -> None:
    """aider has no tools: its edit is the reply's text, a file name then the whole content in a fence."""
    forced = ["greeting.txt\n```\nhello harness-rl\n```\n"]
    force(engine_url, tools=[], no_tools=forced)
    outcome = await run_once(proxy, "aider", load_task(TASKS / "write-greeting"))
    assert outcome.error is None and outcome.reward == 1.0 and outcome.exit_code == 0
    trace = outcome.trace.validate()
    assert [t.role for t in trace.turns] == ["agent"] and not trace.turns[0].request.tools
    turn = trace.turns[0]
    assert turn.loss_mask == [0] * len(turn.prompt_token_ids) + [1] * len(turn.completion_token_ids)
    assert outcome.tool_calls_by_name == {"edit": 1}
    assert_sampled_by_the_engine(engine_url, outcome, forced)
