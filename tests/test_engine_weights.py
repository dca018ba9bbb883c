"""Weight updates (in-process and HTTP) change the outputs and the recorded version; pause blocks
new work until resume. Uses its own engine so the shared one keeps its weights."""

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save, save_file

from harness_rl.engine import Engine, SamplingParams, serve_in_thread

MESSAGES = [{"role": "user", "content": "Fix the bug."}]
REQUEST = {
    "messages": MESSAGES,
    "seed": 9,
    "max_tokens": 12,
    "ignore_eos": True,
    "logprobs": True,
    "return_token_ids": True,
}


@pytest.fixture(scope="module")
def own_engine(tiny_model_dir: Path) -> Iterator[Engine]:
    engine = Engine.from_pretrained(tiny_model_dir)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def own_url(own_engine: Engine) -> Iterator[str]:
    with serve_in_thread(own_engine) as server:
        yield server.url


def snapshot(engine: Engine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine.model.named_parameters()}


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in state.items()}


def answer(url: str) -> tuple[list[int], list[float], str]:
    response = httpx.post(f"{url}/v1/chat/completions", json=REQUEST, timeout=60)
    choice = response.json()["choices"][0]
    return (
        choice["token_ids"],
        [e["logprob"] for e in choice["logprobs"]["content"]],
        response.headers["x-policy-version"],
    )


def test_in_process_and_http_updates_change_outputs_and_version(
    own_engine: Engine, own_url: str, tmp_path: Path
) -> None:
    original = snapshot(own_engine)
    ids0, logprobs0, version0 = answer(own_url)
    assert version0 == "0"

    assert len(own_engine.prefix_cache) > 0
    own_engine.load_weights(perturbed(original, 1), version=1)
    assert len(own_engine.prefix_cache) == 0
    ids1, logprobs1, version1 = answer(own_url)
    assert version1 == "1" and own_engine.policy_version == 1
    assert (ids1, logprobs1) != (ids0, logprobs0)

    save_file(perturbed(original, 2), tmp_path / "model.safetensors")
    reply = httpx.post(f"{own_url}/update_weights_from_disk", json={"path": str(tmp_path), "version": 2})
    assert reply.status_code == 200 and reply.json()["weight_version"] == "2"
    ids2, logprobs2, version2 = answer(own_url)
    assert version2 == "2" and httpx.get(f"{own_url}/weight_info").json() == {"weight_version": "2"}
    assert (ids2, logprobs2) != (ids1, logprobs1)

    reply = httpx.post(f"{own_url}/update_weights_from_bytes", params={"version": 3}, content=save(original))
    assert reply.status_code == 200 and reply.headers["x-policy-version"] == "3"
    assert answer(own_url) == (ids0, logprobs0, "3")


def test_bad_weight_updates_are_refused(own_engine: Engine, own_url: str, tmp_path: Path) -> None:
    version = own_engine.policy_version
    name, tensor = next(iter(snapshot(own_engine).items()))
    cases = [
        ("/update_weights_from_bytes", {"params": {"version": 9}, "content": save({"nope.weight": tensor})}),
        ("/update_weights_from_bytes", {"params": {"version": 9}, "content": save({name: tensor[:1]})}),
        ("/update_weights_from_bytes", {"content": save({name: tensor})}),
        ("/update_weights_from_bytes", {"params": {"version": 9}, "content": b"not safetensors"}),
        ("/update_weights_from_disk", {"json": {"path": str(tmp_path / "missing"), "version": 9}}),
    ]
    for route, kwargs in cases:
        response = httpx.post(f"{own_url}{route}", **kwargs)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"]
    assert own_engine.policy_version == version


def test_pause_blocks_new_work_until_resume(own_engine: Engine, own_url: str) -> None:
    assert httpx.post(f"{own_url}/pause").json() == {"status": "paused"}
    assert httpx.get(f"{own_url}/is_paused").json() == {"is_paused": True}
    done = threading.Event()
    thread = threading.Thread(target=lambda: (answer(own_url), done.set()))
    thread.start()
    assert not done.wait(0.5)
    assert httpx.post(f"{own_url}/resume").json() == {"status": "resumed"}
    assert done.wait(30)
    thread.join()
    assert httpx.get(f"{own_url}/is_paused").json() == {"is_paused": False}
    assert httpx.post(f"{own_url}/reset_prefix_cache").json() == {"success": True}
    assert httpx.post(f"{own_url}/pause", params={"mode": "later"}).status_code == 400


