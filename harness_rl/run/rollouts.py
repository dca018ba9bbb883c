"""The rollout scheduler: G agent runs per task, each in its own proxy session and sandbox, grouped for GRPO.

Each rollout: start a sandbox (retrying creation failures with backoff), open a capture session,
run the harness with the task's time limit, close the session and fetch its trace, run the task's
verifier, and turn it all into a `RolloutOutcome` whose `reward` comes from `rollout_reward_fn`.
G of them make a `RolloutGroup`, put on an asyncio queue the learner drains. Several groups are
in flight at once; `max_concurrent_rollouts` bounds the agents running at any moment.

What counts as what:
- an agent killed at its time limit is `timed_out`, and still scored: the verifier judges the
  partial work;
- a sandbox that never starts, a lost sandbox or proxy connection, an agent that never reached
  the model, or an invalid trace: unscorable (`env_reward` and `reward` None), with `error`
  saying which; `rollout_reward_fn` is not asked about these;
- a verifier that leaves no readable reward: `env_reward` None and `error` says why; the
  reward function still sees the outcome (the default one returns `env_reward`, so None);
- a reward function (`reward_fn`, `--reward-fn`) that raises or returns a non-number stops the run
  (`RewardFnError`, naming the function and the rollout), as a configuration error does;
- cancellation (Ctrl-C): every in-flight rollout closes its session and its sandbox (killing its
  processes) before the cancellation propagates.

For checkpoints the scheduler's `state()` says where it stands: the next group, the finished groups not
yet handed over (kept whole) and the groups still running (run again on resume with the same seeds).

Groups visit the tasks in passes, each pass in its own order (`task_order`, seeded by the run seed and
the pass), as a sampler shuffles a dataset each epoch, with each task category (task.toml's `[metadata]
category`) spread evenly through the pass: a task folder sorted by kind does not train one kind at a time,
every stretch of steps sees the kinds in their shares, and a resumed run visits the same tasks.

Every rollout's proxy session is seeded with `rollout_seed(seed, group, task, index)`, so the proxy
seeds each of its engine calls (`proxy.sampling.call_seed`): the same run seed samples the same
rollouts again, on an engine whose sampling does not depend on what else it batches. With
`lockstep`, groups are also handed over in the order they started, and `hold()` lets the run wait for
every group in flight before a weight sync, so each group is sampled by one policy version.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import random
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

import aiohttp
import msgspec

from adapters.harnesses import AgentRun, Endpoint, Harness, create_harness
from adapters.sandboxes import Sandbox, SandboxError, SandboxStartError, create_sandbox
from adapters.tasks import Task
from adapters.verifier import verify
from harness_rl.outcome import RewardFn, RolloutGroup, RolloutOutcome, default_reward
from harness_rl.run.reward_fn import RewardFnError, load_reward_fn, score
from harness_rl.settings import AtLeastOne, NonNegative, Positive, setting
from harness_rl.trace import TrainingTrace
from harness_rl.trace.tools import tool_usage
from proxy.client import ProxyClient
from proxy.control_api import SessionInfo

log = logging.getLogger(__name__)
DEFAULT_AGENT_TIMEOUT_S = 600.0
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


def off_this_machine(url: str) -> bool:
    """An HTTP URL whose host is not this machine's loopback."""
    return url.startswith("http") and (urlparse(url).hostname or "") not in LOOPBACK_HOSTS


class RolloutConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    harness: Annotated[str, setting("agent CLI that runs each rollout (`harness-rl harnesses` lists them)")] \
        = "opencode"
    tasks: Annotated[str, setting("a Harbor task dir, a dir of them, or hf://<dataset repo>", required=True)] = ""
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
    reward_fn: Annotated[str | None, setting(
        "package.module:function turning each finished rollout into its reward (TRL's rollout_reward_fn: it gets the "
        "outcome, returns a float or none for unscorable); none: the verifier's reward")] = None
    harness_options: Annotated[dict[str, Any], setting("options for the harness adapter", flag=None)] = {}
    sandbox_options: Annotated[dict[str, Any], setting("options for the sandbox", flag=None)] = {}
    sandbox_start_attempts: Annotated[AtLeastOne, setting("sandbox creation attempts", flag=None)] = 3
    sandbox_retry_backoff_s: Annotated[NonNegative, setting("first retry delay", flag=None)] = 1.0
    delete_sessions: Annotated[bool, setting("delete proxy sessions once fetched", flag=None)] = False
    lockstep: Annotated[bool, setting(
        "sample each group with one policy version and hand groups to the learner in the order they started "
        "(a weight sync waits for the groups in flight): with --seed, the same rollouts every run on an engine "
        "whose sampling does not depend on its batch (the embedded engine); costs the overlap of syncs with "
        "sampling")] = False


class RolloutConfigError(ValueError):
    """A setting that would make every rollout fail (e.g. a loopback proxy URL for a cloud sandbox)."""


def task_order(seed: int, categories: Sequence[str | None], epoch: int) -> list[int]:
    """The order in which pass `epoch` visits the tasks whose categories are `categories`: a permutation seeded
    by (seed, epoch) that spaces each category's tasks evenly through the pass.

    A category of n tasks is shuffled and laid at the points (i + phase) / n of the pass, its phase drawn once
    per pass, so any stretch of consecutive groups holds each category in its share, give or take one task;
    with categories of equal size the pass is rounds holding one task of each. The reward of the first steps
    and of the last is then measured on the same mix of kinds, not on whichever kinds the draw put there.
    Tasks without a category are one category; a task set with none is simply shuffled.
    """
    rng = random.Random(f"{seed}/{epoch}")
    members: dict[str | None, list[int]] = {}
    for index, category in enumerate(categories):
        members.setdefault(category, []).append(index)
    placed: list[tuple[float, int]] = []
    for indices in members.values():
        rng.shuffle(indices)
        phase = rng.random()
        placed += [((slot + phase) / len(indices), index) for slot, index in enumerate(indices)]
    return [index for _, index in sorted(placed)]


