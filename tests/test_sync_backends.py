"""The weight-sync backends as one table: what `auto` picks, what each kind of engine may take, what each entry
builds, that a new backend is one entry, and that no module but the table compares a backend's name."""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from harness_rl.learner import sync_backends
from harness_rl.learner.sync_backends import (
    AT_URL,
    BACKENDS,
    CHOICES,
    UNDRIVEN,
    EngineFacts,
    SyncBackend,
    choices_for,
    colocated_refusal,
    resolve,
    syncs_adapter,
)
from harness_rl.run.engines import SERVERS, EngineConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("facts,picked", [
    (EngineFacts("in-process"), "inprocess"),
    (EngineFacts("in-process", lora=True), "inprocess"),  # merged into the embedded engine
    (EngineFacts("harness-rl", lora=True, cuda=False), "http"),
    (EngineFacts("vllm", lora=True, transfer="gloo"), "lora"),
    (EngineFacts("vllm", transfer="gloo"), "gloo"),  # the backend vLLM was started with
    (EngineFacts("vllm", cuda=False, transfer="nccl"), "nccl"),
    (EngineFacts("vllm"), "nccl"),
    (EngineFacts("vllm", transfer="ipc"), "ipc"),  # vLLM started to share the learner's GPU
    (EngineFacts("vllm", cuda=False), "reload"),
])
def test_auto_picks_the_backend_that_fits_the_engine(facts: EngineFacts, picked: str) -> None:
    assert resolve("auto", facts).name == picked
    assert resolve("reload", facts).name == "reload"  # a backend asked for is the one used


@pytest.mark.parametrize("transfer", sorted(UNDRIVEN))
def test_auto_refuses_a_vllm_started_with_a_transfer_no_entry_drives(transfer: str) -> None:
    """Not the broadcast backend in its place (vLLM would wait for a trainer that never joins its way): the reason."""
    with pytest.raises(LookupError) as refused:
        resolve("auto", EngineFacts("vllm", transfer=transfer))
    assert str(refused.value) == UNDRIVEN[transfer] and transfer in UNDRIVEN[transfer]
    assert "\n" not in UNDRIVEN[transfer] and not set(UNDRIVEN) & set(sync_backends.vllm_transfers())


@pytest.mark.parametrize("layout,refusal", [
    (dict(processes=1, device="cuda", cuda=True, foreign_url=None), None),
    (dict(processes=1, device="auto", cuda=True, foreign_url=None), None),
    (dict(processes=2, device="cuda", cuda=True, foreign_url=None),
     "ipc shares one GPU between vLLM and one learner process, not 2: use nccl (vLLM on GPUs of its own)"),
    (dict(processes=1, device="cpu", cuda=True, foreign_url=None),
     "ipc shares a CUDA GPU with vLLM: the learner cannot be on --device cpu"),
    (dict(processes=1, device="auto", cuda=False, foreign_url=None),
     "ipc shares a CUDA GPU with vLLM, and torch sees none on this machine: on CPUs use gloo or reload"),
    (dict(processes=1, device="cuda", cuda=True, foreign_url="http://gpu-box:8000"),
     "ipc shares this machine's GPU with vLLM, and http://gpu-box:8000 is not on this machine: serve vLLM here "
     "(127.0.0.1), or use nccl"),
])
def test_gpu_sharing_is_refused_in_each_layout_it_cannot_serve(layout: dict, refusal: str | None) -> None:
    assert colocated_refusal("ipc", **layout) == refusal


def test_the_flag_and_each_kind_of_engine_keep_their_choices() -> None:
    field = next(f for f in msgspec.inspect.type_info(EngineConfig).fields if f.name == "weight_sync")
    assert CHOICES == ("auto", "inprocess", "http", "nccl", "ipc", "gloo", "reload", "lora", "none")
    assert sorted(field.type.type.values) == sorted(CHOICES)  # the flag's choices (msgspec lists them sorted)
    assert {kind: choices_for(servers) for kind, servers in SERVERS.items()} == {
        "embedded": ("auto", "inprocess", "none"),
        "vllm": ("auto", "nccl", "ipc", "gloo", "reload", "lora", "none"),
        "url": ("auto", "http", "nccl", "ipc", "gloo", "reload", "lora", "none"),
    }
    with pytest.raises(msgspec.ValidationError, match="weight_sync"):
        msgspec.convert({"weight_sync": "rsync"}, EngineConfig)


