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

from typing import TYPE_CHECKING, Any

from harness_rl.grpo import Mismatch
from proxy.engine_wire import SamplingParams
from proxy.upstream import EngineClient, Rendered

if TYPE_CHECKING:
    from harness_rl.background import BackgroundLoop

PROMPT_TOKENS = 256  # the prompt's tail: enough context to be a real prefix, cheap to forward every step


class SyncCheck:
    """Samples `tokens` tokens at the run's temperature from the engine at `url`, on the rollout loop."""

    def __init__(self, url: str, loop: BackgroundLoop, temperature: float, *, tokens: int = 16,
                 timeout_s: float = 120.0) -> None:
        self.loop = loop
        self.temperature = temperature
        self.tokens = tokens
        self.client = EngineClient(url, timeout_s=timeout_s, retries=2)
        self.loop.run(self.client.start())

    def sample(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        """Ids the engine samples after `prompt`, and their logprobs."""
        rendered = Rendered(text=b"".join(b"%d," % i for i in prompt), count=len(prompt))
        sampled = self.loop.run(self.client.generate(rendered, SamplingParams.capturing(
            temperature=self.temperature, max_tokens=self.tokens, seed=len(prompt))))
        return sampled.ids, sampled.logps

    def close(self) -> None:
        self.loop.run(self.client.close())


def score(model: Any, turns: list[tuple[list[int], list[int], list[float]]], temperature: float) -> Mismatch:
    """The learner's logprobs of each turn's sampled ids (after its prompt) against the engine's."""
    import torch

    from harness_rl.packing import pack, packed_logprobs
    from harness_rl.rows import NO_VERSION, Row
    from harness_rl.samples import Sample

    rows = [Row(f"turn-{i}", prompt + ids, [0] * len(prompt) + [1] * len(ids), [0.0] * len(prompt) + logps,
                [NO_VERSION] * (len(prompt) + len(ids))) for i, (prompt, ids, logps) in enumerate(turns)]
    total = Mismatch()
    device = next(model.parameters()).device
    with torch.no_grad():
        for batch in pack([Sample(row, row.rollout_id, 0.0) for row in rows if row.n_trained], token_budget=1 << 16):
            batch = batch.to(device)
            logps, _ = packed_logprobs(model, batch, temperature=temperature, split_rows=True)
            total = total + Mismatch.of(logps, batch.behaviour_logps)
    return total
