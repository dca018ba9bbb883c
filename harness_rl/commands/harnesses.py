"""`harness-rl harnesses`: every agent harness-rl can train, ours and all of Harbor's: the dialect it speaks,
where it installs from, whether that is installed in the local tools dir (what scripts/install_agents.sh
fills), and its state here (proven by which test, or why it cannot run here)."""

from __future__ import annotations

import argparse
from pathlib import Path

STATES = {"proven": "proven", "registry": "runs, not proven", "native": "ours", "network": "needs network",
          "no-endpoint": "no custom endpoint", "host": "not here"}


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("harnesses", help="list every agent harness, ours and Harbor's: dialect, install, "
                                                   "state here")
    parser.add_argument("--tools-dir", type=Path, default=None,
                        help="where the agent CLIs live (default: $HARNESS_RL_TOOLS_DIR, else the checkout's .tools)")
    parser.set_defaults(run=run)


Row = tuple[str, str, str, str, str, str]


def native_rows(tools_dir: Path) -> list[Row]:
    """(name, dialect, installs from, version, installed, state) for each of our own adapters."""
    from adapters.harnesses import HARNESSES, NATIVE_NAMES

    table: list[Row] = []
    for name in NATIVE_NAMES:
        harness, state = HARNESSES[name], "ours: proven, tests/test_agents_cli.py" if name != "echo" else "ours"
        package = harness.package
        if package is None:
            table.append((name, harness.dialect, "(built in)", "-", "yes", state))
            continue
        found = package.installed_version(tools_dir)
        installed = "yes" if found == package.version else f"no ({found} found)" if found else "no"
        table.append((name, harness.dialect, f"{package.registry}:{package.name}", package.version, installed, state))
    return table


def harbor_rows(tools_dir: Path) -> list[Row]:
    """The same for every agent Harbor names, as the bridge drives it (`harbor:<name>`)."""
    from adapters.harbor_bridge.catalog import CATALOG, HARBOR_VENV, HARBOR_VERSION, STAMP

    harbor_ready = (tools_dir / HARBOR_VENV / STAMP).is_file()
    table: list[Row] = []
    for agent in sorted(CATALOG.values(), key=lambda a: (list(STATES).index(a.state), a.name)):
        state = f"{STATES[agent.state]}: {agent.note}"
        if not agent.runnable:
            table.append((f"harbor:{agent.name}", agent.dialect or "-", "-", "-", "-", state))
            continue
        if agent.install is None:
            source, version, installed = f"pypi:harbor ({HARBOR_VERSION})", HARBOR_VERSION, harbor_ready
        else:
            names = ",".join(spec.split("==")[0].rsplit("@", 1)[0] for spec in agent.install.packages)
            source, version = f"{agent.install.registry}:{names}", agent.version or "-"
            installed = harbor_ready and agent.install.installed(tools_dir, agent.name)
        table.append((f"harbor:{agent.name}", agent.dialect or "-", source, version, "yes" if installed else "no",
                      state))
    return table


def run(args: argparse.Namespace) -> int:
    from adapters.sandboxes.local import default_tools_dir

    tools_dir = (args.tools_dir or default_tools_dir()).resolve()
    table = [("HARNESS", "DIALECT", "INSTALLS FROM", "VERSION", "INSTALLED", "STATE HERE"),
             *native_rows(tools_dir), *harbor_rows(tools_dir)]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        print("  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), row[-1]]).rstrip())
    proven = sum(1 for row in table[1:] if row[-1].startswith(("ours: proven", "proven")))
    print(f"{proven} real agents proven here; tools dir: {tools_dir}  (install with scripts/install_agents.sh)")
    return 0
