"""Sampled logprobs of vLLM-compatible engines against a local forward pass of the model they serve
(`engine_conformance.py --model-dir DIR`): the chat route and render → generate, at several
temperature / top-k / top-p settings. At equal weights the processed logprobs agree to float rounding.
"""

import math
from typing import Any

import aiohttp

MESSAGES = [{"role": "system", "content": "You are a coder."}, {"role": "user", "content": "List the files."}]
CAPTURE = {"logprobs": True, "top_logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}

SAMPLING = [(1.0, -1, 1.0), (0.7, -1, 1.0), (0.7, 40, 1.0), (1.0, -1, 0.9), (0.0, -1, 1.0)]


def reference_logprobs(
    model: Any, prompt: list[int], completion: list[int], temperature: float, top_k: int, top_p: float
) -> list[float]:
    """Processed logprobs from one forward pass: /T, top-k, top-p, renormalised (T=0: plain T=1)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].double()
    values = []
    for step, token in enumerate(completion):
        row = logits[len(prompt) - 1 + step]
        if temperature > 0:
            row = row / temperature
            if top_k > 0:
                row = row.masked_fill(row < torch.topk(row, top_k).values[-1], -math.inf)
            if top_p < 1:
                probs = torch.softmax(row, -1)
                order = torch.argsort(probs, descending=True)
                before = torch.cumsum(probs[order], 0) - probs[order]
                row = row.masked_fill(torch.isin(torch.arange(len(row)), order[before >= top_p]), -math.inf)
        values.append(float(torch.log_softmax(row, -1)[token]))
    return values


async def check_logprobs(urls: list[str], models: list[str | None], model_dir: str) -> None:
    """Each engine's sampled logprobs, from the chat route and from render → generate, against a
    local forward pass of the model both serve."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    print("\nprocessed logprobs vs a local forward pass (max |Δ| over 16 sampled tokens)")
    columns = [f"{route} {url}" for url in urls for route in ("chat", "generate")]
    print(f"{'T':>5} {'top_k':>6} {'top_p':>6}" + "".join(f"{column:>38}" for column in columns))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for temperature, top_k, top_p in SAMPLING:
            row = f"{temperature:>5} {top_k:>6} {top_p:>6}"
            for url, name in zip(urls, models, strict=True):
                base = url.rstrip("/")
                body = {
                    "messages": MESSAGES,
                    "max_tokens": 16,
                    "ignore_eos": True,
                    "temperature": temperature,
                    "top_k": top_k,
                    "top_p": top_p,
                    "seed": 3,
                    **CAPTURE,
                    **({"model": name} if name else {}),
                }
                async with session.post(f"{base}/v1/chat/completions", json=body) as response:
                    reply = await response.json()
                choice = reply["choices"][0]
                samples = [(reply["prompt_token_ids"], choice["token_ids"], choice["logprobs"]["content"])]
                async with session.post(f"{base}/v1/chat/completions/render", json=body) as response:
                    rendered = await response.json()
                rendered["sampling_params"]["max_tokens"] = 16  # render leaves vLLM's default 16 out
                async with session.post(f"{base}/inference/v1/generate", json=rendered) as response:
                    generated = (await response.json())["choices"][0]
                samples.append((rendered["token_ids"], generated["token_ids"], generated["logprobs"]["content"]))
                for prompt, ids, entries in samples:
                    expected = reference_logprobs(model, prompt, ids, temperature, top_k, top_p)
                    gap = max(abs(e["logprob"] - x) for e, x in zip(entries, expected, strict=True))
                    row += f"{gap:>38.2e}"
            print(row)
