"""A vLLM logits processor that makes a tiny random model say what a test wrote: think blocks, tool calls in the
family's own format, final answers. So vLLM's real tool-call and reasoning parsers see real structure, sampled
token by token like any reply.

vLLM loads it with `--logits-processors scripted_replies:ScriptedReplies` (tests/ on its PYTHONPATH). A request
is scripted by its sampling seed: `$HARNESS_RL_SCRIPTS` names a JSON file of `{seed: [token ids]}`, read when the
request arrives, so a test writes a turn's script just before it sends the turn. A script ends with the end of
turn token; a request whose seed has no script samples freely. One more key, `"plain": {"marker": id, "ids":
[...]}`, answers every request whose prompt lacks the token `marker` with `ids`, whatever its seed: an agent
CLI's tool-less side call (opencode's title) that races its first agent call for the session's first seed.
Scripted tokens are forced (every other logit -inf), so their behaviour logprobs are 0: tests re-score
unscripted replies only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

SCRIPTS_ENV = "HARNESS_RL_SCRIPTS"
PLAIN = "plain"


def read_scripts() -> dict[str, Any]:
    path = os.environ.get(SCRIPTS_ENV)
    if not path or not os.path.isfile(path):
        return {}
    with open(path) as file:
        return json.load(file)


class ScriptedReplies(AdapterLogitsProcessor):
    """Forces each scripted request's tokens in order; leaves every other request alone."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: Any) -> Callable[[list[int], list[int], torch.Tensor],
                                                                 torch.Tensor] | None:
        scripts = read_scripts()
        by_seed = scripts.get(str(params.seed)) if params.seed is not None else None
        plain = scripts.get(PLAIN)
        if not by_seed and plain is None:
            return None

        def force(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            script = plain["ids"] if plain is not None and plain["marker"] not in prompt_ids else by_seed
            at = len(output_ids)
            if not script or at >= len(script):
                return logits
            forced = torch.full_like(logits, float("-inf"))
            forced[script[at]] = 0.0
            return forced

        return force
