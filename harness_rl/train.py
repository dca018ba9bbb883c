"""`harness-rl train`: an engine, the intercept proxy, the rollout scheduler and the learner, wired up.

Two threads of control. A `BackgroundLoop` runs the proxy and the rollout scheduler: real agents in
sandboxes, each in its own capture session, G per task, several groups in flight. The calling thread
runs the one training loop (`Run.train`): it takes finished groups, makes a learner step, writes the
rollouts and their traces, and the learner pushes the new weights into the engine (gated at the proxy,
so no agent call straddles two versions) while rollouts continue against the new policy. A bounded
hand-over queue, plus `max_staleness` in the learner, keep the rollouts from running far ahead.

`build_run(config)` builds everything from a checked `RunConfig`; tests drive it with a fake harness,
sandbox or reward function in place of the real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness_rl.background import BackgroundLoop
from harness_rl.config import RunConfig, to_toml
from harness_rl.models import vocab_size
from harness_rl.outcome import RewardFn, RolloutGroup, default_reward

if TYPE_CHECKING:
    from adapters.harnesses import Harness
    from adapters.sandboxes import Sandbox
    from harness_rl.learner import Learner
    from harness_rl.rollouts import RolloutScheduler
    from harness_rl.run_files import RunFiles
    from harness_rl.weight_sync import WeightSync
    from proxy.client import ProxyClient
    from proxy.server import RunningProxy


class RunStopped(RuntimeError):
    """The run cannot go on (every rollout of a step failed for a setup reason); the message says why."""


def default_output_dir(config: RunConfig) -> Path:
    return Path("runs") / f"{config.rollouts.harness}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


@dataclass
class Engine:
    """Where rollouts are sampled and where new weights go."""

    url: str
    model_dir: Path
    sync: WeightSync
    close: Callable[[], None]


def start_engine(config: RunConfig, loop: BackgroundLoop, run_dir: Path) -> Engine:
    """The embedded engine in this process, vLLM started as a child, or a client of the engine at `--engine URL`."""
    from harness_rl import weight_sync as ws
    from harness_rl.models import model_dir

    settings = config.engine
    if settings.engine == "vllm":
        return _start_vllm(config, loop, run_dir)
    path = model_dir(settings.model, seed=config.seed, harness=config.rollouts.harness)
    if settings.engine == "embedded":
        from harness_rl.config import BUILT_MODELS
        from harness_rl.engine import Engine as EmbeddedEngine
        from harness_rl.engine import serve_in_thread
        from harness_rl.engine.engine import DEFAULT_MAX_MODEL_LEN

        engine = EmbeddedEngine.from_pretrained(
            path, seed=config.seed, max_model_len=settings.max_model_len or DEFAULT_MAX_MODEL_LEN,
            served_model_name=settings.model if settings.model in BUILT_MODELS else None)
        server = serve_in_thread(engine)
        sync: WeightSync = ws.NoSync() if settings.weight_sync == "none" else ws.InProcessSync(engine)

        def close() -> None:
            server.stop()
            engine.close()

        return Engine(server.url, Path(engine.model.name_or_path), sync, close)

    url = settings.engine.rstrip("/")
    kind = settings.weight_sync
    if kind == "auto":
        kind = "http" if _is_embedded_engine(url) else "nccl"
    _require_exact_capture(url, kind)
    return Engine(url, path, _sync(kind, url, loop, config, run_dir, path), lambda: None)


def _require_exact_capture(url: str, weight_sync: str) -> None:
    """Refuse an engine that would record wrong tokens or logprobs, naming each flag it lacks (`harness-rl doctor`)."""
    from harness_rl.doctor import MIN_RUN_CONTEXT, EngineNotExact, require_exact_capture

    try:
        require_exact_capture(url, min_context=MIN_RUN_CONTEXT, weight_sync=weight_sync)
    except EngineNotExact as exc:
        raise RunStopped(str(exc)) from None


def _sync(kind: str, url: str, loop: BackgroundLoop, config: RunConfig, run_dir: Path, model_dir: Path) -> WeightSync:
    """The weight-sync backend `kind` for the engine at `url`."""
    from harness_rl import weight_sync as ws

    if kind == "http":
        return ws.HttpEngineSync(url, loop)
    if kind == "nccl":
        return ws.VllmNcclSync(url, loop)
    if kind == "reload":
        sync_dir = Path(config.engine.sync_dir) if config.engine.sync_dir else run_dir / "weights"
        return ws.ReloadSync(url, loop, sync_dir, restore_dir=model_dir if model_dir.is_dir() else None)
    return ws.NoSync()


def _start_vllm(config: RunConfig, loop: BackgroundLoop, run_dir: Path) -> Engine:
    """vLLM as a child for the run, with the flags exact capture needs (`harness-rl serve vllm`'s)."""
    import shlex

    from harness_rl import vllm_server as vs
    from harness_rl.config import BUILT_MODELS
    from harness_rl.models import model_dir as resolve_model
    from harness_rl.weight_sync import free_port

    settings = config.engine
    model_dir = resolve_model(settings.model, seed=config.seed, harness=config.rollouts.harness)
    python = vs.find_vllm_python(settings.vllm_python)
    cuda = vs.has_cuda(python)
    launch = vs.vllm_launch(model_dir, python=python, cuda=cuda, port=free_port(),
                            served_model_name=settings.model if settings.model in BUILT_MODELS else None,
                            extra_args=shlex.split(settings.vllm_args))
    print(f"harness-rl train: starting vLLM: {shlex.join(launch.command)}", file=sys.stderr, flush=True)
    server = vs.VllmProcess(launch, run_dir / "vllm.log").start(timeout_s=1800)
    kind = settings.weight_sync if settings.weight_sync != "auto" else "nccl" if cuda else "reload"
    try:
        _require_exact_capture(server.url, kind)
        sync = _sync(kind, server.url, loop, config, run_dir, model_dir)
    except BaseException:
        server.stop()
        raise
    return Engine(server.url, model_dir, sync, server.stop)


def _is_embedded_engine(url: str) -> bool:
    """Our engine stamps every reply with its policy version; vLLM does not."""
    import urllib.error
    import urllib.request

    from harness_rl.engine.server_context import POLICY_VERSION_HEADER

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
            return response.headers.get(POLICY_VERSION_HEADER) is not None
    except (urllib.error.URLError, OSError) as exc:
        raise RunStopped(f"engine {url} is not reachable: {exc}") from None


@dataclass
class Run:
    """A started run: engine, proxy and scheduler on the background loop, the learner, the run directory."""

    config: RunConfig
    output_dir: Path
    loop: BackgroundLoop
    engine: Engine
    proxy: RunningProxy
    client: ProxyClient
    scheduler: RolloutScheduler
    learner: Learner
    files: RunFiles
    tokenizer: Any
    ready: asyncio.Queue[RolloutGroup] | None = None
    rolling: asyncio.Task[None] | None = None
    started: float = field(default_factory=time.time)

    def train(self, on_step: Callable[[int, dict[str, float]], None] | None = None) -> None:
        """The training loop: rollouts in, one learner step per `groups_per_step` groups, until `max_steps`."""
        settings = self.config.learner
        self.loop.run(self._start_rollouts())
        while self.learner.step_count < settings.max_steps:
            waited = time.perf_counter()
            batch = [self.loop.run(self._next_group()) for _ in range(settings.groups_per_step)]
            _stop_on_setup_failures(batch, self.learner.step_count + 1)
            metrics = self.learner.step(batch, rollout_wait_s=time.perf_counter() - waited)
            self.files.write(self.learner.step_count, batch)
            self.learner.extra_state = {"scheduler": self.scheduler.state_dict()}
            if on_step is not None:
                on_step(self.learner.step_count, metrics)
            if self.config.output.save_every and self.learner.step_count % self.config.output.save_every == 0:
                self.save()
        self.save()

    async def _start_rollouts(self) -> None:
        # A bounded hand-over: rollouts run at most this many finished groups ahead of the learner.
        self.ready = asyncio.Queue(maxsize=self.config.learner.groups_per_step)
        self.rolling = asyncio.create_task(self.scheduler.run(self.ready))

    async def _next_group(self) -> RolloutGroup:
        """The next finished group; the scheduler's error if it stopped instead."""
        assert self.ready is not None and self.rolling is not None
        getter = asyncio.ensure_future(self.ready.get())
        await asyncio.wait({getter, self.rolling}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            return getter.result()
        getter.cancel()
        self.rolling.result()
        raise RunStopped("the rollout scheduler ran out of work")

    async def _stop_rollouts(self) -> None:
        if self.rolling is not None:
            self.rolling.cancel()
            await asyncio.gather(self.rolling, return_exceptions=True)

    def save(self) -> Path:
        """A checkpoint whose `model/` is a complete model directory (weights, config and tokenizer)."""
        self.learner.extra_state = {"scheduler": self.scheduler.state_dict()}
        with interrupts_deferred():
            path = self.learner.save()
            self.tokenizer.save_pretrained(path / "model")
        return path

    def close(self) -> None:
        """Cancel every rollout (their sessions and sandboxes close), stop the proxy, the engine and the loop."""
        self.loop.run(self._stop_rollouts(), timeout=120)
        with contextlib.suppress(Exception):
            self.learner.close()
        self.loop.run(self.client.close(), timeout=30)
        self.loop.run(self.proxy.stop(), timeout=60)
        self.files.close()
        self.engine.close()
        self.loop.close()


def _stop_on_setup_failures(batch: list[RolloutGroup], step: int) -> None:
    """Stop a run whose every rollout in a step failed for a setup reason: more steps would fail the same way."""
    outcomes = [o for group in batch for o in group.outcomes]
    if outcomes and all(o.config_error for o in outcomes):
        raise RunStopped(f"every rollout of step {step} failed for a setup reason: {outcomes[0].error}")


def build_run(config: RunConfig, *, harness: Harness | None = None,
              sandbox_factory: Callable[[], Sandbox] | None = None, reward_fn: RewardFn = default_reward) -> Run:
    """Start everything a checked configuration describes; resume from its latest checkpoint when asked."""
    import msgspec
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    from adapters.tasks import load_tasks
    from harness_rl.checkpoint import latest_checkpoint
    from harness_rl.learner import Learner
    from harness_rl.metrics import MetricsLogger
    from harness_rl.rollouts import RolloutScheduler
    from harness_rl.run_files import RunFiles
    from harness_rl.sync_check import SyncCheck
    from harness_rl.weight_sync import NoSync, ProxyGate
    from proxy.client import ProxyClient
    from proxy.server import start_proxy

    transformers_logging.disable_progress_bar()
    output_dir = Path(config.output.output_dir) if config.output.output_dir else default_output_dir(config)
    tasks = load_tasks(config.rollouts.tasks)
    loop = BackgroundLoop("harness-rl-rollouts")
    engine: Engine | None = None
    proxy: RunningProxy | None = None
    created = not output_dir.exists()
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        engine = start_engine(config, loop, output_dir)
        (output_dir / "config.toml").write_text(to_toml(config))
        proxy_config = msgspec.structs.replace(config.proxy, upstream=engine.url, store_dir=str(output_dir / "proxy"),
                                               vocab_size=config.proxy.vocab_size or vocab_size(engine.model_dir))
        proxy = loop.run(start_proxy(proxy_config), timeout=120)
        client = ProxyClient(proxy.url, proxy.admin_token)
        temperature = config.proxy.sampling.temperature or 1.0
        learner = Learner(engine.model_dir, config.learner, temperature=temperature,
                          seed=config.seed, weight_sync=ProxyGate(engine.sync, client, loop), output_dir=output_dir,
                          metrics=MetricsLogger(output_dir, console=False,
                                                report_to=f"jsonl,{config.output.report_to}"),
                          save_total_limit=config.output.save_total_limit,
                          sync_check=None if isinstance(engine.sync, NoSync) else SyncCheck(engine.url, loop,
                                                                                            temperature))
        scheduler = RolloutScheduler(tasks, client, config.rollouts, reward_fn, harness, sandbox_factory)
        checkpoint = latest_checkpoint(output_dir) if config.output.resume else None
        if checkpoint is not None:
            state = learner.load(checkpoint)
            scheduler.load_state_dict(state.get("scheduler", {}))
        # The engine may still hold another run's weights (a vLLM kept between runs): it starts on ours, stamped
        # with our version, so nothing is sampled by weights the learner never had.
        learner.sync_weights()
        return Run(config, output_dir, loop, engine, proxy, client, scheduler, learner,
                   RunFiles(output_dir, scheduler.harness.name), AutoTokenizer.from_pretrained(engine.model_dir))
    except BaseException:
        if proxy is not None:
            with contextlib.suppress(Exception):
                loop.run(proxy.stop(), timeout=60)
        if engine is not None:
            engine.close()
        loop.close()
        if created:  # a run that never started leaves no half-made folder behind
            shutil.rmtree(output_dir, ignore_errors=True)
        raise


def train(config: RunConfig) -> dict[str, Any]:
    """Run training to `max_steps` with a progress bar; the summary (also on Ctrl-C) is written and returned."""
    from tqdm import tqdm

    from harness_rl.checkpoint import latest_checkpoint
    from harness_rl.metrics import console_line
    from harness_rl.report import write_report

    run = build_run(config)
    bar = tqdm(total=config.learner.max_steps, initial=run.learner.step_count, desc="train", unit="step",
               dynamic_ncols=True)

    def on_step(step: int, metrics: dict[str, float]) -> None:
        bar.update(step - bar.n)
        bar.write(console_line(step, metrics))

    try:
        run.train(on_step)
    except KeyboardInterrupt:
        bar.close()
        run.close()
        checkpoint = latest_checkpoint(run.output_dir)
        write_report(run.output_dir, started=run.started)
        kept = f"last checkpoint {checkpoint}" if checkpoint else "no checkpoint was written yet"
        print(f"harness-rl train: interrupted; rollouts and sessions closed; {kept}", file=sys.stderr, flush=True)
        raise
    except BaseException:
        bar.close()
        run.close()
        raise
    bar.close()
    run.close()
    return write_report(run.output_dir, started=run.started)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold Ctrl-C (and SIGTERM) until the block is done, so a checkpoint is never half written."""
    caught: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: caught.append(signum))
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if caught:
            raise KeyboardInterrupt
