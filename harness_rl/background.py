"""The one bridge from synchronous code to asyncio: an event loop running on a daemon thread.

The learner is a plain synchronous torch loop, while the proxy, the rollout scheduler, the engine's
HTTP server and the control clients are asyncio. Synchronous code owns a `BackgroundLoop` and hands it
coroutines with `run`; everything async in one process shares that loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    """An asyncio loop on its own daemon thread; `run(coro)` waits for the result from any other thread."""

    def __init__(self, name: str = "harness-rl-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and return its result (raising its exception); never call from the loop itself."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            future.cancel()
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coro` on the loop without waiting; wait for it later with the future's `result(timeout)`."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the loop and join its thread; pending work should be finished (or cancelled) first."""
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=timeout)
        if not self._thread.is_alive():
            self.loop.close()

    def __enter__(self) -> BackgroundLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