def rollout_seed(seed: int, group_id: int, task: str, index: int) -> int:
    """The session seed of the `index`-th rollout of group `group_id` (on `task`), stable across runs and
    machines (31 bits)."""
    digest = hashlib.sha256(f"{seed}/{group_id}/{task}/{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1


def max_groups_in_flight(config: RolloutConfig) -> int:
    """Enough groups to keep every rollout slot busy, plus one starting while the last ones finish."""
    return max(1, math.ceil(config.max_concurrent_rollouts / config.num_generations)) + 1


class SchedulerState(msgspec.Struct, kw_only=True, frozen=True):
    """Where the scheduler stands, as a checkpoint keeps it: a resumed run goes on from here exactly.

    `finished` groups (done, not yet handed to the learner) are kept whole, traces and policy versions
    included; `running` groups are sampled again on resume with the same group ids, so the same seeds.
    `at_sync`: taken while a lockstep sync held the scheduler, so on resume new groups start at once, as the
    sync's release starts them; otherwise (a step that synced nothing) a lockstep run starts none while a
    restored group is out, as `next_group` would not.
    """

    next_group: int = 0
    finished: list[RolloutGroup] = []
    running: list[int] = []
    at_sync: bool = False


class RolloutScheduler:
    """Runs groups of rollouts over a list of tasks, cycling through them in order (group g runs task g mod n).

    Groups start on their own while `next_group` is not called (the learner trains meanwhile): at most
    `max_groups_in_flight` run at once, and at most `ahead` finished ones wait for the learner beyond them.
    In lockstep they start only when a sync releases the scheduler (or when the learner waits with no group
    left), never as another group happens to finish: which weights sample a group then does not depend on
    timing. `max_groups` ends the work after that many groups (none: forever).
    """

    def __init__(
        self,
        tasks: Sequence[Task],
        proxy: ProxyClient,
        config: RolloutConfig | None = None,
        rollout_reward_fn: RewardFn | None = None,
        harness: Harness | None = None,
        sandbox_factory: Callable[[], Sandbox] | None = None,
        seed: int = 0,
        ahead: int = 1,
        max_groups: int | None = None,
    ) -> None:
        if not tasks:
            raise RolloutConfigError("no tasks to run")
        self.tasks = list(tasks)
        self.proxy = proxy
        self.config = config or RolloutConfig(harness="echo")
        self.reward_fn = rollout_reward_fn or (
            load_reward_fn(self.config.reward_fn) if self.config.reward_fn else default_reward)
        self.harness = harness or create_harness(self.config.harness, **self.config.harness_options)
        self.sandbox_factory = sandbox_factory or (
            lambda: create_sandbox(self.config.sandbox, **self.config.sandbox_options))
        self.seed = seed
        self.ahead = ahead
        self.max_groups = max_groups
        self.groups_started = 0
        self._slots = asyncio.Semaphore(self.config.max_concurrent_rollouts)
        self._groups: dict[int, asyncio.Future[RolloutGroup]] = {}  # started and not yet handed over
        self._restored: SchedulerState | None = None
        self._held = self._closed = False
        self._changed = asyncio.Event()

    def state(self) -> SchedulerState:
        """Where the scheduler stands now (call it on the scheduler's loop)."""
        finished, running = [], []
        for group_id, group in sorted(self._groups.items()):
            if not group.done():
                running.append(group_id)
            elif not group.cancelled() and group.exception() is None:
                finished.append(group.result())
        if self._restored is not None:  # not started yet
            finished, running = [*self._restored.finished, *finished], [*self._restored.running, *running]
        return SchedulerState(next_group=self.groups_started, finished=finished, running=sorted(running))

    def restore(self, state: SchedulerState) -> None:
        """Go on from a checkpoint's state: its finished groups are handed over first, its running ones run
        again; call before the first `next_group`."""
        self.groups_started = state.next_group
        self._restored = state

    async def next_group(self) -> RolloutGroup:
        """The next finished group, in the order they finish (with `lockstep`: the order they started); a
        group's configuration error is raised here."""
        while True:
            self._changed.clear()
            if not (self.config.lockstep and self._groups):
                self._fill()
            done = [group_id for group_id, group in sorted(self._groups.items()) if group.done()]
            if done and (not self.config.lockstep or done[0] == min(self._groups)):
                return self._groups.pop(done[0]).result()
            if not self._groups and not self._held:
                raise RuntimeError("the rollout scheduler has no group left to run")
            await self._changed.wait()

    def _fill(self) -> None:
        """Start what may start now: a restored state's groups first, then new groups within the limits."""
        if self._restored is not None:
            restored, self._restored = self._restored, None
            for group in restored.finished:
                kept: asyncio.Future[RolloutGroup] = asyncio.get_running_loop().create_future()
                kept.set_result(group)
                self._groups[group.group_id] = kept
            for group_id in restored.running:
                self._start(group_id)
            if self.config.lockstep and self._groups and not restored.at_sync:
                return
        while not (self._held or self._closed) and self._room():
            self._start(self.groups_started)
            self.groups_started += 1

    def _room(self) -> bool:
        if self.max_groups is not None and self.groups_started >= self.max_groups:
            return False
        running = sum(not group.done() for group in self._groups.values())
        limit = max_groups_in_flight(self.config)
        return running < limit and len(self._groups) < limit + self.ahead

    def _start(self, group_id: int) -> None:
        count = len(self.tasks)
        order = task_order(self.seed, [task.category for task in self.tasks], group_id // count)
        task = self.tasks[order[group_id % count]]
        group = asyncio.create_task(self.run_group(task, group_id), name=f"group-{group_id}")
        group.add_done_callback(self._group_done)
        self._groups[group_id] = group

    def _group_done(self, group: asyncio.Future[RolloutGroup]) -> None:
        self._changed.set()
        if not (self._closed or self.config.lockstep):
            self._fill()

    async def hold(self) -> SchedulerState:
        """Start no new group, and return once every group in flight has finished (a weight sync may follow):
        the state then, in which no group is running."""
        self._held = True
        await asyncio.gather(*self._groups.values(), return_exceptions=True)
        return msgspec.structs.replace(self.state(), at_sync=True)

    async def release(self) -> None:
        """Start groups again (after `hold`)."""
        self._held = False
        self._fill()

    async def close(self) -> None:
        """Cancel every group still running; each closes its sessions and sandboxes before this returns."""
        self._closed = True
        running = [group for group in self._groups.values() if not group.done()]
        for group in running:
            group.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    async def run_group(self, task: Task, group_id: int) -> RolloutGroup:
        """G rollouts of one task, concurrently (within the scheduler's rollout limit).

        A configuration error in one rollout cancels its siblings (each still closes its session
        and sandbox) and is raised as itself.
        """
        try:
            async with asyncio.TaskGroup() as rollouts:
                runs = [rollouts.create_task(self.run_rollout(task, group_id, i))
                        for i in range(self.config.num_generations)]
        except* (RolloutConfigError, RewardFnError) as errors:
            raise errors.exceptions[0] from None
        return RolloutGroup(group_id=group_id, task=task.name, outcomes=[run.result() for run in runs])

    async def run_rollout(self, task: Task, group_id: int, index: int,
                          agent_timeout_s: float | None = None) -> RolloutOutcome:
        """One agent run, scored; never raises for a failure of the rollout itself (that is its outcome).
        `agent_timeout_s` overrides the configured time limit for this run (a caller's own deadline)."""
        async with self._slots:
            rollout_id = f"g{group_id}-r{index}-{secrets.token_hex(3)}"
            started = time.monotonic()
            outcome = RolloutOutcome(rollout_id=rollout_id, task=task.name)
            sandbox: Sandbox | None = None
            session: SessionInfo | None = None
            try:
                sandbox = await self._start_sandbox(task)
                seed = rollout_seed(self.seed, group_id, task.name, index)
                session = await self._open_session(
                    {"rollout_id": rollout_id, "task": task.name, "group_id": group_id, "harness": self.harness.name,
                     "seed": seed}, seed)
                self._check_reachable(sandbox, session)
                await sandbox.allow(session.openai_base_url)
                await sandbox.allow(session.anthropic_base_url)
                endpoint = Endpoint(session.openai_base_url, session.anthropic_base_url, session.key,
                                    gemini_base_url=session.gemini_base_url)
                run = await self.harness.run(sandbox, endpoint, task.instruction,
                                             agent_timeout_s or self._agent_timeout(task))
                await self.proxy.close_session(session.id)
                closed, session = session, None
                trace = await self.proxy.get_trace(closed.id)
                if self.config.delete_sessions:
                    await self.proxy.delete_session(closed.id)
                trace.metadata.update({"task": task.name, "group_id": group_id, "harness": self.harness.name})
                outcome = self._agent_outcome(outcome, run, trace)
                verification = await verify(task, sandbox, self.config.reward_key)
                if outcome.error is None:
                    outcome.env_reward = verification.reward.value
                    outcome.reward = score(self.reward_fn, outcome)
                    if verification.reward.value is None:
                        outcome.error = f"unscorable: {verification.problem}"
            except (RolloutConfigError, RewardFnError):
                raise
            except (SandboxError, OSError, RuntimeError, ValueError, TimeoutError, aiohttp.ClientError) as error:
                outcome.env_reward = outcome.reward = None
                outcome.error = f"{type(error).__name__}: {error}"
                outcome.config_error = isinstance(error, SandboxError | ImportError | FileNotFoundError)
                log.warning("rollout %s of %s is unscorable: %s", rollout_id, task.name, outcome.error)
            except Exception as error:
                outcome.env_reward = outcome.reward = None
                outcome.error = f"internal error: {type(error).__name__}: {error}"
                log.exception("rollout %s of %s failed unexpectedly", rollout_id, task.name)
            finally:
                await _finish_despite_cancellation(self._release(sandbox, session))
            outcome.duration_s = time.monotonic() - started
            return outcome

    async def _open_session(self, metadata: dict[str, Any], seed: int) -> SessionInfo:
        """Create a capture session; if cancelled while the proxy is creating it, close it before giving up."""
        creating = asyncio.ensure_future(self.proxy.create_session(
            metadata=metadata, max_turns=self.config.max_turns, max_tokens_per_turn=self.config.max_tokens_per_turn,
            seed=seed))
        try:
            return await asyncio.shield(creating)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await self.proxy.close_session((await creating).id)
            raise

    def _agent_outcome(self, outcome: RolloutOutcome, run: AgentRun, trace: TrainingTrace) -> RolloutOutcome:
        """The agent's part of the outcome. Tool calls and failures are read from the trace by TRL's rules
        (`trace.tools`); an agent whose trace holds no tool calls (aider edits in text) keeps its CLI's own count."""
        trace.validate()
        usage = tool_usage(trace)
        outcome.trace = trace
        outcome.completion = run.completion
        outcome.tool_calls_by_name = usage.calls_by_name or run.tool_calls_by_name
        outcome.tool_failures_by_name = usage.failures_by_name
        outcome.tool_call_count = sum(outcome.tool_calls_by_name.values())
        outcome.tool_failure_count = usage.failure_count if usage.calls_by_name else run.tool_failure_count
        outcome.timed_out = run.timed_out
        outcome.exit_code = run.exit_code
        if not any(turn.role == "agent" for turn in trace.turns):
            tail = (run.stderr or run.stdout).strip()[-300:]
            outcome.error = f"the agent never reached the model (exit {run.exit_code}): {tail}"
        return outcome

    async def _start_sandbox(self, task: Task) -> Sandbox:
        attempts = max(1, self.config.sandbox_start_attempts)
        for attempt in range(attempts):
            sandbox = self.sandbox_factory()
            try:
                await sandbox.start(task)
                return sandbox
            except SandboxStartError as error:
                with contextlib.suppress(Exception):
                    await sandbox.close()
                if attempt + 1 == attempts:
                    raise SandboxStartError(f"sandbox did not start after {attempts} attempts: {error}") from error
                delay = self.config.sandbox_retry_backoff_s * 2**attempt
                log.warning("sandbox start failed (%s); retrying in %.1fs", error, delay)
                await asyncio.sleep(delay)
            except BaseException:
                with contextlib.suppress(Exception):
                    await sandbox.close()
                raise
        raise AssertionError("unreachable")

    def _agent_timeout(self, task: Task) -> float:
        return self.config.agent_timeout_s or task.agent_timeout_s or DEFAULT_AGENT_TIMEOUT_S

    @staticmethod
    def _check_reachable(sandbox: Sandbox, session: SessionInfo) -> None:
        host = urlparse(session.openai_base_url).hostname or ""
        if not sandbox.reaches_host_loopback and host in LOOPBACK_HOSTS:
            raise RolloutConfigError(
                f"the {sandbox.kind} sandbox cannot reach a proxy at {session.openai_base_url}: "
                "start the proxy with --advertise-url set to a public URL (a tunnel) that reaches it")

    async def _release(self, sandbox: Sandbox | None, session: SessionInfo | None) -> None:
        """Close a session still open and the sandbox, whatever happened; failures are logged, not raised."""
        if session is not None:
            try:
                await self.proxy.close_session(session.id)
            except Exception as error:
                if getattr(error, "status", None) != 409:
                    log.warning("could not close proxy session %s: %s", session.id, error)
        if sandbox is not None:
            try:
                await sandbox.close()
            except Exception as error:
                log.warning("could not close the %s sandbox: %s", sandbox.kind, error)


async def _finish_despite_cancellation(cleanup: Any) -> None:
    """Run `cleanup` to the end even if the caller is cancelled meanwhile, then re-raise that cancellation.

    `asyncio.shield` alone is not enough: the shielded work would go on in the background while the
    caller's cancellation returns at once, so whoever cancelled (Ctrl-C) could stop the proxy before
    the session was closed.
    """
    task = asyncio.ensure_future(cleanup)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    task.result()
    if cancelled:
        raise asyncio.CancelledError
