"""What `--model` names: a model harness-rl builds offline (`tiny`, `tiny-agent`), a model directory, or a
training run's directory (its latest checkpoint's model).

Built models are made on first use and cached (`engine.tiny_model`, `harness_rl.tiny_agent`); each
takes the run's seed. `tiny-agent` is built for one harness's prompts (mini-swe-agent).
"""

from __future__ import annotations

import json
from pathlib import Path


def model_dir(model: str, *, seed: int = 0, harness: str = "mini-swe-agent") -> Path:
    """The local directory `model` names, built first if it is `tiny` or `tiny-agent` and not cached yet."""
    if model == "tiny":
        from harness_rl.engine import build_tiny_model, default_cache_dir

        return build_tiny_model(default_cache_dir(seed), seed=seed)
    if model == "tiny-agent":
        from harness_rl.tiny_agent import build_tiny_agent

        return build_tiny_agent(seed, harness)
    return run_model(Path(model).expanduser()) or Path(model).expanduser()


def run_model(path: Path) -> Path | None:
    """The model of a training run's latest complete checkpoint, when `path` is a run directory."""
    from harness_rl.checkpoint import latest_checkpoint

    checkpoint = latest_checkpoint(path)
    return checkpoint / "model" if checkpoint is not None else None


def vocab_size(model_dir: Path) -> int | None:
    """The model's vocabulary (its embedding rows), so the proxy refuses ids no engine serving it can sample;
    vLLM's `/v1/models` does not say it."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    return size if isinstance(size, int) and size > 0 else None
