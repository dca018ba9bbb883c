"""qwen-code (npm `@qwen-code/qwen-code` 0.15.10, the last release for Node 20; Harbor calls it
`qwen-coder`): OpenAI Chat through the OpenAI JS SDK, streaming.

Wiring (measured against a scripted server; see tests/fixtures/agents/qwen-coder/):
`OPENAI_BASE_URL` / `OPENAI_API_KEY` / `OPENAI_MODEL` plus `--auth-type openai`;
`~/.qwen/settings.json` in the sandbox's private home pre-selects that auth, turns off
auto-update, usage statistics and telemetry, and removes the web and sub-agent tools; `--yolo`
approves every tool; `--output-format stream-json` prints Claude Code's event shape, which the
Claude Code adapter already reads.
"""

from __future__ import annotations

import json
from pathlib import PurePosixPath

from adapters.harnesses.base import Endpoint, Harness, Launch, Package, ToolReport, isolated_env
from adapters.harnesses.claude_code import stream_json_report
from adapters.sandboxes.base import ExecResult, Sandbox

EXCLUDED_TOOLS = ("web_fetch", "agent")


class QwenCodeHarness(Harness):
    name = "qwen-coder"
    dialect = "openai-chat"
    package = Package("npm", "@qwen-code/qwen-code", "0.15.10", "qwen")

    def __init__(self, max_session_turns: int = 50) -> None:
        self.max_session_turns = max_session_turns

    def settings(self) -> dict:
        return {
            "security": {"auth": {"selectedType": "openai"}},
            "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
            "model": {"maxSessionTurns": self.max_session_turns},
            "tools": {"exclude": list(EXCLUDED_TOOLS)},
        }

    def launch(self, sandbox: Sandbox, endpoint: Endpoint, instruction: str) -> Launch:
        env = isolated_env(sandbox, OPENAI_BASE_URL=endpoint.openai_base_url, OPENAI_API_KEY=endpoint.api_key,
                           OPENAI_MODEL=endpoint.model)
        settings_path = PurePosixPath(sandbox.home) / ".qwen" / "settings.json"
        argv = [self.binary(sandbox), "--yolo", "--auth-type", "openai", "--model", endpoint.model,
                "--output-format", "stream-json", f"--prompt={instruction}"]
        return Launch(argv=argv, env=env, files={str(settings_path): json.dumps(self.settings())})

    async def report(self, sandbox: Sandbox, result: ExecResult) -> ToolReport:
        return stream_json_report(result.stdout)
