"""LoRA and the pieces of the sharded learner that run in one process: what a sync sends (merged weights under
the base model's names, the adapter in peft's format), the embedded engine serving the merged weights, the
split of a step's rows, the exported model directory, and the settings around them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_learner import config, make_groups
from tiny_lm import build_tiny_lm

from harness_rl.learner.checkpoint import export_model
from harness_rl.learner.distributed import balance
from harness_rl.learner.learner import Learner
from harness_rl.learner.weight_source import WeightSource


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lm(tmp_path_factory.mktemp("tiny-lm"))


def test_rows_are_split_longest_first_to_the_least_loaded_rank() -> None:
    assert balance([700, 5, 60, 40, 9], 2) == [[0], [1, 2, 3, 4]]
    assert balance([10, 10, 10, 10], 2) == [[0, 2], [1, 3]]
    assert balance([3], 2) == [[0], []]
    assert balance([5, 4, 3, 3, 3], 3) == [[0], [1, 4], [2, 3]]


def test_only_the_adapter_trains_and_a_sync_sends_the_merged_weights_under_the_base_names(model_dir: Path) -> None:
    from peft.tuners.lora import LoraLayer

    learner = Learner(model_dir, config(lora_rank=4, lora_alpha=8, learning_rate=1e-2))
    trained, total = learner.trained_parameters
    assert 0 < trained < total / 2
    assert {name for name, p in learner.model.named_parameters() if p.requires_grad} == {
        name for name, _ in learner.model.named_parameters() if ".lora_A." in name or ".lora_B." in name}
    before = {name: t.clone() for name, t in learner.weights}
    learner.step(make_groups(2, seed=1))
    learner.step(make_groups(2, seed=2))
    weights = learner.weights
    sent = dict(weights)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert list(sent) == [name for name, _ in plain.named_parameters()]  # the base model's names, in its order
    assert [(m.name, tuple(m.shape)) for m in weights.metadata()] == [(n, tuple(t.shape)) for n, t in sent.items()]
    for name, layer in learner.lora.layers.items():
        assert isinstance(layer, LoraLayer) and layer.scaling["default"] == 2.0
        peft_merge = layer.get_base_layer().weight + layer.get_delta_weight("default")
        assert torch.allclose(sent[f"{name}.weight"], peft_merge, atol=1e-7)
        assert not torch.equal(sent[f"{name}.weight"], before[f"{name}.weight"])
    untouched = [n for n in sent if not any(n == f"{layer}.weight" for layer in learner.lora.layers)]
    assert untouched and all(torch.equal(sent[n], before[n]) for n in untouched)
    x = torch.tensor([[3, 14, 15, 92, 65]])
    plain.load_state_dict(sent)
    with torch.no_grad():
        assert (plain(input_ids=x).logits - learner.model(input_ids=x).logits).abs().max() < 1e-5


def test_an_adapter_on_the_output_head_trains(model_dir: Path) -> None:
    """The learner computes logits from the head's weight (in chunks, float32): with an adapter on the head that
    weight is W + s·B·A, so the head's adapter gets gradients (its B starts at zero) and the sent weights agree."""
    learner = Learner(model_dir, config(lora_rank=4, learning_rate=1e-2, lora_target_modules=["all-linear", "lm_head"]))
    head = learner.lora.layers["lm_head"]
    assert not head.lora_B["default"].weight.any()
    learner.step(make_groups(2, seed=1))
    learner.step(make_groups(2, seed=2))
    assert head.lora_B["default"].weight.abs().max() > 1e-3
    sent = dict(learner.weights)
    assert torch.allclose(sent["lm_head.weight"], head.get_base_layer().weight + head.get_delta_weight("default"),
                          atol=1e-7)


def test_an_adapter_on_a_head_tied_to_the_embeddings_is_refused(tmp_path: Path) -> None:
    from transformers import AutoConfig

    tied = build_tiny_lm(tmp_path / "tied")
    settings = AutoConfig.from_pretrained(tied)
    settings.tie_word_embeddings = True
    settings.save_pretrained(tied)
    with pytest.raises(ValueError, match="output head is tied to its input embeddings"):
        Learner(tied, config(lora_rank=4, lora_target_modules=["all-linear", "lm_head"]))
    Learner(tied, config(lora_rank=4))  # all-linear leaves the head out


