"""Returned logprobs equal an independent forward pass under the same processing (vLLM semantics)."""

import asyncio
import math

import pytest
import torch
from forward_reference import reference_logprobs

from harness_rl.engine import Engine, SamplingParams

PROMPT = [{"role": "user", "content": "Read the file and fix the failing test, please."}]


def run(engine: Engine, prompt: list[int], params: SamplingParams, forced: list[int] | None = None):
    async def go():
        tokens = []
        async for update in engine.generate(prompt, params, forced):
            tokens.extend(update.tokens)
        return [t.token_id for t in tokens], [t.logprob for t in tokens]

    return asyncio.run(go())


def prompt_ids(engine: Engine) -> list[int]:
    return engine.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 40, 1.0), (0.7, 40, 1.0), (1.0, 0, 0.9), (0.7, 200, 0.8)],
)
def test_sampled_logprobs_match_forward_pass(engine: Engine, temperature: float, top_k: int, top_p: float) -> None:
    prompt = prompt_ids(engine)
    params = SamplingParams(max_tokens=24, temperature=temperature, top_k=top_k, top_p=top_p, seed=11, ignore_eos=True)
    tokens, logprobs = run(engine, prompt, params)
    assert len(tokens) == 24
    expected = reference_logprobs(engine.model, prompt, tokens, params, raw=False)
    assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < 1e-4
    assert all(lp > -math.inf for lp in logprobs)


def test_raw_logprobs_ignore_temperature_and_filters(tiny_model_dir) -> None:
    engine = Engine.from_pretrained(tiny_model_dir, logprobs_mode="raw_logprobs")
    try:
        prompt = prompt_ids(engine)
        params = SamplingParams(max_tokens=16, temperature=0.7, top_k=40, seed=5, ignore_eos=True)
        tokens, logprobs = run(engine, prompt, params)
        expected = reference_logprobs(engine.model, prompt, tokens, params, raw=True)
        assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < 1e-4
    finally:
        engine.close()


def test_forced_tokens_carry_the_models_processed_logprobs(engine: Engine) -> None:
    prompt = prompt_ids(engine)
    forced = engine.tokenizer.encode("I will run the tests now.", add_special_tokens=False) + [engine.eos_token_id]
    params = SamplingParams(max_tokens=100, temperature=0.7, seed=1)
    tokens, logprobs = run(engine, prompt, params, forced)
    assert tokens == forced
    expected = reference_logprobs(engine.model, prompt, tokens, params, raw=False)
    assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < 1e-4


def test_same_seed_same_tokens_and_batching_does_not_change_them(engine: Engine) -> None:
    prompt = prompt_ids(engine)
    params = [SamplingParams(max_tokens=20, seed=seed, ignore_eos=True) for seed in range(6)]
    sequential = [run(engine, prompt, p)[0] for p in params]

    async def concurrently():
        async def one(p):
            return [t.token_id async for u in engine.generate(prompt, p) for t in u.tokens]

        return await asyncio.gather(*(one(p) for p in params))

    assert asyncio.run(concurrently()) == sequential
    assert sequential[0] == run(engine, prompt, params[0])[0]
    assert len({tuple(s) for s in sequential}) == len(sequential)


def test_greedy_is_argmax_with_t1_logprobs(engine: Engine) -> None:
    prompt = engine.tokenizer.encode("def main():\n    return", add_special_tokens=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens, logprobs = run(engine, prompt, params)
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + tokens])).logits[0]
    for step, token in enumerate(tokens):
        row = logits[len(prompt) - 1 + step]
        assert token == int(row.argmax())
        assert abs(logprobs[step] - float(torch.log_softmax(row, -1)[token])) < 1e-4


def test_stop_strings_and_max_tokens(engine: Engine) -> None:
    prompt = prompt_ids(engine)

    async def go(params):
        text, tokens, last = "", [], None
        async for update in engine.generate(prompt, params):
            text += update.text
            tokens += [t.token_id for t in update.tokens]
            last = update
        return text, tokens, last

    text, tokens, last = asyncio.run(go(SamplingParams(max_tokens=30, seed=2, ignore_eos=True)))
    assert last.finish_reason == "length" and len(tokens) == 30
    full = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    assert text == full
    stop = full[5:8]
    text2, tokens2, last2 = asyncio.run(go(SamplingParams(max_tokens=30, seed=2, ignore_eos=True, stop=(stop,))))
    assert (last2.finish_reason, last2.stop_reason) == ("stop", stop)
    assert text2 == full[: full.find(stop)]
    assert tokens2 == tokens[: len(tokens2)]
    assert stop in engine.tokenizer.decode(tokens2) and stop not in engine.tokenizer.decode(tokens2[:-1])


def test_prefix_cache_reuses_the_previous_turn_and_keeps_logprobs_exact(engine: Engine) -> None:
    first = prompt_ids(engine) + engine.tokenizer.encode("x " * 40, add_special_tokens=False)
    params = SamplingParams(max_tokens=12, temperature=0.7, top_k=40, seed=8, ignore_eos=True)
    completion, _ = run(engine, first, params)
    hits, reused = engine.prefix_cache.hits, engine.prefix_cache.reused_tokens
    second = first + completion + engine.tokenizer.encode("\nnext turn", add_special_tokens=False)
    tokens, logprobs = run(engine, second, params)
    assert engine.prefix_cache.hits == hits + 1
    assert engine.prefix_cache.reused_tokens - reused == len(first) + len(completion) - 1
    expected = reference_logprobs(engine.model, second, tokens, params, raw=False)
    assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < 1e-4

    assert engine.reset_prefix_cache()
    run(engine, second, params)
    assert engine.prefix_cache.hits == hits + 1


def test_streamed_text_pieces_equal_the_full_decode_even_mid_character(engine: Engine) -> None:
    tokenizer = engine.tokenizer
    generator = torch.Generator().manual_seed(0)
    scripts = [
        tokenizer.encode("héllo wörld — ✓ 日本語のテキスト 🚀🚀 done", add_special_tokens=False),
        torch.randint(3, 4090, (80,), generator=generator).tolist(),
    ]

    async def pieces(forced: list[int]) -> list[str]:
        params = SamplingParams(max_tokens=len(forced), ignore_eos=True)
        return [update.text async for update in engine.generate([1, 358, 201], params, forced)]

    for forced in scripts:
        texts = asyncio.run(pieces(forced))
        assert "".join(texts) == tokenizer.decode(forced, skip_special_tokens=True)
        assert not any(text.endswith("\ufffd") for text in texts[:-1] if text)


def test_requests_admitted_together_share_their_common_prompt(engine: Engine) -> None:
    shared = prompt_ids(engine) + engine.tokenizer.encode("y " * 60, add_special_tokens=False)
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=2, ignore_eos=True)
    hits = engine.prefix_cache.hits

    async def together() -> list[tuple[list[int], list[float]]]:
        async def one(suffix: str):
            prompt = shared + engine.tokenizer.encode(suffix, add_special_tokens=False)
            tokens = [t async for u in engine.generate(prompt, params) for t in u.tokens]
            return prompt, [t.token_id for t in tokens], [t.logprob for t in tokens]

        return await asyncio.gather(one(" first"), one(" second"), one(" third"))

    replies = asyncio.run(together())
    assert engine.prefix_cache.hits >= hits + 2
    for prompt, tokens, logprobs in replies:
        expected = reference_logprobs(engine.model, prompt, tokens, params, raw=False)
        assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < 1e-4
