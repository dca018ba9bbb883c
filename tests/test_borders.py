"""Package borders from DESIGN.md §2, checked on every import (inside functions too) and at run time.

The part map says which parts each part may import; the never-rules are its hard edges (the learner
never imports the proxy, the adapters or the run level; the engine never imports the proxy; rollouts
never import the learner; the proxy and the adapters never import torch). Inside the proxy, each
sub-package imports only its base and the sub-packages below it. No import cycle among our modules,
counting imports inside functions.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("harness_rl", "proxy", "adapters")
HEAVY = ("torch", "transformers")

# Module prefix -> part (the longest matching prefix wins).
PARTS = {
    "harness_rl": "package",
    "harness_rl.settings": "settings",
    "harness_rl.flags": "flags",
    "harness_rl.background": "background",
    "harness_rl.wire": "wire",
    "harness_rl.cpu_threads": "cpu_threads",
    "harness_rl.trace": "trace",
    "harness_rl.outcome": "trace",
    "proxy": "proxy",
    "proxy.dialects": "proxy.dialects",
    "proxy.upstream": "proxy.upstream",
    "proxy.capture": "proxy.capture",
    "proxy.server": "proxy.server",
    "adapters": "adapters",
    "harness_rl.engine": "engine",
    "harness_rl.learner": "learner",
    "harness_rl.tools": "tools",
    "harness_rl.run": "run",
    "harness_rl.demo": "demo",
    "harness_rl.integrations": "faces",
    "harness_rl.commands": "faces",
    "harness_rl.viewer": "faces",
    "harness_rl.cli": "faces",
    "harness_rl.__main__": "faces",
}
LEAVES = {"package", "settings", "flags", "background", "trace", "wire", "cpu_threads"}
# The proxy's base (errors, chat, live, tokens, sampling, config, control API and client) and its sub-packages,
# each above those it may import: dialects and the engine side know nothing of each other or of capture;
# capture asks the engine side for renders; the server sits on everything.
PROXY = {"proxy", "proxy.dialects", "proxy.upstream", "proxy.capture", "proxy.server"}
# Which parts each part may import (itself always).
MAY_IMPORT = {
    "package": set(),
    "settings": set(),
    "flags": set(),
    "background": set(),
    "trace": set(),
    "wire": set(),
    "cpu_threads": set(),
    "proxy": {"trace", "settings", "wire"},
    "proxy.dialects": {"trace", "settings", "wire", "proxy"},
    "proxy.upstream": {"trace", "settings", "wire", "proxy"},
    "proxy.capture": {"trace", "settings", "wire", "proxy", "proxy.upstream"},
    "proxy.server": {"trace", "settings", "wire", "proxy", "proxy.dialects", "proxy.upstream", "proxy.capture"},
    "adapters": {"trace", "settings"},
    "engine": {"package", "trace", "background", "wire", "cpu_threads"},
    "learner": LEAVES | {"engine"},
    "tools": LEAVES | PROXY | {"adapters", "engine", "learner"},
    "run": LEAVES | PROXY | {"adapters", "engine", "learner", "tools"},
    "demo": LEAVES | PROXY | {"adapters", "engine", "learner", "tools", "run"},
    "faces": LEAVES | PROXY | {"adapters", "engine", "learner", "tools", "run", "demo"},
}
# Hard edges, stated once more so a change to the table above cannot quietly open them.
NEVER = {
    "harness_rl.learner": ("proxy", "adapters", "harness_rl.run", "harness_rl.demo"),
    "harness_rl.engine": ("proxy", "adapters", "harness_rl.learner", "harness_rl.run", "harness_rl.demo"),
    "harness_rl.run": ("harness_rl.demo",),
    "harness_rl.run.rollouts": ("harness_rl.learner",),
    "proxy": ("torch", "transformers", "adapters", "harness_rl.engine"),
    "adapters": ("torch", "transformers", "proxy"),
}


def _part(module: str) -> str | None:
    best = max((prefix for prefix in PARTS if module == prefix or module.startswith(prefix + ".")), key=len,
               default=None)
    return PARTS[best] if best is not None else None


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str, modules: set[str]) -> list[tuple[str, int]]:
    """Every module a file imports, at module level or inside functions, with its line (TYPE_CHECKING blocks
    excluded: they never run). `from a import b` names `a.b` when that is one of our modules."""
    tree = ast.parse(path.read_text())
    skip = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
            and ast.unparse(block.test).endswith("TYPE_CHECKING") for node in ast.walk(block)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append((base, node.lineno))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names
                      if f"{base}.{alias.name}" in modules]
    return found


def find_crossings(root: Path) -> tuple[list[str], dict[str, set[str]]]:
    """Every import in the tree at `root` that crosses a border, and our module graph (for cycles)."""
    files = {_module_name(root, p): p for pkg in PACKAGES if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py")}
    modules = set(files)
    crossings: list[str] = []
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        graph[module] = set()
        source_part = _part(module)
        for target, line in _imports(path, module, modules):
            where = f"{path.relative_to(root)}:{line} imports {target}"
            for prefix, banned in NEVER.items():
                if _under(module, prefix) and any(_under(target, b) for b in banned):
                    crossings.append(f"{where} (never: {prefix} -> {', '.join(banned)})")
            if target.split(".")[0] not in PACKAGES:
                continue
            target_part = _part(target)
            if target in modules:
                graph[module].add(target)
            if source_part is None or target_part is None or target_part == source_part:
                continue
            if target_part not in MAY_IMPORT[source_part]:
                crossings.append(f"{where} ({source_part} may not import {target_part})")
    return sorted(set(crossings)), graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep):], dep]
            if dep not in state:
                found = visit(dep, [*path, dep])
                if found:
                    return found
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name, [name])
            if found:
                return found
    return None


def test_no_import_crosses_a_border() -> None:
    crossings, _ = find_crossings(ROOT)
    assert crossings == []


def test_no_import_cycle_among_our_modules_counting_imports_inside_functions() -> None:
    _, graph = find_crossings(ROOT)
    assert find_cycle(graph) is None


def test_a_function_level_import_that_crosses_a_border_is_found(tmp_path: Path) -> None:
    learner = tmp_path / "harness_rl" / "learner"
    learner.mkdir(parents=True)
    (tmp_path / "harness_rl" / "__init__.py").write_text("")
    (learner / "__init__.py").write_text("")
    (learner / "step.py").write_text("def push():\n    from proxy.client import ProxyClient\n    return ProxyClient\n")
    (learner / "gate.py").write_text("def gate():\n    from harness_rl.run import stack\n    return stack\n")
    (tmp_path / "proxy").mkdir()
    (tmp_path / "proxy" / "__init__.py").write_text("")
    (tmp_path / "proxy" / "client.py").write_text("def load():\n    import torch\n    return torch\n")
    crossings, _ = find_crossings(tmp_path)
    assert crossings == [
        "harness_rl/learner/gate.py:2 imports harness_rl.run (learner may not import run)",
        "harness_rl/learner/gate.py:2 imports harness_rl.run (never: harness_rl.learner -> proxy, adapters, "
        "harness_rl.run, harness_rl.demo)",
        "harness_rl/learner/step.py:2 imports proxy.client (learner may not import proxy)",
        "harness_rl/learner/step.py:2 imports proxy.client (never: harness_rl.learner -> proxy, adapters, "
        "harness_rl.run, harness_rl.demo)",
        "proxy/client.py:2 imports torch (never: proxy -> torch, transformers, adapters, harness_rl.engine)",
    ]


def test_an_import_up_the_proxy_sub_packages_is_found(tmp_path: Path) -> None:
    files = {
        "proxy/__init__.py": "",
        "proxy/chat.py": "def late():\n    from proxy.dialects import gemini\n    return gemini\n",
        "proxy/dialects/__init__.py": "",
        "proxy/dialects/gemini.py": "from proxy.upstream.client import EngineClient\n",
        "proxy/upstream/__init__.py": "",
        "proxy/upstream/client.py": "from proxy.capture.session import Session\n",
        "proxy/capture/__init__.py": "",
        "proxy/capture/session.py": "from proxy.upstream.client import EngineClient\nfrom proxy.server import app\n",
        "proxy/server/__init__.py": "",
        "proxy/server/app.py": "from proxy.capture.session import Session\nfrom proxy.dialects import gemini\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    crossings, _ = find_crossings(tmp_path)
    assert crossings == [
        "proxy/capture/session.py:2 imports proxy.server (proxy.capture may not import proxy.server)",
        "proxy/capture/session.py:2 imports proxy.server.app (proxy.capture may not import proxy.server)",
        "proxy/chat.py:2 imports proxy.dialects (proxy may not import proxy.dialects)",
        "proxy/chat.py:2 imports proxy.dialects.gemini (proxy may not import proxy.dialects)",
        "proxy/dialects/gemini.py:1 imports proxy.upstream.client (proxy.dialects may not import proxy.upstream)",
        "proxy/upstream/client.py:1 imports proxy.capture.session (proxy.upstream may not import proxy.capture)",
    ]


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "harness_rl" / "run"
    pkg.mkdir(parents=True)
    (tmp_path / "harness_rl" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from harness_rl.run import b\n")
    (pkg / "b.py").write_text("def late():\n    from harness_rl.run.a import thing\n    return thing\n")
    _, graph = find_crossings(tmp_path)
    assert find_cycle(graph) == ["harness_rl.run.a", "harness_rl.run.b", "harness_rl.run.a"]


def test_every_module_belongs_to_a_part() -> None:
    _, graph = find_crossings(ROOT)
    assert [m for m in graph if _part(m) is None] == []


@pytest.mark.parametrize("statement", [
    "import harness_rl.trace",
    "import harness_rl.outcome",
    "import harness_rl.wire, harness_rl.cpu_threads",
    "import proxy",
    "import adapters",
    "import harness_rl.tools.vllm_server",
    "import harness_rl.tools.doctor",
    "from harness_rl.cli import build_parser; build_parser()",
    "import harness_rl.viewer.load, harness_rl.viewer.page, harness_rl.viewer.tokens",
    "import harness_rl.run.config, harness_rl.run.preflight",
    "import harness_rl.learner.config",
    "import harness_rl.commands.train",
])
def test_light_imports_leave_torch_out(statement: str) -> None:
    code = f"{statement}; import sys; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""


def test_every_proxy_and_adapter_module_imports_without_torch() -> None:
    """The Harbor bridge's runner side imports Harbor (Python >= 3.12): it is imported in Harbor's venv instead."""
    from adapters.harbor_bridge import RUNNER_MODULES
    from adapters.harbor_bridge.install import harbor_python
    from adapters.sandboxes.local import default_tools_dir

    code = (
        "import importlib, pkgutil, sys, proxy, adapters\n"
        "for pkg in (proxy, adapters):\n"
        "    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        f"        if info.name not in {RUNNER_MODULES!r}:\n"
        "            importlib.import_module(info.name)\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
    harbor = harbor_python(default_tools_dir())
    if harbor.exists():
        runner = f"import {', '.join(RUNNER_MODULES)}, sys; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
        done = subprocess.run([str(harbor), "-c", runner], capture_output=True, text=True, cwd=ROOT,
                              env={"PYTHONPATH": str(ROOT), "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == ""


def test_no_proxy_module_is_over_400_lines() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (ROOT / "proxy").rglob("*.py")}
    assert max(sizes.values()) <= 400, sizes


def test_no_module_outside_tests_is_over_500_lines() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for folder in (*PACKAGES, "benchmarks", "examples", "scripts") for p in (ROOT / folder).rglob("*.py")}
    assert {path: n for path, n in sizes.items() if n > 500} == {}
