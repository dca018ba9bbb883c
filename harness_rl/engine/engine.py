"""The embedded engine: a transformers causal LM behind one worker thread that batches requests.

The event loop never runs the model. `generate` queues a request and awaits its updates; the
worker admits waiting requests (prefilling each on its own), then decodes one token for every
running request per step, so concurrent requests share each forward pass. Weight loads and
pauses take effect between steps.
"""

import asyncio
import random
import threading
from collections import deque
from collections.abc import AsyncGenerator, Collection, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, cast

import torch
from transformers import DynamicCache

from harness_rl.cpu_threads import set_threads
from harness_rl.engine.batch import RunningBatch, cache_kv
from harness_rl.engine.generation import (
    Generation,
    GenerationUpdate,
    PromptLogprob,
    SampledToken,
    StopChecker,
)
from harness_rl.engine.prefix_cache import PrefixCache
from harness_rl.engine.prompt_logprobs import score_prompt
from harness_rl.engine.sampling import (
    LOGPROBS_MODES,
    LogprobsMode,
    SamplingParams,
    choose_token,
    processed_logprobs,
)

PauseMode = Literal["wait", "keep", "abort"]
PAUSE_MODES: tuple[str, ...] = ("wait", "keep", "abort")
DEFAULT_MAX_MODEL_LEN = 65536
# After a prefix-cache hit the suffix attends to the cache through an explicit mask (no fused causal
# kernel), so it runs in chunks to bound that mask, and only when the hit covers half the prompt.
PREFILL_CHUNK = 2048
# Prompt logprobs need every position's logits: prefill in chunks of at most this many logits.
PROMPT_LOGITS_BUDGET = 1 << 24


class EngineClosed(RuntimeError):
    """The engine was closed while a request was waiting or running."""


