"""Everything about a run's configuration that can be known wrong before anything starts.

Each check raises the first `ConfigError` it finds: one line naming the flag, which `train` and
`eval` print before exiting with status 2, leaving no run directory behind. Light (no torch).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import msgspec

from harness_rl.run.config import EvalConfig, RunConfig
from harness_rl.run.engines import SYNC_BACKENDS
from harness_rl.run.presets import BUILT_MODELS
from harness_rl.settings import ConfigError

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def check(config: RunConfig) -> None:
    """Everything that can be known wrong before a training run starts."""
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
    from harness_rl.run.models import run_model

    settings = config.engine
    model, kind = settings.model, settings.kind
    engine = " --engine ".join(settings.engine)
    if not settings.engine:
        raise ConfigError("--engine", "required: embedded, vllm, or the URL of a running engine")
    for url in settings.engine if kind == "url" else ():
        if not re.match(r"^https?://[^/\s]+", url):
            raise ConfigError("--engine", f"several engines must all be http(s) URLs of running engines, not {url!r}"
                              if len(settings.engine) > 1 else
                              f"{url!r} is neither embedded, vllm nor an http(s) URL of a running engine")
        if [u.rstrip("/") for u in settings.engine].count(url.rstrip("/")) > 1:
            raise ConfigError("--engine", f"{url} is given twice")
    if not model:
        raise ConfigError("--model", "required: tiny, a local model directory, or the hub id the engine serves")
    if kind == "vllm":
        from harness_rl.tools.vllm_server import VllmSetupError, find_vllm_python

        try:
            find_vllm_python(settings.vllm_python)
        except VllmSetupError as exc:
            raise ConfigError("--engine", f"vllm: {exc}") from None
    if model in BUILT_MODELS:
        if kind == "url":
            raise ConfigError("--model", "with --engine URL, name the weights that engine serves (a local directory "
                                         "or hub id) so the learner trains the same model")
    elif not (Path(model) / "config.json").is_file() and run_model(Path(model)) is None:
        if Path(model).exists():
            raise ConfigError("--model", f"{model} is neither a model directory (no config.json) nor a run with a "
                                         "final checkpoint (its model/)")
        if kind == "embedded" or not HUB_ID.match(model):
            where = "a local model directory" + ("" if kind == "embedded" else " or a hub id (org/name)")
            raise ConfigError("--model", f"{model!r} is neither one of {', '.join(BUILT_MODELS)} nor {where}")
    allowed = SYNC_BACKENDS[kind]
    if settings.weight_sync not in allowed:
        raise ConfigError("--weight-sync", f"{settings.weight_sync!r} does not fit --engine {engine}; use one "
                                           f"of {', '.join(allowed)}")
    if config.proxy.sampling.temperature is None:
        raise ConfigError("--temperature", "training needs one pinned sampling temperature (the learner's)")


def _check_rollouts(config: RunConfig) -> None:
    from adapters.harnesses import HARNESS_NAMES, HarborHarness, harness_class
    from adapters.sandboxes import SandboxError
    from adapters.sandboxes.local import default_tools_dir
    from adapters.tasks import HF_REPO_ID, TaskError, load_tasks, missing_tasks

    rollouts = config.rollouts
    if rollouts.harness.replace("_", "-") not in HARNESS_NAMES:
        raise ConfigError("--harness", f"{rollouts.harness!r} is not a harness; `harness-rl harnesses` lists them all")
    harness = harness_class(rollouts.harness)
    if issubclass(harness, HarborHarness):  # Harbor's agent: installed (now, once, if not) and built by Harbor
        try:
            harness.preflight(rollouts.sandbox, rollouts.sandbox_options, rollouts.harness_options)
        except SandboxError as exc:
            raise ConfigError("--harness", str(exc)) from None
    package = harness.package
    if rollouts.sandbox == "local" and package is not None:  # rollouts never install: the CLI must be here
        missing = package.missing(default_tools_dir())
        if missing is not None:
            raise ConfigError("--harness", f"{rollouts.harness}: {missing}")
    if not rollouts.tasks:
        raise ConfigError("--tasks", "required: a Harbor task dir, a dir of them, or hf://<dataset repo>")
    if Path(rollouts.tasks).expanduser().exists():
        try:
            load_tasks(rollouts.tasks)
        except TaskError as exc:
            raise ConfigError("--tasks", str(exc)) from None
    elif not HF_REPO_ID.match(rollouts.tasks):
        raise ConfigError("--tasks", missing_tasks(rollouts.tasks))
    if rollouts.reward_fn is not None:
        from harness_rl.run.reward_fn import load_reward_fn

        load_reward_fn(rollouts.reward_fn)  # raises the ConfigError naming it
    if rollouts.sandbox == "harbor" and sys.version_info < (3, 12):
        raise ConfigError("--sandbox", "harbor needs Python >= 3.12 (this is "
                                       f"{sys.version_info.major}.{sys.version_info.minor})")
    if rollouts.sandbox in ("e2b", "harbor"):
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
    if config.engine.weight_sync == "lora" and not learner.lora_rank:
        raise ConfigError("--weight-sync", "lora syncs a LoRA adapter: set --lora-rank")
    if learner.lora_rank and importlib.util.find_spec("peft") is None:
        raise ConfigError("--lora-rank", "LoRA needs peft: pip install 'harness-rl[train]'")
    if (learner.lora_rank and "lm_head" in learner.lora_target_modules and config.engine.kind != "embedded"
            and config.engine.weight_sync in ("auto", "lora")):
        raise ConfigError("--lora-target-modules", "vLLM serves LoRA adapters on a model's inner layers, not on its "
                                                   "output head: leave lm_head out, or sync merged weights "
                                                   "(--weight-sync reload, nccl or gloo)")


def _check_output(config: RunConfig) -> None:
    from harness_rl.run.metrics import MetricsBackendError, parse_report_to

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
        from harness_rl.learner.checkpoint import STATE_FILE, complete_checkpoints

        if not complete_checkpoints(run):
            raise ConfigError("--resume", f"no checkpoint under {run}/checkpoints (each holds {STATE_FILE})")
    elif (run / "metrics.jsonl").exists():
        raise ConfigError("--output-dir", f"{run} already holds a run: pass --resume to continue it, or choose "
                                          "another directory")
