"""Harness adapters: the wiring each one produces, what they read from agent output, and the echo agent live.

The real CLIs run end to end in tests/test_agents_cli.py; here the launch is checked piece by
piece and the echo agent talks to a scripted OpenAI-compatible server on loopback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp import web

from adapters.harnesses import Endpoint, create_harness, tool_calls_in_trace
from adapters.sandboxes.base import ExecResult
from adapters.sandboxes.local import LocalSandbox
from adapters.tasks import load_task
from adapters.verifier import verify
from harness_rl.trace import Reply, ToolCall, TrainingTrace, Turn

pytestmark = pytest.mark.anyio
TASKS = Path(__file__).resolve().parents[1] / "examples" / "tasks"
ENDPOINT = Endpoint("http://127.0.0.1:9/s/abc/v1", "http://127.0.0.1:9/s/abc", "sk-session-key")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def sandbox():
    async with LocalSandbox() as box:
        await box.start(load_task(TASKS / "digits"))
        yield box


async def test_opencode_points_at_the_session_with_a_non_openai_provider(sandbox) -> None:
    launch = create_harness("opencode").launch(sandbox, ENDPOINT, "do the task")
    (config_path, config_text), = launch.files.items()
    assert config_path == f"{sandbox.home}/.config/opencode/opencode.json"
    config = json.loads(config_text)
    (provider_id, provider), = config["provider"].items()
    assert provider_id != "openai" and "/" not in ENDPOINT.model
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"]["baseURL"] == ENDPOINT.openai_base_url
    assert provider["options"]["apiKey"] == ENDPOINT.api_key
    assert config["model"] == config["small_model"] == f"{provider_id}/policy"
    assert config["tools"] == {"task": False, "question": False, "webfetch": False}
    assert config["autoupdate"] is False
    assert launch.env["HOME"] == sandbox.home
    assert all(launch.env[k].startswith(sandbox.home) for k in launch.env if k.startswith("XDG_"))
    assert launch.env["OPENCODE_DISABLE_AUTOUPDATE"] == launch.env["OPENCODE_DISABLE_MODELS_FETCH"] == "1"
    assert launch.argv[-2:] == ["--", "do the task"]
    assert "--auto" in launch.argv and launch.argv[launch.argv.index("--format") + 1] == "json"


async def test_claude_code_every_model_alias_is_the_policy(sandbox) -> None:
    launch = create_harness("claude_code").launch(sandbox, ENDPOINT, "do the task")
    env = launch.env
    assert env["ANTHROPIC_BASE_URL"] == ENDPOINT.anthropic_base_url and not env["ANTHROPIC_BASE_URL"].endswith("/v1")
    assert env["ANTHROPIC_API_KEY"] == ENDPOINT.api_key
    for alias in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                  "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_SMALL_FAST_MODEL"):
        assert env[alias] == "policy"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == env["DISABLE_AUTOUPDATER"] == "1"
    assert env["CLAUDE_CONFIG_DIR"].startswith(sandbox.home) and env["IS_SANDBOX"] == "1"
    settings = json.loads(launch.files[f"{env['CLAUDE_CONFIG_DIR']}/settings.json"])
    assert settings["env"]["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    argv = launch.argv
    assert argv[argv.index("--permission-mode") + 1] == "bypassPermissions"
    assert argv[argv.index("--output-format") + 1] == "stream-json" and argv[-1] == "do the task"


async def test_mini_swe_agent_config_file_comes_before_overrides(sandbox) -> None:
    launch = create_harness("mini-swe-agent", step_limit=7).launch(sandbox, ENDPOINT, "do the task")
    configs = [launch.argv[i + 1] for i, arg in enumerate(launch.argv) if arg == "-c"]
    assert configs[0] == "mini.yaml"
    assert f"model.model_kwargs.api_base={ENDPOINT.openai_base_url}" in configs
    assert "agent.step_limit=7" in configs
    assert launch.argv[launch.argv.index("-m", 3) + 1] == "openai/policy"
    assert launch.env["OPENAI_API_KEY"] == ENDPOINT.api_key
    assert launch.env["MSWEA_COST_TRACKING"] == "ignore_errors" and launch.env["MSWEA_CONFIGURED"] == "true"
    assert launch.env["MSWEA_GLOBAL_CONFIG_DIR"].startswith(sandbox.home)


def events(*items: dict) -> ExecResult:
    return ExecResult(0, "\n".join(json.dumps(item) for item in items) + "\nnot json\n", "")


async def test_opencode_report_counts_tools_by_name_and_failures(sandbox) -> None:
    result = events(
        {"type": "step_start", "part": {"type": "step-start"}},
        {"type": "tool_use", "part": {"type": "tool", "tool": "bash", "state": {"status": "completed"}}},
        {"type": "tool_use", "part": {"type": "tool", "tool": "bash", "state": {"status": "error"}}},
        {"type": "tool_use", "part": {"type": "tool", "tool": "write", "state": {"status": "completed"}}},
        {"type": "text", "part": {"type": "text", "text": "Done."}},
    )
    report = await create_harness("opencode").report(sandbox, result)
    assert (report.calls_by_name, report.failures, report.completion) == ({"bash": 2, "write": 1}, 1, "Done.")


async def test_claude_code_report_reads_stream_json(sandbox) -> None:
    result = events(
        {"type": "system", "subtype": "init"},
        {"type": "assistant", "message": {"content": [{"type": "tool_use", "name": "Bash", "input": {}}]}},
        {"type": "user", "message": {"content": [{"type": "tool_result", "is_error": True}]}},
        {"type": "assistant", "message": {"content": [{"type": "tool_use", "name": "Bash"},
                                                      {"type": "tool_use", "name": "Write"}]}},
        {"type": "result", "subtype": "success", "result": "All done."},
    )
    report = await create_harness("claude-code").report(sandbox, result)
    assert (report.calls_by_name, report.failures, report.completion) == ({"Bash": 2, "Write": 1}, 1, "All done.")


async def test_mini_swe_agent_report_skips_the_unexecuted_submit(sandbox) -> None:
    harness = create_harness("mini-swe-agent")
    submit = {"function": {"name": "bash", "arguments": '{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}'},
              "id": "c3"}
    messages = [
        {"role": "assistant", "tool_calls": [{"function": {"name": "bash", "arguments": "{}"}, "id": "c1"}]},
        {"role": "tool", "tool_call_id": "c1", "extra": {"returncode": 0}},
        {"role": "assistant", "tool_calls": [{"function": {"name": "bash", "arguments": "{}"}, "id": "c2"}]},
        {"role": "tool", "tool_call_id": "c2", "extra": {"returncode": 2}},
        {"role": "assistant", "tool_calls": [submit]},
        {"role": "tool", "tool_call_id": "c3", "extra": {"returncode": -1}},
        {"role": "exit", "extra": {"exit_status": "Submitted", "submission": ""}},
    ]
    await sandbox.write_text(harness.trajectory_path(sandbox), json.dumps({"messages": messages}))
    report = await harness.report(sandbox, ExecResult(0, "", ""))
    assert (report.calls_by_name, report.failures, report.completion) == ({"bash": 3}, 1, "Submitted")


def test_tool_calls_in_trace_count_agent_turns_only() -> None:
    def turn(node: str, role: str, names: list[str]) -> Turn:
        calls = [ToolCall(id=f"{node}{i}", name=n, arguments="{}") for i, n in enumerate(names)]
        return Turn(node_id=node, role=role, prompt_token_ids=[1], completion_token_ids=[2], per_token_logps=[-0.5],
                    loss_mask=[0, 1], reply=Reply(tool_calls=calls))

    trace = TrainingTrace(rollout_id="r", turns=[turn("a", "agent", ["bash", "read"]), turn("b", "agent", ["bash"]),
                                                 turn("c", "discarded", ["bash"]), turn("d", "auxiliary", [])])
    assert tool_calls_in_trace(trace) == {"bash": 2, "read": 1}


def test_unknown_harness_is_named() -> None:
    with pytest.raises(ValueError, match="echo, opencode, claude-code, mini-swe-agent"):
        create_harness("codex")


async def test_echo_agent_asks_once_and_writes_the_answer(sandbox) -> None:
    seen: list[tuple[str, dict]] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append((request.headers["Authorization"], await request.json()))
        return web.json_response({"choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": "12 34x"}}]})

    app = web.Application()
    app.router.add_post("/s/abc/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        endpoint = Endpoint(f"http://127.0.0.1:{port}/s/abc/v1", f"http://127.0.0.1:{port}/s/abc", "sk-session")
        run = await create_harness("echo", max_tokens=16).run(sandbox, endpoint, "Reply with digits.", timeout=60)
    finally:
        await runner.cleanup()
    assert run.exit_code == 0 and not run.timed_out, run.stderr
    assert run.completion == "12 34x" and run.tool_call_count == 0
    assert seen == [("Bearer sk-session", {"model": "policy", "max_tokens": 16,
                                          "messages": [{"role": "user", "content": "Reply with digits."}]})]
    assert await sandbox.read_text(f"{sandbox.workdir}/answer.txt") == "12 34x"
    result = await verify(load_task(TASKS / "digits"), sandbox)
    assert result.reward.value == pytest.approx(4 / 5)


async def test_echo_agent_that_cannot_connect_fails_without_hanging(sandbox) -> None:
    run = await create_harness("echo").run(sandbox, ENDPOINT, "Reply.", timeout=30)
    assert run.exit_code not in (0, None) and not run.timed_out
    assert "Connection refused" in run.stderr or "URLError" in run.stderr
