"""Per-token weight versions: a generation kept across a weight load (`/pause?mode=keep`) reports one
`weight_versions` span per version, split where the new weights started sampling, and every logprob
is the one its own weights gave. Also `/inference/v1/abort_requests`. Own engine: weights change."""

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save

from harness_rl.engine import Engine, serve_in_thread

MESSAGES = [{"role": "user", "content": "Fix the bug."}]
EOS = 2  # the tiny model's <|im_end|>


@pytest.fixture
def own_engine(tiny_model_dir: Path) -> Iterator[Engine]:
    engine = Engine.from_pretrained(tiny_model_dir, served_model_name="tiny")
    yield engine
    engine.close()


@pytest.fixture
def own_url(own_engine: Engine) -> Iterator[str]:
    with serve_in_thread(own_engine) as server:
        yield server.url


def prompt(url: str) -> list[int]:
    return httpx.post(f"{url}/v1/chat/completions/render", json={"messages": MESSAGES}).json()["token_ids"]


def next_logprobs(model: torch.nn.Module, ids: list[int], cache: Any = None) -> list[float]:
    """T=1 logprobs of `ids[1:]` from one forward pass of `ids`, reading on from `cache` (keys and
    values of what came before, possibly computed by other weights) when given."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), cache=cache, use_cache=cache is not None).logits[0].double()
    rows = torch.log_softmax(logits[:-1], -1)
    return [float(rows[i, token]) for i, token in enumerate(ids[1:])]


def test_a_generation_kept_across_a_weight_load_reports_both_versions(
    own_engine: Engine, own_url: str, tiny_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in new.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    weights = save({name: t.contiguous() for name, t in new.state_dict().items()})
    ids_prompt = prompt(own_url)
    body = {
        "token_ids": ids_prompt,
        "sampling_params": {"seed": 4, "max_tokens": 600, "ignore_eos": True, "logprobs": 0},
        "stream": True,
    }
    ids: list[int] = []
    logprobs: list[float] = []
    spans = None
    with httpx.stream("POST", f"{own_url}/inference/v1/generate", json=body, timeout=300) as response:
        assert response.headers["x-policy-version"] == "0"
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            ids += choice["token_ids"]
            logprobs += [e["logprob"] for e in choice["logprobs"]["content"]]
            spans = choice["weight_versions"] or spans
            if len(ids) == 20:
                assert httpx.post(f"{own_url}/pause", params={"mode": "keep"}).json() == {"status": "paused"}
                update = httpx.post(
                    f"{own_url}/update_weights_from_bytes", params={"version": 1}, content=weights, timeout=60
                )
                assert update.status_code == 200
                assert httpx.post(f"{own_url}/resume").json() == {"status": "resumed"}
    assert len(ids) == 600
    boundary = spans[0]["end"]
    assert spans == [{"version": "0", "start": 0, "end": boundary}, {"version": "1", "start": boundary, "end": 600}]
    assert 20 <= boundary < 600
    # Before the boundary: the old weights over the whole sequence.
    before = next_logprobs(old, ids_prompt + ids[:boundary])[len(ids_prompt) - 1 :]
    assert max(abs(a - b) for a, b in zip(logprobs[:boundary], before, strict=True)) < 1e-4
    # After it: the new weights reading on from the cache the old weights computed (as the engine did).
    with torch.no_grad():
        cache = old(torch.tensor([ids_prompt + ids[: boundary - 1]]), use_cache=True).cache
    after = next_logprobs(new, ids[boundary - 1 :], cache)
    assert max(abs(a - b) for a, b in zip(logprobs[boundary:], after, strict=True)) < 1e-4
    stale = next_logprobs(old, ids_prompt + ids)[len(ids_prompt) - 1 + boundary :]
    assert max(abs(a - b) for a, b in zip(logprobs[boundary:], stale, strict=True)) > 0.05
    # The next turn extends the straddled sequence: its prompt is computed afresh by the new weights
    # (the old weights' keys and values of the kept request never reach the prefix cache).
    turn = ids_prompt + ids + [EOS]
    sampling = {"seed": 5, "max_tokens": 8, "ignore_eos": True, "logprobs": 0}
    reply = httpx.post(f"{own_url}/inference/v1/generate", json={"token_ids": turn, "sampling_params": sampling})
    choice = reply.json()["choices"][0]
    assert choice["weight_versions"] == [{"version": "1", "start": 0, "end": 8}]
    fresh = next_logprobs(new, turn + choice["token_ids"])[len(turn) - 1 :]
    assert max(abs(e["logprob"] - x) for e, x in zip(choice["logprobs"]["content"], fresh, strict=True)) < 1e-4


def test_abort_requests_ends_running_and_waiting_generations(own_engine: Engine, own_url: str) -> None:
    ids_prompt = prompt(own_url)
    long = {"max_tokens": 5000, "ignore_eos": True}
    with httpx.stream(
        "POST",
        f"{own_url}/inference/v1/generate",
        json={"token_ids": ids_prompt, "sampling_params": long, "stream": True, "request_id": "running"},
        timeout=120,
    ) as response:
        chunks = []
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: ") :]))
                if len(chunks) == 3:
                    aborted = httpx.post(f"{own_url}/inference/v1/abort_requests", json={"request_ids": ["running"]})
                    assert aborted.status_code == 200
    final = chunks[-1]["choices"][0]
    produced = sum(len(c["choices"][0]["token_ids"]) for c in chunks)
    assert final["finish_reason"] == "abort" and produced < 5000
    assert chunks[0]["request_id"] == "generate-tokens-running"
    assert final["weight_versions"] == [{"version": "0", "start": 0, "end": produced}]

    assert httpx.post(f"{own_url}/pause").status_code == 200
    replies: list[httpx.Response] = []
    body = {"token_ids": ids_prompt, "sampling_params": long, "request_id": "waiting"}
    waiting = threading.Thread(
        target=lambda: replies.append(httpx.post(f"{own_url}/inference/v1/generate", json=body, timeout=60))
    )
    waiting.start()
    deadline = time.monotonic() + 30
    while not own_engine._waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    httpx.post(f"{own_url}/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-waiting"]})
    waiting.join(timeout=30)
    httpx.post(f"{own_url}/resume")
    choice = replies[0].json()["choices"][0]
    assert choice["finish_reason"] == "abort" and choice["token_ids"] == [] and choice["weight_versions"] == []
