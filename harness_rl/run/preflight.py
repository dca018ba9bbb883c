"""Everything about a run's configuration that can be known wrong before anything starts.

Each check raises the first `ConfigError` it finds: one line naming the flag, which `train` and
`eval` print before exiting with status 2, leaving no run directory behind. Light: torch only to ask
whether the CUDA device `--device` names is there. The network only where the settings name it: each
engine URL is asked whether it is an engine, and a dataset on the Hub is downloaded (into its cache).
"""

from __future__ import annotations

import errno
import importlib.util
import os
import re
import socket
import sys
from pathlib import Path

import msgspec

from harness_rl.learner.sync_backends import AUTO, BACKENDS, choices_for, colocated_refusal, named, syncs_adapter
from harness_rl.run.config import EvalConfig, RunConfig
from harness_rl.run.engines import SERVERS
from harness_rl.run.presets import BUILT_MODELS
from harness_rl.settings import ConfigError

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
DEVICES = "auto, cpu, cuda, cuda:N or mps"


def check(config: RunConfig) -> None:
    """Everything that can be known wrong before a training run starts (the learner's own settings first: the
    engine and the tasks may be asked over the network)."""
    _check_learner(config)
    _check_engine(config)
    _check_rollouts(config)
    _check_output(config)
    _check_proxy(config)


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
    if config.output_dir is not None:
        _check_directory("--output-dir", config.output_dir)
        if (Path(config.output_dir) / "eval.json").exists():
            raise ConfigError("--output-dir", f"{config.output_dir} already holds an evaluation; choose another "
                                              "directory")
    _check_proxy(run)


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
    if model not in BUILT_MODELS and not (Path(model) / "config.json").is_file() and run_model(Path(model)) is None:
        if Path(model).exists():
            raise ConfigError("--model", f"{model} is neither a model directory (no config.json) nor a run with a "
                                         "final checkpoint (its model/)")
        if not HUB_ID.match(model):
            where = "a local model directory" + (" or the hub id (org/name) it serves" if kind == "url" else "")
            raise ConfigError("--model", f"{model!r} is neither one of {', '.join(BUILT_MODELS)} nor {where}")
        if kind != "url":
            started = "the embedded engine loads" if kind == "embedded" else "--engine vllm starts vLLM on"
            raise ConfigError("--model", f"{model} is a hub id, which an engine at a URL serves: start vLLM with "
                                         f"`harness-rl serve vllm DIR` (DIR from `hf download {model} --local-dir "
                                         f"DIR`) and pass --engine URL; {started} a local directory only")
    if kind == "vllm":
        from harness_rl.tools.vllm_server import VllmSetupError, find_vllm_python

        try:
            find_vllm_python(settings.vllm_python)
        except VllmSetupError as exc:
            raise ConfigError("--engine", f"vllm: {exc}") from None
    allowed = choices_for(SERVERS[kind])
    if settings.weight_sync not in allowed:
        raise ConfigError("--weight-sync", f"{settings.weight_sync!r} does not fit --engine {engine}; use one "
                                           f"of {', '.join(allowed)}")
    if config.proxy.sampling.temperature is None:
        raise ConfigError("--temperature", "training needs one pinned sampling temperature (the learner's)")
    if kind == "url":
        from harness_rl.tools.engine_contact import NotAnEngine, reach_engine

        for url in settings.engine:
            try:
                reach_engine(url)
            except NotAnEngine as exc:
                raise ConfigError("--engine", str(exc)) from None
            if settings.weight_sync == AUTO:
                _check_auto_at(url, config)


def _check_rollouts(config: RunConfig) -> None:
    from adapters.harnesses import HARNESS_NAMES, HarborHarness, harness_class
    from adapters.sandboxes import SandboxError
    from adapters.sandboxes.local import default_tools_dir
    from adapters.tasks import TaskError, load_tasks

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
    try:
        load_tasks(rollouts.tasks)  # a dataset on the Hub is downloaded now, into the cache the run reads
    except TaskError as exc:
        raise ConfigError("--tasks", str(exc)) from None
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
    if rollouts.sandbox == "e2b":
        _check_e2b(config)


def _check_e2b(config: RunConfig) -> None:
    """A cloud sandbox reaches the proxy only at a public URL, and E2B creates none without an API key."""
    from urllib.parse import urlparse

    from harness_rl.run.rollouts import LOOPBACK_HOSTS

    advertised = config.proxy.advertise_url
    if not advertised:
        raise ConfigError("--advertise-url", "an e2b sandbox needs a public URL that reaches the proxy")
    if (urlparse(advertised).hostname or "") in LOOPBACK_HOSTS:
        raise ConfigError("--advertise-url", f"{advertised} is this machine's loopback, which an e2b sandbox "
                                             "cannot reach: give a public URL (a tunnel) that reaches the proxy")
    if not (config.rollouts.sandbox_options.get("api_key") or os.environ.get("E2B_API_KEY")):
        raise ConfigError("--sandbox", "e2b creates sandboxes only with an API key: set E2B_API_KEY (from "
                                       "https://e2b.dev/dashboard?tab=keys)")


