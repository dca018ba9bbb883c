"""Weight sync: vLLM's control-plane order against a fake vLLM server, failures that still resume."""

import asyncio
import json
import threading
import time

import pytest
import torch
from aiohttp import web

from harness_rl.background import BackgroundLoop
from harness_rl.learner.weight_sync import VllmNcclSync, WeightSyncError, free_port
from harness_rl.run.proxy_gate import ProxyGate
from proxy.client import ProxyClient

PUSH_ORDER = ["POST /pause?mode=wait", "POST /start_weight_update", "POST /update_weights",
              "POST /finish_weight_update", "POST /reset_prefix_cache", "POST /resume"]


class FakeVllm:
    """vLLM's dev-mode control routes on loopback. `/update_weights` and `/init_weight_transfer_engine`
    block until the trainer's side of the transfer has started, as the real ones block on NCCL."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.bodies: dict[str, object] = {}
        self.fail: dict[str, int] = {}
        self.hang: set[str] = set()
        self.trainer_joined = threading.Event()
        self.server_joined = threading.Event()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.Response:
        route = request.path
        self.calls.append(f"{request.method} {route}" + (f"?{request.query_string}" if request.query_string else ""))
        self.authorization = request.headers.get("Authorization")
        if request.can_read_body:
            self.bodies[route] = await request.json()
        if route in self.hang:
            await asyncio.sleep(2.5)
        if route in self.fail:
            return web.json_response({"error": f"{route} exploded"}, status=self.fail[route])
        if route in ("/update_weights", "/init_weight_transfer_engine"):
            self.server_joined.set()
            joined = await asyncio.to_thread(self.trainer_joined.wait, 5)
            self.trainer_joined.clear()
            if not joined:
                return web.json_response({"error": "trainer never joined"}, status=500)
        if route == "/get_world_size":
            return web.json_response({"world_size": 2})
        if route == "/admin/pause":
            return web.json_response({"paused": True, "in_flight": 0})
        if route == "/admin/resume":
            return web.json_response({"paused": False})
        if route == "/admin/policy_version":
            return web.json_response(self.bodies[route])
        return web.json_response({"status": "ok"})

    def start(self) -> None:
        self.loop = BackgroundLoop("fake-vllm")
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)

        async def serve() -> None:
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

        self.loop.run(serve())

    def stop(self) -> None:
        self.loop.run(self.runner.cleanup(), timeout=10)
        self.loop.close()


class FakeNccl:
    """The trainer's side of the broadcast: it needs the server to be receiving, as NCCL does."""

    def __init__(self, server: FakeVllm, stuck: bool = False) -> None:
        self.server, self.stuck = server, stuck
        self.inits: list[tuple[str, int, int]] = []
        self.sent: list[list[str]] = []

    def init(self, master_address: str, master_port: int, world_size: int) -> None:
        assert self.server.server_joined.wait(5), "server never entered the rendezvous"
        self.server.server_joined.clear()
        self.inits.append((master_address, master_port, world_size))
        self.server.trainer_joined.set()

    def send(self, tensors) -> None:
        assert self.server.server_joined.wait(5), "update_weights was not in flight during the broadcast"
        self.server.server_joined.clear()
        if self.stuck:
            time.sleep(2.5)
        self.sent.append([name for name, _ in tensors])
        self.server.trainer_joined.set()


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


def test_push_follows_vllm_order_with_the_broadcast_during_update_weights(vllm, model, loop):
    nccl = FakeNccl(vllm)
    sync = VllmNcclSync(vllm.url, loop, master_port=29555, transport=nccl, control_timeout_s=5, transfer_timeout_s=10)
    sync.push(model, version=3)
    sync.dtype = torch.bfloat16  # a bf16 engine: the trainer's float32 weights are cast on the way
    sync.push(model, version=4)
    sync.close()
    assert vllm.calls == ["GET /get_world_size", "POST /init_weight_transfer_engine"] + PUSH_ORDER * 2
    assert vllm.bodies["/init_weight_transfer_engine"] == {"init_info": {
        "master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 3}}
    assert nccl.inits == [("127.0.0.1", 29555, 3)]
    names = ["0.weight", "0.bias", "1.weight"]
    assert nccl.sent == [names, names]  # announce order == broadcast order
    assert vllm.bodies["/update_weights"] == {"update_info": {
        "names": names, "dtype_names": ["bfloat16"] * 3, "shapes": [[2, 3], [2], [1, 2]], "packed": True}}
    assert vllm.bodies["/finish_weight_update"] == {"weight_version": "4"}


@pytest.mark.parametrize("route", ["/pause", "/start_weight_update", "/update_weights",
                                   "/finish_weight_update", "/reset_prefix_cache"])
def test_a_failing_step_raises_a_clear_error_and_still_resumes(vllm, model, route, loop):
    sync = VllmNcclSync(vllm.url, loop, transport=FakeNccl(vllm), control_timeout_s=5, transfer_timeout_s=3)
    sync.init()
    vllm.calls.clear()
    vllm.fail[route] = 500
    with pytest.raises(WeightSyncError, match=f"POST {route}(\\?[^ ]*)? failed: HTTP 500: .*exploded"):
        sync.push(model, version=1)
    sync.close()
    assert vllm.calls[-1] == "POST /resume"
    step = next(i for i, call in enumerate(PUSH_ORDER) if call.startswith(f"POST {route}"))
    assert vllm.calls[:step + 1] == PUSH_ORDER[:step + 1]
    if route in ("/update_weights",):  # an update was started: it is finished before resuming
        assert vllm.calls[-2:] == ["POST /finish_weight_update", "POST /resume"]


def test_a_stuck_broadcast_times_out_instead_of_hanging_and_resumes(vllm, model, loop):
    sync = VllmNcclSync(vllm.url, loop, transport=FakeNccl(vllm, stuck=True), control_timeout_s=5, transfer_timeout_s=1)
    sync._ready = True  # joined earlier
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match="update_weights timed out after 1s"):
        sync.push(model, version=1)
    assert time.monotonic() - started < 5
    assert vllm.calls[-2:] == ["POST /finish_weight_update", "POST /resume"]
    sync.close()


def test_a_hanging_control_route_times_out_and_resumes(vllm, model, loop):
    vllm.hang.add("/reset_prefix_cache")
    sync = VllmNcclSync(vllm.url, loop, transport=FakeNccl(vllm), control_timeout_s=1, transfer_timeout_s=5)
    with pytest.raises(WeightSyncError, match="POST /reset_prefix_cache timed out after 1s"):
        sync.push(model, version=1)
    assert vllm.calls[-1] == "POST /resume"
    sync.close()


def test_an_unreachable_server_is_named(loop):
    sync = VllmNcclSync(f"http://127.0.0.1:{free_port()}", loop, transport=None, control_timeout_s=2)
    with pytest.raises(WeightSyncError, match="GET /get_world_size failed: cannot reach"):
        sync.init()
    sync.close()


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


def test_a_world_size_answer_without_a_number_is_named(vllm, model, loop):
    vllm.fail["/get_world_size"] = 200  # answers {"error": ...} with status 200
    sync = VllmNcclSync(vllm.url, loop, transport=FakeNccl(vllm), control_timeout_s=5)
    with pytest.raises(WeightSyncError, match="GET /get_world_size answered"):
        sync.init()
    sync.close()
