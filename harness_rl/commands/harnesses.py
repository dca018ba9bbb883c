"""`harness-rl harnesses`: every agent CLI harness-rl can train, with its dialect, pinned package and
whether that exact version is installed in the local tools dir (what scripts/install_agents.sh fills)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("harnesses", help="list the agent harnesses: dialect, pinned version, installed")
    parser.add_argument("--tools-dir", type=Path, default=None,
                        help="where the agent CLIs live (default: $HARNESS_RL_TOOLS_DIR, else the checkout's .tools)")
    parser.set_defaults(run=run)


def rows(tools_dir: Path) -> list[tuple[str, str, str, str, str]]:
    """(name, dialect, package, pinned version, installed) per harness, in registry order."""
    from adapters.harnesses import HARNESSES

    table: list[tuple[str, str, str, str, str]] = []
    for name, harness in HARNESSES.items():
        package = harness.package
        if package is None:
            table.append((name, harness.dialect, "(built in)", "-", "yes"))
            continue
        found = package.installed_version(tools_dir)
        installed = "yes" if found == package.version else f"no ({found} found)" if found else "no"
        source = f"{package.registry}:{package.name}"
        table.append((name, harness.dialect, source, package.version, installed))
    return table


def run(args: argparse.Namespace) -> int:
    from adapters.sandboxes.local import default_tools_dir

    tools_dir = (args.tools_dir or default_tools_dir()).resolve()
    table = [("HARNESS", "DIALECT", "PACKAGE", "PINNED", "INSTALLED"), *rows(tools_dir)]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    print(f"tools dir: {tools_dir}  (install with scripts/install_agents.sh)")
    return 0
