"""pi (npm `@earendil-works/pi-coding-agent` 0.74.2, the last release for Node 20): OpenAI Chat, streaming.

Wiring (measured against a scripted server; see tests/fixtures/agents/pi/): `PI_CODING_AGENT_DIR`
in the sandbox's private home holds `models.json` with one provider (`api: openai-completions`,
`baseUrl` = the session's OpenAI base URL, `apiKey` naming the variable that carries the session
key, sent as `Authorization: Bearer`) and the policy model with its context and output limits.
`--print --mode json --no-session --offline` runs once, unattended, without start-up network
calls, and prints one JSON event per line. pi's four tools (read, bash, edit, write) need no
approval. pi reads a leading `@` in a message as a file to attach, so the instruction is sent
with a space in front when it starts with one.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import PurePosixPath

from adapters.harnesses.base import Endpoint, Harness, Launch, Package, ToolReport, isolated_env, json_lines
from adapters.sandboxes.base import ExecResult, Sandbox

PROVIDER_ID = "harness-rl"
KEY_VARIABLE = "HARNESS_RL_API_KEY"


class PiHarness(Harness):
    name = "pi"
    dialect = "openai-chat"
    package = Package("npm", "@earendil-works/pi-coding-agent", "0.74.2", "pi")

    def __init__(self, context_tokens: int = 65536, output_tokens: int = 8192) -> None:
        self.context_tokens = context_tokens
        self.output_tokens = output_tokens

    def models(self, endpoint: Endpoint) -> dict:
        return {"providers": {PROVIDER_ID: {
            "baseUrl": endpoint.openai_base_url,
            "api": "openai-completions",
            "apiKey": KEY_VARIABLE,
            "models": [{"id": endpoint.model, "contextWindow": self.context_tokens, "maxTokens": self.output_tokens}],
        }}}

    def launch(self, sandbox: Sandbox, endpoint: Endpoint, instruction: str) -> Launch:
        agent_dir = PurePosixPath(sandbox.home) / ".pi" / "agent"
        env = isolated_env(sandbox, PI_CODING_AGENT_DIR=str(agent_dir), PI_OFFLINE="1",
                           **{KEY_VARIABLE: endpoint.api_key})
        message = f" {instruction}" if instruction.startswith(("@", "-")) else instruction
        argv = [self.binary(sandbox), "--print", "--mode", "json", "--no-session", "--offline",
                "--provider", PROVIDER_ID, "--model", endpoint.model, message]
        return Launch(argv=argv, env=env, files={str(agent_dir / "models.json"): json.dumps(self.models(endpoint))})

    async def report(self, sandbox: Sandbox, result: ExecResult) -> ToolReport:
        """`--mode json`: `tool_execution_end` events name each tool and flag errors; `agent_end` holds
        the conversation, whose last assistant text is the final answer."""
        calls: Counter[str] = Counter()
        failures, completion = 0, ""
        for event in json_lines(result.stdout):
            if event.get("type") == "tool_execution_end":
                calls[str(event.get("toolName", "?"))] += 1
                failures += bool(event.get("isError"))
            elif event.get("type") == "agent_end":
                for message in event.get("messages") or []:
                    if isinstance(message, dict) and message.get("role") == "assistant":
                        texts = [part.get("text", "") for part in message.get("content") or []
                                 if isinstance(part, dict) and part.get("type") == "text"]
                        completion = "".join(texts) or completion
        return ToolReport(dict(calls), failures, completion)
