"""Checkpoints that resume a run as if it never stopped.

A checkpoint directory holds `model/` (`save_pretrained`: loadable by the engine and by anyone) and
`trainer_state.pt`: optimizer, LR scheduler, every RNG, the step, the policy version, and the rollout
scheduler's position (next task, groups started; groups that were in flight are not replayed on
resume). It is written to a temporary directory and renamed into place, so a crash mid-save never
leaves a half checkpoint behind. Listing checkpoints needs no torch.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

STATE_FILE = "trainer_state.pt"
MODEL_DIR = "model"
PREFIX = "step-"


@dataclass
class TrainerState:
    step: int
    policy_version: int
    extra: dict[str, Any] = field(default_factory=dict)


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"{PREFIX}{step:08d}"


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


def prune_checkpoints(output_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints; return what was deleted."""
    done = complete_checkpoints(output_dir)
    doomed = done[:-keep] if keep > 0 else done
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def save_checkpoint(path: str | Path, model: PreTrainedModel, optimizer: torch.optim.Optimizer,
                    scheduler: Any, state: TrainerState) -> Path:
    import torch

    path = Path(path)
    staging = path.with_name(path.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(staging / MODEL_DIR)
    torch.save({
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": _rng_state(),
        "step": state.step,
        "policy_version": state.policy_version,
        "extra": state.extra,
    }, staging / STATE_FILE)
    shutil.rmtree(path, ignore_errors=True)
    staging.rename(path)
    return path


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any) -> TrainerState:
    """Restore everything in place; the model's weights come from `path/model`."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no {STATE_FILE})")
    saved = AutoModelForCausalLM.from_pretrained(path / MODEL_DIR, dtype=torch.float32)
    target = model.state_dict()
    with torch.no_grad():
        for name, tensor in saved.state_dict().items():
            target[name].copy_(tensor)
    del saved
    blob = torch.load(path / STATE_FILE, weights_only=False)
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    _set_rng_state(blob["rng"])
    return TrainerState(step=blob["step"], policy_version=blob["policy_version"], extra=blob["extra"])


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
