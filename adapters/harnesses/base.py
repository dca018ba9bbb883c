"""What every harness adapter shares: the endpoint it is pointed at, what it launches, what it reports.

An adapter knows one agent CLI: how to install it into a sandbox, which command, environment and
config files point it at a proxy session (isolated HOME and XDG dirs, no telemetry, no
auto-update, permissions for unattended work), and how to read tool calls out of what it printed.
It gets the session's URLs and key as plain strings and never talks to the proxy itself.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shlex
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar, Literal

from adapters.sandboxes.base import ExecResult, Sandbox, SandboxError

POLICY_MODEL = "policy"
NPM_INSTALL = "npm install --no-audit --no-fund --loglevel=error"
PIP_INSTALL = "pip install --quiet --disable-pip-version-check"

Dialect = Literal["openai-chat", "openai-responses", "anthropic-messages", "google-gemini"]


@dataclass(frozen=True)
class Package:
    """One pinned release of a harness's CLI on a registry: what installs it, where, and which binary runs it.

    npm packages go to the tools dir's shared npm prefix; a PyPI package with `venv` gets its own
    virtualenv `<tools>/<venv>` (aider pins a hundred dependencies); one without lives in the
    sandbox's own Python (mini-swe-agent, a dev dependency of this project).
    """

    registry: Literal["npm", "pypi"]
    name: str
    version: str
    binary: str
    venv: str | None = None

    @property
    def spec(self) -> str:
        return f"{self.name}@{self.version}" if self.registry == "npm" else f"{self.name}=={self.version}"

    def install_command(self, tools_dir: Path) -> str:
        """The one shell command that installs this release into a tools dir on this machine."""
        if self.registry == "npm":
            return f"{NPM_INSTALL} --prefix {shlex.quote(str(tools_dir / 'npm'))} {shlex.quote(self.spec)}"
        if self.venv is None:
            return f"{shlex.quote(sys.executable)} -m {PIP_INSTALL} {shlex.quote(self.spec)}"
        venv = tools_dir / self.venv
        return (f"python3 -m venv {shlex.quote(str(venv))} && {shlex.quote(str(venv / 'bin' / 'python'))} -m "
                f"{PIP_INSTALL} {shlex.quote(self.spec)}")

    def missing(self, tools_dir: Path) -> str | None:
        """Why this release cannot run from a tools dir on this machine (with the command that fixes it), or None."""
        found = self.installed_version(tools_dir)
        if found == self.version:
            return None
        state = "is not installed" if found is None else f"is at {found}, not {self.version},"
        return (f"{self.registry} {self.spec} {state} in {tools_dir}: run scripts/install_agents.sh, or "
                f"{self.install_command(tools_dir)}")

    def installed_version(self, tools_dir: Path) -> str | None:
        """The version present in a tools dir on this machine (or this Python), None when absent."""
        if self.registry == "npm":
            manifest = tools_dir / "npm" / "node_modules" / self.name / "package.json"
            try:
                return str(json.loads(manifest.read_text())["version"])
            except (OSError, ValueError, KeyError):
                return None
        if self.venv is None:
            try:
                return importlib.metadata.version(self.name)
            except importlib.metadata.PackageNotFoundError:
                return None
        wheel_name = re.sub(r"[-_.]+", "_", self.name).lower()
        for info in (tools_dir / self.venv).glob(f"lib/python*/site-packages/{wheel_name}-*.dist-info"):
            return info.name.removesuffix(".dist-info").rpartition("-")[2]
        return None


def npm_prefix(sandbox: Sandbox) -> str:
    """Where the npm-installed agent CLIs live in a sandbox's tools dir."""
    return str(PurePosixPath(sandbox.tools_dir) / "npm")


def npm_binary(sandbox: Sandbox, name: str) -> str:
    return str(PurePosixPath(npm_prefix(sandbox)) / "node_modules" / ".bin" / name)


