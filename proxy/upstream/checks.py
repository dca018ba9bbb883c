"""An engine's sample checked before anyone sees it: ids, logprobs and usage must describe one sample.

Whole answers (`client.generate`) and streamed ones (`stream`) are held to the same checks, so a
sample the learner could not trust never becomes a turn.
"""

from __future__ import annotations

import functools
import math
from typing import Annotated

import msgspec

from proxy.errors import ProxyError
from proxy.upstream.wire import Usage

VLLM_HINT = ("start vLLM 0.32+ with `--enable-scale-out --logprobs-mode processed_logprobs "
             "--return-tokens-as-token-ids --generation-config vllm` (`harness-rl serve vllm` does)")


def check_usage(url: str, usage: Usage, prompt_tokens: int, sampled: int) -> None:
    """Refuse usage that counts another prompt or sample than the ids the engine sent."""
    if usage.completion_tokens != sampled or usage.prompt_tokens != prompt_tokens:
        raise ProxyError(502, f"the engine at {url} reported usage {usage.prompt_tokens}+{usage.completion_tokens} "
                              f"tokens for a {prompt_tokens}-token prompt and {sampled} sampled ids")


def check_sample(url: str, ids: list[int], logprob_ids: list[int], logps: list[float],
                 vocab_size: int | None = None) -> None:
    """Refuse a sample whose ids and logprobs do not describe one and the same sample of a distribution
    (C-speed scans: ids inside the vocabulary when its size is known, logprobs finite and at most 0)."""
    if len(logps) != len(ids):
        raise ProxyError(502, f"the engine at {url} returned {len(logps)} logprobs for {len(ids)} sampled tokens")
    if logprob_ids != ids:
        k = next(k for k, (a, e) in enumerate(zip(logprob_ids, ids, strict=True)) if a != e)
        raise ProxyError(502, f"the engine at {url} returned a logprob for token {logprob_ids[k]} at position {k} "
                              f"of sampled id {ids[k]}; {VLLM_HINT}")
    if ids and min(ids) < 0:
        raise ProxyError(502, f"the engine at {url} returned a negative token id {min(ids)}")
    if ids and vocab_size is not None and max(ids) >= vocab_size:
        raise ProxyError(502, f"the engine at {url} returned token id {max(ids)}, outside its {vocab_size}-token "
                              "vocabulary")
    bad = next((lp for lp in logps if not math.isfinite(lp) or lp > 0), None)
    if bad is not None:
        raise ProxyError(502, f"the engine at {url} returned a logprob {bad!r} that is not finite and <= 0")


@functools.cache
def ids_below(vocab_size: int) -> msgspec.json.Decoder:
    """A decoder that refuses an id outside a `vocab_size`-token vocabulary (one per size, kept)."""
    return msgspec.json.Decoder(list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]])
