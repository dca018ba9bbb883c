"""opencode (npm `opencode-ai` 1.18.x): OpenAI Chat through `@ai-sdk/openai-compatible`, streaming.

Wiring (see the agents reference):
- a global config in the sandbox's private `XDG_CONFIG_HOME/opencode/opencode.json` with one
  provider whose id is not `openai` (that id switches opencode to the Responses API), pointing
  `baseURL` at the session's OpenAI base URL, model and `small_model` both the policy (so the
  title call also reaches the proxy, which labels it auxiliary), and the `task`, `question` and
  `webfetch` tools disabled;
- `opencode run --auto --format json` so permissions are granted unattended and the run prints
  JSON events we read tool calls from;
- no auto-update, no models.dev fetch, no LSP downloads, no sharing, no Claude Code config import.

opencode installs its plugin package into `XDG_CONFIG_HOME/opencode/node_modules` on first run,
from the npm registry. A sandbox without network (or a hundred rollouts at once) cannot afford
that, so install warms one shared copy under the tools dir (`opencode-warm/`), and each run
links it into its fresh config dir.
"""

from __future__ import annotations

import json
import shlex
from collections import Counter
from pathlib import PurePosixPath

from adapters.harnesses.base import (
    NPM_INSTALL,
    Endpoint,
    Harness,
    Launch,
    Package,
    ToolReport,
    install_locked,
    isolated_env,
    json_lines,
)
from adapters.sandboxes.base import ExecResult, Sandbox

PACKAGE = Package("npm", "opencode-ai", "1.18.33", "opencode")
PROVIDER_ID = "harness-rl"
DISABLED_TOOLS = ("task", "question", "webfetch")


class OpencodeHarness(Harness):
    name = "opencode"
    dialect = "openai-chat"
    package = PACKAGE

    def __init__(self, context_tokens: int = 65536, output_tokens: int = 8192) -> None:
        self.context_tokens = context_tokens
        self.output_tokens = output_tokens

    @staticmethod
    def warm_dir(sandbox: Sandbox) -> str:
        return str(PurePosixPath(sandbox.tools_dir) / "opencode-warm")

    async def install(self, sandbox: Sandbox) -> None:
        await super().install(sandbox)
        warm = shlex.quote(self.warm_dir(sandbox))
        await install_locked(sandbox, "opencode's plugin cache", (
            f"mkdir -p {warm} && {{ test -d {warm}/node_modules/@opencode-ai/plugin || "
            f"{NPM_INSTALL} --prefix {warm} --save-exact @opencode-ai/plugin@{PACKAGE.version}; }}"))

    def config(self, endpoint: Endpoint) -> dict:
        model = f"{PROVIDER_ID}/{endpoint.model}"
        return {
            "$schema": "https://opencode.ai/config.json",
            "provider": {
                PROVIDER_ID: {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "harness-rl proxy",
                    "options": {"baseURL": endpoint.openai_base_url, "apiKey": endpoint.api_key, "timeout": 600000},
                    "models": {endpoint.model: {
                        "name": endpoint.model,
                        "limit": {"context": self.context_tokens, "output": self.output_tokens},
                    }},
                },
            },
            "model": model,
            "small_model": model,
            "autoupdate": False,
            "share": "disabled",
            "tools": {tool: False for tool in DISABLED_TOOLS},
            "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny", "external_directory": "allow"},
        }

    def launch(self, sandbox: Sandbox, endpoint: Endpoint, instruction: str) -> Launch:
        env = isolated_env(
            sandbox,
            OPENCODE_DISABLE_AUTOUPDATE="1",
            OPENCODE_DISABLE_MODELS_FETCH="1",
            OPENCODE_DISABLE_LSP_DOWNLOAD="1",
            OPENCODE_DISABLE_SHARE="1",
            OPENCODE_DISABLE_CLAUDE_CODE="1",
            OPENCODE_DISABLE_EXTERNAL_SKILLS="1",
            OPENCODE_DISABLE_PROJECT_CONFIG="1",
            OPENCODE_FAKE_VCS="git",
        )
        config_dir = PurePosixPath(env["XDG_CONFIG_HOME"]) / "opencode"
        warm = PurePosixPath(self.warm_dir(sandbox))
        link_warm_cache = (
            f"mkdir -p {shlex.quote(str(config_dir))} && "
            f"cp {shlex.quote(str(warm / 'package.json'))} {shlex.quote(str(warm / 'package-lock.json'))} "
            f"{shlex.quote(str(config_dir))}/ && "
            f"ln -sfn {shlex.quote(str(warm / 'node_modules'))} {shlex.quote(str(config_dir / 'node_modules'))} && "
            'exec "$@"'
        )
        argv = ["bash", "-c", link_warm_cache, "opencode", self.binary(sandbox),
                "run", "--auto", "--format", "json", "--model", f"{PROVIDER_ID}/{endpoint.model}", "--", instruction]
        return Launch(argv=argv, env=env, files={str(config_dir / "opencode.json"): json.dumps(self.config(endpoint))})

    async def report(self, sandbox: Sandbox, result: ExecResult) -> ToolReport:
        """`--format json` prints one event per line; `tool_use` events carry the tool name and its status."""
        calls: Counter[str] = Counter()
        failures, texts = 0, []
        for event in json_lines(result.stdout):
            part = event.get("part") or {}
            if event.get("type") == "tool_use" or part.get("type") == "tool":
                calls[str(part.get("tool", "?"))] += 1
                if (part.get("state") or {}).get("status") == "error":
                    failures += 1
            elif event.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
        return ToolReport(dict(calls), failures, texts[-1] if texts else "")
