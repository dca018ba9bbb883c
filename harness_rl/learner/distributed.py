"""The learner across processes: torchrun's ranks, FSDP2 sharding, and balancing a step's rows.

Under `torchrun` (WORLD_SIZE > 1) every rank holds a shard of the policy: `fully_shard` on each decoder
layer and at the root (embeddings, final norm, LM head), bf16 compute with fp32 gradient reduction on
GPUs (NCCL), fp32 on CPUs (gloo). Rank 0 alone owns the engine, the proxy and the rollouts; the others
follow its commands (`Learner.follow`). The loss of a step is a global sum (each token's weight is
normalised over the whole step before the rows are split), so the gradients are summed across ranks,
never averaged, and any number of processes takes the same step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the learner's processes (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def current(cls) -> Ranks:
        """This process's ranks in the process group it joined (`join`), or rank 0 of 1."""
        if not dist.is_initialized():
            return cls()
        return cls(dist.get_rank(), dist.get_world_size())

    @property
    def leader(self) -> bool:
        """Rank 0: the one that talks to the engine, the proxy and the rollouts."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def broadcast(self, value: T | None) -> T:
        """Rank 0's `value`, on every rank."""
        if not self.sharded:
            return value  # type: ignore[return-value]
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]

    def scatter(self, values: Sequence[T] | None) -> T:
        """Rank 0's `values[r]` on rank r."""
        if not self.sharded:
            assert values is not None
            return values[0]
        box: list[Any] = [None]
        dist.scatter_object_list(box, list(values) if self.leader and values is not None else None, src=0)
        return box[0]

    def gather(self, value: T) -> list[T]:
        """Every rank's `value`, in rank order, on every rank."""
        if not self.sharded:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        if self.sharded:
            dist.barrier()


def join(device: torch.device, timeout_s: float) -> Ranks:
    """This process's ranks: a process group from torchrun's environment when WORLD_SIZE > 1.

    `timeout_s` bounds every collective, and the followers wait in one for rank 0's next command while
    it waits for rollouts: it must outlast the slowest step.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Ranks()
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return Ranks.current()


def join_learner(device: str, timeout_s: float) -> Ranks:
    """`join` for a learner on `device` (`auto`: cuda when available), before anything else is started."""
    return join(torch.device(torch_device(device)), timeout_s)


def torch_device(name: str) -> str:
    """`auto`: cuda when available, else cpu; anything else as given."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def local_device(device: torch.device) -> torch.device:
    """Under torchrun, each process's own GPU (LOCAL_RANK); the device as given otherwise."""
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    return device


def leave() -> None:
    """Destroy the process group (at the end of a run), if there is one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def shard(policy: torch.nn.Module, model: torch.nn.Module, device: torch.device) -> None:
    """FSDP2 over `policy` (which holds `model`): each decoder layer its own unit, the rest (embeddings, final
    norm, LM head) at the root. On a GPU the layers compute in bf16 and the root in fp32, as one process does
    under autocast (the LM head and the loss in float32); gradients are reduced in fp32. They are summed across
    ranks (divide factor 1): the loss is already normalised over the step. Each shard moves to `device`.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layers = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if device.type == "cuda" else MixedPrecisionPolicy())
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=layers)
    fully_shard(policy, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no pre-multiplied one


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model (its `_no_split_modules`), each an FSDP unit."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules): cannot shard it")
    return layers


def balance(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """Indices of the rows each rank trains: longest first, each to the rank with the fewest tokens so far."""
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        shares[rank].append(index)
        load[rank] += lengths[index]
    return [sorted(share) for share in shares]


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded one (DTensor) is gathered from every rank (a collective), a plain one as is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