def _check_learner(config: RunConfig) -> None:
    learner = config.learner
    _check_device(learner.device)
    if learner.lr_scheduler != "constant" and learner.max_steps <= learner.warmup_steps:
        raise ConfigError("--lr-scheduler", f"a {learner.lr_scheduler} schedule needs --max-steps greater than "
                                            "--warmup-steps")
    choice, servers = config.engine.weight_sync, SERVERS[config.engine.kind]
    chosen = named(choice)
    if chosen is not None and chosen.adapter and not learner.lora_rank:
        raise ConfigError("--weight-sync", f"{chosen.name} syncs a LoRA adapter: set --lora-rank")
    if chosen is not None and chosen.colocated:
        _check_colocated(chosen.name, config)
    if learner.lora_rank and importlib.util.find_spec("peft") is None:
        raise ConfigError("--lora-rank", "LoRA needs peft: pip install 'harness-rl[train]'")
    if learner.lora_rank and "lm_head" in learner.lora_target_modules and syncs_adapter(choice, servers):
        merged = [b.name for b in BACKENDS.values() if "vllm" in b.engines and b.moves_weights and not b.adapter]
        raise ConfigError("--lora-target-modules", "vLLM serves LoRA adapters on a model's inner layers, not on its "
                                                   "output head: leave lm_head out, or sync merged weights "
                                                   f"(--weight-sync {', '.join(merged[:-1])} or {merged[-1]})")


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
    _check_directory("--output-dir", output.output_dir)
    from harness_rl.learner.checkpoint import checkpoint_step, latest_checkpoint
    from harness_rl.run.resume import RUN_CONFIG
    from harness_rl.run.run_files import RUN_RECORDS

    run = Path(output.output_dir)
    checkpoint = latest_checkpoint(run)
    if checkpoint is not None and not output.resume:  # without a checkpoint, the same command starts it again
        raise ConfigError("--output-dir", f"{run} holds a run saved at step {checkpoint_step(checkpoint)}: pass "
                                          "--resume to continue it, or choose another directory")
    records = [name for name in RUN_RECORDS if (run / name).exists()]
    if records and not (run / RUN_CONFIG).is_file():
        raise ConfigError("--output-dir", f"{run} holds {records[0]} but no {RUN_CONFIG}: it is not a run of "
                                          "harness-rl's to continue or start again; choose another directory")


def _check_auto_at(url: str, config: RunConfig) -> None:
    """What `auto` picks for the engine at `url` (it follows the transfer a vLLM was started with) can serve this
    run: a transfer harness-rl drives, and for GPU sharing the layout `--weight-sync ipc` would need."""
    from harness_rl.run.engines import RunStopped, backend_at_url

    try:
        backend, _ = backend_at_url(config.engine, url, lora=config.learner.lora_rank > 0)
    except RunStopped as exc:
        raise ConfigError("--engine", f"{url}: {exc}") from None
    refusal = colocated_problem(backend.name, config) if backend.colocated else None
    if refusal is not None:
        raise ConfigError("--weight-sync", f"auto picks {backend.name} for {url} (the weight transfer it was started "
                                           f"with), and {refusal}")


def _check_colocated(name: str, config: RunConfig) -> None:
    refusal = colocated_problem(name, config)
    if refusal is not None:
        raise ConfigError("--weight-sync", refusal)


def colocated_problem(name: str, config: RunConfig) -> str | None:
    """Why this run's layout cannot share the learner's GPU with vLLM (`sync_backends.colocated_refusal`): checked
    for an explicit --weight-sync before anything starts, and for `auto` once the engine says how it was started."""
    import torch

    from harness_rl.run.rollouts import off_this_machine

    processes = max(config.learner.nproc_per_node, int(os.environ.get("WORLD_SIZE", "1")))
    foreign = [url for url in config.engine.engine if off_this_machine(url)]
    return colocated_refusal(name, processes=processes, device=config.learner.device, cuda=torch.cuda.is_available(),
                             foreign_url=foreign[0] if foreign else None)


def _check_device(device: str) -> None:
    """A device torch can name, and for CUDA one this machine has (torch is imported only then)."""
    if not DEVICE.match(device):
        raise ConfigError("--device", f"{device!r} is not a device: use {DEVICES}")
    if device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.partition(":")[2] or 0)
        if not count:
            raise ConfigError("--device", f"{device}: torch sees no CUDA device on this machine: use --device auto "
                                          "or cpu")
        if index >= count:
            raise ConfigError("--device", f"{device}: torch sees {count} CUDA device(s) on this machine, cuda:0 "
                                          f"to cuda:{count - 1}: use one of them, or --device auto")
    if device == "mps":
        import torch

        if not torch.backends.mps.is_available():
            raise ConfigError("--device", "mps: this machine has no Apple GPU (MPS): use --device auto or cpu")


def _check_directory(flag: str, directory: str) -> None:
    """A directory to write into: it, or the nearest part of its path that exists, is a writable directory."""
    path = Path(directory).expanduser().absolute()
    existing = next(part for part in (path, *path.parents) if part.exists())
    if not existing.is_dir():
        inside = "" if existing == path else f" (on the way to {directory})"
        raise ConfigError(flag, f"{existing} is a file{inside}: name a directory (it is made if missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(flag, f"{existing} is not writable by this user: choose another directory")


def _check_proxy(config: RunConfig) -> None:
    """The proxy can listen where it is told: the port is free on that interface (tried as the proxy binds, so
    a socket still closing never counts), and the interface is this machine's."""
    host, port = config.proxy.host, config.proxy.port
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError("--proxy-host", f"{host!r} is no address of this machine ({exc.strerror})") from None
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ConfigError("--proxy-port", f"port {port} on {host} is in use (another run or proxy?): "
                                                      "choose another, or 0 for a free one") from None
                raise ConfigError("--proxy-host", f"cannot listen on {host}: {exc.strerror}") from None
