"""A run's configuration, composed from each part's settings: every setting of `harness-rl train` and
`harness-rl eval`, resolved from a preset, a TOML/JSON `--config` file and the flags (later wins).

Each part owns its section beside its code: `EngineConfig` (`run.engines`), `ProxyConfig`
(`proxy.config`), `RolloutConfig` (`run.rollouts`), `LearnerConfig` (`learner.config`),
`OutputConfig` (`run.run_files`). The presets are in `run.presets`; what can be known wrong before
anything starts is checked by `run.preflight`.

This module stays light (no torch): flags, `--print-config` and every check run in well under a
second.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, TypeVar, cast

import msgspec

from harness_rl.flags import flag_for_path, flags_of
from harness_rl.learner.config import LearnerConfig
from harness_rl.run.engines import EngineConfig
from harness_rl.run.presets import PRESET_FOR_MODEL, PRESETS, Preset
from harness_rl.run.rollouts import RolloutConfig
from harness_rl.run.run_files import OutputConfig
from harness_rl.settings import AtLeastOne, ConfigError, setting
from proxy.config import ProxyConfig

StructT = TypeVar("StructT", bound=msgspec.Struct)


class RunConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    preset: Annotated[Preset, setting("defaults to start from; the model decides when not given (tiny: demo)",
                                      flag=None)] = "real"
    seed: Annotated[int, setting("seed of the tiny model (not tiny-agent: one build), the learner, and every "
                                 "rollout's sampling (each proxy session seeds its engine calls from it, the step and "
                                 "the rollout)")] = 0
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    proxy: ProxyConfig = msgspec.field(default_factory=ProxyConfig)
    rollouts: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    output: OutputConfig = msgspec.field(default_factory=OutputConfig)


class EvalConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every setting of `harness-rl eval`: a run's engine, proxy and rollouts sections, and what to sample."""

    preset: Annotated[Preset, setting("defaults to start from; the model decides when not given", flag=None)] = "real"
    tasks: Annotated[list[str], setting(
        "tasks to evaluate: a Harbor task dir, a dir of them, or hf://<dataset repo>; repeat the flag for "
        "several splits, each labelled by its folder name; none given: the preset's training tasks")] = []
    num_samples: Annotated[AtLeastOne, setting("rollouts per task")] = 4
    success_reward: Annotated[float, setting("a rollout succeeds when its reward is at least this")] = 1.0
    seed: Annotated[int, setting("seed of the tiny model (not tiny-agent: one build) and of every rollout's "
                                 "sampling (each proxy session seeds its engine calls from it, the task and the "
                                 "sample)")] = 0
    output_dir: Annotated[str | None, setting("where eval.json, rollouts.jsonl and traces/ go; none: "
                                              "runs/eval-<harness>-<UTC time>")] = None
    baseline: Annotated[str | None, setting("an earlier evaluation (its eval.json or directory) to print beside this "
                                            "one, task by task")] = None
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    proxy: ProxyConfig = msgspec.field(default_factory=ProxyConfig)
    rollouts: RolloutConfig = msgspec.field(default_factory=RolloutConfig)

    def run_config(self) -> RunConfig:
        """The run these rollouts are sampled as (no learner: weights never change)."""
        engine = msgspec.structs.replace(self.engine, weight_sync="none")
        return RunConfig(preset=self.preset, seed=self.seed, engine=engine, proxy=self.proxy, rollouts=self.rollouts)


# Settings of `train` that `eval` does not take: it has its own --tasks (several) and --num-samples.
EVAL_EXCLUDED = frozenset({"rollouts.tasks", "rollouts.num_generations"})
# Sections of a run's configuration (its config.toml) that `eval` ignores: it never trains or writes checkpoints.
EVAL_IGNORED_SECTIONS = ("learner", "output")


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid on `base`, section by section."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def preset_for(settings: dict[str, Any]) -> Preset:
    """The preset asked for, else the one of a built model (tiny: demo, tiny-agent: agent; none given: demo),
    else `real`."""
    named = settings.get("preset")
    if named is not None:
        if named not in PRESETS:
            raise ConfigError("--preset", f"{named!r} is not one of {', '.join(PRESETS)}")
        return cast(Preset, named)
    return PRESET_FOR_MODEL.get(settings.get("engine", {}).get("model", "tiny"), "real")


def with_preset(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings laid over their preset.

    A preset's harness options belong to its harness: they are dropped when the settings choose
    another harness (`--preset agent --harness opencode` gets opencode's defaults, not mini-swe-agent's).
    """
    preset = preset_for(settings)
    base = PRESETS[preset]
    harness = settings.get("rollouts", {}).get("harness")
    if harness is not None and harness != base.get("rollouts", {}).get("harness", harness):
        base = {**base, "rollouts": {**base["rollouts"], "harness_options": {}}}
    return merge(base, {**settings, "preset": preset})


def resolve(*layers: dict[str, Any]) -> RunConfig:
    """The configuration from settings layers (a config file, then the flags), over their preset."""
    return _convert(with_preset(_merged(layers)), RunConfig)


def resolve_eval(*layers: dict[str, Any]) -> EvalConfig:
    """`eval`'s configuration from settings layers over their preset (a run's config.toml is a valid layer:
    its learner and output sections are ignored); no tasks given means the preset's."""
    settings = with_preset(_merged(tuple({k: v for k, v in layer.items() if k not in EVAL_IGNORED_SECTIONS}
                                         for layer in layers)))
    for section in EVAL_IGNORED_SECTIONS:
        settings.pop(section, None)
    if not settings.get("tasks") and settings.get("rollouts", {}).get("tasks"):
        settings["tasks"] = [settings["rollouts"]["tasks"]]
    return _convert(settings, EvalConfig)


