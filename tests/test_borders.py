"""Package borders from DESIGN.md §2: the proxy, the adapters, the trace contract and the viewer start without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers")


@pytest.mark.parametrize("statement", [
    "import harness_rl.trace",
    "import harness_rl.outcome",
    "import proxy",
    "import adapters",
    "import harness_rl.vllm_server",
    "from harness_rl.cli import build_parser; build_parser()",
    "import harness_rl.viewer.load, harness_rl.viewer.page, harness_rl.viewer.tokens",
    "import harness_rl.doctor",
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


@pytest.mark.parametrize("statement", ["import harness_rl.config", "import harness_rl.commands.train"])
def test_the_run_configuration_is_checked_without_torch(statement: str) -> None:
    test_light_imports_leave_torch_out(statement)


ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("harness_rl", "proxy", "adapters")


def _imports_of(path: Path) -> set[str]:
    """Our own modules a file imports at module level or inside functions (TYPE_CHECKING blocks excluded)."""
    tree = ast.parse(path.read_text())
    skip = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
            and ast.unparse(block.test).endswith("TYPE_CHECKING") for node in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, ast.ImportFrom | ast.Import):
            continue
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
        found |= {name for name in names if name.split(".")[0] in PACKAGES}
    return found


def _module_level_imports(path: Path) -> set[str]:
    """Our modules a file imports at module level, type-only imports included (a type cycle is a cycle too)."""
    tree = ast.parse(path.read_text())
    found = set()
    body = [*tree.body, *(node for block in tree.body if isinstance(block, ast.If)
                          and ast.unparse(block.test).endswith("TYPE_CHECKING") for node in block.body)]
    for node in body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
            found.add(node.module or "")
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycle_among_our_modules() -> None:
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {name: {dep for dep in _module_level_imports(path) if dep in files} for name, path in files.items()}
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in graph[name]:
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(dep):], dep]))
            if dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_the_proxy_imports_only_the_trace_contract_of_harness_rl() -> None:
    for path in (ROOT / "proxy").rglob("*.py"):
        ours = {name for name in _imports_of(path) if name.startswith("harness_rl")}
        assert ours <= {"harness_rl.trace"}, (path.name, ours)


def test_no_proxy_module_is_over_400_lines() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "proxy").glob("*.py")}
    assert max(sizes.values()) <= 400, sizes
