"""A vLLM logits processor that makes a tiny random model say what a test wrote: think blocks, tool calls in the
family's own format, final answers. So vLLM's real tool-call and reasoning parsers see real structure, sampled
token by token like any reply.

vLLM loads it with `--logits-processors scripted_replies:ScriptedReplies` (tests/ on its PYTHONPATH). A request
is scripted by its sampling seed: `$HARNESS_RL_SCRIPTS` names a JSON file of `{seed: [token ids]}`, read when the
request arrives, so a test writes a turn's script just before it sends the turn. A script ends with the end of
turn token; a request whose seed has no script samples freely. Scripted tokens are forced (every other logit
-inf), so their behaviour logprobs are 0: tests re-score unscripted replies only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

SCRIPTS_ENV = "HARNESS_RL_SCRIPTS"


def read_scripts() -> dict[int, list[int]]:
    path = os.environ.get(SCRIPTS_ENV)
    if not path or not os.path.isfile(path):
        return {}
    with open(path) as file:
        return {int(seed): ids for seed, ids in json.load(file).items()}


class ScriptedReplies(AdapterLogitsProcessor):
    """Forces each scripted request's tokens in order; leaves every other request alone."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: Any) -> Callable[[list[int], torch.Tensor], torch.Tensor] | None:
        script = read_scripts().get(params.seed) if params.seed is not None else None
        if not script:
            return None

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            at = len(output_ids)
            if at >= len(script):
                return logits
            forced = torch.full_like(logits, float("-inf"))
            forced[script[at]] = 0.0
            return forced

        return force
