"""`harness-rl train`: an engine, the intercept proxy, the rollout scheduler and the learner, wired up.

Two threads of control. A `BackgroundLoop` runs the proxy and the rollout scheduler: real agents in
sandboxes, each in its own capture session, G per task, several groups in flight. The calling thread
runs the one training loop (`Run.train`): it takes finished groups, makes a learner step, writes the
rollouts and their traces, and the learner pushes the new weights into the engine (gated at the proxy,
so no agent call straddles two versions) while rollouts continue against the new policy. A bounded
hand-over queue, plus `max_staleness` in the learner, keep the rollouts from running far ahead.

`build_run(config, model_dir)` builds everything from a checked `RunConfig` on its `Stack` (engine, proxy,
client, scheduler); tests drive it with a fake harness, sandbox or reward function in place of the real ones.

Under torchrun only rank 0 runs all this; every other rank holds a shard of the policy and follows rank 0's
learner (`follow`): the engine, the proxy and the rollouts are rank 0's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from harness_rl.learner.checkpoint import checkpoint_step, latest_checkpoint
from harness_rl.outcome import RewardFn, RolloutGroup, default_reward, unscorable_cause
from harness_rl.run.config import RunConfig, to_toml
from harness_rl.run.engines import RunStopped
from harness_rl.run.metrics import rollout_metrics
from harness_rl.run.resume import RUN_CONFIG
from harness_rl.run.reward_fn import RewardFnError
from harness_rl.run.rollouts import RolloutConfigError, SchedulerState

if TYPE_CHECKING:

    from adapters.harnesses import Harness
    from adapters.sandboxes import Sandbox
    from harness_rl.background import BackgroundLoop
    from harness_rl.learner.learner import Learner
    from harness_rl.learner.weight_sync import Weights, WeightSync
    from harness_rl.run.metrics import MetricsLogger
    from harness_rl.run.rollouts import RolloutScheduler
    from harness_rl.run.run_files import RunFiles
    from harness_rl.run.stack import Stack


ENGINE_CHECK_S = 10.0  # how often a run asks whether its engines are still there
ROLLOUT_STATE = "rollouts"  # the key of the rollouts' state in a checkpoint's extra state


def default_output_dir(config: RunConfig) -> Path:
    return Path("runs") / f"{config.rollouts.harness}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


@dataclass
class Run:
    """A started run: its stack (engine, proxy, client, scheduler on the background loop), the learner, and the
    run directory's files and metrics."""

    config: RunConfig
    output_dir: Path
    stack: Stack
    learner: Learner
    files: RunFiles
    metrics: MetricsLogger
    tokenizer: Any
    lockstep: LockstepSync | None = None
    rollout_state: SchedulerState = field(default_factory=SchedulerState)  # as of the last finished step
    watching: asyncio.Task[None] | None = None
    started: float = field(default_factory=time.time)

    @property
    def loop(self) -> BackgroundLoop:
        return self.stack.loop

    @property
    def scheduler(self) -> RolloutScheduler:
        return self.stack.scheduler

    def train(self, on_step: Callable[[int, dict[str, float]], None] | None = None) -> None:
        """The training loop: rollouts in, one learner step per `groups_per_step` groups, until `max_steps`."""
        from harness_rl.learner.weight_sync import WeightSyncError

        settings = self.config.learner
        self.loop.run(self._start_rollouts())
        while self.learner.step_count < settings.max_steps:
            waited = time.perf_counter()
            batch = [self.loop.run(self._next_group()) for _ in range(settings.groups_per_step)]
            self._stop_if_engines_gone()  # its last rollouts failed for that, not for what the policy did
            try:
                _stop_on_setup_failures(batch, self.learner.step_count + 1)
            except RunStopped:
                self.files.write(self.learner.step_count + 1, batch)  # what failed, to read in rollouts.jsonl
                raise
            with finish_first(f"step {self.learner.step_count + 1}"):
                try:
                    metrics = self.learner.step(batch, rollout_wait_s=time.perf_counter() - waited)
                except WeightSyncError:
                    self._stop_if_engines_gone()
                    raise
                self.rollout_state = self._rollout_state()
                metrics.update(rollout_metrics(batch, custom_reward=self.scheduler.reward_fn is not default_reward))
                self.metrics.log(self.learner.step_count, metrics)
                self.files.write(self.learner.step_count, batch)
            if on_step is not None:
                on_step(self.learner.step_count, metrics)
            if self.config.output.save_every and self.learner.step_count % self.config.output.save_every == 0:
                self.save(final=self.learner.step_count >= settings.max_steps)
        self.save(final=True)

    def _rollout_state(self) -> SchedulerState:
        """The scheduler's state as of the step just taken: in lockstep, as the step's weight sync found it (every
        group finished, none started on the new weights: a resumed run starts those again from there); else as it
        is now (groups still running are sampled again on resume, by the checkpoint's weights)."""
        held = self.lockstep.take_held_state() if self.lockstep is not None else None
        return held if held is not None else self.loop.run(self._scheduler_state())

    async def _scheduler_state(self) -> SchedulerState:
        return self.scheduler.state()

    async def _start_rollouts(self) -> None:
        self.watching = asyncio.create_task(self._watch_engines())

    async def _next_group(self) -> RolloutGroup:
        """The next finished group; a rollout's configuration error as RunStopped, RunStopped if the engines died."""
        assert self.watching is not None
        getter = asyncio.ensure_future(self.scheduler.next_group())
        await asyncio.wait({getter, self.watching}, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
            self.watching.result()
        try:
            return getter.result()
        except (RolloutConfigError, RewardFnError) as error:  # one line for the user, not a traceback
            raise RunStopped(str(error)) from error

    async def _watch_engines(self) -> None:
        """Raise RunStopped once no engine can serve, rather than let every rollout fail against them."""
        while (gone := await asyncio.to_thread(self._engines_gone)) is None:
            await asyncio.sleep(ENGINE_CHECK_S)
        raise gone

    def _stop_if_engines_gone(self) -> None:
        gone = self._engines_gone()
        if gone is not None:
            raise gone

    def _engines_gone(self) -> RunStopped | None:
        """Why the run cannot go on when no engine can serve; None while one can (with several engines, the
        proxy moves a dead one's sessions to the others, and a restarted one rejoins)."""
        reasons: list[tuple[str, str]] = []
        for engine in self.stack.engines:
            reason = engine.failure()
            if reason is None:
                return None
            reasons.append((engine.url, reason))
        if len(reasons) == 1:
            return RunStopped(f"the engine at {reasons[0][0]} is gone: {reasons[0][1]}")
        return RunStopped("every engine is gone: " + "; ".join(f"{url}: {reason}" for url, reason in reasons))

    async def _stop_rollouts(self) -> None:
        if self.watching is not None:
            self.watching.cancel()
            await asyncio.gather(self.watching, return_exceptions=True)
        await self.scheduler.close()

    def save(self, final: bool = False) -> Path:
        """A checkpoint of the last finished step, the rollouts' state with it; the final one also holds `model/`,
        a complete model directory (weights, config and tokenizer)."""
        with finish_first("the checkpoint"):
            return self._write_checkpoint(final)

    def _write_checkpoint(self, final: bool) -> Path:
        self.learner.extra_state = {ROLLOUT_STATE: msgspec.msgpack.encode(self.rollout_state)}
        path = self.learner.save(export=final)
        if final:
            self.tokenizer.save_pretrained(path / "model")
        return path

    def stop(self) -> Path | None:
        """Ctrl-C or SIGTERM: rollouts cancelled (their sessions and sandboxes closed) while the last finished step
        is saved, unless a checkpoint holds it already; the newest checkpoint (none before the first step)."""
        closing = self.loop.submit(self._stop_rollouts())
        checkpoint = latest_checkpoint(self.output_dir)
        try:
            if self.learner.step_count > (checkpoint_step(checkpoint) if checkpoint else 0):
                checkpoint = self._write_checkpoint(final=False)
        finally:
            closing.result(timeout=120)
        return checkpoint

    def close(self) -> None:
        """Cancel every rollout (their sessions and sandboxes close), then stop the learner and the stack."""
        self.loop.run(self._stop_rollouts(), timeout=120)
        with contextlib.suppress(Exception):
            self.learner.close()
        self.metrics.close()
        self.files.close()
        self.stack.close()


def _stop_on_setup_failures(batch: list[RolloutGroup], step: int) -> None:
    """Stop a run whose every rollout in a step failed for a setup reason, or whose first step scored none (a broken
    task: its verifier writes no reward, times out, ...): more steps would fail the same way, training on nothing."""
    outcomes = [o for group in batch for o in group.outcomes]
    if outcomes and all(o.config_error for o in outcomes):
        raise RunStopped(f"every rollout of step {step} failed for a setup reason: {outcomes[0].error}")
    if step == 1 and outcomes and not any(o.scorable for o in outcomes):
        raise RunStopped(f"no rollout of step 1 could be scored: {unscorable_cause(outcomes)}")


def restored_rollouts(extra: dict[str, Any]) -> SchedulerState:
    """The rollouts' state a checkpoint holds (of a harness-rl before it kept one: the next group only)."""
    if ROLLOUT_STATE not in extra:
        return SchedulerState(next_group=int(extra.get("scheduler", {}).get("groups_started", 0)))
    return msgspec.msgpack.decode(extra[ROLLOUT_STATE], type=SchedulerState)


def build_run(config: RunConfig, model_dir: Path, *, harness: Harness | None = None,
              sandbox_factory: Callable[[], Sandbox] | None = None, reward_fn: RewardFn | None = None) -> Run:
    """Start everything a checked configuration describes on `model_dir` (resolved: a directory or the hub id
    the engine serves); resume from its latest checkpoint when asked."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    from adapters.tasks import load_tasks
    from harness_rl.learner.distributed import Ranks
    from harness_rl.learner.learner import Learner
    from harness_rl.run.engines import sync_check_for, weight_sync_for
    from harness_rl.run.metrics import MetricsLogger
    from harness_rl.run.proxy_gate import ProxyGate
    from harness_rl.run.run_files import RunFiles
    from harness_rl.run.stack import Stack

    transformers_logging.disable_progress_bar()
    output_dir = Path(config.output.output_dir) if config.output.output_dir else default_output_dir(config)
    tasks = load_tasks(config.rollouts.tasks)
    created = not output_dir.exists()
    checkpoint = latest_checkpoint(output_dir)  # preflight refused one that --resume did not ask for
    stack: Stack | None = None
    try:
        _prepare_run_dir(output_dir, checkpoint, config.output.resume)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / RUN_CONFIG).write_text(to_toml(config))  # first: whatever stops the run, it is ours
        stack = Stack.start(config, model_dir, output_dir, tasks, harness=harness, sandbox_factory=sandbox_factory,
                            reward_fn=reward_fn)
        engine, loop = stack.engine, stack.loop
        if stack.proxy.proxy.pipeline.prompts.said is not None:
            print(f"harness-rl: {stack.proxy.proxy.pipeline.prompts.said}", file=sys.stderr, flush=True)
        temperature = config.proxy.sampling.temperature or 1.0
        sync = weight_sync_for(stack.engines, loop)
        Ranks.current().broadcast((engine.model_dir, output_dir))  # what the other ranks' learners load and write
        gated: WeightSync = ProxyGate(sync, stack.client, loop)
        lockstep = LockstepSync(gated, stack.scheduler, loop) if config.rollouts.lockstep else None
        learner = Learner(engine.model_dir, config.learner, temperature=temperature, seed=config.seed,
                          weight_sync=lockstep or gated, output_dir=output_dir,
                          save_total_limit=config.output.save_total_limit,
                          sync_check=sync_check_for(stack.engines, sync, loop, temperature))
        if learner.lora is not None:
            trained, total = learner.trained_parameters
            served = f"vLLM serves it as {engine.adapter_name}" if engine.adapter_name else "the engine gets it merged"
            print(f"harness-rl: LoRA rank {config.learner.lora_rank} trains {trained:,} of {total:,} parameters "
                  f"({trained / total:.2%}); {served}", file=sys.stderr, flush=True)
        rollout_state = SchedulerState()
        if checkpoint is not None:
            rollout_state = restored_rollouts(learner.load(checkpoint))
            stack.scheduler.restore(rollout_state)
        # The engine may still hold another run's weights (a vLLM kept between runs): it starts on ours, stamped
        # with our version, so nothing is sampled by weights the learner never had.
        learner.sync_weights()
        if lockstep is not None:  # what a checkpoint keeps is a step's hold: this one's would be saved by a first
            lockstep.take_held_state()  # step that pushes nothing (nothing to learn), and its groups run again
        metrics = MetricsLogger(output_dir, console=False, report_to=f"jsonl,{config.output.report_to}",
                                resumed_after=None if checkpoint is None else checkpoint_step(checkpoint))
        return Run(config, output_dir, stack, learner, RunFiles(output_dir, stack.scheduler.harness.name), metrics,
                   AutoTokenizer.from_pretrained(engine.model_dir), lockstep, rollout_state)
    except BaseException:
        if stack is not None:
            stack.close()
        if created:  # a run that never started leaves no half-made folder behind
            shutil.rmtree(output_dir, ignore_errors=True)
        raise


def _prepare_run_dir(run_dir: Path, checkpoint: Path | None, resume: bool) -> None:
    """Continue from the checkpoint (dropping records of later steps, lost with the process that took them);
    a run that stopped before its first checkpoint starts again from step 0. Either way, saying so."""
    from harness_rl.run.run_files import rewind, start_over

    if checkpoint is not None:
        rewind(run_dir, checkpoint_step(checkpoint))
        said = f"resuming {run_dir} from its checkpoint of step {checkpoint_step(checkpoint)}"
    elif (run_dir / RUN_CONFIG).is_file():
        start_over(run_dir)
        said = f"{run_dir} stopped before its first checkpoint: starting it again from step 0"
    elif resume:
        said = f"no run in {run_dir} yet: starting it from step 0"
    else:
        return
    print(f"harness-rl train: {said}", file=sys.stderr, flush=True)


class LockstepSync:
    """A weight sync that first lets every group in flight finish and starts no new one until the new weights
    are in (`rollouts.lockstep`): each group is then sampled by one policy version. The scheduler's state while
    held is what a checkpoint of this step keeps (`take_held_state`)."""

    def __init__(self, inner: WeightSync, scheduler: RolloutScheduler, loop: BackgroundLoop) -> None:
        self.inner, self.scheduler, self.loop = inner, scheduler, loop
        self.keeps_requests = inner.keeps_requests
        self.sends = inner.sends
        self._held: SchedulerState | None = None

    def take_held_state(self) -> SchedulerState | None:
        """The scheduler's state at the last push's hold, once (None: no push since the last call)."""
        held, self._held = self._held, None
        return held

    def push(self, weights: Weights, version: int) -> None:
        self._held = self.loop.run(self.scheduler.hold())
        try:
            self.inner.push(weights, version)
        finally:
            self.loop.run(self.scheduler.release())

    def close(self) -> None:
        self.inner.close()


def follow(config: RunConfig) -> None:
    """A rank other than 0 under torchrun: its shard of the policy, stepped, synced and saved as rank 0 says."""
    from harness_rl.learner.distributed import Ranks
    from harness_rl.learner.learner import Learner

    where: tuple[Path, Path] = Ranks.current().broadcast(None)
    model_dir, output_dir = where
    learner = Learner(model_dir, config.learner, temperature=config.proxy.sampling.temperature or 1.0,
                      seed=config.seed, output_dir=output_dir)
    learner.follow()


def train(config: RunConfig, model_dir: Path) -> dict[str, Any]:
    """Run training to `max_steps` with a progress bar; the summary (also on Ctrl-C) is written and returned."""
    from tqdm import tqdm

    from harness_rl.run.metrics import console_line
    from harness_rl.run.report import write_report

    run = build_run(config, model_dir)
    bar = tqdm(total=config.learner.max_steps, initial=run.learner.step_count, desc="train", unit="step",
               dynamic_ncols=True)

    def on_step(step: int, metrics: dict[str, float]) -> None:
        bar.update(step - bar.n)
        bar.write(console_line(step, metrics))

    try:
        run.train(on_step)
    except KeyboardInterrupt:
        # Already stopping: a second signal (torchrun passes on the Ctrl-C its processes got too) changes nothing.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        bar.close()
        checkpoint = run.stop()
        run.close()
        write_report(run.output_dir, started=run.started, stopped="interrupted")
        kept = (f"checkpoint {checkpoint} (step {checkpoint_step(checkpoint)}): continue with "
                f"harness-rl train --resume --output-dir {run.output_dir}" if checkpoint else
                "no step was finished: the same command starts it again from step 0")
        print(f"harness-rl train: interrupted; rollouts and sessions closed; {kept}", file=sys.stderr, flush=True)
        raise
    except BaseException as error:
        bar.close()
        run.close()
        write_report(run.output_dir, started=run.started, stopped=f"{type(error).__name__}: {error}")
        raise
    bar.close()
    run.close()
    return write_report(run.output_dir, started=run.started)


@contextlib.contextmanager
def finish_first(work: str) -> Iterator[None]:
    """Let the block finish before Ctrl-C (or SIGTERM) stops the run, so a step is never half taken nor a
    checkpoint half written; a second Ctrl-C stops at once, except under torchrun (which forwards the one it
    gets, and kills its processes itself after its own grace period)."""
    caught: list[int] = []
    at_once = "LOCAL_RANK" not in os.environ

    def defer(signum: int, frame: Any) -> None:
        if caught and at_once:
            raise KeyboardInterrupt
        if not caught:
            again = " (Ctrl-C again to stop at once)" if at_once else ""
            print(f"harness-rl train: stopping once {work} is done{again}", file=sys.stderr, flush=True)
        caught.append(signum)

    previous = {signum: signal.signal(signum, defer) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if caught:
            raise KeyboardInterrupt
