"""Harness adapters: the wiring each one produces, what they read from agent output, the one place
their pins live (the adapter classes, read by `harness-rl harnesses` and the install script), and
the echo agent live.

The real CLIs run end to end in tests/test_agents_cli.py (through the proxy) and
tests/test_agents_scripted.py (against the scripted server); here the launch is checked piece by
piece and the echo agent talks to a scripted OpenAI-compatible server on loopback.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from aiohttp import web

from adapters.harbor_bridge.catalog import CATALOG, TEST
from adapters.harnesses import HARNESSES, NATIVE_NAMES, Endpoint, create_harness
from adapters.harnesses.base import Package
from adapters.sandboxes.base import ExecResult
from adapters.sandboxes.local import LocalSandbox
from adapters.tasks import load_task
from adapters.verifier import verify
from harness_rl.commands.harnesses import native_rows

pytestmark = pytest.mark.anyio
TASKS = Path(__file__).resolve().parents[1] / "examples" / "tasks"
ROOT = TASKS.parents[1]
ENDPOINT = Endpoint("http://127.0.0.1:9/s/abc/v1", "http://127.0.0.1:9/s/abc", "sk-session-key")
HARBOR_NAMES = {"echo", "opencode", "claude-code", "mini-swe-agent", "codex", "gemini-cli", "qwen-coder", "pi",
                "aider"}


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
    launch = create_harness("mini-swe-agent", step_limit=7, max_consecutive_format_errors=1).launch(
        sandbox, ENDPOINT, "do the task")
    configs = [launch.argv[i + 1] for i, arg in enumerate(launch.argv) if arg == "-c"]
    assert configs[0] == "mini.yaml"
    assert f"model.model_kwargs.api_base={ENDPOINT.openai_base_url}" in configs
    assert "agent.step_limit=7" in configs and "agent.max_consecutive_format_errors=1" in configs
    assert launch.argv[launch.argv.index("-m", 3) + 1] == "openai/policy"
    assert launch.env["OPENAI_API_KEY"] == ENDPOINT.api_key
    assert launch.env["MSWEA_COST_TRACKING"] == "ignore_errors" and launch.env["MSWEA_CONFIGURED"] == "true"
    assert launch.env["MSWEA_GLOBAL_CONFIG_DIR"].startswith(sandbox.home)
    assert not any(c.startswith("agent.instance_template=") for c in configs)  # mini-swe-agent's own prompt


async def test_mini_swe_agent_takes_a_task_prompt_that_places_the_task(sandbox) -> None:
    template = "{{task}}\n\nOne command per reply."
    launch = create_harness("mini-swe-agent", instance_template=template).launch(sandbox, ENDPOINT, "do the task")
    configs = [launch.argv[i + 1] for i, arg in enumerate(launch.argv) if arg == "-c"]
    assert configs[-1] == f"agent.instance_template={template}"
    with pytest.raises(ValueError, match="must place the task with"):
        create_harness("mini-swe-agent", instance_template="Solve it.")


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


def test_unknown_harness_is_named() -> None:
    with pytest.raises(ValueError, match="unknown harness 'qwen-code'; `harness-rl harnesses` lists them all"):
        create_harness("qwen-code")


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


def assert_isolated(env: dict[str, str], home: str) -> None:
    assert env["HOME"] == home and all(env[k].startswith(home) for k in env if k.startswith("XDG_"))


async def test_codex_config_names_a_responses_provider_at_the_session(sandbox) -> None:
    launch = create_harness("codex").launch(sandbox, ENDPOINT, "do the task")
    (path, text), = launch.files.items()
    assert path == f"{sandbox.home}/.codex/config.toml" == f"{launch.env['CODEX_HOME']}/config.toml"
    config = tomllib.loads(text)
    provider = config["model_providers"][config["model_provider"]]
    assert config["model_provider"] != "openai" and config["model"] == "policy"
    assert provider["base_url"] == ENDPOINT.openai_base_url and provider["wire_api"] == "responses"
    assert launch.env[provider["env_key"]] == ENDPOINT.api_key
    assert provider["request_max_retries"] == provider["stream_max_retries"] == 0
    assert config["web_search"] == "disabled" and config["check_for_update_on_startup"] is False
    assert config["analytics"] == {"enabled": False} and config["agents"] == {"enabled": False}
    assert config["features"]["plugins"] is False and not any(config["features"].values())
    assert_isolated(launch.env, sandbox.home)
    assert launch.argv[:3] == [f"{sandbox.tools_dir}/npm/node_modules/.bin/codex", "exec", "--json"]
    assert "--dangerously-bypass-approvals-and-sandbox" in launch.argv and launch.argv[-2:] == ["--", "do the task"]


async def test_codex_report_counts_tool_items_and_failed_commands(sandbox) -> None:
    result = events(
        {"type": "thread.started", "thread_id": "t"},
        {"type": "item.completed", "item": {"type": "error", "message": "unknown model"}},
        {"type": "item.started", "item": {"type": "command_execution", "exit_code": None}},
        {"type": "item.completed", "item": {"type": "command_execution", "exit_code": 0, "status": "completed"}},
        {"type": "item.completed", "item": {"type": "command_execution", "exit_code": 2, "status": "failed"}},
        {"type": "item.completed", "item": {"type": "file_change", "status": "completed"}},
        {"type": "item.completed", "item": {"type": "agent_message", "text": "Done."}},
        {"type": "turn.completed", "usage": {}},
    )
    report = await create_harness("codex").report(sandbox, result)
    assert (report.calls_by_name, report.failures, report.completion) == (
        {"command_execution": 2, "file_change": 1}, 1, "Done.")


async def test_gemini_cli_points_at_the_session_root_with_api_key_auth(sandbox) -> None:
    launch = create_harness("gemini-cli", max_session_turns=9).launch(sandbox, ENDPOINT, "do the task")
    assert launch.env["GOOGLE_GEMINI_BASE_URL"] == ENDPOINT.anthropic_base_url == "http://127.0.0.1:9/s/abc"
    assert launch.env["GEMINI_API_KEY"] == ENDPOINT.api_key and launch.env["GEMINI_CLI_TRUST_WORKSPACE"] == "true"
    settings = json.loads(launch.files[f"{sandbox.home}/.gemini/settings.json"])
    assert settings["security"]["auth"]["selectedType"] == "gemini-api-key"
    assert settings["telemetry"]["enabled"] is False and settings["privacy"]["usageStatisticsEnabled"] is False
    assert settings["general"]["disableAutoUpdate"] is True and settings["model"]["maxSessionTurns"] == 9
    assert set(settings["tools"]["exclude"]) == {"google_web_search", "web_fetch"}
    assert_isolated(launch.env, sandbox.home)
    argv = launch.argv
    assert "--yolo" in argv and argv[argv.index("--output-format") + 1] == "stream-json"
    assert argv[argv.index("--model") + 1] == "policy" and argv[-1] == "--prompt=do the task"


async def test_gemini_cli_report_reads_stream_json(sandbox) -> None:
    result = events(
        {"type": "init", "model": "policy"},
        {"type": "message", "role": "assistant", "content": "Let me", "delta": True},
        {"type": "tool_use", "tool_name": "run_shell_command", "tool_id": "a", "parameters": {}},
        {"type": "tool_result", "tool_id": "a", "status": "error", "output": "boom"},
        {"type": "tool_use", "tool_name": "write_file", "tool_id": "b", "parameters": {}},
        {"type": "tool_result", "tool_id": "b", "status": "success", "output": ""},
        {"type": "message", "role": "assistant", "content": "All ", "delta": True},
        {"type": "message", "role": "assistant", "content": "done.", "delta": True},
        {"type": "result", "status": "success"},
    )
    report = await create_harness("gemini-cli").report(sandbox, result)
    assert (report.calls_by_name, report.failures, report.completion) == (
        {"run_shell_command": 1, "write_file": 1}, 1, "All done.")


async def test_qwen_coder_uses_openai_auth_at_the_session(sandbox) -> None:
    launch = create_harness("qwen-coder").launch(sandbox, ENDPOINT, "do the task")
    env = launch.env
    assert (env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"], env["OPENAI_MODEL"]) == (
        ENDPOINT.openai_base_url, ENDPOINT.api_key, "policy")
    settings = json.loads(launch.files[f"{sandbox.home}/.qwen/settings.json"])
    assert settings["security"]["auth"]["selectedType"] == "openai" and settings["telemetry"]["enabled"] is False
    assert "web_fetch" in settings["tools"]["exclude"]
    assert_isolated(env, sandbox.home)
    argv = launch.argv
    assert argv[argv.index("--auth-type") + 1] == "openai" and "--yolo" in argv
    assert argv[argv.index("--output-format") + 1] == "stream-json" and argv[-1] == "--prompt=do the task"


async def test_qwen_coder_report_reads_claude_shaped_stream_json(sandbox) -> None:
    result = events(
        {"type": "assistant", "message": {"content": [{"type": "tool_use", "name": "run_shell_command"}]}},
        {"type": "user", "message": {"content": [{"type": "tool_result", "is_error": False}]}},
        {"type": "result", "subtype": "success", "result": "All done."},
    )
    report = await create_harness("qwen-coder").report(sandbox, result)
    assert (report.calls_by_name, report.failures, report.completion) == ({"run_shell_command": 1}, 0, "All done.")


async def test_pi_models_json_names_the_session_and_the_key_variable(sandbox) -> None:
    launch = create_harness("pi", context_tokens=4096, output_tokens=512).launch(sandbox, ENDPOINT, "do the task")
    agent_dir = launch.env["PI_CODING_AGENT_DIR"]
    assert agent_dir.startswith(sandbox.home) and launch.env["PI_OFFLINE"] == "1"
    (provider_id, provider), = json.loads(launch.files[f"{agent_dir}/models.json"])["providers"].items()
    assert provider["baseUrl"] == ENDPOINT.openai_base_url and provider["api"] == "openai-completions"
    assert launch.env[provider["apiKey"]] == ENDPOINT.api_key
    assert provider["models"] == [{"id": "policy", "contextWindow": 4096, "maxTokens": 512}]
    argv = launch.argv
    assert argv[argv.index("--provider") + 1] == provider_id and argv[argv.index("--model") + 1] == "policy"
    assert {"--print", "--no-session", "--offline"} <= set(argv) and argv[-1] == "do the task"
    assert create_harness("pi").launch(sandbox, ENDPOINT, "@notes.md").argv[-1] == " @notes.md"


async def test_pi_report_reads_tool_executions_and_the_last_answer(sandbox) -> None:
    result = events(
        {"type": "tool_execution_end", "toolName": "bash", "isError": False},
        {"type": "tool_execution_end", "toolName": "bash", "isError": True},
        {"type": "tool_execution_end", "toolName": "edit", "isError": False},
        {"type": "agent_end", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "task"}]},
            {"role": "assistant", "content": [{"type": "toolCall", "name": "bash"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Fixed."}]}]},
    )
    report = await create_harness("pi").report(sandbox, result)
    assert (report.calls_by_name, report.failures, report.completion) == ({"bash": 2, "edit": 1}, 1, "Fixed.")


async def test_aider_runs_offline_from_its_venv_on_a_git_snapshot(sandbox) -> None:
    launch = create_harness("aider").launch(sandbox, ENDPOINT, "do the task")
    assert (launch.env["OPENAI_API_BASE"], launch.env["OPENAI_API_KEY"]) == (ENDPOINT.openai_base_url, ENDPOINT.api_key)
    argv = launch.argv
    assert argv[:2] == ["bash", "-c"] and "git init" in argv[2] and argv[4] == f"{sandbox.tools_dir}/aider/bin/aider"
    assert {"--model=openai/policy", "--edit-format=whole", "--yes-always", "--no-auto-commits", "--no-check-update",
            "--no-analytics"} <= set(argv) and argv[-1] == "--message=do the task"
    cache = json.loads(launch.files[f"{sandbox.home}/.aider/caches/model_prices_and_context_window.json"])
    assert cache["openai/policy"]["max_input_tokens"] == 65536  # non-empty: aider fetches nothing at start
    assert f"{sandbox.home}/.gitconfig" in launch.files
    assert_isolated(launch.env, sandbox.home)


async def test_aider_report_counts_applied_and_malformed_edits(sandbox) -> None:
    stdout = ("Aider v0.86.2\ngreeting.txt\nApplied edit to greeting.txt\nApplied edit to main.py\n"
              "The LLM did not conform to the edit format.\n")
    report = await create_harness("aider").report(sandbox, ExecResult(0, stdout, ""))
    assert (report.calls_by_name, report.failures) == ({"edit": 2}, 1)


def test_harness_names_are_harbors_and_declare_dialect_and_pin() -> None:
    assert set(NATIVE_NAMES) == HARBOR_NAMES
    assert {f"harbor:{name}" for name in CATALOG} | HARBOR_NAMES | set(CATALOG) == set(HARNESSES)
    assert HARNESSES["terminus-2"] is HARNESSES["harbor:terminus-2"] and HARNESSES["opencode"].package is not None
    assert {name: cls.dialect for name, cls in HARNESSES.items() if name in ("codex", "gemini-cli", "claude-code")} == {
        "codex": "openai-responses", "gemini-cli": "google-gemini", "claude-code": "anthropic-messages"}
    assert all(HARNESSES[name].package is not None for name in NATIVE_NAMES if name != "echo")


def test_pins_command_prints_every_adapter_package() -> None:
    out = subprocess.run([sys.executable, "-m", "adapters.harnesses", "--pins"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    pins = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    expected = {name: [p.registry, p.name, p.version, p.binary, p.venv or "-"]
                for name, cls in HARNESSES.items() if (p := cls.package) is not None}
    assert pins == expected and pins["codex"] == ["npm", "@openai/codex", "0.171.0", "codex", "-"]


def test_installed_version_reads_npm_manifests_and_venv_dist_info(tmp_path: Path) -> None:
    npm = Package("npm", "@scope/cli", "1.2.3", "cli")
    venv = Package("pypi", "aider-chat", "0.86.2", "aider", venv="aider")
    assert npm.installed_version(tmp_path) is None and venv.installed_version(tmp_path) is None
    manifest = tmp_path / "npm" / "node_modules" / "@scope" / "cli" / "package.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"name": "@scope/cli", "version": "1.2.2"}))
    (tmp_path / "aider" / "lib" / "python3.11" / "site-packages" / "aider_chat-0.86.2.dist-info").mkdir(parents=True)
    assert npm.installed_version(tmp_path) == "1.2.2" and venv.installed_version(tmp_path) == "0.86.2"
    table = {row[0]: row for row in native_rows(tmp_path)}
    assert table["aider"][1:5] == ("openai-chat", "pypi:aider-chat", "0.86.2", "yes")
    assert table["codex"][4] == "no" and table["echo"][4] == "yes"


def test_harnesses_command_lists_every_harness(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "harness_rl.cli", "harnesses", "--tools-dir", str(tmp_path)],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    lines = out.splitlines()
    assert lines[0].split() == ["HARNESS", "DIALECT", "INSTALLS", "FROM", "VERSION", "INSTALLED", "STATE", "HERE"]
    listed = {line.split()[0]: line.split() for line in lines[1:-1]}
    assert set(listed) == HARBOR_NAMES | {f"harbor:{name}" for name in CATALOG}
    assert listed["gemini-cli"][1:5] == ["google-gemini", "npm:@google/gemini-cli", "0.61.0", "no"]
    assert listed["harbor:kimi-cli"][1:5] == ["openai-chat", "pypi:kimi-cli,uv", "1.51.0", "no"]
    assert listed["harbor:kimi-cli"][5:] == ["proven:", f"{TEST}[kimi-cli]"]
    assert " ".join(listed["harbor:goose"][5:]).startswith("needs network: Harbor's install() needs the goose CLI")
    proven = sum(1 for agent in CATALOG.values() if agent.state == "proven") + len(HARBOR_NAMES) - 1  # not echo
    assert lines[-1].startswith(f"{proven} real agents proven here") and proven >= 16
