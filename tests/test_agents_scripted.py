"""The new agent CLIs end to end against the scripted model server (tests/scripted_llm.py).

Each CLI is installed at its pinned version (scripts/install_agents.sh), launched by its adapter
in the local sandbox (bubblewrap with `network="proxy-only"` when installed: the CLI reaches the
scripted server and nothing else, so it runs fully offline) and pointed at a by-path session URL.
The scripted model answers with one tool call that writes a file, then a final text: the test
checks the dialect's endpoint and key header, that the tool ran in the sandbox and its result went
back to the model, and what the adapter's report read from the CLI's own output.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from scripted_llm import RunningScripted, Script, serve_scripted

from adapters.harnesses import Endpoint, create_harness
from adapters.harnesses.base import AgentRun
from adapters.sandboxes.local import LocalSandbox
from adapters.tasks import load_task

pytestmark = [pytest.mark.slow, pytest.mark.anyio]
ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-session-key"
WRITE = "printf 'hello harness-rl\\n' > greeting.txt"


@pytest.fixture(scope="module")
def agent_clis() -> None:
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("npm/node are not installed: the npm agent CLIs cannot be installed")
    subprocess.run(["bash", str(ROOT / "scripts" / "install_agents.sh")], check=True, capture_output=True,
                   timeout=1800)


@pytest.fixture
async def sandbox(agent_clis: None) -> AsyncIterator[LocalSandbox]:
    network = "proxy-only" if shutil.which("bwrap") else "host"
    async with LocalSandbox(network=network) as box:
        await box.start(load_task(ROOT / "examples" / "tasks" / "write-greeting"))
        yield box


async def run_agent(sandbox: LocalSandbox, harness: str, script: Script) -> tuple[AgentRun, RunningScripted]:
    with serve_scripted(script) as server:
        await sandbox.allow(server.url)
        endpoint = Endpoint(f"{server.url}/s/abc/v1", f"{server.url}/s/abc", KEY)
        run = await create_harness(harness).run(sandbox, endpoint, "Write the greeting file.", timeout=240)
    assert run.exit_code == 0 and not run.timed_out, (run.stdout[-2000:], run.stderr[-2000:])
    assert await sandbox.read_text(f"{sandbox.workdir}/greeting.txt") == "hello harness-rl\n"
    return run, server


def bodies(server: RunningScripted, path: str) -> list[dict[str, Any]]:
    calls = server.model_calls()
    assert calls and all(call.path == path for call in calls), [call.path for call in calls]
    return [call.body for call in calls]


async def test_codex_speaks_responses_and_runs_exec_command(sandbox: LocalSandbox) -> None:
    run, server = await run_agent(sandbox, "codex", Script("exec_command", {"cmd": WRITE}, final_text="Done."))
    first, second = bodies(server, "/s/abc/v1/responses")
    assert all(call.headers["Authorization"] == f"Bearer {KEY}" for call in server.model_calls())
    assert first["stream"] is True and first["store"] is False and "previous_response_id" not in second
    assert {tool["name"] for tool in first["tools"]} == {"exec_command", "write_stdin", "request_user_input",
                                                         "view_image"}
    call, output = second["input"][-2:]
    assert call["type"] == "function_call" and call["name"] == "exec_command"
    assert json.loads(call["arguments"]) == {"cmd": WRITE}
    assert output["type"] == "function_call_output" and output["call_id"] == call["call_id"]
    assert second["input"][:-2] == first["input"]
    assert not [r for r in server.requests if r.method == "GET"]
    assert (run.tool_calls_by_name, run.tool_failure_count, run.completion) == ({"command_execution": 1}, 0, "Done.")


async def test_gemini_cli_speaks_generate_content_and_runs_the_shell_tool(sandbox: LocalSandbox) -> None:
    run, server = await run_agent(sandbox, "gemini-cli",
                                  Script("run_shell_command", {"command": WRITE}, final_text="Done."))
    first, second = bodies(server, "/s/abc/v1beta/models/policy:streamGenerateContent")
    assert all(call.query == {"alt": "sse"} and call.headers["x-goog-api-key"] == KEY
               for call in server.model_calls())
    declared = {d["name"] for tool in first["tools"] for d in tool["functionDeclarations"]}
    assert "run_shell_command" in declared and not declared & {"google_web_search", "web_fetch"}
    model_turn, result_turn = second["contents"][-2:]
    assert model_turn["role"] == "model" and model_turn["parts"][0]["functionCall"]["args"] == {"command": WRITE}
    assert result_turn["parts"][0]["functionResponse"]["name"] == "run_shell_command"
    assert (run.tool_calls_by_name, run.tool_failure_count, run.completion) == ({"run_shell_command": 1}, 0, "Done.")


@pytest.mark.parametrize(("harness", "tool"), [("qwen-coder", "run_shell_command"), ("pi", "bash")])
async def test_chat_clis_run_their_shell_tool(sandbox: LocalSandbox, harness: str, tool: str) -> None:
    run, server = await run_agent(sandbox, harness, Script(tool, {"command": WRITE}, final_text="Done."))
    first, second = bodies(server, "/s/abc/v1/chat/completions")
    assert all(call.headers["Authorization"] == f"Bearer {KEY}" for call in server.model_calls())
    assert first["stream"] is True and first["model"] == "policy" and tool in {
        t["function"]["name"] for t in first["tools"]}
    assistant, result = second["messages"][-2:]
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"command": WRITE}
    assert result["role"] == "tool" and result["tool_call_id"] == assistant["tool_calls"][0]["id"]
    assert (run.tool_calls_by_name, run.tool_failure_count, run.completion) == ({tool: 1}, 0, "Done.")


async def test_aider_writes_the_file_from_its_reply(sandbox: LocalSandbox) -> None:
    run, server = await run_agent(sandbox, "aider", Script(edit="greeting.txt\n```\nhello harness-rl\n```\n"))
    first, *_ = bodies(server, "/s/abc/v1/chat/completions")
    assert server.model_calls()[0].headers["Authorization"] == f"Bearer {KEY}"
    assert first["model"] == "policy" and "tools" not in first
    assert first["messages"][-1]["content"].startswith("Write the greeting file.")
    assert (run.tool_calls_by_name, run.tool_failure_count) == ({"edit": 1}, 0)
