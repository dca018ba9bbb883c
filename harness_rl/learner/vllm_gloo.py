"""`gloo`: vLLM's NCCL weight transfer with gloo as the communicator, so its whole protocol runs on CPU.

vLLM 0.32 lets a backend be registered at run time. This module registers `gloo` on both sides:
- in vLLM (a general plugin, `register`, that `make vllm` installs into vLLM's virtualenv, so
  `--weight-transfer-config '{"backend":"gloo"}'` is accepted): `GlooWeightTransferEngine`, vLLM's
  `NCCLWeightTransferEngine` with its communicator swapped;
- in the trainer (`WeightTransferTrainerFactory`): `GlooTrainerWeightTransferEngine`, vLLM's
  `NCCLTrainerWeightTransferEngine` with its communicator swapped.

What stays vLLM's own: the rendezvous (`StatelessProcessGroup` over a TCPStore, the trainer rank 0,
workers from `rank_offset` 1), the init info the trainer sends (`NCCLWeightTransferInitInfo`, packed
geometry included), the per-round update info and its parsing, the trainer's round (start → update ∥
broadcast → finish, metadata checked against what is sent), the packing (`pack_tensors`,
`unpack_tensor`), and the worker's layerwise reload and `load_weights`. What differs: a gloo process
group instead of `PyNcclCommunicator`, and no CUDA streams (gloo calls return when the data is there).

Only torch and vLLM are imported: the same file is the plugin vLLM loads, copied into its virtualenv
as `harness_rl_vllm_gloo` by `scripts/install_vllm.sh`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo
from vllm.distributed.utils import StatelessProcessGroup
from vllm.distributed.weight_transfer.base import ParamMeta, VLLMWeightSyncClient, WeightSource
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferEngine,
    NCCLWeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor

BACKEND = "gloo"
TIMEOUT = timedelta(minutes=30)  # a broadcast waits this long for its peers (vLLM's store waits 300 s to form)


class GlooCommunicator:
    """What vLLM's NCCL engines use of `PyNcclCommunicator` (broadcast, destroy), over gloo.

    The group forms through vLLM's own `StatelessProcessGroup` rendezvous, as NCCL's does: rank 0 hosts
    the TCPStore at `master_address:master_port` and waits there for every other rank.
    """

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int) -> None:
        group = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank, world_size=world_size)
        self.group: ProcessGroupGloo | None = ProcessGroupGloo(PrefixStore("gloo", group.store), rank, world_size,
                                                               TIMEOUT)
        self.store = group.store

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        if self.group is None:
            raise RuntimeError("the gloo weight-transfer group was destroyed")
        options = torch.distributed.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([tensor], options).wait()  # type: ignore[attr-defined]  # not in torch's stubs

    def destroy(self) -> None:
        self.group = None


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's side: its NCCL engine (init info, update info, layerwise reload) receiving over gloo."""

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo) -> None:
        if init_info.master_address is None or init_info.master_port is None:
            raise ValueError("the gloo backend joins through master_address and master_port")
        self.packed = init_info.packed
        self.packed_buffer_size_bytes = init_info.packed_buffer_size_bytes
        self.packed_num_buffers = init_info.packed_num_buffers
        parallel = self.parallel_config  # this worker's rank, as vLLM's worker_init_process_group numbers it
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.model_update_group = GlooCommunicator(
            init_info.master_address, init_info.master_port, rank, init_info.world_size)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # no device to synchronize: gloo is done

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        group = self.model_update_group
        if group is None:
            raise RuntimeError("gloo weight transfer not initialized: call init_weight_transfer_engine first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        specs = [(name, shape, getattr(torch, dtype)) for name, dtype, shape in
                 zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True)]
        with disable_mtp_completeness_check():
            if not self.packed:
                for name, shape, dtype in specs:
                    weight = torch.empty(shape, dtype=dtype)
                    group.broadcast(weight, src=0)
                    self.model.load_weights([(name, weight)])
                return
            for chunk in packed_chunks(specs, self.packed_buffer_size_bytes):
                names, shapes, dtypes, sizes = (list(column) for column in zip(*chunk, strict=True))
                packed = torch.empty(sum(sizes), dtype=torch.uint8)
                group.broadcast(packed, src=0)
                self.model.load_weights(unpack_tensor(packed, names, shapes, dtypes, sizes))


def packed_chunks(specs: list[tuple[str, list[int], torch.dtype]],
                  buffer_size_bytes: int) -> Iterator[list[tuple[str, list[int], torch.dtype, int]]]:
    """The chunks the trainer's `pack_tensors` cuts: tensors in order, each chunk closed as soon as it
    holds more than `buffer_size_bytes` (vLLM's packed consumer cuts the same way)."""
    chunk: list[tuple[str, list[int], torch.dtype, int]] = []
    size = 0
    for name, shape, dtype in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        chunk.append((name, shape, dtype, nbytes))
        size += nbytes
        if size > buffer_size_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


@dataclass
class GlooTrainerInitInfo(NCCLTrainerInitInfo):
    """`NCCLTrainerInitInfo` under the `gloo` key: same fields, same wire parameters."""

    backend: ClassVar[str] = BACKEND


TRAINER_INIT_INFO = GlooTrainerInitInfo  # what the learner joins with (`vllm_trainer.start_trainer`)


class GlooTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
    """The trainer's side: vLLM's NCCL trainer engine (its `send_weights` round) broadcasting over gloo."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: NCCLTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> GlooTrainerWeightTransferEngine:
        """vLLM's NCCL `trainer_init`, step for step: the workers' init call runs on a side thread while
        this rank opens the group, since both block in the same rendezvous."""
        if source is None:
            raise ValueError("gloo trainer weight transfer requires a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, packed=init_info.packed,
                     packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
                     packed_num_buffers=init_info.packed_num_buffers)
        if not engine.is_sender:
            return engine
        workers = NCCLWeightTransferInitInfo(
            master_address=init_info.master_address, master_port=init_info.master_port, rank_offset=1,
            world_size=init_info.world_size, packed=init_info.packed,
            packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
            packed_num_buffers=init_info.packed_num_buffers)
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, worker_init_payload(workers))
            engine.model_update_group = GlooCommunicator(
                init_info.master_address, init_info.master_port, 0, init_info.world_size)
            joined.result()
        return engine

    def _broadcast(self, source: WeightSource, meta: list[ParamMeta]) -> None:
        group = self.model_update_group
        if not self.is_sender or group is None:
            super()._broadcast(source, meta)
            return
        pairs = self._checked_iter(source, meta)
        if not self.packed:
            for _name, tensor in pairs:
                group.broadcast(tensor.contiguous(), src=0)
            return
        while (chunk := pack_tensors(pairs, lambda item: item[1], self.packed_buffer_size_bytes)) is not None:
            group.broadcast(chunk.packed_tensor, src=0)


def register() -> None:
    """The vLLM general plugin (entry point group `vllm.general_plugins`): `gloo` on both registries.
    Lazy (by module path), and safe to run more than once per process, as vLLM requires of plugins."""
    for factory, engine in ((WeightTransferEngineFactory, "GlooWeightTransferEngine"),
                            (WeightTransferTrainerFactory, "GlooTrainerWeightTransferEngine")):
        try:
            factory.register_engine(BACKEND, __name__, engine)
        except ValueError:  # already registered in this process
            pass
