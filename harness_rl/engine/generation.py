"""One request's generation state, owned by the worker thread, reported to the event loop."""

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch

from harness_rl.engine.sampling import SamplingParams


@dataclass(frozen=True)
class SampledToken:
    """One completion token with its logprob, the top alternatives and its rank (1 = most likely)
    when logprobs were asked for, and the weight version whose forward pass chose it."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()
    rank: int | None = None
    version: int = 0


@dataclass(frozen=True)
class PromptLogprob:
    """A prompt token's raw (T=1) logprob and rank (1 = most likely), with the top alternatives as
    `(token_id, logprob, rank)`, as vLLM reports `prompt_logprobs`."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float, int], ...] = ()


@dataclass(frozen=True)
class GenerationUpdate:
    """What one engine step adds to a request: new tokens, new stable text, maybe the end. The
    first update of a request that asked for `prompt_logprobs` carries them (position 0 has none).
    `policy_version` is the version the request started under; each token carries its own."""

    tokens: tuple[SampledToken, ...]
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    policy_version: int = 0
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None


@dataclass(eq=False)
class Generation:
    """A request in the engine: prompt, sampling, forced ids, and what it has produced so far."""

    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    forced_ids: list[int] | None = None
    request_id: str | None = None
    token_ids: list[int] = field(default_factory=list)
    emitted_chars: int = 0
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    policy_version: int = 0
    cancelled: bool = False
    finished: bool = False

    def next_forced(self) -> int | None:
        """The id a forced completion dictates next, or None when sampling freely."""
        if self.forced_ids is not None and len(self.token_ids) < len(self.forced_ids):
            return self.forced_ids[len(self.token_ids)]
        return None

    def send(self, update: Any) -> None:
        """Hand an update (or an exception) to the request's event loop; safe from any thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, update)
        except RuntimeError:  # the caller's loop is gone; nobody is listening any more
            self.cancelled = True


class StopChecker:
    """Detokenises a completion incrementally and finds the end of turn: eos, stop ids, stop strings.

    Text that could still turn out to be the start of a stop string is held back, and text ending
    in an incomplete UTF-8 sequence waits for the next token, so streamed pieces concatenate to
    exactly the final text (which excludes the stop string, as in vLLM).
    """

    def __init__(self, tokenizer: Any, eos_token_id: int | None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id

    def step(self, gen: Generation) -> GenerationUpdate:
        """Account for the token just appended to `gen.token_ids` and say what to report."""
        params = gen.params
        token = gen.token_ids[-1]
        finish: str | None = None
        stop_reason: int | str | None = None
        if token in params.stop_token_ids:  # the stop token's own text is left out, as vLLM does
            finish, stop_reason = "stop", token
            text = self._decoded(gen, gen.token_ids[:-1])
        else:
            text = self._decoded(gen, gen.token_ids)
            if token == self.eos_token_id and not params.ignore_eos:
                finish = "stop"
        if params.stop and finish is None:
            longest = max(len(s) for s in params.stop)
            start = max(0, gen.emitted_chars - longest)
            hits = [(text.find(s, start), s) for s in params.stop if text.find(s, start) >= 0]
            if hits:
                position, stop_reason = min(hits)
                text, finish = text[:position], "stop"
        if finish is None and len(gen.token_ids) >= params.max_tokens:
            finish = "length"
        if finish is None:
            stable = len(text) - (max(len(s) for s in params.stop) - 1 if params.stop else 0)
            if text.endswith("\ufffd"):
                stable = min(stable, len(text) - 1)
            text = text[: max(stable, gen.emitted_chars)]
        delta = text[gen.emitted_chars :]
        gen.emitted_chars = len(text)
        return GenerationUpdate(tokens=(), text=delta, finish_reason=finish, stop_reason=stop_reason)

    def _decoded(self, gen: Generation, ids: list[int]) -> str:
        """The text of `ids` (the completion so far), decoding only the last few tokens per step (as
        vLLM's incremental detokenizer does): text is committed once it no longer ends mid-character."""
        settled = self.tokenizer.decode(ids[gen.prefix_offset : gen.read_offset], skip_special_tokens=True)
        recent = self.tokenizer.decode(ids[gen.prefix_offset :], skip_special_tokens=True)
        tail = recent[len(settled) :]
        if tail and not tail.endswith("\ufffd"):
            gen.text += tail
            gen.prefix_offset, gen.read_offset = gen.read_offset, len(ids)
            return gen.text
        return gen.text + tail
