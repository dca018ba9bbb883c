"""Several engines behind one proxy (`proxy.upstream.pool`): sessions spread and stay put, a dead engine's sessions go
on exactly elsewhere, and an engine serves only while it holds the announced weights.

Each engine is a fake vLLM (tests/fake_engine.py) on its own port, stopped and started again on the same port
as a crashed and restarted engine would be.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest
from fake_engine import FakeEngine, start_fake_engine
from proxy_agent import Agent

from harness_rl.background import BackgroundLoop
from harness_rl.run.stack import serve_proxy
from harness_rl.trace import TrainingTrace
from proxy.config import ProxyConfig
from proxy.control_api import Health
from proxy.server.app import RunningProxy

TASK = [{"role": "user", "content": "count"}]
FAKE_ENGINE = Path(__file__).parent / "fake_engine.py"


class Engine:
    """A fake engine served on a fixed port that can be stopped (refusing connections) and started again."""

    def __init__(self, loop: BackgroundLoop) -> None:
        self.loop = loop
        self.fake = FakeEngine()
        self.runner = None
        self.port = 0
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.runner, url = self.loop.run(start_fake_engine(self.fake, port=self.port))
        self.port = int(url.rsplit(":", 1)[1])

    def stop(self) -> None:
        self.loop.run(self.runner.cleanup())

    def samples(self) -> int:
        return len(self.fake.requests)


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    with BackgroundLoop("fake-engines") as loop:
        started = [Engine(loop), Engine(loop)]
        yield started
        for engine in started:
            engine.stop()


@pytest.fixture
def proxy(engines: list[Engine], tmp_path: Path) -> Iterator[RunningProxy]:
    config = ProxyConfig(upstream=[e.url for e in engines], store_dir=str(tmp_path / "store"), engine_check_s=0.1)
    with serve_proxy(config) as running:
        yield running


def turn(agent: Agent, messages: list[dict]) -> list[dict]:
    """One call; the conversation with the reply and a follow-up appended."""
    got = agent.chat(messages)
    assert got.status_code == 200, got.text
    return [*messages, got.json()["choices"][0]["message"], {"role": "user", "content": "more"}]


def health(proxy: RunningProxy) -> Health:
    return msgspec.json.decode(httpx.get(f"{proxy.url}/health").content, type=Health)


def announce(proxy: RunningProxy, version: int) -> None:
    got = httpx.post(f"{proxy.url}/admin/policy_version", json={"version": version},
                     headers={"Authorization": f"Bearer {proxy.admin_token}"})
    assert got.status_code == 200, got.text


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def engines_of(trace: TrainingTrace) -> list[str]:
    return [t.metadata["engine"] for t in trace.turns]


def assert_one_chain(trace: TrainingTrace) -> None:
    turns = trace.validate().turns
    assert [t.prompt_source for t in turns] == ["rendered"] + ["spliced"] * (len(turns) - 1)
    for parent, child in zip(turns, turns[1:], strict=False):
        assert child.parent_id == parent.node_id and child.prompt_token_ids[:len(parent.sequence)] == parent.sequence


def test_new_sessions_go_to_the_least_loaded_engine_and_each_stays_on_its_own(proxy: RunningProxy,
                                                                              engines: list[Engine]) -> None:
    agents = [Agent(proxy) for _ in range(6)]
    conversations = [list(TASK) for _ in agents]
    for _ in range(3):
        conversations = [turn(agent, c) for agent, c in zip(agents, conversations, strict=True)]
    traces = [agent.trace() for agent in agents]
    for trace in traces:
        assert len(set(engines_of(trace))) == 1  # every turn of a session on one engine (its prefix cache)
        assert_one_chain(trace)
    served = [engines_of(trace)[0] for trace in traces]
    assert sorted(served.count(e.url) for e in engines) == [3, 3]
    assert [e.samples() for e in engines] == [9, 9]
    assert {rank for e in engines for rank in e.fake.ranks} == {None}  # no data parallelism: no rank asked for
    state = health(proxy)
    assert [(e.state, e.open_sessions, e.sessions, e.samples) for e in state.engines] == [("serving", 3, 3, 9)] * 2


def test_a_closed_session_no_longer_counts_toward_its_engines_load(proxy: RunningProxy,
                                                                   engines: list[Engine]) -> None:
    first, second = Agent(proxy), Agent(proxy)
    turn(first, TASK)
    turn(second, TASK)
    httpx.post(f"{proxy.url}/sessions/{first.session['id']}/close", headers=first.admin)
    third = Agent(proxy)
    turn(third, TASK)
    assert engines_of(third.trace()) == engines_of(first.trace())  # the engine whose session closed


def test_a_dead_engines_sessions_go_on_exactly_on_another_engine(proxy: RunningProxy, engines: list[Engine]) -> None:
    agents = [Agent(proxy) for _ in range(4)]
    conversations = [turn(agent, list(TASK)) for agent in agents]
    dead, alive = engines
    moved = [i for i, agent in enumerate(agents) if engines_of(agent.trace()) == [dead.url]]
    assert len(moved) == 2
    dead.stop()
    for i in moved:  # answered at once, by the other engine: the agent never sees the crash
        conversations[i] = turn(agents[i], conversations[i])
        conversations[i] = turn(agents[i], conversations[i])
    for i in moved:
        trace = agents[i].trace()
        assert engines_of(trace) == [dead.url, alive.url, alive.url]
        assert_one_chain(trace)  # token in, token out: the chain holds across the move
        # the engine it moved to sampled from the exact ids of the turn before, sampled elsewhere
        assert trace.turns[1].prompt_token_ids[:len(trace.turns[0].sequence)] == trace.turns[0].sequence
    down = health(proxy).engines[0]
    assert down.state == "down" and down.open_sessions == 0 and health(proxy).engines[1].open_sessions == 4


def test_a_call_at_an_engine_killed_mid_call_is_answered_by_another_from_the_same_ids(engines: list[Engine],
                                                                                    tmp_path: Path) -> None:
    dying = subprocess.Popen([sys.executable, str(FAKE_ENGINE), "--hold-generate"], stdout=subprocess.PIPE)
    try:
        assert dying.stdout is not None
        dying_url, alive = dying.stdout.readline().decode().strip(), engines[0]
        config = ProxyConfig(upstream=[dying_url, alive.url], store_dir=str(tmp_path / "store"), engine_check_s=0.1)
        with serve_proxy(config) as running, ThreadPoolExecutor(1) as agent_thread:
            agent = Agent(running)  # its first call goes to the first engine: neither has a session yet
            answer = agent_thread.submit(agent.chat, TASK)
            assert dying.stdout.readline().decode().strip() == "generate"  # the call is at the engine now
            dying.kill()
            got = answer.result(timeout=60)
            assert got.status_code == 200, got.text
            trace = agent.trace()
            assert engines_of(trace) == [alive.url]
            # the prompt ids the dead engine rendered are the ones the other engine sampled from
            assert alive.fake.requests[-1]["token_ids"] == trace.turns[0].prompt_token_ids
            assert [e.state for e in health(running).engines] == ["down", "serving"]
    finally:
        dying.kill()
        dying.wait()


def test_a_restarted_engine_serves_again_only_once_it_holds_the_announced_version(proxy: RunningProxy,
                                                                                 engines: list[Engine]) -> None:
    first, second = engines
    for engine in engines:
        engine.fake.version = 3
    announce(proxy, 3)
    second.stop()
    wait_for(lambda: health(proxy).engines[1].state == "down")
    second.fake.version = None  # restarted: the weights it was started with ("default")
    second.start()
    wait_for(lambda: health(proxy).engines[1].state == "stale")
    assert "holds version default, the run is at 3" in health(proxy).engines[1].reason
    agents = [Agent(proxy) for _ in range(3)]
    for agent in agents:
        turn(agent, TASK)
    assert second.samples() == 0 and {e for a in agents for e in engines_of(a.trace())} == {first.url}
    for engine in engines:  # the next weight sync reaches both
        engine.fake.version = 4
    announce(proxy, 4)
    assert [(e.state, e.version) for e in health(proxy).engines] == [("serving", "4"), ("serving", "4")]
    newcomer = Agent(proxy)
    turn(newcomer, TASK)
    assert engines_of(newcomer.trace()) == [second.url]  # the least loaded again


def test_an_engine_a_sync_missed_is_taken_out_until_one_reaches_it(proxy: RunningProxy,
                                                                   engines: list[Engine]) -> None:
    first, second = engines
    agents = [Agent(proxy) for _ in range(2)]
    conversations = [turn(agent, list(TASK)) for agent in agents]
    first.fake.version = 1  # only the first engine took version 1
    announce(proxy, 1)
    assert [e.state for e in health(proxy).engines] == ["serving", "stale"]
    conversations = [turn(agent, c) for agent, c in zip(agents, conversations, strict=True)]
    assert all(engines_of(agent.trace())[-1] == first.url for agent in agents)
    assert all(t.policy_version == 1 for agent in agents for t in agent.trace().turns[1:])


def test_an_announcement_no_engine_reports_changes_nothing(proxy: RunningProxy, engines: list[Engine]) -> None:
    """A run whose engines never take weights (`--weight-sync none`) still announces versions."""
    announce(proxy, 7)
    assert [e.state for e in health(proxy).engines] == ["serving", "serving"]
    agents = [Agent(proxy) for _ in range(2)]
    for agent in agents:
        turn(agent, TASK)
    assert sorted(engines_of(a.trace())[0] for a in agents) == sorted(e.url for e in engines)


def test_with_no_engine_serving_a_call_is_503_with_retry_after_and_nothing_is_recorded(
        proxy: RunningProxy, engines: list[Engine]) -> None:
    agent = Agent(proxy)
    for engine in engines:
        engine.stop()
    got = agent.chat(TASK)
    assert got.status_code == 503 and got.headers["Retry-After"]
    assert "no engine is serving" in got.json()["error"]["message"]
    assert agent.trace().turns == []
    engines[0].start()
    wait_for(lambda: health(proxy).engines[0].state == "serving")
    assert agent.chat(TASK).status_code == 200


def test_its_only_engine_dead_health_is_503_and_200_again_once_it_is_back(engines: list[Engine],
                                                                          tmp_path: Path) -> None:
    """One engine is probed as several are: two failed probes take it out, one answered brings it back."""
    only = engines[0]
    config = ProxyConfig(upstream=only.url, store_dir=str(tmp_path / "store"), retries=0, engine_check_s=0.1)
    with serve_proxy(config) as running:
        agent = Agent(running)
        turn(agent, TASK)
        assert httpx.get(f"{running.url}/health").status_code == 200 and health(running).status == "ok"
        only.stop()
        died = time.monotonic()
        wait_for(lambda: httpx.get(f"{running.url}/health").status_code == 503, timeout_s=60)
        taken_out_s = time.monotonic() - died  # two intervals (0.2 s) on an idle machine; not asserted: timing
        state = health(running)
        assert state.status == "unavailable" and state.engines[0].state == "down"
        assert state.reason == f"no engine is serving ({only.url} down: 2 health probes in a row failed)", \
            taken_out_s
        got = agent.chat(TASK)  # refused at once, in the agent's dialect, after one more probe
        assert got.status_code == 503 and got.headers["Retry-After"] == "5"
        assert got.json()["error"]["message"] == state.reason
        only.start()
        assert agent.chat(TASK).status_code == 200  # a call finding none serving probes first: it is back at once
        wait_for(lambda: httpx.get(f"{running.url}/health").status_code == 200, timeout_s=60)
        assert health(running).reason is None and health(running).engines[0].state == "serving"
        assert [t.metadata["engine"] for t in agent.trace().turns] == [only.url] * 2  # the 503 recorded nothing


def test_the_same_engine_twice_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError, match="engine http://a:1 is given twice"):
        msgspec.convert({"upstream": ["http://a:1", "http://a:1/"]}, ProxyConfig)


def test_requests_of_concurrent_sessions_each_reach_their_own_engine(proxy: RunningProxy,
                                                                     engines: list[Engine]) -> None:
    """The session rides with each call's task: calls interleaved on the proxy's loop never swap engines."""
    agents = [Agent(proxy) for _ in range(8)]

    async def converse(agent: Agent) -> None:
        messages = list(TASK)
        async with httpx.AsyncClient(timeout=30) as http:
            for _ in range(4):
                got = await http.post(f"{agent.base}/chat/completions", headers=agent.auth,
                                      json={"model": "policy", "messages": messages})
                assert got.status_code == 200, got.text
                messages += [got.json()["choices"][0]["message"], {"role": "user", "content": "more"}]

    async def all_of_them() -> None:
        await asyncio.gather(*(converse(agent) for agent in agents))

    asyncio.run(all_of_them())
    for agent in agents:
        trace = agent.trace()
        assert len(trace.turns) == 4 and len(set(engines_of(trace))) == 1
        assert_one_chain(trace)
    assert [e.samples() for e in engines] == [16, 16]


def test_a_data_parallel_engine_keeps_each_session_on_one_of_its_copies(tmp_path: Path) -> None:
    with BackgroundLoop("fake-engines") as loop:
        engine = Engine(loop)
        engine.fake.data_parallel = 3
        config = ProxyConfig(upstream=[engine.url], store_dir=str(tmp_path / "store"), engine_check_s=0.1)
        with serve_proxy(config) as running:
            wait_for(lambda: health(running).engines[0].data_parallel == 3)
            agents = [Agent(running) for _ in range(6)]
            conversations = [list(TASK) for _ in agents]
            for _ in range(3):  # one call at a time: the k-th sample is call k
                conversations = [turn(agent, c) for agent, c in zip(agents, conversations, strict=True)]
            for agent in agents:
                assert_one_chain(agent.trace())
            assert health(running).engines[0].open_sessions == 6
        engine.stop()
    ranks = [engine.fake.ranks[i::6] for i in range(6)]  # each session's samples, in order
    assert all(len(set(r)) == 1 for r in ranks)  # a session stays on one copy (its prefix cache)
    assert sorted(r[0] for r in ranks) == ["0", "0", "1", "1", "2", "2"]  # sessions spread over the copies
