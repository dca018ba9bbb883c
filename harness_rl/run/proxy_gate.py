"""Holding agent calls at the intercept proxy around a weight sync, so no turn straddles two versions.

`ProxyGate` wraps any of the learner's `WeightSync` backends: pause the proxy (draining the calls at
the engine unless the backend keeps in-flight generations), push, tell the proxy the new version,
resume. The proxy answers its pause once every call already at the engine has been recorded, and
turns recorded afterwards carry the new version even from an engine (vLLM) whose replies do not say
which weights produced them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness_rl.background import BackgroundLoop
from harness_rl.learner.weight_sync import WeightSync, WeightSyncError
from proxy.client import ProxyClient, ProxyClientError

if TYPE_CHECKING:
    from harness_rl.learner.weight_source import Sends
    from harness_rl.learner.weight_sync import Weights


class ProxyGate:
    """A `WeightSync` that gates another one at the proxy, through the proxy's one control client."""

    def __init__(self, inner: WeightSync, client: ProxyClient, loop: BackgroundLoop) -> None:
        self.inner = inner
        self.client = client
        self.loop = loop
        self.keeps_requests = inner.keeps_requests
        self.sends: Sends = getattr(inner, "sends", "weights")

    def push(self, weights: Weights, version: int) -> None:
        # A backend that keeps in-flight generations needs no drain: the learner never waits on a long one.
        self.loop.run(self._call("pause", self.client.pause(drain=not self.inner.keeps_requests)))
        try:
            self.inner.push(weights, version)
            self.loop.run(self._call("policy_version", self.client.set_policy_version(version)))
        finally:
            self.loop.run(self._call("resume", self.client.resume()))

    async def _call(self, step: str, call: Any) -> None:
        try:
            await call
        except (ProxyClientError, OSError, TimeoutError) as error:
            raise WeightSyncError(f"proxy {step} failed: {error}") from None

    def close(self) -> None:
        self.inner.close()
