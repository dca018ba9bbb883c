"""Package borders from DESIGN.md §2: the proxy, the adapters and the trace contract start without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers")


@pytest.mark.parametrize("statement", [
    "import harness_rl.trace",
    "import harness_rl.outcome",
    "import proxy",
    "import adapters",
    "import harness_rl.vllm_server",
    "from harness_rl.cli import build_parser; build_parser()",
])
def test_light_imports_leave_torch_out(statement: str) -> None:
    code = f"{statement}; import sys; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""


def test_every_proxy_and_adapter_module_imports_without_torch() -> None:
    code = (
        "import importlib, pkgutil, sys, proxy, adapters\n"
        "for pkg in (proxy, adapters):\n"
        "    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(info.name)\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
