"""What `--model` names: a model harness-rl builds offline (`tiny`, `tiny-agent`), or a model directory.

Built models are made on first use and cached (`engine.tiny_model`, `harness_rl.tiny_agent`); each
takes the run's seed. `tiny-agent` is built for one harness's prompts (mini-swe-agent).
"""

from __future__ import annotations

from pathlib import Path


def model_dir(model: str, *, seed: int = 0, harness: str = "mini-swe-agent") -> Path:
    """The local directory `model` names, built first if it is `tiny` or `tiny-agent` and not cached yet."""
    if model == "tiny":
        from harness_rl.engine import build_tiny_model, default_cache_dir

        return build_tiny_model(default_cache_dir(seed), seed=seed)
    if model == "tiny-agent":
        from harness_rl.tiny_agent import build_tiny_agent

        return build_tiny_agent(seed, harness)
    return Path(model).expanduser()
