"""LoRA adapters on the policy (peft): only the adapter trains, is checkpointed and, for vLLM, is synced.

`add_lora` injects peft's LoRA layers into the transformers model in place (the model keeps its class and
its forward; a LoRA layer's name gains `.base_layer` for the frozen weight and `.lora_A/.lora_B.default`
for the adapter) and freezes everything else. The adapter is written in peft's own format
(`adapter_config.json` + `adapter_model.safetensors`, keys `base_model.model.<module>.lora_A.weight`),
which `PeftModel.from_pretrained` and vLLM's `/v1/load_lora_adapter` read. An engine that serves full
weights gets them merged instead, W + (α/r)·B·A per LoRA layer (`WeightSource`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from harness_rl.learner.config import LearnerConfig

ADAPTER_NAME = "default"  # peft's name for the one adapter a model has
ALL_LINEAR = "all-linear"
PEFT_PREFIX = "base_model.model."  # peft's keys in a saved adapter start with this


class Lora:
    """The adapter injected into a model: its peft config (written beside the weights) and its layers."""

    def __init__(self, model: torch.nn.Module, config: LearnerConfig, base_model: str) -> None:
        try:
            from peft import LoraConfig, inject_adapter_in_model
        except ImportError as error:
            raise ImportError("--lora-rank needs peft: pip install 'harness-rl[train]'") from error

        targets = list(config.lora_target_modules)
        self.config = LoraConfig(
            r=config.lora_rank, lora_alpha=config.lora_alpha or 2 * config.lora_rank, lora_dropout=0.0,
            target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets, bias="none",
            task_type="CAUSAL_LM", base_model_name_or_path=base_model)
        head = getattr(model, "get_output_embeddings", lambda: None)()
        if head is not None and getattr(model.config, "tie_word_embeddings", False) and any(
                name.split(".")[-1] in targets for name, module in model.named_modules() if module is head):
            raise ValueError("--lora-target-modules: this model's output head is tied to its input embeddings, so an "
                             "adapter on the head would change both; leave the head out")
        inject_adapter_in_model(self.config, model, adapter_name=ADAPTER_NAME)
        for name, param in model.named_parameters():
            param.requires_grad_(is_adapter_parameter(name))
        self.layers = lora_layers(model)
        if not self.layers:
            raise ValueError(f"--lora-target-modules {' '.join(targets)} matched no layer of the model")

    def write(self, tensors: dict[str, torch.Tensor], directory: Path) -> Path:
        """The adapter (full tensors under the model's parameter names) in peft's format, in `directory`."""
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        config = self.config.to_dict()
        config["target_modules"] = sorted(cast(Iterable[str], self.config.target_modules))  # all-linear, resolved
        (directory / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
        save_file({peft_key(name): t.detach().contiguous().cpu() for name, t in tensors.items()},
                  str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
        return directory


def is_adapter_parameter(name: str) -> bool:
    return f".{ADAPTER_NAME}." in name and (".lora_A." in name or ".lora_B." in name)


def peft_key(name: str) -> str:
    """A model parameter's name as peft saves it: `model.layers.0.q_proj.lora_A.default.weight` ->
    `base_model.model.model.layers.0.q_proj.lora_A.weight`."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER_NAME}.", ".")


def lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """Every module carrying the adapter, by name."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)
            and ADAPTER_NAME in module.lora_A}


def merged(layer: Any, base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """The weight `layer` computes with: base + scaling·(B·A) (transposed for fan-in-fan-out layers)."""
    delta = lora_b.float() @ lora_a.float()
    if getattr(layer, "fan_in_fan_out", False):
        delta = delta.T
    return (base.float() + delta * layer.scaling[ADAPTER_NAME]).to(base.dtype)


def split_names(model: torch.nn.Module, layers: dict[str, Any]) -> Iterator[tuple[str, str | None]]:
    """Each parameter's name and, under a LoRA layer, that layer's name (adapter parameters skipped)."""
    for name, _ in model.named_parameters():
        if is_adapter_parameter(name):
            continue
        owner = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        yield name, owner if owner in layers else None
