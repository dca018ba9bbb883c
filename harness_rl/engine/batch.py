"""The running batch: left-padded KV caches of several requests decoded together.

Requests join after their own prefill (batch of one, no padding, so long prompts use sdpa's causal
kernel) by left-padding the shorter cache, and leave by index selection; columns that only hold
padding are trimmed. Each row keeps its true positions, so rotary embeddings see no padding.
"""

import torch
from transformers import DynamicCache

from harness_rl.engine.generation import Generation


class RunningBatch:
    """Requests being decoded together, with their shared cache and attention mask."""

    def __init__(self) -> None:
        self.generations: list[Generation] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.lengths: list[int] = []

    def __len__(self) -> int:
        return len(self.generations)

    def add(self, gen: Generation, cache: DynamicCache) -> None:
        """Join a prefilled request (its cache holds exactly prompt + first token minus one)."""
        new_len = cache.get_seq_length()
        if self.cache is None:
            self.generations, self.cache = [gen], cache
            self.mask = torch.ones(1, new_len, dtype=torch.long)
            self.lengths = [new_len]
            return
        old_len = self.mask.shape[1]
        width = max(old_len, new_len)
        layers = []
        for (old_keys, old_values), (new_keys, new_values) in zip(cache_kv(self.cache), cache_kv(cache), strict=True):
            keys = torch.cat([_left_pad(old_keys, width), _left_pad(new_keys, width)])
            values = torch.cat([_left_pad(old_values, width), _left_pad(new_values, width)])
            layers.append((keys, values))
        self.cache = DynamicCache(layers)
        new_mask = torch.ones(1, new_len, dtype=torch.long)
        self.mask = torch.cat([_left_pad(self.mask, width), _left_pad(new_mask, width)])
        self.generations.append(gen)
        self.lengths.append(new_len)

    def step_inputs(self) -> dict:
        """Model inputs for decoding one token per row (each row's last sampled token)."""
        self.mask = torch.cat([self.mask, torch.ones(len(self), 1, dtype=torch.long)], dim=1)
        return {
            "input_ids": torch.tensor([[g.token_ids[-1]] for g in self.generations]),
            "position_ids": torch.tensor([[n] for n in self.lengths]),
            "attention_mask": self.mask,
            "cache": self.cache,
            "use_cache": True,
        }

    def advance(self) -> None:
        """Record that every row now holds one more real token."""
        self.lengths = [n + 1 for n in self.lengths]

    def row_kv(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of one row's keys and values without padding (for the prefix cache)."""
        length = self.lengths[row]
        return [
            (keys[row : row + 1, :, -length:].clone(), values[row : row + 1, :, -length:].clone())
            for keys, values in cache_kv(self.cache)
        ]

    def keep(self, keep: list[bool]) -> None:
        """Drop finished rows and padding columns no row needs any more."""
        if all(keep):
            return
        indices = torch.tensor([i for i, k in enumerate(keep) if k], dtype=torch.long)
        self.generations = [g for g, k in zip(self.generations, keep, strict=True) if k]
        self.lengths = [n for n, k in zip(self.lengths, keep, strict=True) if k]
        if not self.generations:
            self.cache, self.mask = None, torch.zeros(0, 0, dtype=torch.long)
            return
        mask = self.mask[indices]
        first = int(mask.any(dim=0).long().argmax())
        self.mask = mask[:, first:]
        self.cache = DynamicCache(
            [(keys[indices, :, first:], values[indices, :, first:]) for keys, values in cache_kv(self.cache)]
        )


def cache_kv(cache: DynamicCache | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each attention layer's (keys, values) of a filled cache (the engine serves attention-only models)."""
    if cache is None:
        return []
    out = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        assert isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor), "an empty or non-KV cache layer"
        out.append((keys, values))
    return out


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Pad dimension -2 (sequence) of a KV tensor, or the last of a mask, on the left with zeros."""
    if tensor.dim() == 2:
        missing = width - tensor.shape[1]
        return torch.nn.functional.pad(tensor, (missing, 0)) if missing else tensor
    missing = width - tensor.shape[-2]
    return torch.nn.functional.pad(tensor, (0, 0, missing, 0)) if missing else tensor
