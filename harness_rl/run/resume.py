"""What `train --resume --output-dir RUN` continues: the run as its own `RUN/config.toml` describes it.

The settings that define a run (its tasks, harness, model, seed, group size, sampling, learner and loss)
are read back from the run and cannot change on resume: a flag or `--config` value that would change one is
refused, naming it. Where the run runs and how it reports may change (`CHANGEABLE`: more steps, another
save interval, the engine's new URL after a restart, the proxy's port, the learner's processes, timeouts,
logging); the run then records the new values in its config.toml.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from harness_rl.flags import flag_for_path, flags_of, show
from harness_rl.run.config import RunConfig, load_file, resolve
from harness_rl.settings import ConfigError

# Settings a resumed run may take anew: none of them changes what the run samples or how it learns.
CHANGEABLE = frozenset({
    "engine.engine", "engine.weight_sync", "engine.sync_dir", "engine.vllm_python", "engine.vllm_args",
    "proxy.host", "proxy.port", "proxy.advertise_url", "proxy.max_body_mb", "proxy.max_reply_mb",
    "proxy.request_timeout_s", "proxy.retries", "proxy.header_timeout_s", "proxy.body_timeout_s",
    "proxy.max_connections", "proxy.max_connections_per_client", "proxy.whole_turn_every", "proxy.keepalive_s",
    "proxy.stream_read_s", "proxy.collect_on_pause", "proxy.fsync", "proxy.splice_check_tokens",
    "proxy.engine_check_s",
    "rollouts.max_concurrent_rollouts", "rollouts.sandbox_start_attempts", "rollouts.sandbox_retry_backoff_s",
    "rollouts.delete_sessions",
    "learner.max_steps", "learner.token_budget", "learner.gradient_checkpointing", "learner.device",
    "learner.nproc_per_node",
    "learner.attn_implementation", "learner.max_sync_failures", "learner.collective_timeout_s",
    "output.output_dir", "output.resume", "output.save_every", "output.save_total_limit", "output.report_to",
})
RUN_CONFIG = "config.toml"


def resolve_run(layers: list[dict[str, Any]]) -> RunConfig:
    """The configuration `train` runs from settings layers (a `--config` file, the flags); with `--resume` of a run
    that has a config.toml, that file under them, refusing any change to a setting that defines the run."""
    config = resolve(*layers)
    if not config.output.resume or config.output.output_dir is None:
        return config
    saved_file = Path(config.output.output_dir) / RUN_CONFIG
    if not saved_file.is_file():
        return config  # nothing saved yet: the run starts from step 0 (and says so)
    try:
        saved_layer = load_file(saved_file)
    except ConfigError as exc:
        raise ConfigError("--resume", f"{exc}: mend or remove it to resume this run") from None
    saved, config = resolve(saved_layer), resolve(saved_layer, *layers)
    for path, was, now in differences(saved, config):
        if path not in CHANGEABLE:
            raise ConfigError(flag_for_path(flags_of(RunConfig), path),
                              f"cannot change on --resume: the run in {config.output.output_dir} has {show(was)}, "
                              f"not {show(now)}; drop it, or start a new run in another --output-dir")
    return config


def differences(a: msgspec.Struct, b: msgspec.Struct, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(dotted path, value in `a`, value in `b`) of every setting where two configurations differ."""
    for name in a.__struct_fields__:
        here, mine, theirs = f"{path}{name}", getattr(a, name), getattr(b, name)
        if isinstance(mine, msgspec.Struct):
            yield from differences(mine, theirs, here + ".")
        elif mine != theirs:
            yield here, mine, theirs