def package_binary(sandbox: Sandbox, package: Package) -> str:
    """The path of a package's CLI inside a sandbox."""
    if package.registry == "npm":
        return npm_binary(sandbox, package.binary)
    if package.venv is not None:
        return str(PurePosixPath(sandbox.tools_dir) / package.venv / "bin" / package.binary)
    return str(PurePosixPath(sandbox.python).parent / package.binary)


async def install_locked(sandbox: Sandbox, label: str, steps: str) -> None:
    """Run shell install `steps` holding the tools dir's lock, so concurrent rollouts install once."""
    prefix = shlex.quote(npm_prefix(sandbox))
    result = await sandbox.exec(f"mkdir -p {prefix} && exec 9>{prefix}/.install.lock && flock 9 && {steps}",
                                timeout=900)
    if not result.ok:
        raise SandboxError(f"could not install {label}: {(result.stderr or result.stdout).strip()[-500:]}")


async def install_package(sandbox: Sandbox, package: Package) -> None:
    """Install `package` into the sandbox's tools dir unless that exact version is already there."""
    quote = shlex.quote
    if package.registry == "npm":
        manifest = PurePosixPath(npm_prefix(sandbox)) / "node_modules" / package.name / "package.json"
        probe = f"node -p {quote(f'require({json.dumps(str(manifest))}).version')}"
        steps = f"{NPM_INSTALL} --prefix {quote(npm_prefix(sandbox))} {quote(package.spec)}"
    elif package.venv is not None:
        venv = PurePosixPath(sandbox.tools_dir) / package.venv
        probe = f"{quote(str(venv / 'bin' / 'python'))} -m pip show {quote(package.name)} | sed -n 's/^Version: //p'"
        steps = (f"{quote(sandbox.python)} -m venv --clear {quote(str(venv))} && "
                 f"{quote(str(venv / 'bin' / 'python'))} -m {PIP_INSTALL} {quote(package.spec)}")
    else:
        probe = f"{quote(sandbox.python)} -m pip show {quote(package.name)} | sed -n 's/^Version: //p'"
        steps = f"{quote(sandbox.python)} -m {PIP_INSTALL} {quote(package.spec)}"
    current = f'"$({probe} 2>/dev/null)"'
    await install_locked(sandbox, package.spec, f"[ {current} = {quote(package.version)} ] || {{ {steps}; }}")


@dataclass(frozen=True)
class Endpoint:
    """Where one rollout's agent sends its model calls: a proxy session's URLs and key. (Sampling seeds are
    the proxy's: it seeds every call of a seeded session, whatever the agent sends or not.)"""

    openai_base_url: str
    anthropic_base_url: str
    api_key: str
    model: str = POLICY_MODEL
    gemini_base_url: str = ""  # Google's SDKs append `/v1beta/models/...`; the session's root when not given

    def __post_init__(self) -> None:
        if not self.gemini_base_url:
            object.__setattr__(self, "gemini_base_url", self.anthropic_base_url)


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
    """One agent CLI, under Harbor's name for it. Subclasses declare the dialect it speaks and its pinned
    package (the one place those facts live), fill in `launch`, and `report` when the CLI says what it did."""

    name: ClassVar[str] = "abstract"
    dialect: ClassVar[Dialect] = "openai-chat"
    package: ClassVar[Package | None] = None

    async def install(self, sandbox: Sandbox) -> None:
        """Make the CLI runnable inside the sandbox; a no-op when its pinned version already is. A sandbox that
        shares this machine's tools dir never installs: the CLI must be there already (a setup error)."""
        if self.package is None:
            return
        if sandbox.shares_host_tools:
            missing = self.package.missing(Path(sandbox.tools_dir))
            if missing is not None:
                raise SandboxError(f"{self.name}: {missing}")
            return
        await install_package(sandbox, self.package)

    def binary(self, sandbox: Sandbox) -> str:
        if self.package is None:
            raise SandboxError(f"{self.name} has no package to run")
        return package_binary(sandbox, self.package)

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
