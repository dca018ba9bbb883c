"""The processes a benchmark compares, started and measured alike: the fake engine, OpenEnv's capture proxy and
ours, each in its own process under the same small wrapper that times every garbage collection; their CPU time
and memory (the machine's load average beside every figure: `conventions.load_average`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
STARTED: list[subprocess.Popen] = []  # every process started here, ended by `stopping_all` however a run ends

# Runs a module as __main__ and appends every gen-2 collection and every pause over 1 ms to $GC_STATS
# as "generation wall-seconds cpu-seconds wall-time" lines, as they happen (so a killed process still
# reports). CPU seconds tell the collector's own work apart from time the process was descheduled.
GC_WRAPPER = """
import gc, os, runpy, sys, time
out = open(os.environ["GC_STATS"], "a", buffering=1)
started = [0.0, 0.0]
def timed(phase, info):
    if phase == "start":
        started[:] = time.perf_counter(), time.process_time()
        return
    wall, cpu = time.perf_counter() - started[0], time.process_time() - started[1]
    if info["generation"] == 2 or wall > 0.001:
        out.write(f"{info['generation']} {wall} {cpu} {time.time()}\\n")
gc.callbacks.append(timed)
module = sys.argv[1]
sys.argv = [module] + sys.argv[2:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_s(pid: int) -> float:
    """User+system CPU seconds the process has used (robust to other load on the machine)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


@dataclass
class Target:
    """One way for an agent to reach the engine."""

    name: str
    process: subprocess.Popen | None
    base: str
    kind: str  # direct | openenv | ours
    admin: dict[str, str] = field(default_factory=dict)
    gc_stats: Path | None = None

    async def session(self, http: aiohttp.ClientSession) -> tuple[str, dict[str, str]]:
        """(chat completions URL, headers) for a fresh agent."""
        if self.kind == "direct":
            return f"{self.base}/v1/chat/completions", {"Content-Type": "application/json"}
        async with http.post(f"{self.base}/sessions", json={}, headers=self.admin) as resp:
            info = await resp.json()
        if self.kind == "openenv":
            return f"{self.base}/v1/chat/completions", {"Authorization": f"Bearer {info['session_id']}",
                                                        "Content-Type": "application/json"}
        return f"{info['openai_base_url']}/chat/completions", {"Authorization": f"Bearer {info['key']}",
                                                               "Content-Type": "application/json"}


def wait_health(url: str, process: subprocess.Popen, timeout: float = 60) -> None:
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def start_engine(model_dir: Path, served_root: str | None = None) -> tuple[subprocess.Popen, str]:
    """The fake engine, rendering with the tiny model's tokenizer and template (which it names, so a proxy beside
    it renders prompts itself, as beside a vLLM on the same machine); with `served_root`, naming that hub id
    instead, as `vllm serve ORG/NAME` does."""
    process = subprocess.Popen([PYTHON, str(ROOT / "tests" / "fake_engine.py"), "--model-dir", str(model_dir),
                                *(["--served-root", served_root] if served_root else [])],
                               stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    STARTED.append(process)
    return process, process.stdout.readline().decode().strip()


def tiny_model() -> Path:
    from harness_rl.engine import build_tiny_model, default_cache_dir

    return build_tiny_model(default_cache_dir(0))


def start_openenv(engine: str, work: Path) -> Target:
    port = free_port()
    stats = work / f"openenv-gc-{port}.json"
    process = subprocess.Popen(
        [PYTHON, "-c", GC_WRAPPER, "openenv.core.harness.capture.server", "--llm-url", engine, "--model", "fake",
         "--capture-level", "tokens", "--port", str(port)],
        env={**os.environ, "GC_STATS": str(stats)}, stdout=subprocess.DEVNULL,
        stderr=(work / f"openenv-{port}.log").open("wb"))  # its INFO log must never block on a full pipe
    STARTED.append(process)
    url = f"http://127.0.0.1:{port}"
    wait_health(url, process)
    return Target("OpenEnv capture proxy", process, url, "openenv", gc_stats=stats)


def start_ours(engine: str, work: Path, *flags: str, env: dict[str, str] | None = None) -> Target:
    stats = work / f"ours-gc-{time.monotonic_ns()}.json"
    process = subprocess.Popen(
        [PYTHON, "-c", GC_WRAPPER, "harness_rl.cli", "serve", "proxy", "--upstream", engine, "--port", "0",
         "--store", str(work / "store"), "--no-engine-check", *flags],
        env={**os.environ, "GC_STATS": str(stats), "HARNESS_RL_ADMIN_TOKEN": "bench", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=(work / f"ours-{time.monotonic_ns()}.log").open("wb"))
    STARTED.append(process)
    url = process.stdout.readline().decode().split()[3]
    wait_health(url, process)
    return Target("harness-rl proxy", process, url, "ours", admin={"Authorization": "Bearer bench"}, gc_stats=stats)


def stop(target: Target, since: float) -> list[tuple[int, float, float]]:
    """Stop the proxy; return (generation, wall, cpu) of the collections it ran from `since` until the stop
    signal (the interpreter's own collection at exit is no pause an agent sees)."""
    if target.process is None:
        return []
    until = time.time()
    target.process.send_signal(signal.SIGTERM)
    try:
        target.process.wait(20)
    except subprocess.TimeoutExpired:
        target.process.kill()
        target.process.wait()
    if target.gc_stats is None or not target.gc_stats.exists():
        return []
    rows = [line.split() for line in target.gc_stats.read_text().splitlines()]
    return [(int(g), float(wall), float(cpu)) for g, wall, cpu, at in rows if since <= float(at) < until]




@contextmanager
def stopping_all() -> Iterator[None]:
    """Ends every process this module started when the block ends, by error or not."""
    try:
        yield
    finally:
        for process in STARTED:
            if process.poll() is None:
                process.kill()
                process.wait()
