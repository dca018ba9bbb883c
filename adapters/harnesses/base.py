"""What every harness adapter shares: the endpoint it is pointed at, what it launches, what it reports.

An adapter knows one agent CLI: how to install it into a sandbox, which command, environment and
config files point it at a proxy session (isolated HOME and XDG dirs, no telemetry, no
auto-update, permissions for unattended work), and how to read tool calls out of what it printed.
It gets the session's URLs and key as plain strings and never talks to the proxy itself.
"""

from __future__ import annotations

import json
import shlex
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from adapters.sandboxes.base import ExecResult, Sandbox, SandboxError
from harness_rl.trace import TrainingTrace

POLICY_MODEL = "policy"
NPM_INSTALL = "npm install --no-audit --no-fund --loglevel=error"


def npm_prefix(sandbox: Sandbox) -> str:
    """Where the npm-installed agent CLIs live in a sandbox's tools dir."""
    return str(PurePosixPath(sandbox.tools_dir) / "npm")


def npm_binary(sandbox: Sandbox, name: str) -> str:
    return str(PurePosixPath(npm_prefix(sandbox)) / "node_modules" / ".bin" / name)


async def install_locked(sandbox: Sandbox, label: str, steps: str) -> None:
    """Run shell install `steps` holding the tools dir's lock, so concurrent rollouts install once."""
    prefix = shlex.quote(npm_prefix(sandbox))
    result = await sandbox.exec(f"mkdir -p {prefix} && exec 9>{prefix}/.install.lock && flock 9 && {steps}",
                                timeout=900)
    if not result.ok:
        raise SandboxError(f"could not install {label}: {(result.stderr or result.stdout).strip()[-500:]}")


@dataclass(frozen=True)
class Endpoint:
    """Where one rollout's agent sends its model calls: a proxy session's URLs and key."""

    openai_base_url: str
    anthropic_base_url: str
    api_key: str
    model: str = POLICY_MODEL


@dataclass(frozen=True)
class Launch:
    """One agent run, fully spelled out: files to write first, then argv with env in the workdir."""

    argv: list[str]
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class AgentRun:
    """How the agent run ended and what it did, as far as its own output tells."""

    exit_code: int | None
    timed_out: bool
    stdout: str
    stderr: str
    duration_s: float
    tool_calls_by_name: dict[str, int] = field(default_factory=dict)
    tool_failure_count: int = 0
    completion: str = ""

    @property
    def tool_call_count(self) -> int:
        return sum(self.tool_calls_by_name.values())


@dataclass(frozen=True)
class ToolReport:
    """Tool calls by name, failures, and the agent's final text, read from its own output."""

    calls_by_name: dict[str, int] = field(default_factory=dict)
    failures: int = 0
    completion: str = ""


class Harness(ABC):
    """One agent CLI. Subclasses fill in `install` and `launch`, and `report` when the CLI says what it did."""

    name: str = "abstract"

    @abstractmethod
    async def install(self, sandbox: Sandbox) -> None:
        """Make the CLI runnable inside the sandbox; a no-op when it already is."""

    @abstractmethod
    def launch(self, sandbox: Sandbox, endpoint: Endpoint, instruction: str) -> Launch:
        """The files, command and environment that run the agent on `instruction` against `endpoint`."""

    async def report(self, sandbox: Sandbox, result: ExecResult) -> ToolReport:
        """Tool calls and final text from the agent's output or logs; empty when the CLI does not say."""
        return ToolReport()

    async def run(self, sandbox: Sandbox, endpoint: Endpoint, instruction: str, timeout: float | None) -> AgentRun:
        """Install when needed, write the config files, run the agent with a time limit, and report."""
        await self.install(sandbox)
        launch = self.launch(sandbox, endpoint, instruction)
        for path, content in launch.files.items():
            await sandbox.write_text(path, content)
        result = await sandbox.exec(launch.argv, env=launch.env, timeout=timeout, cwd=sandbox.workdir)
        report = await self.report(sandbox, result)
        return AgentRun(
            exit_code=result.exit_code,
            timed_out=result.timed_out,
            stdout=result.stdout,
            stderr=result.stderr,
            duration_s=result.duration_s,
            tool_calls_by_name=report.calls_by_name,
            tool_failure_count=report.failures,
            completion=report.completion,
        )


def isolated_env(sandbox: Sandbox, **extra: str) -> dict[str, str]:
    """HOME and XDG dirs inside the sandbox's private home, so no host config leaks in or out."""
    home = PurePosixPath(sandbox.home)
    return {
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "NO_COLOR": "1",
        "TERM": "dumb",
        "CI": "1",
        **extra,
    }


def json_lines(text: str) -> Iterable[dict[str, Any]]:
    """The JSON objects among a CLI's output lines; anything else is skipped."""
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            yield value


def tool_calls_in_trace(trace: TrainingTrace) -> dict[str, int]:
    """Tool calls by name the model made in a trace's agent turns (what the proxy recorded it answering)."""
    return dict(Counter(call.name for turn in trace.turns if turn.role == "agent" and turn.reply is not None
                        for call in turn.reply.tool_calls))
