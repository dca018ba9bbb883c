"""Claude Code (npm `@anthropic-ai/claude-code` 2.1.197, the last release for Node 20): Anthropic Messages.

Wiring (see the agents reference): `ANTHROPIC_BASE_URL` is the session's Anthropic base URL (no
`/v1`; the CLI appends `/v1/messages`), `ANTHROPIC_API_KEY` the session key (sent as
`x-api-key`), and every model alias (`ANTHROPIC_MODEL`, the default opus/sonnet/haiku models, the
small/fast model, the subagent model) is the policy, so even auxiliary calls reach the proxy.
Non-essential traffic, telemetry, error reporting and the auto-updater are off; the billing
header is off in `settings.json`. `CLAUDE_CONFIG_DIR` lives in the sandbox's private home, and
`IS_SANDBOX=1` lets bypass-permissions mode run as root. The run prints `stream-json` events we
read tool calls and the final result from.

Options (`harness_options`): `disallowed_tools` (default WebFetch, WebSearch and Task; pass the list
without Task to let the agent hand work to subagents) and `env`, Claude Code's own settings for the
run, e.g. `{"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000", "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "43"}` to
compact its context at 43 % of a 100k window (minus its output reserve) instead of near 200k.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import PurePosixPath

from adapters.harnesses.base import Endpoint, Harness, Launch, Package, ToolReport, isolated_env, json_lines
from adapters.sandboxes.base import ExecResult, Sandbox

DISALLOWED_TOOLS = ("WebFetch", "WebSearch", "Task")


class ClaudeCodeHarness(Harness):
    name = "claude-code"
    dialect = "anthropic-messages"
    package = Package("npm", "@anthropic-ai/claude-code", "2.1.197", "claude")

    def __init__(self, api_timeout_ms: int = 600000, disallowed_tools: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.api_timeout_ms = api_timeout_ms
        self.disallowed_tools = list(DISALLOWED_TOOLS if disallowed_tools is None else disallowed_tools)
        self.env = env or {}

    def launch(self, sandbox: Sandbox, endpoint: Endpoint, instruction: str) -> Launch:
        config_dir = PurePosixPath(sandbox.home) / ".claude"
        models = {name: endpoint.model for name in (
            "ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
            "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL")}
        env = isolated_env(
            sandbox,
            ANTHROPIC_BASE_URL=endpoint.anthropic_base_url,
            ANTHROPIC_API_KEY=endpoint.api_key,
            CLAUDE_CONFIG_DIR=str(config_dir),
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
            CLAUDE_CODE_ATTRIBUTION_HEADER="0",
            DISABLE_TELEMETRY="1",
            DISABLE_ERROR_REPORTING="1",
            DISABLE_AUTOUPDATER="1",
            DISABLE_BUG_COMMAND="1",
            API_TIMEOUT_MS=str(self.api_timeout_ms),
            IS_SANDBOX="1",
            **models,
            **self.env,
        )
        settings = {
            "env": {"CLAUDE_CODE_ATTRIBUTION_HEADER": "0"},
            "permissions": {"defaultMode": "bypassPermissions"},
            "includeCoAuthoredBy": False,
        }
        argv = [
            self.binary(sandbox), "--print", "--verbose", "--output-format", "stream-json",
            "--permission-mode", "bypassPermissions", "--model", endpoint.model,
            *(["--disallowedTools", *self.disallowed_tools] if self.disallowed_tools else []), "--", instruction,
        ]
        return Launch(argv=argv, env=env, files={str(config_dir / "settings.json"): json.dumps(settings)})

    async def report(self, sandbox: Sandbox, result: ExecResult) -> ToolReport:
        return stream_json_report(result.stdout)


def stream_json_report(stdout: str) -> ToolReport:
    """Claude Code's `stream-json` (qwen-code prints the same): assistant `tool_use` blocks name the
    tools, `tool_result` blocks flag errors, the `result` event holds the final text."""
    calls: Counter[str] = Counter()
    failures, completion = 0, ""
    for event in json_lines(stdout):
        content = (event.get("message") or {}).get("content")
        for block in content if isinstance(content, list) else []:
            if not isinstance(block, dict):
                continue
            if event.get("type") == "assistant" and block.get("type") == "tool_use":
                calls[str(block.get("name", "?"))] += 1
            elif event.get("type") == "user" and block.get("type") == "tool_result" and block.get("is_error"):
                failures += 1
        if event.get("type") == "result" and isinstance(event.get("result"), str):
            completion = event["result"]
    return ToolReport(dict(calls), failures, completion)
