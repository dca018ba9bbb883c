"""One run configuration: every setting of `harness-rl train`, its default, its help, and three presets.

`RunConfig` is decoded once from the built-in preset, a TOML/JSON `--config` file and the flags
(later wins), and checked before anything starts. Field defaults are the defaults of a real run
(`real`: a real model on a real engine, TRL's learning rate, no per-call cap below the model's
context). The `demo` preset overrides a few of them for the embedded CPU demo (tiny model, `echo`
harness, short replies, a large learning rate); the `agent` preset does the same for the CPU agent
demo (`tiny-agent`, mini-swe-agent on the shipped agent tasks). A preset applies when asked for with
`--preset`, or when no preset is named and the model is `tiny` (demo) or `tiny-agent` (agent), so a
demo value never reaches a real run. `EvalConfig` (`harness-rl eval`) reuses the engine, proxy and
rollouts sections and the same presets.

This module stays light (no torch): flags, `--print-config` and every check run in well under a
second.
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, cast

import msgspec

from proxy.config import ProxyConfig

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEMO_TASK = EXAMPLES / "tasks" / "digits"
AGENT_TASKS = EXAMPLES / "agent-tasks"
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
Preset = Literal["demo", "agent", "real"]
StructT = TypeVar("StructT", bound=msgspec.Struct)
# Models harness-rl builds offline, by name (served by the embedded engine or a vLLM started for the run): the
# random tiny model, and the tiny model warm-started on teacher traces of mini-swe-agent (`harness_rl.tiny_agent`).
BUILT_MODELS = ("tiny", "tiny-agent")
# mini-swe-agent puts the machine's uname in its prompt; the agent demo pins it, so the prompts the
# tiny-agent learned from are the same on every machine (the cache is portable).
PINNED_UNAME = {"system": "Linux", "release": "6.1.0", "version": "#1 SMP", "machine": "x86_64"}
# A reply without a tool call ends the agent demo's rollout: mini-swe-agent drops such a reply from its history,
# so the turn after it could not continue its tokens (README, "The agent demo").
AGENT_HARNESS_OPTIONS: dict[str, Any] = {"step_limit": 6, "uname": PINNED_UNAME, "max_consecutive_format_errors": 1}


def setting(description: str, flag: str | None = "") -> msgspec.Meta:
    """A field's help text; `flag=None` keeps it out of the command line, a string renames its flag."""
    return msgspec.Meta(description=description, extra={"flag": flag})


AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]
AtLeastZero = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[float, msgspec.Meta(gt=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    engine: Annotated[str, setting("embedded (this process, CPU or GPU), vllm (started for the run, as "
                                   "`harness-rl serve vllm` does), or the URL of a running engine")] = "embedded"
    model: Annotated[str, setting("tiny or tiny-agent (built offline), a local model directory, a run directory "
                                  "(its latest checkpoint), or with --engine URL the hub id that engine serves")] = ""
    weight_sync: Annotated[Literal["auto", "inprocess", "http", "nccl", "reload", "none"], setting(
        "how new weights reach the engine; auto: in-process for embedded, http for a harness-rl engine, nccl "
        "for vLLM on CUDA, reload (safetensors on disk, vLLM's reload_weights) for vLLM without CUDA")] = "auto"
    sync_dir: Annotated[str | None, setting("where --weight-sync reload writes the weights (a local disk, "
                                            "/dev/shm is fastest); none: RUN/weights")] = None
    vllm_python: Annotated[str | None, setting("vLLM's interpreter for --engine vllm; none: "
                                               "$HARNESS_RL_VLLM_PYTHON, .tools/vllm-venv, or this one")] = None
    vllm_args: Annotated[str, setting("extra arguments for vLLM with --engine vllm (one shell-quoted string)")] = ""
    max_model_len: Annotated[AtLeastOne | None, setting("context length of the embedded engine; none: the "
                                                        "model's own (at most 65536)")] = None


class RolloutConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    harness: Annotated[str, setting("agent CLI that runs each rollout (`harness-rl harnesses` lists them)")] \
        = "opencode"
    tasks: Annotated[str, setting("a Harbor task dir, a dir of them, or hf://<dataset repo>")] = ""
    sandbox: Annotated[Literal["local", "e2b", "harbor"], setting("where each rollout runs")] = "local"
    num_generations: Annotated[int, msgspec.Meta(ge=2), setting("rollouts per task in a GRPO group")] = 8
    max_concurrent_rollouts: Annotated[AtLeastOne, setting("agents running at once")] = 8
    max_turns: Annotated[AtLeastOne | None, setting("model calls per rollout before the proxy stops the agent")] \
        = 64
    max_tokens_per_turn: Annotated[AtLeastOne | None, setting(
        "cap on each model call's max_tokens; none: up to the model's context")] = None
    agent_timeout_s: Annotated[Positive | None, setting("seconds before an agent is killed; none: the task's "
                                                        "own limit", flag="--agent-timeout")] = None
    reward_key: Annotated[str | None, setting("which key of the verifier's reward.json is the reward")] = None
    harness_options: Annotated[dict[str, Any], setting("options for the harness adapter", flag=None)] = {}
    sandbox_options: Annotated[dict[str, Any], setting("options for the sandbox", flag=None)] = {}
    sandbox_start_attempts: Annotated[AtLeastOne, setting("sandbox creation attempts", flag=None)] = 3
    sandbox_retry_backoff_s: Annotated[NonNegative, setting("first retry delay", flag=None)] = 1.0
    delete_sessions: Annotated[bool, setting("delete proxy sessions once fetched", flag=None)] = False


class LossConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    epsilon: Annotated[Positive, setting("lower clip of the ratio")] = 0.2
    epsilon_high: Annotated[Positive | None, setting("upper clip of the ratio; none: epsilon")] = None
    tis_cap: Annotated[Positive | None, setting("truncated importance-sampling cap on the behaviour ratio")] = 3.0
    beta: Annotated[NonNegative, setting("k3 KL weight to the initial model")] = 0.0
    decoupled: Annotated[bool, setting(
        "decoupled PPO: the trust region against the weights before the step, truncated IS against the sampler "
        "(off: clip to the sampler, as TRL's AsyncGRPO)")] = True
    normalization: Annotated[Literal["token", "rollout"], setting(
        "token: every trained token weighs the same; rollout: every rollout does", flag="--loss-normalization")] \
        = "token"

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


class LearnerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    learning_rate: Annotated[Positive, setting("AdamW learning rate")] = 1e-6
    weight_decay: Annotated[NonNegative, setting("AdamW weight decay")] = 0.0
    adam_beta1: Annotated[NonNegative, setting("AdamW beta1", flag=None)] = 0.9
    adam_beta2: Annotated[NonNegative, setting("AdamW beta2", flag=None)] = 0.999
    adam_eps: Annotated[Positive, setting("AdamW epsilon", flag=None)] = 1e-8
    lr_scheduler: Annotated[Literal["constant", "linear", "cosine"], setting("learning-rate schedule")] = "constant"
    warmup_steps: Annotated[AtLeastZero, setting("linear warmup steps")] = 0
    max_steps: Annotated[AtLeastOne, setting("optimizer steps")] = 200
    max_grad_norm: Annotated[Positive | None, setting("gradient-norm clip; none: no clipping")] = 1.0
    groups_per_step: Annotated[AtLeastOne, setting("GRPO groups per optimizer step")] = 1
    token_budget: Annotated[AtLeastOne, setting("tokens per packed micro-batch")] = 16384
    max_staleness: Annotated[AtLeastZero | None, setting(
        "drop tokens sampled more than N policy versions ago; none: keep all")] = 4
    gradient_checkpointing: Annotated[bool, setting("trade compute for activation memory")] = False
    device: Annotated[str, setting("torch device of the learner; auto: cuda when available")] = "auto"
    attn_implementation: Annotated[str | None, setting("attention kernel; none: flash_attention_2 on CUDA when "
                                                       "installed, else sdpa", flag=None)] = None
    sync_every: Annotated[AtLeastOne, setting("push weights to the engine every N steps")] = 1
    max_sync_failures: Annotated[AtLeastZero, setting("failed weight syncs in a row tolerated", flag=None)] = 3
    loss: LossConfig = msgspec.field(default_factory=LossConfig)


class OutputConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    output_dir: Annotated[str | None, setting("the run directory (metrics, traces, checkpoints, plot, summary); "
                                              "none: runs/<harness>-<UTC time>")] = None
    resume: Annotated[bool, setting("continue the run in --output-dir from its latest checkpoint")] = False
    save_every: Annotated[AtLeastZero, setting("checkpoint every N steps; 0: only at the end")] = 10
    save_total_limit: Annotated[AtLeastOne | None, setting("keep the newest N checkpoints; none: all")] = 3
    report_to: Annotated[str, setting("where step metrics go besides metrics.jsonl: tensorboard, trackio "
                                      "(comma-separated) or none")] = "tensorboard"


class RunConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    preset: Annotated[Preset, setting("defaults to start from; the model decides when not given (tiny: demo)",
                                      flag=None)] = "real"
    seed: Annotated[int, setting("seed of the tiny model, sampling and the learner")] = 0
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    proxy: ProxyConfig = msgspec.field(default_factory=ProxyConfig)
    rollouts: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    output: OutputConfig = msgspec.field(default_factory=OutputConfig)


class SftConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every setting of `harness-rl sft` (rejection-sampling fine-tuning from captured traces)."""

    traces: Annotated[str, setting("a directory of *.json traces (e.g. runs/<run>/traces) or a glob of trace files")] \
        = ""
    model: Annotated[str, setting("a local model directory, or tiny")] = ""
    output_dir: Annotated[str, setting("where the fine-tuned model directory goes (must not exist or be empty)")] = ""
    min_reward: Annotated[float, setting("keep traces whose metadata reward is at least this")] = 1.0
    epochs: Annotated[AtLeastOne, setting("passes over the selected traces")] = 3
    learning_rate: Annotated[Positive, setting("AdamW learning rate")] = 1e-5
    token_budget: Annotated[AtLeastOne, setting("tokens per packed micro-batch, one optimizer step each")] = 16384
    seed: Annotated[int, setting("seed of the batch order (and of the tiny model)")] = 0
    weight_decay: Annotated[NonNegative, setting("AdamW weight decay")] = 0.0
    max_grad_norm: Annotated[Positive | None, setting("gradient-norm clip; none: no clipping")] = 1.0
    device: Annotated[str, setting("torch device; auto: cuda when available")] = "auto"


class EvalConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every setting of `harness-rl eval`: a run's engine, proxy and rollouts sections, and what to sample."""

    preset: Annotated[Preset, setting("defaults to start from; the model decides when not given", flag=None)] = "real"
    tasks: Annotated[list[str], setting(
        "tasks to evaluate: a Harbor task dir, a dir of them, or hf://<dataset repo>; repeat the flag for "
        "several splits, each labelled by its folder name; none given: the preset's training tasks")] = []
    num_samples: Annotated[AtLeastOne, setting("rollouts per task")] = 4
    success_reward: Annotated[float, setting("a rollout succeeds when its reward is at least this")] = 1.0
    seed: Annotated[int, setting("seed of the tiny models and of every rollout's sampling seed, derived per task "
                                 "and sample for agents that send one")] = 0
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


# A preset is a partial configuration laid over the field defaults (which are `real`).
PRESETS: dict[str, dict[str, Any]] = {
    "real": {},
    "demo": {
        "engine": {"model": "tiny"},
        "rollouts": {"harness": "echo", "tasks": str(DEMO_TASK), "max_tokens_per_turn": 16},
        "learner": {"learning_rate": 1e-2, "max_steps": 40},
    },
    # Measured on a loaded 2-core box (README, "The agent demo"): every rollout starts mini-swe-agent (about
    # 5 CPU-seconds, most of it importing litellm), so a step is 2 tasks x 4 rollouts and the run is short.
    "agent": {
        "engine": {"model": "tiny-agent"},
        "rollouts": {"harness": "mini-swe-agent", "tasks": str(AGENT_TASKS / "train"), "max_tokens_per_turn": 64,
                     "num_generations": 4, "max_concurrent_rollouts": 4, "harness_options": AGENT_HARNESS_OPTIONS},
        "learner": {"learning_rate": 1e-3, "max_steps": 10, "groups_per_step": 2,
                    "loss": {"normalization": "rollout"}},
    },
}
PRESET_FOR_MODEL: dict[str, Preset] = {"tiny": "demo", "tiny-agent": "agent"}


class ConfigError(ValueError):
    """A setting that cannot run: `setting` names the flag (or config key), `str()` is the one line to print."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting


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
        settings = merge(settings, layer)
    return settings


def _convert(settings: dict[str, Any], struct: type[StructT]) -> StructT:
    """`settings` as `struct`; a validation error names the flag that sets the bad value."""
    from harness_rl.flags import flag_for_path, flags_of

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
    return _undash(data)


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


def check(config: RunConfig) -> None:
    """Everything that can be known wrong before anything starts; raises the first `ConfigError`."""
    _check_engine(config)
    _check_rollouts(config)
    _check_learner(config)
    _check_output(config)


def check_eval(config: EvalConfig) -> None:
    """What `check` finds wrong in the run these rollouts are sampled as, for every task source; the output
    directory must not hold an evaluation already."""
    if not config.tasks:
        raise ConfigError("--tasks", "required: a Harbor task dir, a dir of them, or hf://<dataset repo>")
    run = config.run_config()
    _check_engine(run)
    for tasks in config.tasks:
        _check_rollouts(msgspec.structs.replace(run, rollouts=msgspec.structs.replace(run.rollouts, tasks=tasks)))
    if config.baseline is not None and not baseline_file(config.baseline).is_file():
        raise ConfigError("--baseline", f"no evaluation at {config.baseline} (an eval.json or a directory holding one)")
    if config.output_dir is not None and (Path(config.output_dir) / "eval.json").exists():
        raise ConfigError("--output-dir", f"{config.output_dir} already holds an evaluation; choose another directory")


def baseline_file(baseline: str) -> Path:
    """An evaluation's eval.json, given it or its directory."""
    path = Path(baseline)
    return path / "eval.json" if path.is_dir() else path


def _check_engine(config: RunConfig) -> None:
    from harness_rl.models import run_model

    engine, model = config.engine.engine, config.engine.model
    embedded, vllm = engine == "embedded", engine == "vllm"
    if not embedded and not vllm and not re.match(r"^https?://[^/\s]+", engine):
        raise ConfigError("--engine", f"{engine!r} is neither embedded, vllm nor an http(s) URL of a running engine")
    if not model:
        raise ConfigError("--model", "required: tiny, a local model directory, or the hub id the engine serves")
    if vllm:
        from harness_rl.vllm_server import VllmSetupError, find_vllm_python

        try:
            find_vllm_python(config.engine.vllm_python)
        except VllmSetupError as exc:
            raise ConfigError("--engine", f"vllm: {exc}") from None
    if model in BUILT_MODELS:
        if not embedded and not vllm:
            raise ConfigError("--model", "with --engine URL, name the weights that engine serves (a local directory "
                                         "or hub id) so the learner trains the same model")
    elif not (Path(model) / "config.json").is_file() and run_model(Path(model)) is None:
        if Path(model).exists():
            raise ConfigError("--model", f"{model} is neither a model directory (no config.json) nor a run with a "
                                         "checkpoint")
        if embedded or not HUB_ID.match(model):
            where = "a local model directory" if embedded else "a local model directory or a hub id (org/name)"
            raise ConfigError("--model", f"{model!r} is neither one of {', '.join(BUILT_MODELS)} nor {where}")
    allowed = ("auto", "inprocess", "none") if embedded else ("auto", "nccl", "reload", "none") if vllm else (
        "auto", "http", "nccl", "reload", "none")
    if config.engine.weight_sync not in allowed:
        raise ConfigError("--weight-sync", f"{config.engine.weight_sync!r} does not fit --engine {engine}; use one "
                                           f"of {', '.join(allowed)}")
    if config.proxy.sampling.temperature is None:
        raise ConfigError("--temperature", "training needs one pinned sampling temperature (the learner's)")
    if model == "tiny-agent":
        from harness_rl.tiny_agent import HARNESSES

        if config.rollouts.harness not in HARNESSES:
            raise ConfigError("--model", f"tiny-agent is built for {', '.join(HARNESSES)} (its teacher's prompts), "
                                         f"not {config.rollouts.harness}")


def _check_rollouts(config: RunConfig) -> None:
    from adapters.harnesses import HARNESS_NAMES
    from adapters.tasks import HF_REPO_ID, TaskError, load_tasks

    rollouts = config.rollouts
    if rollouts.harness.replace("_", "-") not in HARNESS_NAMES:
        raise ConfigError("--harness", f"{rollouts.harness!r} is not one of {', '.join(HARNESS_NAMES)}")
    if not rollouts.tasks:
        raise ConfigError("--tasks", "required: a Harbor task dir, a dir of them, or hf://<dataset repo>")
    if Path(rollouts.tasks).expanduser().exists():
        try:
            load_tasks(rollouts.tasks)
        except TaskError as exc:
            raise ConfigError("--tasks", str(exc)) from None
    elif not HF_REPO_ID.match(rollouts.tasks):
        raise ConfigError("--tasks", f"{rollouts.tasks!r} is neither a task directory nor hf://<dataset repo>")
    if rollouts.sandbox == "harbor" and sys.version_info < (3, 12):
        raise ConfigError("--sandbox", "harbor needs Python >= 3.12 (this is "
                                       f"{sys.version_info.major}.{sys.version_info.minor})")
    if rollouts.sandbox in ("e2b", "harbor"):
        import importlib.util

        if importlib.util.find_spec(rollouts.sandbox) is None:
            raise ConfigError("--sandbox", f"{rollouts.sandbox} is not installed: pip install "
                                           f"'harness-rl[{rollouts.sandbox}]'")
        if rollouts.sandbox == "e2b" and not config.proxy.advertise_url:
            raise ConfigError("--advertise-url", "an e2b sandbox needs a public URL that reaches the proxy")


def _check_learner(config: RunConfig) -> None:
    learner = config.learner
    if learner.lr_scheduler != "constant" and learner.max_steps <= learner.warmup_steps:
        raise ConfigError("--lr-scheduler", f"a {learner.lr_scheduler} schedule needs --max-steps greater than "
                                            "--warmup-steps")


def _check_output(config: RunConfig) -> None:
    import importlib.util

    from harness_rl.metrics import MetricsBackendError, parse_report_to

    output = config.output
    try:
        backends = parse_report_to(output.report_to)
    except MetricsBackendError as exc:
        raise ConfigError("--report-to", str(exc)) from None
    for backend in backends:
        if backend != "jsonl" and importlib.util.find_spec(backend) is None:
            raise ConfigError("--report-to", f"{backend} is not installed: pip install 'harness-rl[train]'")
    if output.resume and not output.output_dir:
        raise ConfigError("--resume", "needs --output-dir (the run to continue)")
    if output.output_dir is None:
        return
    run = Path(output.output_dir)
    if output.resume:
        from harness_rl.checkpoint import STATE_FILE, complete_checkpoints

        if not complete_checkpoints(run):
            raise ConfigError("--resume", f"no checkpoint under {run}/checkpoints (each holds {STATE_FILE})")
    elif (run / "metrics.jsonl").exists():
        raise ConfigError("--output-dir", f"{run} already holds a run: pass --resume to continue it, or choose "
                                          "another directory")
