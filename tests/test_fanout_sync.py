"""`FanOutSync`: every version goes to every engine at once, each engine's reported version is read back, and an
engine that misses a version is left out of it (its backend rebuilt) without failing the push."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from fake_engine import FakeEngine, run_fake_engine

from harness_rl.background import BackgroundLoop
from harness_rl.engine import Engine, serve_in_thread
from harness_rl.learner.weight_source import WeightSource
from harness_rl.learner.weight_sync import HttpEngineSync, WeightSyncError
from harness_rl.run.fanout_sync import FanOutSync, SharedPass


class SetsVersion:
    """A backend that 'pushes' by setting a fake engine's version, after waiting for every other push to start."""

    keeps_requests = True
    sends = "weights"

    def __init__(self, fake: FakeEngine, together: threading.Barrier, fail: bool = False, lie: bool = False) -> None:
        self.fake, self.together, self.fail, self.lie = fake, together, fail, lie
        self.closed = False

    def push(self, model: torch.nn.Module, version: int) -> None:
        self.together.wait(timeout=30)  # passes only if the pushes to all engines are under way at once
        if self.fail:
            raise WeightSyncError("POST /pause?mode=keep failed: cannot reach the engine")
        self.fake.version = version - 1 if self.lie else version

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fakes() -> Iterator[tuple[list[FakeEngine], list[str]]]:
    engines = [FakeEngine(), FakeEngine(), FakeEngine()]
    with run_fake_engine(engines[0]) as a, run_fake_engine(engines[1]) as b, run_fake_engine(engines[2]) as c:
        yield engines, [a, b, c]


def test_every_engine_takes_the_version_at_once_and_reports_it(fakes) -> None:
    engines, urls = fakes
    together = threading.Barrier(3)
    with BackgroundLoop() as loop:
        sync = FanOutSync([(url, lambda f=fake: SetsVersion(f, together))
                           for fake, url in zip(engines, urls, strict=True)], loop)
        sync.push(torch.nn.Linear(1, 1), 5)
        sync.close()
    assert [e.version for e in engines] == [5, 5, 5] and sync.reached == urls and sync.missed == {}


def test_an_engine_that_fails_or_reports_another_version_misses_it_and_gets_a_fresh_backend(fakes, capsys) -> None:
    engines, urls = fakes
    together = threading.Barrier(3)
    made: list[SetsVersion] = []
    faults = {urls[1]: [{"fail": True}, {}], urls[2]: [{"lie": True}, {}]}

    def backend(fake: FakeEngine, url: str) -> SetsVersion:
        made.append(SetsVersion(fake, together, **(faults[url].pop(0) if url in faults else {})))
        return made[-1]

    with BackgroundLoop() as loop:
        sync = FanOutSync([(url, lambda f=fake, u=url: backend(f, u))
                           for fake, url in zip(engines, urls, strict=True)], loop)
        assert len(made) == 3
        sync.push(torch.nn.Linear(1, 1), 1)
        assert sync.reached == [urls[0]]
        assert "cannot reach the engine" in sync.missed[urls[1]]
        assert "GET /weight_info answered {'weight_version': '0'} after version 1" in sync.missed[urls[2]]
        assert made[1].closed and made[2].closed and not made[0].closed
        warned = capsys.readouterr().err
        assert f"engine {urls[1]} missed version 1" in warned and "keeps it out of service" in warned
        sync.push(torch.nn.Linear(1, 1), 2)  # the next version reaches them again, through fresh backends
        assert len(made) == 5 and sync.reached == urls and [e.version for e in engines] == [2, 2, 2]
        sync.close()


def test_a_push_no_engine_took_fails_naming_each_engine(fakes) -> None:
    engines, urls = fakes
    together = threading.Barrier(3)
    with BackgroundLoop() as loop:
        sync = FanOutSync([(url, lambda f=fake: SetsVersion(f, together, fail=True))
                           for fake, url in zip(engines, urls, strict=True)], loop)
        with pytest.raises(WeightSyncError, match="no engine took version 3") as raised:
            sync.push(torch.nn.Linear(1, 1), 3)
        assert all(url in str(raised.value) for url in urls)
        assert sync.reached == urls  # unchanged: the last version that reached them
        sync.close()


def test_real_engines_each_serve_the_pushed_weights(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01)
    served = [Engine.from_pretrained(tiny_model_dir), Engine.from_pretrained(tiny_model_dir)]
    with BackgroundLoop() as loop, serve_in_thread(served[0]) as a, serve_in_thread(served[1]) as b:
        sync = FanOutSync([(s.url, lambda u=s.url: HttpEngineSync(u, loop)) for s in (a, b)], loop)
        assert not sync.keeps_requests  # http drains generations first, so the proxy must too
        sync.push(model, 7)
        sync.close()
    for engine in served:
        assert engine.policy_version == 7
        for name, parameter in model.named_parameters():
            assert torch.equal(engine.model.get_parameter(name), parameter), name
        engine.close()


def test_the_sync_check_asks_the_engines_in_turn_and_passes_over_a_dead_one(tiny_model_dir: Path) -> None:
    from harness_rl.learner.weight_sync import free_port
    from harness_rl.run.engines import EngineSampler
    from proxy.errors import ProxyError

    engine = Engine.from_pretrained(tiny_model_dir)
    dead = f"http://127.0.0.1:{free_port()}"
    with BackgroundLoop() as loop, serve_in_thread(engine) as alive:
        sampler = EngineSampler(lambda: [alive.url, dead], loop, 1.0, tokens=4)
        first = sampler.sample([1, 2, 3])
        second = sampler.sample([1, 2, 3])  # the dead engine's turn: the live one answers, the same seeded sample
        assert first == second and first[0] and list(sampler.clients) == [alive.url, dead]
        only_dead = EngineSampler(lambda: [dead], loop, 1.0, tokens=4)
        with pytest.raises(ProxyError, match=f"cannot reach the engine at {dead}"):
            only_dead.sample([1, 2, 3])
        sampler.close()
        only_dead.close()
    engine.close()


class CountingSource(WeightSource):
    """A source whose passes are counted (under torchrun each one is a collective every rank must join)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        return super().__iter__()


def test_one_pass_of_the_weights_feeds_every_engine_and_a_failing_reader_stops_no_one() -> None:
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(5)))
    source = CountingSource(model)
    shared = SharedPass(source, 3, "weights")
    got: list[dict[str, torch.Tensor]] = [{}, {}, {}]

    def read(reader: int) -> None:
        view = shared.view(reader)
        try:
            for i, (name, tensor) in enumerate(view):
                if reader == 1 and i == 2:
                    raise WeightSyncError("engine 1 went away mid-push")
                got[reader][name] = tensor
        finally:
            view.leave()

    with ThreadPoolExecutor(3) as threads:
        reading = [threads.submit(read, i) for i in range(3)]
        shared.feed()
        failures = [r.exception() for r in reading]
    expected = {name: p for name, p in model.named_parameters()}
    assert source.passes == 1
    assert [f is None for f in failures] == [True, False, True]
    for reader in (0, 2):
        assert got[reader].keys() == expected.keys()
        assert all(torch.equal(got[reader][n], expected[n]) for n in expected)
    assert len(got[1]) == 2
