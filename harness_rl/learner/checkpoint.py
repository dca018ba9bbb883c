"""Checkpoints that resume a run as if it never stopped, with the same or another number of processes.

A checkpoint directory holds:
- `state/`: the trained parameters (every weight, or the LoRA adapter alone) and AdamW's moments, as a
  `torch.distributed.checkpoint`: each rank writes its own shards in parallel, and a load reshards them
  for any number of processes (one process without torchrun included).
- `trainer_state.pt`: LR scheduler, every RNG, the step, the policy version, the weight syncs failed in a
  row, and what the run adds (`extra`: the rollouts' state, with the groups finished but not yet trained).
- `adapter/` (LoRA): the adapter in peft's format.
- `model/` (the final checkpoint of a run): one Hugging Face model directory, the adapter merged in,
  loadable by the engine, vLLM and anyone (`export_model`).

A checkpoint is written to `step-N.partial` and renamed into place once every rank has written its
part, so a crash mid-save never leaves a half checkpoint behind. Listing checkpoints needs no torch.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from harness_rl.learner.distributed import Ranks
    from harness_rl.learner.weight_source import WeightSource

STATE_FILE = "trainer_state.pt"
STATE_DIR = "state"
MODEL_DIR = "model"
ADAPTER_DIR = "adapter"
PREFIX = "step-"
SHARD_BYTES = 4 * 2**30  # safetensors files of an exported model stay under this


@dataclass
class TrainerState:
    step: int
    policy_version: int
    sync_failures: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"{PREFIX}{step:08d}"


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint directory holds (`step-00000040`: 40)."""
    return int(path.name.removeprefix(PREFIX))


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Finished checkpoints, oldest first; a staging dir left by an interrupted save never counts."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"{PREFIX}*") if not p.name.endswith(".partial") and (p / STATE_FILE).is_file())


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under `output_dir`, or None."""
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None


def latest_model(output_dir: str | Path) -> Path | None:
    """The model directory of the newest checkpoint that has one (a finished run's last checkpoint does)."""
    models = [p / MODEL_DIR for p in complete_checkpoints(output_dir) if (p / MODEL_DIR / "config.json").is_file()]
    return models[-1] if models else None


def prune_checkpoints(output_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints; return what was deleted."""
    done = complete_checkpoints(output_dir)
    doomed = done[:-keep] if keep > 0 else done
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def save_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    state: TrainerState, *, ranks: Ranks | None = None, trainable_only: bool = False,
                    extras: Callable[[Path], None] | None = None) -> Path:
    """Write a checkpoint (a collective under torchrun: every rank calls it with the same `path`).

    `trainable_only` leaves frozen weights out (a LoRA run keeps its adapter only); `extras(staging)` adds
    what else the checkpoint holds (the adapter, an exported model) before it is renamed into place.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from harness_rl.learner.distributed import Ranks

    ranks = ranks or Ranks()
    path = Path(path)
    staging = path.with_name(path.name + ".partial")
    if ranks.leader:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    ranks.barrier()
    started = optimizer_started(optimizer)
    model_state, optimizer_state = get_state_dict(model, optimizer,
                                                  options=StateDictOptions(ignore_frozen_params=trainable_only))
    if not started:  # get_state_dict gave it the state of one step at lr 0: the run goes on as if never saved
        optimizer.state.clear()
    with _one_process_is_fine():
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=staging / STATE_DIR,
                 no_dist=not ranks.sharded)
    if extras is not None:
        extras(staging)
    if ranks.leader:
        torch.save({"scheduler": scheduler.state_dict(), "rng": _rng_state(), "step": state.step,
                    "policy_version": state.policy_version, "sync_failures": state.sync_failures,
                    "optimizer_started": started, "extra": state.extra}, staging / STATE_FILE)
        shutil.rmtree(path, ignore_errors=True)
        staging.rename(path)
    ranks.barrier()
    return path


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    *, trainable_only: bool = False) -> TrainerState:
    """Restore everything in place, resharded for this run's processes (a collective under torchrun)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no {STATE_FILE})")
    if not (path / STATE_DIR).is_dir():
        raise FileNotFoundError(f"{path} has no {STATE_DIR}/ (a checkpoint of an older harness-rl): start the run "
                                f"again from its model, --model {path / MODEL_DIR}")
    # A LoRA checkpoint holds the adapter alone: the frozen weights stay as loaded from the model.
    options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    with _one_process_is_fine():
        dcp.load(state, checkpoint_id=path / STATE_DIR, no_dist=not torch.distributed.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=options)
    blob = torch.load(path / STATE_FILE, weights_only=False)
    if not blob.get("optimizer_started", True):  # saved before its first step: as fresh as it was then
        optimizer.state.clear()
    scheduler.load_state_dict(blob["scheduler"])
    _set_rng_state(blob["rng"])
    return TrainerState(step=blob["step"], policy_version=blob["policy_version"],
                        sync_failures=blob.get("sync_failures", 0), extra=blob["extra"])


def optimizer_started(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer has taken a step. torch's `get_state_dict` initialises the state of one that has not
    (a step at lr 0: AdamW's step count 1, zero moments), which would change its next real step; a checkpoint
    therefore records this, and neither saving nor loading one leaves that made-up state behind."""
    return bool(optimizer.state)


def export_model(weights: WeightSource, directory: Path, *, shard_bytes: int = SHARD_BYTES) -> Path:
    """`weights` as one Hugging Face model directory (config, generation config, safetensors shards and their
    index), streamed: at most one shard is held whole. A collective under torchrun; rank 0 writes."""
    from safetensors.torch import save_file

    leader = weights.ranks.leader
    shards: list[list[str]] = [[]]
    size = 0
    for meta in weights.metadata():
        if shards[-1] and size + meta.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(meta.name)
        size += meta.nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    if leader:
        directory.mkdir(parents=True, exist_ok=True)
        model: Any = weights.model
        model.config.save_pretrained(directory)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(directory)
    weight_map: dict[str, str] = {}
    tensors = iter(weights)
    total = 0
    for names, file in zip(shards, files, strict=True):
        shard = {}
        for expected in names:
            name, tensor = next(tensors)
            assert name == expected, f"weights came out of order: {name} where {expected} was due"
            if leader:
                shard[name] = tensor.detach().contiguous().cpu()
                weight_map[name] = file
                total += tensor.numel() * tensor.element_size()
        if leader:
            save_file(shard, str(directory / file), metadata={"format": "pt"})
    if leader and len(files) > 1:
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return directory


@contextlib.contextmanager
def _one_process_is_fine() -> Iterator[None]:
    """Without torchrun a checkpoint is written and read by one process, as meant: no warning about it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_state() -> dict[str, Any]:
    import torch

    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
