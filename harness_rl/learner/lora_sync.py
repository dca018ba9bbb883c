"""Syncing a LoRA run into vLLM: the adapter alone, re-loaded in place under the run's adapter name.

vLLM serves the adapter by name beside its base model (`--enable-lora --max-lora-rank R`, runtime
loading allowed by `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`); the proxy asks for that name, so agents
never see it. Per push, every HTTP call under a timeout: pause(mode=keep) → the adapter in peft's
format into the next of two directories → `POST /v1/load_lora_adapter {"lora_name", "lora_path",
"load_inplace": true}` → `/update_weight_version` → `/reset_prefix_cache` → resume.

The two directories take turns because vLLM keys its prefix cache by the adapter's path: blocks computed
with the previous weights must not be found again (the cache is reset as well). vLLM loads the new
adapter before it drops the old one, so a failed load leaves the engine serving the previous version.
In-flight requests are kept (`keep`) and finish on the new adapter, as with `ReloadSync`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from harness_rl.background import BackgroundLoop
from harness_rl.learner.weight_source import Sends, WeightSource
from harness_rl.learner.weight_sync import EngineControl, Weights, WeightSyncError


class LoraAdapterSync:
    """Push a LoRA run's adapter to a vLLM serving it as `adapter_name`."""

    keeps_requests = True
    sends: Sends = "adapter"

    def __init__(self, base_url: str, loop: BackgroundLoop, adapter_dir: Path, adapter_name: str, *,
                 timeout_s: float = 60.0, load_timeout_s: float = 600.0) -> None:
        self.loop = loop
        self.control = EngineControl(base_url, timeout_s)
        self.slots = (Path(adapter_dir) / "a", Path(adapter_dir) / "b")
        self.adapter_name = adapter_name
        self.load_timeout_s = load_timeout_s
        self.loaded: Path | None = None

    def push(self, weights: Weights, version: int) -> None:
        if not isinstance(weights, WeightSource) or weights.lora is None:
            raise WeightSyncError("the adapter sync needs a LoRA policy (--lora-rank > 0)")
        lora, tensors = weights.lora, weights.adapter()
        target = self.slots[1] if self.loaded == self.slots[0] else self.slots[0]

        async def push() -> None:
            try:
                await asyncio.to_thread(lora.write, tensors, target)
            except OSError as error:
                raise WeightSyncError(f"writing the adapter to {target} failed: {error}") from None
            await self._push(target, version)

        self.loop.run(push())
        self.loaded = target

    async def _push(self, target: Path, version: int) -> None:
        control = self.control
        async with control.paused("keep"):
            await control.call("POST", "/v1/load_lora_adapter", timeout_s=self.load_timeout_s,
                               body={"lora_name": self.adapter_name, "lora_path": str(target), "load_inplace": True})
            await control.call("POST", "/update_weight_version", body={"new_version": str(version)})
            await control.call("POST", "/reset_prefix_cache")

    def close(self) -> None:
        self.loop.run(self.control.close())
