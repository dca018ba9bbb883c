"""Logprobs from one independent forward pass, processed by hand as vLLM processes them."""

import math

import torch

from harness_rl.engine import SamplingParams


def reference_logprobs(
    model, prompt: list[int], completion: list[int], params: SamplingParams, raw: bool
) -> list[float]:
    """One full forward pass over prompt + completion, processed by hand: /T, top-k, top-p."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].double()
    values = []
    for step, token in enumerate(completion):
        row = logits[len(prompt) - 1 + step]
        if not raw and params.temperature > 0:
            row = row / params.temperature
            if params.top_k > 0:
                threshold = sorted(row.tolist(), reverse=True)[params.top_k - 1]
                row = torch.where(row >= threshold, row, torch.tensor(-math.inf, dtype=row.dtype))
            if params.top_p < 1:
                probs = torch.softmax(row, -1)
                order = torch.argsort(probs, descending=True)
                mass_before = torch.cumsum(probs[order], 0) - probs[order]
                keep = torch.zeros_like(row, dtype=torch.bool)
                keep[order[mass_before < params.top_p]] = True
                row = torch.where(keep, row, torch.tensor(-math.inf, dtype=row.dtype))
        values.append(float(torch.log_softmax(row, -1)[token]))
    return values
