"""How the help of the commands with generated flags is laid out, so a user finds a flag by the part it sets.

`train` and `eval` show a run's settings in sections by the part each belongs to, the flags most runs
set first; `serve proxy` shows the proxy's settings by what they govern. A flag's section comes from
where its field lives (its section path); the few fields named one by one are those that belong
elsewhere.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from harness_rl.flags import Flag, Group, show
from harness_rl.run.presets import EXAMPLES, PRESETS

# The flags most runs set, in the order a user reaches for them; `""` is the top level's own settings (the
# seed; for eval its tasks, samples and output).
RUN = Group("run and tasks", ("rollouts.harness", "rollouts.tasks", "tasks", "num_samples", "engine.model",
                              "engine.engine", "learner.max_steps", "output.output_dir", "output.resume", "",
                              "rollouts.num_generations", "learner.nproc_per_node"))
RUN_GROUPS = (
    RUN,
    Group("agent and sandbox", ("rollouts.sandbox", "rollouts.agent_timeout_s", "rollouts.max_turns")),
    Group("engine and weight sync", ("engine", "learner.sync_every")),
    Group("learner and loss", ("learner",)),
    Group("rollouts, sampling and rewards", ("rollouts", "proxy.sampling")),
    Group("proxy", ("proxy",)),
    Group("checkpoints and logging", ("output",)),
)
# `serve proxy`: the proxy's settings are one flat section, so its fields are placed one by one; `""` takes the rest.
PROXY_GROUPS = (
    Group("engines", ("upstream", "upstream_model", "vocab_size", "engine_check_s")),
    Group("address and store", ("host", "port", "advertise_url", "store_dir")),
    Group("sampling", ("sampling", "max_turns", "max_tokens_per_turn")),
    Group("capture", ("tito", "splice_check_tokens", "local_render", "accept_images", "whole_turn_every", "fsync",
                      "stream_read_s")),
    Group("limits and timeouts", ("",)),
)
DEMO_PRESETS = ("demo", "agent")


def preset_default_text(flag: Flag) -> str:
    """What a run's flag not given comes to: a real run's default (or that a real run must give it), then each
    demo preset's value where it differs."""
    shown = ["required for a real run" if flag.required else flag.default_text]
    for name in DEMO_PRESETS:
        value = functools.reduce(lambda node, key: node.get(key, {}) if isinstance(node, dict) else {},
                                 flag.path, PRESETS[name])
        if not isinstance(value, dict) and value != flag.default:  # a dict: the preset leaves the field alone
            shown.append(f"{name} preset: {show(_in_repository(value))}")
    return "; ".join(shown)


def _in_repository(value: Any) -> Any:
    """A preset's path into this checkout (its demo tasks) as the user would type it from the checkout's root."""
    root = EXAMPLES.parent
    return str(Path(value).relative_to(root)) if isinstance(value, str) and Path(value).is_relative_to(root) \
        else value
