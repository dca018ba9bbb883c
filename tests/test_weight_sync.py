"""Weight sync into the embedded engine (in process and over HTTP), the proxy gate around any backend, and a
tied output head through each backend. vLLM's transfer: test_vllm_transfer.py and test_vllm_weight_transfer.py."""

import json
import re

import pytest
import torch
from fake_vllm import FakeVllm

from harness_rl.background import BackgroundLoop
from harness_rl.learner.weight_sync import WeightSyncError
from harness_rl.run.proxy_gate import ProxyGate
from proxy.client import ProxyClient


@pytest.fixture
def vllm():
    server = FakeVllm()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def loop():
    with BackgroundLoop("sync") as background:
        yield background


@pytest.fixture
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1, bias=False))


# ---------------------------------------------------------------------------------------------
# The embedded engine, in this process and over HTTP


@pytest.fixture
def trained_copy(tiny_model_dir):
    """The tiny model with every weight moved, as a learner would have it after a step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    return model


def assert_same_weights(engine, model):
    engine_params = dict(engine.model.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(engine_params[name], p), name


def test_in_process_sync_copies_the_weights_and_sets_the_version(tiny_model_dir, trained_copy):
    from harness_rl.engine import Engine
    from harness_rl.learner.weight_sync import InProcessSync

    engine = Engine.from_pretrained(tiny_model_dir)
    try:
        InProcessSync(engine).push(trained_copy, version=7)
        assert engine.policy_version == 7
        assert_same_weights(engine, trained_copy)
        with torch.no_grad():
            next(trained_copy.parameters()).add_(1.0)
        assert not torch.equal(next(engine.model.parameters()), next(trained_copy.parameters()))  # a copy
    finally:
        engine.close()


def test_http_sync_updates_an_engine_in_another_server_and_leaves_it_serving(tiny_model_dir, trained_copy, loop):
    import urllib.request

    from harness_rl.engine import Engine, serve_in_thread
    from harness_rl.learner.weight_sync import HttpEngineSync

    engine = Engine.from_pretrained(tiny_model_dir)
    try:
        with serve_in_thread(engine) as server:
            sync = HttpEngineSync(server.url, loop, timeout_s=30)
            sync.push(trained_copy, version=3)
            sync.close()
            info = json.loads(urllib.request.urlopen(f"{server.url}/weight_info").read())
            assert info == {"weight_version": "3"}
            assert not engine.is_paused
            assert_same_weights(engine, trained_copy)
    finally:
        engine.close()


def test_http_sync_failure_names_the_route_and_resumes(tiny_model_dir, loop):
    from transformers import AutoModelForCausalLM

    from harness_rl.engine import Engine, serve_in_thread
    from harness_rl.learner.weight_sync import HttpEngineSync

    wrong = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    wrong.model.embed_tokens.weight = torch.nn.Parameter(torch.zeros(3, 3))
    engine = Engine.from_pretrained(tiny_model_dir)
    try:
        with serve_in_thread(engine) as server:
            sync = HttpEngineSync(server.url, loop, timeout_s=30)
            with pytest.raises(WeightSyncError,
                               match=r"POST /update_weights_from_bytes\?version=1 failed: HTTP 400: .*shape"):
                sync.push(wrong, version=1)
            sync.close()
            assert not engine.is_paused and engine.policy_version == 0
    finally:
        engine.close()


ALL_CALLS = ["POST /pause?mode=keep", "POST /reset_prefix_cache", "POST /resume"]


@pytest.mark.parametrize(("failing", "raised", "note", "calls"), [
    ((), None, None, ALL_CALLS),
    (("/pause",), "POST /pause?mode=keep failed", None, [ALL_CALLS[0], ALL_CALLS[2]]),
    (("/reset_prefix_cache",), "POST /reset_prefix_cache failed", None, ALL_CALLS),
    (("/resume",), "POST /resume failed", None, ALL_CALLS),
    (("/reset_prefix_cache", "/resume"), "POST /reset_prefix_cache failed", "then POST /resume failed", ALL_CALLS),
])
def test_a_paused_engine_is_resumed_whatever_failed(vllm, loop, failing, raised, note, calls):
    """Every sync backend's pause → ... → resume: the resume is always tried (a pause that seemed to fail may have
    paused), the body's error wins, and a failed resume is raised or noted on it, never lost."""
    from harness_rl.learner.weight_sync import EngineControl

    control = EngineControl(vllm.url, timeout_s=10)
    vllm.fail = {route: 500 for route in failing}

    async def push() -> None:
        try:
            async with control.paused("keep"):
                await control.call("POST", "/reset_prefix_cache")
        finally:
            await control.close()

    if raised is None:
        loop.run(push())
    else:
        with pytest.raises(WeightSyncError, match=f"^{re.escape(raised)}") as caught:
            loop.run(push())
        notes = getattr(caught.value, "__notes__", [])
        assert [n[:len(note)] for n in notes] == ([note] if note else [])
    assert vllm.calls == calls


class RecordingSync:
    keeps_requests = False

    def __init__(self, server: FakeVllm, error: Exception | None = None) -> None:
        self.server, self.error, self.closed = server, error, False

    def push(self, model, version: int) -> None:
        self.server.calls.append(f"inner push {version}")
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.closed = True


def test_proxy_gate_holds_agents_around_the_push_and_stamps_the_version(vllm, model, loop):
    inner = RecordingSync(vllm)
    gate = ProxyGate(inner, ProxyClient(vllm.url, "s3cret", timeout_s=5), loop)
    gate.push(model, version=5)
    gate.close()
    assert vllm.calls == ["POST /admin/pause", "inner push 5", "POST /admin/policy_version", "POST /admin/resume"]
    assert vllm.bodies["/admin/policy_version"] == {"version": 5}
    assert vllm.authorization == "Bearer s3cret" and inner.closed


def test_proxy_gate_resumes_the_proxy_when_the_inner_sync_fails(vllm, model, loop):
    gate = ProxyGate(RecordingSync(vllm, WeightSyncError("POST /update_weights failed: HTTP 500")),
                     ProxyClient(vllm.url, "t", timeout_s=5), loop)
    with pytest.raises(WeightSyncError, match="update_weights failed"):
        gate.push(model, version=1)
    gate.close()
    assert vllm.calls == ["POST /admin/pause", "inner push 1", "POST /admin/resume"]


def test_a_tied_output_head_is_sent_once_and_both_backends_accept_it(tiny_model_dir, tmp_path, loop):
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from harness_rl.engine import Engine, serve_in_thread
    from harness_rl.learner.weight_sync import HttpEngineSync, InProcessSync, parameters

    tied_dir = tmp_path / "tied"
    shutil.copytree(tiny_model_dir, tied_dir)
    config = json.loads((tied_dir / "config.json").read_text())
    (tied_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(tied_dir / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tied_dir / "model.safetensors", metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(tied_dir, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in parameters(model)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.5)
    for backend in ("in-process", "http"):
        engine = Engine.from_pretrained(tied_dir)
        try:
            if backend == "in-process":
                InProcessSync(engine).push(model, version=1)
            else:
                with serve_in_thread(engine) as server:
                    sync = HttpEngineSync(server.url, loop, timeout_s=30)
                    sync.push(model, version=1)
                    sync.close()
            assert torch.equal(engine.model.lm_head.weight, model.lm_head.weight), backend
        finally:
            engine.close()
