"""What `--model` names, for the run: a model directory, a training run's directory (the model of its
newest checkpoint that has one: the final checkpoint of a run), or a hub id the engine serves. Models
harness-rl builds offline (`tiny`, `tiny-agent`) are resolved to their directories by the demo
(`harness_rl.demo.models`) before a run starts.
"""

from __future__ import annotations

import json
from pathlib import Path


def local_model(model: str) -> Path:
    """The directory `model` names: a run directory's latest checkpoint model, else the path as given."""
    path = Path(model).expanduser()
    return run_model(path) or path


def run_model(path: Path) -> Path | None:
    """The model of a training run's newest checkpoint that holds one, when `path` is a run directory."""
    from harness_rl.learner.checkpoint import latest_model

    return latest_model(path)


def vocab_size(model_dir: Path) -> int | None:
    """The model's vocabulary (its embedding rows), so the proxy refuses ids no engine serving it can sample;
    vLLM's `/v1/models` does not say it."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    return size if isinstance(size, int) and size > 0 else None
