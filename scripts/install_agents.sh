#!/usr/bin/env bash
# Install the real agent CLIs harness-rl drives, once, at the versions the adapters pin
# (`python -m adapters.harnesses --pins`, the one source of truth): npm packages into .tools/npm,
# PyPI packages with their own virtualenv into .tools/<venv> (gitignored; $HARNESS_RL_TOOLS_DIR
# moves .tools, as it does for the local sandbox), a warmed opencode plugin cache, and bubblewrap
# from apt when missing and running as root, then Harbor and the agents the Harbor bridge drives. Packages
# that live in the project's own Python (mini-swe-agent) come with its dev extra. Idempotent: each step
# checks first.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${HARNESS_RL_TOOLS_DIR:-$ROOT/.tools}"
PREFIX="$TOOLS/npm"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python3

npm_version() {  # npm_version <package> -> installed version or nothing
    local manifest="$PREFIX/node_modules/$1/package.json"
    [[ -f "$manifest" ]] && node -p "require('$manifest').version" 2>/dev/null || true
}

venv_version() {  # venv_version <venv dir> <package> -> installed version or nothing
    [[ -x "$1/bin/python" ]] && "$1/bin/python" -m pip show "$2" 2>/dev/null | sed -n 's/^Version: //p' || true
}

if ! command -v npm >/dev/null 2>&1; then
    echo "install_agents: npm not found; install Node.js >= 20 to use the npm agent CLIs" >&2
    exit 1
fi

pins="$(cd "$ROOT" && "$PYTHON" -m adapters.harnesses --pins)"
wanted=()
opencode_version=""
while read -r harness registry package version binary venv; do
    if [[ "$registry" == npm ]]; then
        [[ "$harness" == opencode ]] && opencode_version="$version"
        [[ "$(npm_version "$package")" == "$version" ]] || wanted+=("$package@$version")
    elif [[ "$registry" == pypi && "$venv" != - ]]; then
        if [[ "$(venv_version "$TOOLS/$venv" "$package")" != "$version" ]]; then
            echo "install_agents: pip install $package==$version into $TOOLS/$venv ($harness)"
            python3 -m venv --clear "$TOOLS/$venv"
            "$TOOLS/$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$package==$version"
        fi
    fi
done <<< "$pins"

if (( ${#wanted[@]} )); then
    mkdir -p "$PREFIX"
    echo "install_agents: npm install ${wanted[*]} into $PREFIX"
    npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error "${wanted[@]}"
fi

# opencode installs its plugin package into its config dir from the registry on first run; warm one
# shared copy that every isolated run links in (adapters/harnesses/opencode.py).
WARM="$TOOLS/opencode-warm"
if [[ -n "$opencode_version" && ! -d "$WARM/node_modules/@opencode-ai/plugin" ]]; then
    mkdir -p "$WARM"
    echo "install_agents: warming opencode's plugin cache in $WARM"
    npm install --prefix "$WARM" --save-exact --no-audit --no-fund --loglevel=error "@opencode-ai/plugin@$opencode_version"
fi

if ! command -v bwrap >/dev/null 2>&1; then
    if [[ "$(id -u)" == "0" ]] && command -v apt-get >/dev/null 2>&1; then
        echo "install_agents: apt-get install bubblewrap"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null \
            || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; }
    else
        echo "install_agents: bubblewrap missing (needs root to apt-get install it); the local sandbox runs unisolated" >&2
    fi
fi

# Harbor's agents through the bridge: Harbor itself in $TOOLS/harbor-venv (Python >= 3.12) and each proven
# agent's CLI from PyPI or npm in $TOOLS/harbor-agents/<name> (adapters/harbor_bridge/catalog.py pins them).
# HARNESS_RL_HARBOR=0 skips it; a failure here leaves our own harnesses installed and says why.
if [[ "${HARNESS_RL_HARBOR:-1}" != 0 ]]; then
    (cd "$ROOT" && "$PYTHON" -m adapters.harbor_bridge.install --all --tools-dir "$TOOLS") \
        || echo "install_agents: the Harbor bridge's agents are not all installed (see above)" >&2
fi

(cd "$ROOT" && "$PYTHON" -m harness_rl.cli harnesses --tools-dir "$TOOLS") || true
echo "install_agents: bwrap $(command -v bwrap || echo missing)"
