"""One weight sync for several engines: each new version goes to every engine at once, and each engine's
reported version is read back.

One learner backend per engine (`learner.weight_sync`: http, nccl or reload), each pushed on its own
thread, so a sync over N engines takes about as long as the slowest one. An engine that fails its push,
or reports another version after it, is left out of that version: the proxy keeps it out of service
until a later push reaches it (`proxy.engines`), and its backend is built afresh for that push (an
engine that restarted has lost its transfer group, its weights and its version). A push fails only when
no engine took it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness_rl.background import BackgroundLoop
from harness_rl.learner.weight_sync import EngineControl, WeightSync, WeightSyncError

if TYPE_CHECKING:
    import torch

VERSION_TIMEOUT_S = 60.0


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
        self.reached = [e.url for e in self.engines]
        self.missed: dict[str, str] = {}

    def push(self, model: torch.nn.Module, version: int) -> None:
        with ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="weight-sync") as threads:
            errors = list(threads.map(lambda engine: self._push_one(engine, model, version), self.engines))
        self.missed = {e.url: error for e, error in zip(self.engines, errors, strict=True) if error is not None}
        reached = [e.url for e in self.engines if e.url not in self.missed]
        if not reached:
            raise WeightSyncError(f"no engine took version {version}: "
                                  + "; ".join(f"{url}: {error}" for url, error in self.missed.items()))
        self.reached = reached
        for url, error in self.missed.items():
            print(f"harness-rl: engine {url} missed version {version} ({error}); the proxy keeps it out of service "
                  "until a sync reaches it", file=sys.stderr, flush=True)

    def _push_one(self, engine: _Engine, model: torch.nn.Module, version: int) -> str | None:
        """Push to one engine and read its version back; why it failed, or None."""
        try:
            if engine.sync is None:
                engine.sync = engine.make()
            engine.sync.push(model, version)
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
