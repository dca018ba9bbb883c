"""The models harness-rl builds offline, by name: `tiny` (a random tiny model and its tokenizer,
`engine.tiny_model`) and `tiny-agent` (tiny warm-started on teacher traces of mini-swe-agent,
`demo.tiny_agent`).

The faces resolve `--model` here before a run starts (`model_dir`), so the run level only ever sees
a directory or a hub id. `tiny` is cached after its first build; `tiny-agent` is shipped in the repository
(built here only when its recipe changed). `tiny` is a random start, built from
the run's seed; `tiny-agent` is a trained start, like the pretrained model a user brings: one build
(seed 0) whatever the run's seed, so `--seed` varies a run's learning and sampling, not where it starts.
"""

from __future__ import annotations

from pathlib import Path

from harness_rl.run.models import local_model
from harness_rl.settings import ConfigError


def model_dir(model: str, *, seed: int = 0, harness: str = "mini-swe-agent") -> Path:
    """The local directory `model` names, built first if it is `tiny` (from `seed`) or `tiny-agent` and not cached
    yet."""
    if model == "tiny":
        from harness_rl.engine.tiny_model import build_tiny_model, default_cache_dir

        return build_tiny_model(default_cache_dir(seed), seed=seed)
    if model == "tiny-agent":
        from harness_rl.demo.tiny_agent import TINY_AGENT_SEED, build_tiny_agent

        return build_tiny_agent(TINY_AGENT_SEED, harness)
    return local_model(model)


def check(model: str, harness: str) -> None:
    """A built model used with a harness it was not built for: one `ConfigError` line (`--model`)."""
    if model == "tiny-agent":
        from harness_rl.demo.tiny_agent import HARNESSES

        if harness not in HARNESSES:
            raise ConfigError("--model", f"tiny-agent is built for {', '.join(HARNESSES)} (its teacher's prompts), "
                                         f"not {harness}")
