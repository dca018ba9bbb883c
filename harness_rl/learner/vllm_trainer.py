"""The learner's side of vLLM's weight transfer in vLLM's own terms; imported once `vllm_transfer.import_vllm`
made vLLM importable. It imports exactly the names `vllm_transfer.VLLM_TRAINER_API` lists.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import math
import pickle
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
    IPCWeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

if TYPE_CHECKING:
    from harness_rl.learner import weight_source
    from harness_rl.learner.vllm_transfer import TrainerInit


# vLLM's trainer init info per transfer backend it ships (a plugin's backend brings its own).
INIT_INFO: dict[str, type] = {"nccl": NCCLTrainerInitInfo, "ipc": IPCTrainerInitInfo}
HANDLES, PICKLED = "ipc_handles", "ipc_handles_pickled"  # fields of IPCWeightTransferUpdateInfo


class HandlesOverJson:
    """vLLM's client protocol over one that sends JSON: an update's CUDA IPC handles (tuples naming a tensor's
    storage) go pickled and base64-encoded as `ipc_handles_pickled`, as vLLM's own HTTP client sends them
    (vLLM unpickles them only with VLLM_ALLOW_INSECURE_SERIALIZATION=1, which `sync_backends` starts it with)."""

    def __init__(self, client: VLLMWeightSyncClient) -> None:
        self.client = client

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.client.update_weights(json_update(update_info) if isinstance(update_info, dict) else update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.finish_weight_update(weight_version)


def json_update(update_info: dict[str, Any]) -> dict[str, Any]:
    """One update as JSON carries it (unchanged when it holds no IPC handles)."""
    if update_info.get(HANDLES) is None:
        return update_info
    wire = {name: value for name, value in update_info.items() if name != HANDLES}
    wire[PICKLED] = base64.b64encode(pickle.dumps(update_info[HANDLES])).decode()
    assert set(wire) <= {field.name for field in dataclasses.fields(IPCWeightTransferUpdateInfo)}, sorted(wire)
    return wire


class LearnerWeights(WeightSource):
    """The learner's weights of the push under way (`harness_rl.learner.weight_source`: full tensors under
    their Hugging Face names, FSDP shards gathered in the one pass every rank joins, a LoRA adapter
    merged) as vLLM's trainer engine sends them: cast to `dtype` when the engine serves another one,
    and a tied output head sent under its own name too, after the rest (vLLM reloads layer by layer,
    and a layer it is sent nothing for keeps its old weights)."""

    def __init__(self, weights: Callable[[], weight_source.WeightSource], dtype: torch.dtype | None) -> None:
        self.weights = weights
        self.dtype = dtype

    def metadata(self) -> list[ParamMeta]:
        source = self.weights()
        meta = [ParamMeta(m.name, self.dtype or m.dtype, m.shape) for m in source.metadata()]
        if source.tied is not None:
            head, embedding = source.tied
            meta.append(next(ParamMeta(head, m.dtype, m.shape) for m in meta if m.name == embedding))
        return meta

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        source = self.weights()
        tied = source.tied
        head: torch.Tensor | None = None
        for name, tensor in source:
            tensor = tensor.detach() if self.dtype is None else tensor.detach().to(self.dtype)
            if tied is not None and name == tied[1]:
                head = tensor
            yield name, tensor
        if tied is not None and head is not None:
            yield tied[0], head


def start_trainer(init: TrainerInit, client: VLLMWeightSyncClient,
                  weights: Callable[[], weight_source.WeightSource],
                  dtype: torch.dtype | None) -> TrainerWeightTransferEngine:
    """vLLM's trainer engine for `init.backend`, joined to vLLM's workers (with a rendezvous, this blocks in it).

    The init info is the backend's own type, given the fields of `init` it has; a packed buffer holds at least
    the largest tensor (vLLM's CUDA IPC producer refuses one that does not fit: an 8B model's embedding in
    bfloat16 is 1.2 GB, over its 1 GiB default)."""
    if init.plugin is not None:  # a backend of ours, added to vLLM's factories (`gloo`)
        module = importlib.import_module(init.plugin)
        module.register()
        info_type: type = module.TRAINER_INIT_INFO
    else:
        info_type = INIT_INFO[init.backend]
    source = LearnerWeights(weights, dtype)
    fields = {field.name: field for field in dataclasses.fields(info_type)}
    given = {name: value for name, value in msgspec.structs.asdict(init).items()
             if name in fields and value is not None}
    buffer = fields.get("packed_buffer_size_bytes")
    if init.packed and buffer is not None and isinstance(buffer.default, int) and buffer.name not in given:
        largest = max((math.prod(m.shape) * m.dtype.itemsize for m in source.metadata()), default=0)
        given[buffer.name] = max(largest, buffer.default)
    info = info_type(**given)
    assert info.backend == init.backend, (info.backend, init.backend)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=HandlesOverJson(client), source=source)
    assert isinstance(engine, NCCLTrainerWeightTransferEngine | IPCTrainerWeightTransferEngine)  # gloo's is NCCL's
    return engine
