"""mini-swe-agent (PyPI `mini-swe-agent` 2.4.x): OpenAI Chat through litellm, non-streaming.

Wiring (see the agents reference): `-c mini.yaml` first (any `-c` replaces the default config),
then dotted overrides for the proxy's `api_base`, the step limit (mini-swe-agent honours it),
`drop_params`, and a no-op cost limit; cost tracking is set to ignore errors and litellm reads its
bundled cost map instead of fetching one. The model is `openai/<leaf>` so litellm speaks OpenAI
Chat and sends the leaf name. Its global config dir lives in the sandbox's private home.

mini-swe-agent's prompt shows the machine's `uname` (system, release, version, machine: its
template variables come from `platform.uname()`, then the environment, which wins). `uname` pins
them through the environment, so the prompt is the same on every machine.

`instance_template` replaces mini-swe-agent's task prompt (its `agent.instance_template`, a Jinja
template with `{{task}}`): its default is about 1,100 tokens of workflow advice around the task, which
a CPU demo model cannot read.

A reply without a tool call is a format error: mini-swe-agent leaves that reply out of its history
and sends an error message instead, so the next call cannot continue the reply's tokens (a new
training row). It exits after `max_consecutive_format_errors` of them in a row (its own default: 3).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import PurePosixPath

from adapters.harnesses.base import Endpoint, Harness, Launch, Package, ToolReport, isolated_env
from adapters.sandboxes.base import ExecResult, Sandbox

SUBMIT_COMMAND = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
UNAME_FIELDS = frozenset({"system", "node", "release", "version", "machine"})


class MiniSweAgentHarness(Harness):
    name = "mini-swe-agent"
    dialect = "openai-chat"
    package = Package("pypi", "mini-swe-agent", "2.4.6", "mini")

    def __init__(self, step_limit: int = 30, request_timeout_s: float = 3600.0,
                 uname: dict[str, str] | None = None, max_consecutive_format_errors: int = 3,
                 instance_template: str | None = None) -> None:
        unknown = set(uname or {}) - UNAME_FIELDS
        if unknown:
            raise ValueError(f"mini-swe-agent uname: unknown fields {sorted(unknown)}; use {sorted(UNAME_FIELDS)}")
        self.step_limit = step_limit
        self.request_timeout_s = request_timeout_s
        self.uname = dict(uname or {})
        self.max_consecutive_format_errors = max_consecutive_format_errors
        if instance_template is not None and "{{task}}" not in instance_template.replace(" ", ""):
            raise ValueError("mini-swe-agent instance_template: it must place the task with {{task}}")
        self.instance_template = instance_template

    def trajectory_path(self, sandbox: Sandbox) -> str:
        return str(PurePosixPath(sandbox.logs_dir) / "agent" / "mini-swe-agent.traj.json")

    def launch(self, sandbox: Sandbox, endpoint: Endpoint, instruction: str) -> Launch:
        home = PurePosixPath(sandbox.home)
        argv = [
            sandbox.python, "-m", "minisweagent.run.mini",
            "-m", f"openai/{endpoint.model}",
            "-t", instruction,
            "-y", "--exit-immediately",
            "-o", self.trajectory_path(sandbox),
            "-c", "mini.yaml",
            "-c", f"model.model_kwargs.api_base={endpoint.openai_base_url}",
            "-c", "model.model_kwargs.drop_params=true",
            "-c", f"model.model_kwargs.timeout={self.request_timeout_s:g}",
            "-c", f"agent.step_limit={self.step_limit}",
            "-c", f"agent.max_consecutive_format_errors={self.max_consecutive_format_errors}",
            "-c", "agent.cost_limit=0",
        ]
        if self.instance_template is not None:
            argv += ["-c", f"agent.instance_template={self.instance_template}"]
        env = isolated_env(
            sandbox,
            OPENAI_API_KEY=endpoint.api_key,
            MSWEA_API_KEY=endpoint.api_key,
            MSWEA_GLOBAL_CONFIG_DIR=str(home / "mini-swe-agent"),
            MSWEA_CONFIGURED="true",
            MSWEA_COST_TRACKING="ignore_errors",
            LITELLM_LOCAL_MODEL_COST_MAP="True",
            LITELLM_TELEMETRY="False",
            PYTHONUNBUFFERED="1",
            **self.uname,
        )
        return Launch(argv=argv, env=env)

    async def report(self, sandbox: Sandbox, result: ExecResult) -> ToolReport:
        """From the trajectory file: assistant tool calls by name; failures are tool results with a
        non-zero return code, except the submit command's (mini-swe-agent never executes it)."""
        text = await sandbox.read_text(self.trajectory_path(sandbox))
        try:
            messages = json.loads(text or "{}").get("messages", [])
        except (json.JSONDecodeError, AttributeError):
            return ToolReport()
        calls: Counter[str] = Counter()
        submits: set[str] = set()
        failures, completion = 0, ""
        for message in (m for m in messages if isinstance(m, dict)):
            extra = message.get("extra") or {}
            for call in message.get("tool_calls") or []:
                calls[str((call.get("function") or {}).get("name", "?"))] += 1
                if SUBMIT_COMMAND in str((call.get("function") or {}).get("arguments", "")):
                    submits.add(str(call.get("id")))
            if message.get("role") == "tool" and message.get("tool_call_id") not in submits:
                failures += extra.get("returncode", 0) not in (0, None)
            if message.get("role") == "exit":
                completion = str(extra.get("submission") or extra.get("exit_status") or "")
        return ToolReport(dict(calls), failures, completion)
