"""Embedded engine throughput, measured in one run and printed side by side.

1. 8 concurrent chat requests vs the same 8 sent one after another, over HTTP (tokens/s).
2. Our per-token cost for one request (in-process and over HTTP) vs `model.generate` directly.

    .venv/bin/python benchmarks/engine_bench.py [--tokens 128] [--model tiny|DIR] [--quick]
"""

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import aiohttp
import torch
from conventions import load_average, parse_args

from harness_rl.engine import Engine, SamplingParams, serve_in_thread

MESSAGES = [{"role": "user", "content": "Write a function that parses a config file and reports errors."}]


async def chat(session: aiohttp.ClientSession, url: str, tokens: int, seed: int) -> int:
    body = {
        "messages": MESSAGES,
        "max_tokens": tokens,
        "ignore_eos": True,
        "seed": seed,
        "logprobs": True,
        "return_token_ids": True,
    }
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        reply = await response.json()
    return len(reply["choices"][0]["token_ids"])


async def http_rates(url: str, tokens: int, streams: int) -> tuple[float, float]:
    async with aiohttp.ClientSession() as session:
        await chat(session, url, 8, 0)
        started = time.perf_counter()
        sequential = sum([await chat(session, url, tokens, seed) for seed in range(streams)])
        sequential_rate = sequential / (time.perf_counter() - started)
        started = time.perf_counter()
        concurrent = sum(await asyncio.gather(*(chat(session, url, tokens, seed) for seed in range(streams))))
        concurrent_rate = concurrent / (time.perf_counter() - started)
    return sequential_rate, concurrent_rate


def engine_seconds_per_token(engine: Engine, prompt: list[int], tokens: int, repeats: int) -> float:
    async def one() -> int:
        count = 0
        async for update in engine.generate(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, seed=0)):
            count += len(update.tokens)
        return count

    asyncio.run(one())
    started = time.perf_counter()
    produced = sum(asyncio.run(one()) for _ in range(repeats))
    return (time.perf_counter() - started) / produced


def generate_seconds_per_token(engine: Engine, prompt: list[int], tokens: int, repeats: int) -> float:
    inputs = torch.tensor([prompt])
    kwargs = {
        "do_sample": True,
        "max_new_tokens": tokens,
        "min_new_tokens": tokens,
        "top_k": 0,
        "top_p": 1.0,
        "pad_token_id": engine.tokenizer.pad_token_id,
    }
    with torch.inference_mode():
        engine.model.generate(inputs, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})
        started = time.perf_counter()
        produced = 0
        for _ in range(repeats):
            produced += engine.model.generate(inputs, **kwargs).shape[1] - len(prompt)
    return (time.perf_counter() - started) / produced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are printed")
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parse_args(parser, {"tokens": 16, "streams": 2, "repeats": 1})

    engine = Engine.from_pretrained(args.model, cache_dir=args.cache_dir)
    prompt = engine.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    rates, ours, direct = [], [], []
    try:
        with serve_in_thread(engine) as server:
            for _ in range(args.rounds):
                rates.append(asyncio.run(http_rates(server.url, args.tokens, args.streams)))
                ours.append(engine_seconds_per_token(engine, prompt, args.tokens, args.repeats))
                direct.append(generate_seconds_per_token(engine, prompt, args.tokens, args.repeats))
    finally:
        engine.close()
    sequential = statistics.median(r[0] for r in rates)
    concurrent = statistics.median(r[1] for r in rates)
    ours, direct = statistics.median(ours), statistics.median(direct)

    print(
        f"model {args.model}, {args.tokens} tokens per request, torch threads {torch.get_num_threads()}, "
        f"median of {args.rounds} interleaved rounds, {load_average()}"
    )
    print(f"{'':36}{'tokens/s':>12}")
    print(f"{f'{args.streams} sequential HTTP requests':36}{sequential:12.0f}")
    print(f"{f'{args.streams} concurrent HTTP requests':36}{concurrent:12.0f}")
    print(f"concurrent / sequential = {concurrent / sequential:.2f}x")
    print(f"{'':36}{'ms/token':>12}")
    print(f"{'model.generate (batch 1)':36}{direct * 1e3:12.3f}")
    print(f"{'Engine.generate (in-process)':36}{ours * 1e3:12.3f}")
    print(f"per-token overhead: Engine / model.generate = {ours / direct:.2f}x")


if __name__ == "__main__":
    main()