class Engine:
    """A model and its tokenizer, served to many concurrent requests by one batching worker."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        served_model_name: str,
        model_root: str | None = None,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        logprobs_mode: LogprobsMode = "processed_logprobs",
        seed: int = 0,
        max_batch_size: int = 32,
        policy_version: int = 0,
        prefix_cache_bytes: int = 1 << 30,
        batch_invariant: bool = False,
    ) -> None:
        """`model_root` is where the model was loaded from, which `/v1/models` reports as vLLM does (a proxy on this
        machine renders prompts with its tokenizer files); the served name when not given. `batch_invariant`
        computes each request alone (one at a time, no prefix cache): its tokens and logprobs then depend on
        nothing else the engine serves, whatever arrives when."""
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, not {logprobs_mode!r}")
        self.model: Any = cast(Any, model).eval()
        self.tokenizer = tokenizer
        self._vocab_size = int(self.model.config.get_text_config().vocab_size)
        self.served_model_name = served_model_name
        self.model_root = model_root or served_model_name
        limit = getattr(model.config, "max_position_embeddings", None) or max_model_len
        self.max_model_len = min(max_model_len, limit)
        self.logprobs_mode = logprobs_mode
        self.max_batch_size = 1 if batch_invariant else max_batch_size
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self._policy_version = policy_version
        self._rng = random.Random(seed)
        self._stops = StopChecker(tokenizer, self.eos_token_id)
        self._cond = threading.Condition()
        self._model_lock = threading.Lock()
        self._waiting: deque[Generation] = deque()
        self._batch = RunningBatch()
        self.prefix_cache = PrefixCache(0 if batch_invariant else prefix_cache_bytes)
        self._clear_prefix_cache = False
        self._active: list[Generation] = []
        self._paused = False
        self._frozen = False
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="engine-worker", daemon=True)
        self._worker.start()

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path = "tiny",
        *,
        cache_dir: Path | None = None,
        seed: int = 0,
        served_model_name: str | None = None,
        num_threads: int | None = None,
        **kwargs,
    ) -> "Engine":
        """Load a local causal-LM directory, or `"tiny"`: the offline tiny model, built if needed.

        `num_threads` sets torch's intra-op threads, which is process-wide (`cpu_threads.set_threads`).
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from harness_rl.engine.tiny_model import build_tiny_model, default_cache_dir

        if str(model) == "tiny":
            path = build_tiny_model(cache_dir or default_cache_dir(seed), seed=seed)
            name = served_model_name or "tiny"
        else:
            path = Path(model)
            if not path.is_dir():
                raise FileNotFoundError(f"model directory {path} does not exist (no hub downloads here)")
            name = served_model_name or path.name
        tokenizer = AutoTokenizer.from_pretrained(path)
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        set_threads(loaded, num_threads)
        return cls(loaded, tokenizer, served_model_name=name, model_root=str(path.resolve()), seed=seed, **kwargs)

    @property
    def policy_version(self) -> int:
        """Version of the weights new tokens are sampled with (set by `load_weights`)."""
        return self._policy_version

    @property
    def vocab_size(self) -> int:
        """Token ids below this are valid (the larger of the tokenizer's and the model's vocabulary)."""
        return max(len(self.tokenizer), self._vocab_size)

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def num_requests(self) -> int:
        """Requests waiting or running now (abandoned ones leave within one step)."""
        with self._cond:
            return sum(not g.finished for g in (*self._waiting, *self._active))

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        forced_ids: list[int] | None = None,
        request_id: str | None = None,
    ) -> AsyncGenerator[GenerationUpdate, None]:
        """Yield updates (one per sampled token) until the request finishes.

        `forced_ids` makes the completion those ids (teacher forcing) while every logprob is still
        the model's own for the request's sampling processing. Abandoning the iterator aborts it,
        and so does `abort([request_id])`.
        """
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        gen = Generation(
            prompt_ids=list(prompt_ids),
            params=params,
            generator=torch.Generator().manual_seed(seed),
            loop=asyncio.get_running_loop(),
            queue=asyncio.Queue(),
            forced_ids=forced_ids,
            request_id=request_id,
        )
        with self._cond:
            if self._closed:
                raise EngineClosed("the engine is shut down")
            self._waiting.append(gen)
            self._cond.notify_all()
        try:
            while True:
                update = await gen.queue.get()
                if isinstance(update, BaseException):
                    raise update
                yield update
                if update.finish_reason is not None:
                    return
        finally:
            if not gen.finished:
                gen.cancelled = True
                with self._cond:
                    self._cond.notify_all()

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy (a subset of) the model's parameters in place between steps and set the version."""
        params = self.model.state_dict(keep_vars=True)
        unknown = sorted(set(state_dict) - set(params))
        if unknown:
            raise KeyError(f"unknown parameter names: {unknown[:5]}{' …' if len(unknown) > 5 else ''}")
        for name, tensor in state_dict.items():
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(params[name].shape)}")
        with self._model_lock, torch.no_grad():
            for name, tensor in state_dict.items():
                params[name].copy_(tensor)
            self.prefix_cache.clear()
            self._policy_version = int(version)

    async def pause(self, mode: PauseMode = "wait") -> None:
        """Stop admitting requests. `wait`: return once running ones finish; `keep`: freeze them
        until resume; `abort`: end them now with finish_reason "abort"."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, not {mode!r}")
        with self._cond:
            self._paused = True
            if mode == "keep":
                self._frozen = True
            if mode == "abort":
                for gen in self._active:
                    gen.cancelled = True
            self._cond.notify_all()
        if mode == "keep":
            await asyncio.to_thread(self._model_lock.acquire)
            self._model_lock.release()
            return
        while self._active:
            await asyncio.sleep(0.005)

    def abort(self, request_ids: Collection[str]) -> None:
        """End the named requests with finish_reason "abort": running ones at their next step,
        waiting ones at once (vLLM's `/abort_requests`; unknown ids are ignored)."""
        with self._cond:
            for gen in self._active:
                if gen.request_id in request_ids:
                    gen.cancelled = True
            for gen in [g for g in self._waiting if g.request_id in request_ids]:
                self._waiting.remove(gen)
                gen.finished = True
                gen.send(GenerationUpdate((), "", "abort", None, self._policy_version))
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self._paused = self._frozen = False
            self._cond.notify_all()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix before the next prefill (weight updates do this themselves)."""
        self._clear_prefix_cache = True
        return True

    def abort_all(self) -> None:
        """End every waiting and running request now, with finish_reason "abort" (a server shutting down)."""
        with self._cond:
            for gen in self._waiting:
                gen.cancelled = gen.finished = True
                gen.send(GenerationUpdate((), "", "abort", None, self._policy_version))
            self._waiting.clear()
            for gen in self._active:
                gen.cancelled = True
            self._cond.notify_all()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the worker; waiting and running requests fail with `EngineClosed`.

        Waits up to `timeout` for the worker's current step (the worker is a daemon thread, so a
        process may exit while a long prefill still runs)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join(timeout=timeout)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._frozen or not (self._batch or self._admissible())):
                    self._cond.wait()
                if self._closed:
                    self._fail_all()
                    return
                admitted: list[Generation] = []
                while self._admissible() and len(self._batch) + len(admitted) < self.max_batch_size:
                    admitted.append(self._waiting.popleft())
                self._active = [*self._batch.generations, *admitted]
            try:
                with self._model_lock, torch.inference_mode():
                    for gen in admitted:
                        self._prefill(gen)
                    if self._batch:
                        self._decode_step()
            except Exception as error:  # a model failure must reach the callers, not kill the worker
                for gen in [*admitted, *self._batch.generations]:
                    if not gen.finished:
                        gen.finished = True
                        gen.send(error)
                self._batch = RunningBatch()
            with self._cond:
                self._active = list(self._batch.generations)

    def _admissible(self) -> bool:
        """Whether a waiting request can start now (dropping ones abandoned while waiting)."""
        while self._waiting and self._waiting[0].cancelled:
            self._waiting.popleft().finished = True
        return bool(self._waiting) and not self._paused

    def _prefill(self, gen: Generation) -> None:
        """Run the prompt (past its longest cached prefix) and choose the first token.

        The prompt's KV goes into the prefix cache at once, so requests admitted right after it
        with the same start (a group of rollouts of one task) reuse it. The cache tensors stored are
        never written to again: decoding grows a cache by concatenation, into new tensors."""
        gen.policy_version = self._policy_version
        if self._clear_prefix_cache:
            self._clear_prefix_cache = False
            self.prefix_cache.clear()
        prompt = gen.prompt_ids
        scoring = gen.params.prompt_logprobs is not None
        hit = None if scoring else self.prefix_cache.lookup(prompt, min_length=(len(prompt) + 1) // 2)
        cache = DynamicCache(hit.layers) if hit else DynamicCache()
        if scoring:
            start, step = 0, max(1, PROMPT_LOGITS_BUDGET // self._vocab_size)
        else:
            start, step = (hit.length, PREFILL_CHUNK) if hit else (0, len(prompt))
        scored: list[PromptLogprob] = []
        for begin in range(start, len(prompt), step):
            out = self.model(
                input_ids=torch.tensor([prompt[begin : begin + step]]),
                cache=cache,
                use_cache=True,
                logits_to_keep=0 if scoring else 1,
            )
            if scoring:
                top = gen.params.prompt_logprobs or 0
                scored += score_prompt(out.logits[0], prompt[begin + 1 : begin + step + 1], top)
        self.prefix_cache.store(prompt, cache_kv(cache))
        update = self._next_token(gen, out.logits[0, -1])
        if scoring:
            update = replace(update, prompt_logprobs=tuple(scored))
        if not gen.finished:
            self._batch.add(gen, cache)
        gen.send(update)

    def _decode_step(self) -> None:
        """One token for every running request; finished ones leave their KV in the prefix cache
        before their last update is sent, so an agent's next turn always finds it. A request kept
        across a weight load holds keys and values of the old weights: those are never cached."""
        running = list(self._batch.generations)
        out = self.model(**self._batch.step_inputs())
        self._batch.advance()
        updates = [self._next_token(gen, out.logits[row, -1]) for row, gen in enumerate(running)]
        for row, gen in enumerate(running):
            if gen.finished and not gen.cancelled and gen.policy_version == self._policy_version:
                self.prefix_cache.store(gen.prompt_ids + gen.token_ids[:-1], self._batch.row_kv(row))
        self._batch.keep([not gen.finished for gen in running])
        for gen, update in zip(running, updates, strict=True):
            gen.send(update)

    def _next_token(self, gen: Generation, logits: torch.Tensor) -> GenerationUpdate:
        """Choose (or take the forced) next token for `gen` and say what to report."""
        if gen.cancelled:
            gen.finished = True
            return GenerationUpdate((), "", "abort", None, gen.policy_version)
        params = gen.params
        processed = processed_logprobs(logits, params)
        forced = gen.next_forced()
        token = forced if forced is not None else choose_token(processed, params, gen.generator)
        reported = processed if self.logprobs_mode == "processed_logprobs" else torch.log_softmax(logits.float(), -1)
        top: tuple[tuple[int, float], ...] = ()
        rank = None
        if params.logprobs is not None:
            rank = int((reported > reported[token]).sum()) + 1
        if params.logprobs:
            values, ids = torch.topk(reported, min(params.logprobs, reported.shape[-1]))
            top = tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True))
        gen.token_ids.append(token)
        update = self._stops.step(gen)
        sampled = SampledToken(token, float(reported[token]), top, rank, self._policy_version)
        gen.finished = update.finish_reason is not None
        return GenerationUpdate((sampled,), update.text, update.finish_reason, update.stop_reason, gen.policy_version)

    def _fail_all(self) -> None:
        for gen in [*self._waiting, *self._batch.generations]:
            if not gen.finished:
                gen.finished = True
                gen.send(EngineClosed("the engine shut down before this request finished"))
        self._waiting.clear()
        self._batch = RunningBatch()