def _merged(layers: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for layer in layers:
        settings = merge(settings, _engines_listed(layer))
    return settings


def _engines_listed(layer: dict[str, Any]) -> dict[str, Any]:
    """`engine.engine` as a list: one engine may be written as a string (as run configurations before several
    engines were)."""
    engine = layer.get("engine")
    if isinstance(engine, dict) and isinstance(engine.get("engine"), str):
        return {**layer, "engine": {**engine, "engine": [engine["engine"]]}}
    return layer


def _convert(settings: dict[str, Any], struct: type[StructT]) -> StructT:
    """`settings` as `struct`; a validation error names the flag that sets the bad value."""
    try:
        return msgspec.convert(settings, struct)
    except msgspec.ValidationError as exc:
        text, _, where = str(exc).partition(" - at `")
        setting = flag_for_path(flags_of(struct), where.rstrip("`")) if where else "config"
        raise ConfigError(setting, text.replace("`", "").replace("Expected", "expected")) from None


def load_file(path: str | Path) -> dict[str, Any]:
    """Settings from a TOML or JSON file (sections as in `--print-config`; dashes in keys are accepted)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError("--config", f"cannot read {path}: {exc.strerror}") from None
    kind = "JSON" if path.suffix == ".json" else "TOML"
    try:
        data = json.loads(text) if kind == "JSON" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError("--config", f"{path} is not valid {kind}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("--config", f"{path} must hold a table of settings")
    data = _undash(data)
    if (unknown := _unknown_key(data, (RunConfig, EvalConfig))) is not None:
        raise ConfigError("--config", f"{path}: unknown setting {unknown} (harness-rl train --print-config "
                                      "shows every one)")
    return data


def _unknown_key(data: dict[str, Any], structs: tuple[type[msgspec.Struct], ...], at: str = "") -> str | None:
    """The first key of `data`, dotted, that no struct of `structs` has; sections are followed into their structs,
    free-form tables (harness options, metadata) are not."""
    fields = {f.name: f.type for struct in structs
              for f in cast(msgspec.inspect.StructType, msgspec.inspect.type_info(struct)).fields}
    for key, value in data.items():
        if key not in fields:
            return f"{at}{key}"
        kinds = getattr(fields[key], "types", (fields[key],))  # a union's members, or the type itself
        inner = [t.cls for t in kinds if isinstance(t, msgspec.inspect.StructType)]
        if isinstance(value, dict) and inner and (found := _unknown_key(value, tuple(inner), f"{at}{key}.")):
            return found
    return None


def _undash(data: dict[str, Any]) -> dict[str, Any]:
    return {key.replace("-", "_"): _undash(value) if isinstance(value, dict) and key not in (
        "harness_options", "sandbox_options", "metadata") else value for key, value in data.items()}


def to_toml(config: RunConfig) -> str:
    """The configuration as TOML that `--config` reads back to the same configuration.

    TOML has no null: a setting that is none is written as a comment, and reads back as none because
    every such setting is none in its preset too (checked by the tests for both presets). Settings a
    run sets itself (the proxy's upstream and store) are left out.
    """
    lines = ["# harness-rl run configuration (harness-rl train --config FILE)", ""]
    lines += _toml_table(config, ())
    return "\n".join(lines) + "\n"


def _internal_fields(struct: type[msgspec.Struct]) -> set[str]:
    import msgspec.inspect as mi

    info = mi.type_info(struct)
    assert isinstance(info, mi.StructType)
    return {f.name for f in info.fields if isinstance(f.type, mi.Metadata) and (f.type.extra or {}).get("internal")}


def _toml_table(section: msgspec.Struct, path: tuple[str, ...]) -> list[str]:
    lines: list[str] = ["", f"[{'.'.join(path)}]"] if path else []
    tables = []
    skip = _internal_fields(type(section))
    for key in section.__struct_fields__:
        value = getattr(section, key)
        if key in skip:
            continue
        if isinstance(value, msgspec.Struct):
            tables.append((key, value))
        elif value is None:
            lines.append(f"# {key} = none")
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    for key, value in tables:
        lines += _toml_table(value, (*path, key))
    return lines


def _toml_value(value: Any) -> str:
    """One TOML value; tables inline, so every section stays where it is."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return msgspec.toml.encode({"v": value}).decode().strip()[len("v = "):]