def test_a_lora_run_syncs_its_adapter_alone_only_into_vllm() -> None:
    assert [name for name in CHOICES if syncs_adapter(name, AT_URL)] == ["auto", "lora"]
    assert not syncs_adapter("auto", SERVERS["embedded"]) and not syncs_adapter("lora", SERVERS["embedded"])


@dataclass
class Target:
    url: str
    model_dir: Path
    weights_dir: Path
    embedded: object | None = None
    adapter_name: str | None = "adapter"
    serves_dtype: str = "bfloat16"


def test_each_entry_builds_its_sync(tmp_path: Path) -> None:
    import torch

    from harness_rl.background import BackgroundLoop

    target = Target("http://127.0.0.1:1", tmp_path, tmp_path / "weights")
    with BackgroundLoop("sync-backends") as loop:
        built = {name: backend.start(target, loop) for name, backend in BACKENDS.items()}
        kinds = {name: type(sync).__name__ for name, sync in built.items()}
        for sync in built.values():
            sync.close()
    assert kinds == {"inprocess": "InProcessSync", "http": "HttpEngineSync", "nccl": "VllmTransferSync",
                     "ipc": "VllmTransferSync", "gloo": "VllmTransferSync", "reload": "ReloadSync",
                     "lora": "LoraAdapterSync", "none": "NoSync"}
    transfers = [(built[name].backend, built[name].dtype, built[name].rendezvous)  # type: ignore[attr-defined]
                 for name in ("nccl", "ipc", "gloo")]
    assert transfers == [("nccl", torch.bfloat16, True), ("ipc", torch.bfloat16, False),
                         ("gloo", torch.bfloat16, True)]


def test_a_new_backend_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM transfer backend added as one entry: auto follows a vLLM started with it, vLLM engines offer it."""
    nccl = BACKENDS["nccl"]
    new = dataclasses.replace(nccl, name="mooncake", transfer="mooncake", auto_when=lambda facts: False)
    monkeypatch.setitem(BACKENDS, "mooncake", new)
    assert resolve("auto", EngineFacts("vllm", transfer="mooncake")) is new
    assert resolve("auto", EngineFacts("vllm")) is nccl
    assert "mooncake" in choices_for(SERVERS["vllm"]) and "mooncake" not in choices_for(SERVERS["embedded"])
    assert sync_backends.transfer_plugin("mooncake") is None and sync_backends.transfer_plugin("gloo") is not None


def test_no_module_but_the_table_compares_a_backends_name() -> None:
    """`==`, `!=` and `in` against a backend's name appear in `sync_backends.py` alone (auto and none are
    words other settings use too: the table spells those through its own names)."""
    names = set(BACKENDS) - {"none"}
    found = []
    for path in (ROOT / "harness_rl").rglob("*.py"):
        if path.name == "sync_backends.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            words = [e for side in sides for e in (side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set)
                                                     else [side])]
            if any(isinstance(word, ast.Constant) and word.value in names for word in words):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_every_entry_fits_some_engine_and_says_how_it_is_reached() -> None:
    for backend in BACKENDS.values():
        assert isinstance(backend, SyncBackend) and backend.engines, backend.name
        assert backend.routes or backend.engines == ("in-process",) or not backend.moves_weights, backend.name
        assert backend.transfer is None or backend.routes, backend.name


def test_a_colocated_backend_starts_vllm_with_what_sharing_the_gpu_needs(tiny_model_dir: Path) -> None:
    """ipc: vLLM unpickles the handles only when allowed, and leaves the learner most of the GPU unless told
    otherwise; a flag the user gives wins."""
    from harness_rl.tools.vllm_server import vllm_launch

    assert sync_backends.transfer_launch("ipc") == ({"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},
                                                    ("--gpu-memory-utilization", "0.4"))
    assert sync_backends.transfer_launch("nccl") == ({}, ())
    model = tiny_model_dir
    launch = vllm_launch(model, python="python", cuda=True, weight_transfer="ipc")
    assert launch.env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert launch.command[launch.command.index("--gpu-memory-utilization") + 1] == "0.4"
    assert '{"backend": "ipc"}' in launch.command
    given = vllm_launch(model, python="python", cuda=True, weight_transfer="ipc",
                        extra_args=["--gpu-memory-utilization", "0.25"])
    assert given.command.count("--gpu-memory-utilization") == 1 and given.command[-1] == "0.25"
    nccl = vllm_launch(model, python="python", cuda=True)
    assert "--gpu-memory-utilization" not in nccl.command and "VLLM_ALLOW_INSECURE_SERIALIZATION" not in nccl.env