def test_the_adapter_is_written_in_peft_format_and_peft_loads_it(model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    learner = Learner(model_dir, config(lora_rank=8, learning_rate=1e-2, lora_target_modules=["q_proj", "v_proj"]))
    learner.step(make_groups(2, seed=3))
    directory = learner.lora.write(learner.weights.adapter(), tmp_path / "adapter")
    saved = json.loads((directory / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], saved["peft_type"]) == (8, 16, "LORA")
    assert {name.rsplit(".", 1)[-1] for name in saved["target_modules"]} == {"q_proj", "v_proj"}
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                       directory)
    x = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        assert (loaded(input_ids=x).logits - learner.model(input_ids=x).logits).abs().max() < 1e-5


def test_the_embedded_engine_serves_a_lora_policy_merged_and_the_sync_check_agrees(tiny_model_dir: Path) -> None:
    from harness_rl.background import BackgroundLoop
    from harness_rl.engine import Engine, serve_in_thread
    from harness_rl.learner.weight_sync import InProcessSync
    from harness_rl.run.engines import EngineSampler

    engine = Engine.from_pretrained(tiny_model_dir)
    try:
        with BackgroundLoop("lora-inprocess") as loop, serve_in_thread(engine) as server:
            learner = Learner(tiny_model_dir, config(lora_rank=8, learning_rate=1e-2, lr_scheduler="constant",
                                                     warmup_steps=0),
                              weight_sync=InProcessSync(engine),
                              sync_check=EngineSampler(lambda: [server.url], loop, 1.0))
            metrics = [learner.step(make_groups(2, seed=seed)) for seed in range(2)]
            learner.close()
    finally:
        engine.close()
    assert all(m["sync/logp_difference_max"] < 1e-5 for m in metrics)
    assert metrics[-1]["grad_norm"] > 0


def test_an_exported_model_in_several_shards_loads_as_the_policy(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    learner = Learner(model_dir, config(learning_rate=1e-2))
    learner.step(make_groups(2, seed=4))
    export_model(WeightSource(learner.model), tmp_path / "model", shard_bytes=40_000)
    index = json.loads((tmp_path / "model" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "model").glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    for (name, mine), (_, theirs) in zip(learner.model.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(mine, theirs), name


def test_train_starts_itself_under_torchrun_and_each_process_keeps_the_flag_for_config_toml() -> None:
    from harness_rl.commands.train import torchrun_command

    for argv in (["train", "--nproc-per-node", "4", "--max-steps", "3"], ["train", "--nproc-per-node=4",
                                                                           "--max-steps", "3"]):
        command = torchrun_command(4, argv)
        assert command[1:] == ["-m", "harness_rl.torchrun", "--standalone", "--nproc-per-node", "4", "-m",
                               "harness_rl", *argv]


def test_lora_settings_are_checked_before_anything_starts(tiny_model_dir: Path) -> None:
    from harness_rl.run.config import resolve
    from harness_rl.run.preflight import check
    from harness_rl.settings import ConfigError
    from harness_rl.tools.vllm_server import vllm_launch

    with pytest.raises(ConfigError, match="--weight-sync: lora syncs a LoRA adapter: set --lora-rank"):
        check(resolve({"preset": "demo", "engine": {"engine": "http://127.0.0.1:9", "model": str(tiny_model_dir),
                                                    "weight_sync": "lora"}}))
    with pytest.raises(ConfigError, match="--lora-target-modules: vLLM serves LoRA adapters on a model's inner "
                                          "layers, not on its output head"):
        check(resolve({"preset": "demo", "engine": {"engine": "http://127.0.0.1:9", "model": str(tiny_model_dir)},
                       "learner": {"lora_rank": 8, "lora_target_modules": ["all-linear", "lm_head"]}}))
    launch = vllm_launch(tiny_model_dir, python="python", cuda=False, lora_rank=5)
    assert launch.command[launch.command.index("--max-lora-rank") + 1] == "8" and "--enable-lora" in launch.command
    assert launch.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "--enable-lora" not in vllm_launch(tiny_model_dir, python="python", cuda=False).command
