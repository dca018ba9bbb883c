"""What a weight sync sends: the policy's weights as the engine loads them, one whole tensor at a time.

Iterating a `WeightSource` yields `(Hugging Face name, full tensor)` pairs. Under FSDP each parameter
is all-gathered on the way, which is a collective: every rank iterates the same pass in lockstep,
exactly once per push, and only rank 0 hands the tensors to the engine (`drain` runs the rest of a
pass its consumer left, so a failed push never leaves the other ranks waiting). Only one tensor (with
a LoRA layer, its two adapter matrices too) is whole at a time, so a sync of a 32B model needs the
memory of its largest tensor, not of the model.

With LoRA, iteration gives the merged weights (W + (α/r)·B·A), for engines that serve full weights
(the embedded engine); `adapter()` gives the adapter alone, for engines that serve adapters (vLLM).

`WeightSync` backends consume it (`harness_rl.learner.weight_sync`); vLLM's own trainer-side
`WeightSource` (metadata, then a lockstep iteration) has the same shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from harness_rl.learner.distributed import Ranks, full_tensor

if TYPE_CHECKING:
    from harness_rl.learner.lora import Lora

Sends = Literal["weights", "adapter", "nothing"]


@dataclass(frozen=True)
class ParamMeta:
    """One tensor a pass will yield: its name, dtype and full shape (known without gathering)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


class WeightSource:
    """The weights of `model` (a transformers model, maybe sharded, maybe with a LoRA adapter)."""

    def __init__(self, model: torch.nn.Module, ranks: Ranks | None = None, lora: Lora | None = None) -> None:
        self.model = model
        self.ranks = ranks or Ranks()
        self.lora = lora
        self._pass: Iterator[tuple[str, torch.Tensor]] | None = None
        self._adapter_taken = False

    @property
    def tied(self) -> tuple[str, str] | None:
        """(output head's name, input embedding's name) when the head is the embedding: a pass yields it once,
        as the embedding; an engine that reloads layer by layer needs it under the head's name too."""
        model = self.model
        head = getattr(model, "get_output_embeddings", lambda: None)()
        embed = getattr(model, "get_input_embeddings", lambda: None)()
        if head is None or embed is None or head.weight is not embed.weight:
            return None
        names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        return f"{names[id(head)]}.weight", f"{names[id(embed)]}.weight"

    def metadata(self) -> list[ParamMeta]:
        """What a pass yields, in order, without gathering anything."""
        params = dict(self.model.named_parameters())
        return [ParamMeta(_hf_name(name, owner), params[name].dtype, tuple(params[name].shape))
                for name, owner in self._names()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """A fresh pass over the full weights (merged with the adapter, if any); a collective under FSDP."""
        self._pass = self._weights()
        return self._pass

    def adapter(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter's full tensors, by parameter name (a collective under FSDP)."""
        if self.lora is None:
            raise ValueError("this policy has no LoRA adapter (--lora-rank 0)")
        self._adapter_taken = True
        from harness_rl.learner.lora import is_adapter_parameter

        return {name: full_tensor(p.detach()) for name, p in self.model.named_parameters()
                if is_adapter_parameter(name)}

    def drain(self, sends: Sends) -> None:
        """Finish this rank's share of a push: the rest of a started pass, or a whole one of what rank 0 sends."""
        if not self.ranks.sharded or sends == "nothing":
            return
        if sends == "adapter":
            if not self._adapter_taken:
                self.adapter()
            return
        for _ in self._pass if self._pass is not None else iter(self):
            pass

    def _names(self) -> Iterator[tuple[str, str | None]]:
        if self.lora is None:
            return ((name, None) for name, _ in self.model.named_parameters())
        from harness_rl.learner.lora import split_names

        return split_names(self.model, self.lora.layers)

    def _weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        params = dict(self.model.named_parameters())
        for name, owner in self._names():
            tensor = full_tensor(params[name].detach())
            if owner is not None and name.endswith(".base_layer.weight"):
                assert self.lora is not None
                from harness_rl.learner.lora import ADAPTER_NAME, merged

                layer = self.lora.layers[owner]
                lora_a = full_tensor(layer.lora_A[ADAPTER_NAME].weight.detach())
                lora_b = full_tensor(layer.lora_B[ADAPTER_NAME].weight.detach())
                if self.ranks.leader:
                    tensor = merged(layer, tensor, lora_a, lora_b)
            yield _hf_name(name, owner), tensor


def _hf_name(name: str, owner: str | None) -> str:
    """A LoRA layer's frozen weight under the name the base model gives it."""
    return name.replace(".base_layer.", ".", 1) if owner is not None else name
