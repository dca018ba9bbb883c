"""Padding-free packing of samples into micro-batches, and per-token logprobs of a packed batch.

A micro-batch is one sequence: its rows concatenated, `position_ids` restarting at 0 for each row,
no padding and no attention mask. transformers reads the restarts as sequence boundaries: flash
attention turns them into varlen `cu_seqlens`, sdpa and eager build a block-diagonal causal mask,
so attention never crosses rows. That dense mask costs (Σ L)² where varlen costs Σ L², so without
flash attention (or with recurrent layers, which would carry state across rows) the forward runs
the micro-batch's rows one after another instead (same numbers, causal kernels, about 10× faster
for the tiny model on CPU).

Rows are placed first-fit decreasing into micro-batches of at most `token_budget` tokens; a row
longer than the budget gets a micro-batch of its own (never dropped: dropping long rows would bias
training toward short rollouts).

Logprobs are computed only where a trained token is predicted: the hidden states at those positions
go through the LM head in checkpointed chunks, so the full (tokens × vocab) logits never exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
from torch.utils.checkpoint import checkpoint

from harness_rl.learner.lora import ADAPTER_NAME, merged
from harness_rl.learner.samples import Sample

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class MicroBatch:
    """Packed rows plus, for each trained token, where it is predicted and how it was sampled."""

    input_ids: torch.Tensor  # (1, T)
    position_ids: torch.Tensor  # (1, T)
    target_index: torch.Tensor  # (N,) positions whose logits predict a trained token
    target_ids: torch.Tensor  # (N,)
    behaviour_logps: torch.Tensor  # (N,)
    versions: torch.Tensor  # (N,) the policy version that sampled each token (-1 when unknown)
    advantages: torch.Tensor  # (N,)
    weights: torch.Tensor  # (N,)
    row_index: torch.Tensor  # (N,) which of the micro-batch's rows the token is in
    row_lengths: list[int]

    @property
    def n_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def n_trained(self) -> int:
        return self.target_ids.shape[0]

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=True)
        return MicroBatch(**moved)


def plan_bins(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices of the items in each bin, first-fit decreasing; an item over budget gets its own bin."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        size = lengths[index]
        slot = next((b for b, free in enumerate(room) if free >= size), None)
        if slot is None:
            bins.append([index])
            room.append(token_budget - size)
        else:
            bins[slot].append(index)
            room[slot] -= size
    return bins


def pack(samples: Sequence[Sample], token_budget: int) -> list[MicroBatch]:
    return [_collate([samples[i] for i in plan]) for plan in plan_bins([len(s.row) for s in samples],
                                                                         token_budget)]


def _collate(samples: list[Sample]) -> MicroBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    target_index: list[int] = []
    target_ids: list[int] = []
    behaviour: list[float] = []
    versions: list[int] = []
    advantages: list[float] = []
    weights: list[float] = []
    row_index: list[int] = []
    for index, sample in enumerate(samples):
        row, offset = sample.row, len(input_ids)
        input_ids.extend(row.tokens)
        positions.extend(range(len(row)))
        for pos, m in enumerate(row.mask):
            if m:
                target_index.append(offset + pos - 1)
                target_ids.append(row.tokens[pos])
                behaviour.append(row.logprobs[pos])
                versions.append(row.versions[pos])
        n = len(target_ids) - len(advantages)
        advantages.extend([sample.advantage] * n)
        weights.extend([sample.weight] * n)
        row_index.extend([index] * n)
    return MicroBatch(
        input_ids=torch.tensor([input_ids]),
        position_ids=torch.tensor([positions]),
        target_index=torch.tensor(target_index),
        target_ids=torch.tensor(target_ids),
        behaviour_logps=torch.tensor(behaviour, dtype=torch.float32),
        versions=torch.tensor(versions, dtype=torch.long),
        advantages=torch.tensor(advantages, dtype=torch.float32),
        weights=torch.tensor(weights, dtype=torch.float32),
        row_index=torch.tensor(row_index),
        row_lengths=[len(s.row) for s in samples],
    )


def fill_fraction(batches: Sequence[MicroBatch], token_budget: int) -> float:
    """Share of the micro-batches' token budget holding real tokens (1.0 = no room wasted)."""
    return sum(b.n_tokens for b in batches) / (len(batches) * token_budget) if batches else 0.0


def packed_logprobs(
    model: PreTrainedModel, batch: MicroBatch, temperature: float = 1.0, chunk_size: int = 4096,
    split_rows: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each trained token under `model` at `temperature`, and the entropy there (detached).

    Logits are computed in float32 from the hidden states at the target positions only, chunk by
    chunk under activation checkpointing, to match the engine's processed (temperature-scaled)
    sampling logprobs without materialising the full logits. `split_rows` (default: unless
    `varlen_packing` holds) forwards the rows one by one rather than as one packed sequence.
    """
    if split_rows is None:
        split_rows = not varlen_packing(model)
    if split_rows:
        hidden = torch.cat([model.base_model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
                            for ids in batch.input_ids[0].split(batch.row_lengths)])
    else:
        hidden = model.base_model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                                  use_cache=False).last_hidden_state[0]
    selected = hidden.index_select(0, batch.target_index)
    weight, bias = output_head(model)
    logps, entropies = [], []
    for start in range(0, selected.shape[0], chunk_size):
        end = start + chunk_size
        lp, ent = checkpoint(_head_logprobs, selected[start:end], weight, bias, batch.target_ids[start:end],
                             temperature, use_reentrant=False)
        logps.append(lp)
        entropies.append(ent)
    if not logps:
        empty = selected.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(entropies)


def output_head(model: PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output head's weight and bias in float32. A head carrying a LoRA adapter (peft) computes with
    W + s·B·A, taken here from its parts, so that the adapter on the head trains."""
    head = model.get_output_embeddings()
    bias = None if getattr(head, "bias", None) is None else head.bias.float()
    if hasattr(head, "base_layer") and ADAPTER_NAME in getattr(head, "lora_A", {}):
        weight = merged(head, head.base_layer.weight.float(), head.lora_A[ADAPTER_NAME].weight,
                        head.lora_B[ADAPTER_NAME].weight)
        return weight, None if head.base_layer.bias is None else head.base_layer.bias.float()
    return head.weight.float(), bias


class PackedPolicy(torch.nn.Module):
    """A causal LM whose forward is `packed_logprobs`: one module call per micro-batch, so that a sharded
    (FSDP) model gathers its root parameters (embeddings, final norm, LM head) around the whole of it."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: MicroBatch, temperature: float = 1.0,
                split_rows: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return packed_logprobs(self.model, batch, temperature, split_rows=split_rows)


def varlen_packing(model: PreTrainedModel) -> bool:
    """Whether one packed forward keeps rows apart at varlen cost: flash attention, and attention in
    every layer (recurrent or convolutional mixers, as in hybrid linear-attention models, would carry
    state from one row into the next)."""
    config = model.config
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    return "flash" in str(config._attn_implementation) and layer_types <= {"full_attention", "sliding_attention"}


def _head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.autocast(hidden.device.type, enabled=False):  # the head stays float32 under bf16 autocast
        logits = torch.nn.functional.linear(hidden.float(), weight, bias) / temperature
        log_probs = torch.log_softmax(logits, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1).detach()
    return log_probs.gather(-1, targets[:, None])[:, 0], entropy
