"""After every weight sync, check that the engine now serves the learner's weights.

The engine samples a few tokens from the end of a prompt the learner has just trained on, and the
learner scores them with its own weights. At equal weights the two agree to float rounding (about
1e-6 in fp32), so a sync that went wrong — a tied output head left out, a shard missed, a dtype cast,
weights pushed into the wrong engine — shows as `sync/logp_difference_max` on the step it happens,
not as a slow drift in the loss. The learner's own `sampling/sampling_logp_difference/*` sees only
tokens sampled by the weights it holds, which an asynchronous run (sampling one version behind)
rarely has.
"""

from __future__ import annotations

from typing import Any, Protocol

from harness_rl.learner.grpo import Mismatch

PROMPT_TOKENS = 256  # the prompt's tail: enough context to be a real prefix, cheap to forward every step


class EngineSampler(Protocol):
    """Samples a few tokens from the engine after a prompt, at the run's temperature (the run level's
    `EngineSampler` does it through the engine's token-in route)."""

    def sample(self, prompt: list[int]) -> tuple[list[int], list[float]]: ...

    def close(self) -> None: ...


def score(model: Any, turns: list[tuple[list[int], list[int], list[float]]], temperature: float) -> Mismatch:
    """The learner's logprobs of each turn's sampled ids (after its prompt) against the engine's; `model` is
    a causal LM or the learner's `PackedPolicy` (sharded: every rank scores the same turns)."""
    import torch

    from harness_rl.learner.packing import PackedPolicy, pack
    from harness_rl.learner.rows import NO_VERSION, Row
    from harness_rl.learner.samples import Sample

    rows = [Row(f"turn-{i}", prompt + ids, [0] * len(prompt) + [1] * len(ids), [0.0] * len(prompt) + logps,
                [NO_VERSION] * (len(prompt) + len(ids))) for i, (prompt, ids, logps) in enumerate(turns)]
    total = Mismatch()
    policy = model if isinstance(model, PackedPolicy) else PackedPolicy(model)
    device = next(model.parameters()).device
    with torch.no_grad():
        for batch in pack([Sample(row, row.rollout_id, 0.0) for row in rows if row.n_trained], token_budget=1 << 16):
            batch = batch.to(device)
            logps, _ = policy(batch, temperature, split_rows=True)
            total = total + Mismatch.of(logps, batch.behaviour_logps)
    return total
