"""The learner's side of vLLM's weight transfer in vLLM's own terms; imported once `vllm_transfer.import_vllm`
made vLLM importable. It imports exactly the names `vllm_transfer.VLLM_TRAINER_API` lists.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

if TYPE_CHECKING:
    from harness_rl.learner import weight_source
    from harness_rl.learner.vllm_transfer import TrainerInit


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
    """vLLM's trainer engine for `init.backend`, joined to vLLM's workers (this blocks in the rendezvous)."""
    info_type: type[NCCLTrainerInitInfo] = NCCLTrainerInitInfo
    if init.plugin is not None:  # a backend of ours, added to vLLM's factories (`gloo`)
        module = importlib.import_module(init.plugin)
        module.register()
        info_type = module.TRAINER_INIT_INFO
    packing = {key: value for key, value in (("packed_buffer_size_bytes", init.packed_buffer_size_bytes),
                                             ("packed_num_buffers", init.packed_num_buffers)) if value is not None}
    info = info_type(master_address=init.master_address, master_port=init.master_port, world_size=init.world_size,
                     packed=init.packed, rank=init.rank, **packing)
    assert info.backend == init.backend, (info.backend, init.backend)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=LearnerWeights(weights, dtype))
    assert isinstance(engine, NCCLTrainerWeightTransferEngine)  # the gloo stand-in is one too
    return engine
