"""gemini-cli (npm `@google/gemini-cli` 0.61.0): Google generateContent, streaming.

Wiring (measured against a scripted server; see tests/fixtures/agents/gemini-cli/):
- `GOOGLE_GEMINI_BASE_URL` is the session's root (the SDK appends
  `/v1beta/models/<model>:streamGenerateContent?alt=sse`), `GEMINI_API_KEY` the session key (sent
  as `x-goog-api-key`);
- `~/.gemini/settings.json` in the sandbox's private home pre-selects API-key auth (headless runs
  cannot ask, and a custom base URL confuses its detection), turns off auto-update, the update nag,
  usage statistics and telemetry, and removes the web tools;
- `GEMINI_CLI_TRUST_WORKSPACE=true`, without which `--yolo` falls back to asking for approval;
- `--output-format stream-json` prints one JSON event per line.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import PurePosixPath

from adapters.harnesses.base import Endpoint, Harness, Launch, Package, ToolReport, isolated_env, json_lines
from adapters.sandboxes.base import ExecResult, Sandbox

EXCLUDED_TOOLS = ("google_web_search", "web_fetch")


class GeminiCliHarness(Harness):
    name = "gemini-cli"
    dialect = "google-gemini"
    package = Package("npm", "@google/gemini-cli", "0.61.0", "gemini")

    def __init__(self, max_session_turns: int = 50) -> None:
        self.max_session_turns = max_session_turns

    def settings(self) -> dict:
        return {
            "security": {"auth": {"selectedType": "gemini-api-key"}},
            "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
            "model": {"maxSessionTurns": self.max_session_turns},
            "tools": {"exclude": list(EXCLUDED_TOOLS)},
        }

    def launch(self, sandbox: Sandbox, endpoint: Endpoint, instruction: str) -> Launch:
        env = isolated_env(sandbox, GOOGLE_GEMINI_BASE_URL=endpoint.gemini_base_url, GEMINI_API_KEY=endpoint.api_key,
                           GEMINI_CLI_TRUST_WORKSPACE="true")
        settings_path = PurePosixPath(sandbox.home) / ".gemini" / "settings.json"
        argv = [self.binary(sandbox), "--yolo", "--model", endpoint.model, "--output-format", "stream-json",
                f"--prompt={instruction}"]
        return Launch(argv=argv, env=env, files={str(settings_path): json.dumps(self.settings())})

    async def report(self, sandbox: Sandbox, result: ExecResult) -> ToolReport:
        """`stream-json`: `tool_use` events name the tools, `tool_result` events with status `error`
        are failures, and the assistant's text after the last tool is the final answer."""
        calls: Counter[str] = Counter()
        texts: list[str] = []
        failures = 0
        for event in json_lines(result.stdout):
            kind = event.get("type")
            if kind == "tool_use":
                calls[str(event.get("tool_name", "?"))] += 1
                texts.clear()
            elif kind == "tool_result" and event.get("status") == "error":
                failures += 1
            elif kind == "message" and event.get("role") == "assistant" and isinstance(event.get("content"), str):
                texts.append(event["content"])
        return ToolReport(dict(calls), failures, "".join(texts))