def test_pause_modes_wait_keep_abort(own_engine: Engine) -> None:
    prompt = own_engine.tokenizer.encode("hello", add_special_tokens=False)
    long = SamplingParams(max_tokens=400, seed=1, ignore_eos=True)

    async def scenario() -> None:
        sampling = asyncio.Event()  # set at a generation's first tokens

        async def generate() -> tuple[int, str]:
            count, finish = 0, ""
            async for update in own_engine.generate(prompt, long):
                count += len(update.tokens)
                finish = update.finish_reason or finish
                sampling.set()
            return count, finish

        running = asyncio.create_task(generate())
        await sampling.wait()
        await own_engine.pause("wait")
        assert running.done() and running.result() == (400, "length")
        own_engine.resume()

        sampling.clear()
        running = asyncio.create_task(generate())
        await sampling.wait()
        await own_engine.pause("abort")
        count, finish = await running
        assert finish == "abort" and count < 400
        own_engine.resume()

        tokens: list[int] = []

        async def collect() -> str:
            async for update in own_engine.generate(prompt, long):
                tokens.extend(t.token_id for t in update.tokens)
                sampling.set()
                if update.finish_reason:
                    return update.finish_reason
            return ""

        sampling.clear()
        running = asyncio.create_task(collect())
        await sampling.wait()
        await own_engine.pause("keep")
        await asyncio.sleep(0.05)
        frozen = len(tokens)
        await asyncio.sleep(0.3)
        assert len(tokens) == frozen < 400 and not running.done()
        own_engine.resume()
        assert await running == "length" and len(tokens) == 400

    started = time.monotonic()
    asyncio.run(scenario())
    assert time.monotonic() - started < 60


def test_a_client_leaving_mid_stream_frees_its_generation(own_url: str) -> None:
    body = {**REQUEST, "max_tokens": 5000, "stream": True}
    with httpx.stream("POST", f"{own_url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    started = time.monotonic()
    assert httpx.post(f"{own_url}/pause", timeout=60).json() == {"status": "paused"}
    assert time.monotonic() - started < 5
    httpx.post(f"{own_url}/resume")


def test_any_local_causal_lm_with_tied_embeddings_loads_and_takes_full_state_dicts(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama-tied")
    tokenizer.save_pretrained(tmp_path / "llama-tied")
    engine = Engine.from_pretrained(tmp_path / "llama-tied")
    try:
        assert engine.served_model_name == "llama-tied" and engine.max_model_len == 2048
        prompt = tokenizer.encode("hello there", add_special_tokens=False)
        params = SamplingParams(max_tokens=8, seed=4, ignore_eos=True)

        async def sample() -> list[int]:
            return [t.token_id async for u in engine.generate(prompt, params) for t in u.tokens]

        before = asyncio.run(sample())
        learner = AutoModelForCausalLM.from_config(config)
        engine.load_weights(learner.state_dict(), version=5)
        assert engine.policy_version == 5
        assert torch.equal(engine.model.lm_head.weight, learner.model.embed_tokens.weight)
        assert asyncio.run(sample()) != before
    finally:
        engine.close()


@pytest.mark.slow
def test_every_reply_is_exactly_the_weights_its_header_names(own_engine: Engine, own_url: str) -> None:
    """Traffic keeps flowing while the trainer's pause(wait) → update → resume cycles run: each
    reply's logprobs must come from the single weight version in its x-policy-version header."""
    from transformers import AutoModelForCausalLM

    original = snapshot(own_engine)
    versions = {100 + k: perturbed(original, 100 + k) for k in range(3)}
    replies: list[tuple[str, dict]] = []
    stop = threading.Event()

    def client(seed: int) -> None:
        with httpx.Client(timeout=60) as session:
            while not stop.is_set():
                body = {**REQUEST, "seed": seed, "max_tokens": 20, "return_tokens_as_token_ids": True}
                response = session.post(f"{own_url}/v1/chat/completions", json=body)
                replies.append((response.headers["x-policy-version"], response.json()))

    clients = [threading.Thread(target=client, args=(seed,)) for seed in range(4)]
    for thread in clients:
        thread.start()
    def replied(header: str | None) -> None:
        """Until a reply carries `header` (None: any reply), while the clients keep calling."""
        deadline = time.monotonic() + 60
        while not any(header in (None, got) for got, _ in replies):
            assert time.monotonic() < deadline, f"no reply of version {header} in 60 s"
            time.sleep(0.01)

    replied(None)  # traffic flows before the first cycle, and between cycles
    for version, state in versions.items():
        assert httpx.post(f"{own_url}/pause", params={"mode": "wait"}, timeout=60).status_code == 200
        reply = httpx.post(f"{own_url}/update_weights_from_bytes", params={"version": version}, content=save(state))
        assert reply.status_code == 200
        httpx.post(f"{own_url}/resume")
        replied(str(version))
    stop.set()
    for thread in clients:
        thread.join()
    own_engine.load_weights(original, version=0)

    model = AutoModelForCausalLM.from_pretrained(own_engine.model.name_or_path)
    seen = {header for header, _ in replies}
    assert {str(v) for v in versions} <= seen
    for version, state in versions.items():
        model.load_state_dict(state, strict=False)
        for header, body in replies:
            if header != str(version):
                continue
            choice = body["choices"][0]
            ids = body["prompt_token_ids"] + choice["token_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0]
            start = len(body["prompt_token_ids"]) - 1
            expected = torch.log_softmax(logits[start : start + len(choice["token_ids"])], -1)
            expected = expected.gather(1, torch.tensor(choice["token_ids"])[:, None])[:, 0]
            got = torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]])
            assert torch.allclose(got, expected, atol=1e-4), version
