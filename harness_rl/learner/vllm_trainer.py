"""The learner's side of vLLM's weight transfer in vLLM's own terms; imported once `vllm_transfer.import_vllm`
made vLLM importable. It imports exactly the names `vllm_transfer.VLLM_TRAINER_API` lists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    materialize_full_tensor,
)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

from harness_rl.learner.weight_sync import tied_head

if TYPE_CHECKING:
    from harness_rl.learner.vllm_transfer import TrainerInit


class LearnerWeights(WeightSource):
    """The weights of the model being pushed, as vLLM's trainer engine sends them: every parameter under
    its Hugging Face name, a tied output head under its own name too (vLLM reloads layer by layer, and
    a layer it is sent nothing for keeps its old weights), FSDP shards gathered whole (`full_tensor`,
    on every rank in the same order), cast to `dtype` when the engine serves another one."""

    def __init__(self, model: Callable[[], torch.nn.Module], dtype: torch.dtype | None) -> None:
        self.model = model
        self.dtype = dtype

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        model = self.model()
        tied = tied_head(model)
        return [*model.named_parameters(), *([tied] if tied is not None else [])]

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, self.dtype or p.dtype, tuple(p.shape)) for name, p in self._named()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self._named():
            tensor = materialize_full_tensor(p.detach())
            yield name, tensor if self.dtype is None else tensor.to(self.dtype)


def start_trainer(init: TrainerInit, client: VLLMWeightSyncClient, model: Callable[[], torch.nn.Module],
                  dtype: torch.dtype | None) -> TrainerWeightTransferEngine:
    """vLLM's trainer engine for `init.backend`, joined to vLLM's workers (this blocks in the rendezvous)."""
    info_type: type[NCCLTrainerInitInfo] = NCCLTrainerInitInfo
    if init.backend == "gloo":
        from harness_rl.learner import vllm_gloo

        vllm_gloo.register()
        info_type = vllm_gloo.GlooTrainerInitInfo
    packing = {key: value for key, value in (("packed_buffer_size_bytes", init.packed_buffer_size_bytes),
                                             ("packed_num_buffers", init.packed_num_buffers)) if value is not None}
    info = info_type(master_address=init.master_address, master_port=init.master_port, world_size=init.world_size,
                     packed=init.packed, rank=init.rank, **packing)
    assert info.backend == init.backend, (info.backend, init.backend)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=LearnerWeights(model, dtype))
    assert isinstance(engine, NCCLTrainerWeightTransferEngine)  # the gloo stand-in is one too
    return engine
