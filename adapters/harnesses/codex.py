"""codex (npm `@openai/codex` 0.171.0, a native binary that runs on Node 20): OpenAI Responses, streaming.

Wiring (measured against a scripted server; notes in tests/fixtures/agents/codex/):
- `CODEX_HOME` in the sandbox's private home holds `config.toml` with one custom model provider
  (`wire_api = "responses"`, `base_url` = the session's OpenAI base URL, `env_key` naming the
  variable that carries the session key, sent as `Authorization: Bearer`). A custom provider never
  tries the Responses websocket nor lists models; retries are off so a refused turn stays refused.
- Off: web search, update checks, analytics, sub-agents, goals, plugins (their start-up sync
  reaches for github.com), apps, image generation, browser/computer use, tool suggestions, skill
  search, model discovery, the shell snapshot. What is left for the model: `exec_command`,
  `write_stdin`, `request_user_input`, `view_image`.
- `codex exec --json --dangerously-bypass-approvals-and-sandbox --skip-git-repo-check` runs
  unattended (the sandbox is ours) and prints one JSON event per line.

Options: `context_tokens` (the model's context window codex assumes) and `auto_compact_tokens`
(`model_auto_compact_token_limit`: past this many tokens codex asks the model for a handoff summary
and goes on in a fresh conversation that carries it; none: codex's own default).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import PurePosixPath

from adapters.harnesses.base import Endpoint, Harness, Launch, Package, ToolReport, isolated_env, json_lines
from adapters.sandboxes.base import ExecResult, Sandbox

PROVIDER_ID = "harness-rl"
KEY_VARIABLE = "HARNESS_RL_API_KEY"
DISABLED_FEATURES = ("goals", "plugins", "apps", "image_generation", "tool_suggest", "skill_search", "browser_use",
                     "computer_use", "remote_plugin", "api_key_model_discovery", "shell_snapshot")
TOOL_ITEMS = ("command_execution", "file_change", "mcp_tool_call", "web_search", "collab_tool_call")


def toml_string(value: str) -> str:
    """A TOML basic string (JSON's escapes are valid TOML)."""
    return json.dumps(value)


class CodexHarness(Harness):
    name = "codex"
    dialect = "openai-responses"
    package = Package("npm", "@openai/codex", "0.171.0", "codex")

    def __init__(self, context_tokens: int = 65536, auto_compact_tokens: int | None = None) -> None:
        self.context_tokens = context_tokens
        self.auto_compact_tokens = auto_compact_tokens

    def config(self, endpoint: Endpoint) -> str:
        lines = [
            f"model = {toml_string(endpoint.model)}",
            f"model_provider = {toml_string(PROVIDER_ID)}",
            'web_search = "disabled"',
            "check_for_update_on_startup = false",
            f"model_context_window = {self.context_tokens}",
            *([f"model_auto_compact_token_limit = {self.auto_compact_tokens}"] if self.auto_compact_tokens else []),
            "",
            f"[model_providers.{PROVIDER_ID}]",
            'name = "harness-rl proxy"',
            f"base_url = {toml_string(endpoint.openai_base_url)}",
            'wire_api = "responses"',
            f"env_key = {toml_string(KEY_VARIABLE)}",
            "request_max_retries = 0",
            "stream_max_retries = 0",
            "",
            "[analytics]",
            "enabled = false",
            "",
            "[agents]",
            "enabled = false",
            "",
            "[features]",
            *(f"{feature} = false" for feature in DISABLED_FEATURES),
        ]
        return "\n".join(lines) + "\n"

    def launch(self, sandbox: Sandbox, endpoint: Endpoint, instruction: str) -> Launch:
        codex_home = PurePosixPath(sandbox.home) / ".codex"
        env = isolated_env(sandbox, CODEX_HOME=str(codex_home), **{KEY_VARIABLE: endpoint.api_key})
        argv = [self.binary(sandbox), "exec", "--json", "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox", "--model", endpoint.model, "--", instruction]
        return Launch(argv=argv, env=env, files={str(codex_home / "config.toml"): self.config(endpoint)})

    async def report(self, sandbox: Sandbox, result: ExecResult) -> ToolReport:
        """`--json` events: each finished tool item (`command_execution`, `file_change`, …) by kind; a
        command with a non-zero exit code or an item with status `failed` is a failure."""
        calls: Counter[str] = Counter()
        failures, completion = 0, ""
        for event in json_lines(result.stdout):
            item = event.get("item") or {}
            if event.get("type") != "item.completed" or not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind in TOOL_ITEMS:
                calls[str(kind)] += 1
                failures += item.get("status") == "failed" or item.get("exit_code") not in (0, None)
            elif kind == "agent_message" and isinstance(item.get("text"), str):
                completion = item["text"]
        return ToolReport(dict(calls), failures, completion)
