"""One weight sync for several engines: each new version goes to every engine at once, and each engine's
reported version is read back.

One learner backend per engine (`learner.weight_sync`: http, nccl or reload), each pushed on its own
thread, so a sync over N engines takes about as long as the slowest one. An engine that fails its push,
or reports another version after it, is left out of that version: the proxy keeps it out of service
until a later push reaches it (`proxy.upstream.pool`), and its backend is built afresh for that push (an
engine that restarted has lost its transfer group, its weights and its version). A push fails only when
no engine took it.

The learner's weights are read once per push however many engines there are (`SharedPass`): under
torchrun that pass is a collective every rank joins once, and each tensor is whole only while the
slowest engine's backend still needs it.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from harness_rl.background import BackgroundLoop
from harness_rl.learner.weight_source import Sends, WeightSource
from harness_rl.learner.weight_sync import EngineControl, Weights, WeightSync, WeightSyncError, weight_source

VERSION_TIMEOUT_S = 60.0
PASS_DEPTH = 2  # tensors a slow engine's backend may lag behind the pass
_END = object()


@dataclass
class _Engine:
    url: str
    make: Callable[[], WeightSync]
    sync: WeightSync | None
    control: EngineControl


class FanOutSync:
    """A `WeightSync` over several engines (see the module). `reached` names the engines that hold the last
    version pushed; `missed` says why each other engine does not."""

    def __init__(self, engines: list[tuple[str, Callable[[], WeightSync]]], loop: BackgroundLoop) -> None:
        self.loop = loop
        self.engines = [_Engine(url, make, make(), EngineControl(url, VERSION_TIMEOUT_S)) for url, make in engines]
        # generations in flight go on across a push only if every engine lets them
        self.keeps_requests = all(e.sync is not None and e.sync.keeps_requests for e in self.engines)
        kinds = {e.sync.sends for e in self.engines if e.sync is not None}
        if len(kinds) > 1:
            raise WeightSyncError(f"the engines take different things ({', '.join(sorted(kinds))}): one run's engines "
                                  "must all take the weights, or all the adapter")
        self.sends: Sends = kinds.pop() if kinds else "nothing"
        self.reached = [e.url for e in self.engines]
        self.missed: dict[str, str] = {}

    def push(self, weights: Weights, version: int) -> None:
        shared = SharedPass(weight_source(weights), len(self.engines), self.sends)
        with ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="weight-sync") as threads:
            pushing = [threads.submit(self._push_one, engine, shared.view(i), version)
                       for i, engine in enumerate(self.engines)]
            shared.feed()  # the one pass, on this thread: under torchrun the other ranks gather with it
            errors = [push.result() for push in pushing]
        self.missed = {e.url: error for e, error in zip(self.engines, errors, strict=True) if error is not None}
        reached = [e.url for e in self.engines if e.url not in self.missed]
        if not reached:
            raise WeightSyncError(f"no engine took version {version}: "
                                  + "; ".join(f"{url}: {error}" for url, error in self.missed.items()))
        self.reached = reached
        for url, error in self.missed.items():
            print(f"harness-rl: engine {url} missed version {version} ({error}); the proxy keeps it out of service "
                  "until a sync reaches it", file=sys.stderr, flush=True)

    def _push_one(self, engine: _Engine, weights: _View, version: int) -> str | None:
        """Push to one engine and read its version back; why it failed, or None."""
        try:
            if engine.sync is None:
                engine.sync = engine.make()
            try:
                engine.sync.push(weights, version)
            finally:
                weights.leave()
            info = self.loop.run(engine.control.call("GET", "/weight_info"))
            if not isinstance(info, dict) or info.get("weight_version") != str(version):
                raise WeightSyncError(f"GET /weight_info answered {info!r} after version {version} was pushed")
        except Exception as error:  # this engine's failure, whatever it was, is not the others'
            if engine.sync is not None:
                with contextlib.suppress(Exception):
                    engine.sync.close()
            engine.sync = None
            return str(error) or repr(error)
        return None

    def close(self) -> None:
        for engine in self.engines:
            if engine.sync is not None:
                with contextlib.suppress(Exception):
                    engine.sync.close()
            self.loop.run(engine.control.close())


class SharedPass:
    """One pass over a `WeightSource`, read by `readers` backends at once, each on its own thread.

    `feed()` (on the caller's thread) iterates the source once and hands every tensor to each reader still
    reading, at most `PASS_DEPTH` ahead of the slowest; a reader that fails leaves, and the pass goes on for
    the others. With `sends="adapter"` the adapter is taken once, before the readers start.
    """

    def __init__(self, source: WeightSource, readers: int, sends: Sends) -> None:
        self.source = source
        self.sends = sends
        self.adapter = source.adapter() if sends == "adapter" else None
        self.queues: list[queue.Queue[object]] = [queue.Queue(PASS_DEPTH) for _ in range(readers)]
        self.left = [threading.Event() for _ in range(readers)]

    def view(self, reader: int) -> _View:
        return _View(self, reader)

    def feed(self) -> None:
        items: Iterator[tuple[str, torch.Tensor]] = iter(self.source) if self.sends == "weights" else iter(())
        for item in items:
            self._hand(item)
        self._hand(_END)

    def _hand(self, item: object) -> None:
        for reader, tensors in enumerate(self.queues):
            while not self.left[reader].is_set():
                with contextlib.suppress(queue.Full):
                    tensors.put(item, timeout=0.1)
                    break


class _View(WeightSource):
    """One reader's side of a `SharedPass`: the source's names and metadata, its tensors as the pass reaches
    them, the adapter taken once."""

    def __init__(self, shared: SharedPass, reader: int) -> None:
        self.shared, self.reader = shared, reader
        self.model, self.ranks, self.lora = shared.source.model, shared.source.ranks, shared.source.lora

    @property
    def tied(self) -> tuple[str, str] | None:
        return self.shared.source.tied

    def metadata(self) -> list:
        return self.shared.source.metadata()

    def adapter(self) -> dict[str, torch.Tensor]:
        if self.shared.adapter is None:
            raise ValueError("this push sends the weights, not the adapter")
        return self.shared.adapter

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        tensors = self.shared.queues[self.reader]
        while (item := tensors.get()) is not _END:
            yield item  # type: ignore[misc]

    def drain(self, sends: Sends) -> None:
        pass  # the pass is fed once, by `SharedPass.feed`

    def leave(self) -> None:
        """This reader reads no more (its push ended, or failed): the pass no longer waits for it."""
        self.shared.left[self.reader].set()
