"""The stack every run stands on: its engines, the intercept proxy in front of them, the proxy's control
client and the rollout scheduler, all on one background event loop.

`harness-rl train` (`run.train`), `harness-rl eval` (`run.evaluate`) and the demo's teacher start it
the same way and close it the same way: rollouts cancelled first by their owner, then the client,
the proxy, the engines and the loop. A stack that fails half-way through starting closes what it had
started before the error propagates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from harness_rl.background import BackgroundLoop
from harness_rl.outcome import RewardFn
from harness_rl.run.config import RunConfig
from harness_rl.run.engines import RunningEngine, start_engines
from harness_rl.run.models import vocab_size
from harness_rl.run.presets import BUILT_MODELS

if TYPE_CHECKING:
    from adapters.harnesses import Harness
    from adapters.sandboxes import Sandbox
    from adapters.tasks import Task
    from harness_rl.run.rollouts import RolloutScheduler
    from proxy.client import ProxyClient
    from proxy.config import ProxyConfig
    from proxy.server.app import RunningProxy


@dataclass
class Stack:
    """A started stack; `close()` stops it (rollouts must be cancelled by whoever runs them, first)."""

    loop: BackgroundLoop
    engines: list[RunningEngine]
    proxy: RunningProxy
    client: ProxyClient
    scheduler: RolloutScheduler

    @classmethod
    def start(cls, config: RunConfig, model_dir: Path, run_dir: Path, tasks: Sequence[Task], *,
              harness: Harness | None = None, sandbox_factory: Callable[[], Sandbox] | None = None,
              reward_fn: RewardFn | None = None, served_model_name: str | None = None,
              forced_completions: bool = False, name: str = "harness-rl-rollouts") -> Stack:
        """Start the engines `config.engine` describes on `model_dir`, a proxy (its store under `run_dir/proxy`),
        its client and a scheduler over `tasks`. `forced_completions` is the demo teacher's, never a run's."""
        from harness_rl.run.rollouts import RolloutScheduler
        from proxy.client import ProxyClient

        loop = BackgroundLoop(name)
        with contextlib.ExitStack() as undo:
            undo.callback(loop.close)
            served = served_model_name or (config.engine.model if config.engine.model in BUILT_MODELS else None)
            engines = start_engines(config.engine, model_dir, run_dir, seed=config.seed, served_model_name=served,
                                    forced_completions=forced_completions, lora_rank=config.learner.lora_rank)
            for engine in engines:
                undo.callback(engine.close)
            proxy_config = msgspec.structs.replace(
                config.proxy, upstream=[e.url for e in engines], store_dir=str(run_dir / "proxy"),
                upstream_model=engines[0].adapter_name or config.proxy.upstream_model,  # agents never see the adapter
                vocab_size=config.proxy.vocab_size or vocab_size(engines[0].model_dir))
            proxy = loop.run(_start_proxy(proxy_config), timeout=120)
            undo.callback(lambda: loop.run(proxy.stop(), timeout=60))
            client = ProxyClient(proxy.url, proxy.admin_token)
            scheduler = RolloutScheduler(tasks, client, config.rollouts, reward_fn, harness, sandbox_factory,
                                         seed=config.seed, ahead=config.learner.groups_per_step)
            undo.pop_all()
        return cls(loop, engines, proxy, client, scheduler)

    @property
    def engine(self) -> RunningEngine:
        """The first engine (the only one, unless the run samples from several engines at URLs)."""
        return self.engines[0]

    def close(self) -> None:
        """Stop the client, the proxy, the engines and the loop, each even if one before it failed."""
        with contextlib.ExitStack() as closing:
            closing.callback(self.loop.close)
            for engine in self.engines:
                closing.callback(engine.close)
            closing.callback(lambda: self.loop.run(self.proxy.stop(), timeout=60))
            closing.callback(lambda: self.loop.run(self.client.close(), timeout=30))

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _start_proxy(config: ProxyConfig) -> RunningProxy:
    from proxy.server.app import start_proxy

    return await start_proxy(config)


@contextlib.contextmanager
def serve_proxy(config: ProxyConfig, loop: BackgroundLoop | None = None) -> Iterator[RunningProxy]:
    """A proxy serving on `loop` (a fresh one when not given) until the block ends (tests, scripts)."""
    owned = loop is None
    loop = loop or BackgroundLoop("harness-rl-proxy")
    try:
        running = loop.run(_start_proxy(config), timeout=30)
        try:
            yield running
        finally:
            loop.run(running.stop(), timeout=30)
    finally:
        if owned:
            loop.close()
