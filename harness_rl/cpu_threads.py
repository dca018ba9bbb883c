"""How many CPU threads torch runs a model with: one for small models, torch's default for the rest.

Shared by the embedded engine and the learners (`harness-rl sft`), which run the same small models on the
same shared cores; torch is imported only when the threads are set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SMALL_MODEL_PARAMS = 50_000_000


def set_threads(model: torch.nn.Module, num_threads: int | None = None) -> None:
    """Set torch's intra-op threads (process-wide) for running `model` on the CPU.

    Left at None, models under `SMALL_MODEL_PARAMS` get 1: their kernels are too small to gain from
    threads, and multi-threaded kernels run ~10-20x slower when other processes share the cores
    (measured on the 2-core CI box, for generation and for training steps alike). Larger models keep
    torch's default.
    """
    import torch

    if num_threads is None and sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS:
        num_threads = 1
    if num_threads is not None:
        torch.set_num_threads(num_threads)
