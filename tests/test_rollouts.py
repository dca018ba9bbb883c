"""The rollout scheduler against a real proxy (in front of the fast fake engine) and real local sandboxes.

Fault cases: a sandbox that fails to start (retried, then unscorable), an agent that hangs
(killed at its limit, `timed_out`, scored on its partial work), a verifier that writes nothing
(unscorable), an engine failure (transport: unscorable), and cancellation mid-run (no process,
sandbox directory or open session left behind).
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
from pathlib import Path

import msgspec
import pytest
from fake_engine import Scripted

from adapters.harnesses.base import Endpoint, Launch
from adapters.harnesses.echo import EchoHarness
from adapters.sandboxes import Sandbox, SandboxStartError
from adapters.sandboxes.local import LocalSandbox, marked_processes
from adapters.tasks import load_task
from harness_rl.run.rollouts import (
    RolloutConfig,
    RolloutConfigError,
    RolloutScheduler,
    SchedulerState,
    rollout_seed,
    task_order,
)
from proxy.client import ProxyClient
from proxy.sampling import call_seed

pytestmark = pytest.mark.anyio
TASKS = Path(__file__).resolve().parents[1] / "examples" / "tasks"
DIGITS = load_task(TASKS / "digits")


@pytest.fixture
async def client(fake_proxy):
    async with ProxyClient(fake_proxy.url, fake_proxy.admin_token) as proxy_client:
        yield proxy_client


class TrackedSandboxes:
    """A sandbox factory that remembers every sandbox it made, and how many ran at once."""

    def __init__(self, make=lambda: LocalSandbox()) -> None:
        self.made: list[Sandbox] = []
        self.roots: list[Path] = []
        self.active = self.peak = 0
        self._make = make

    def __call__(self) -> Sandbox:
        box = self._make()
        self.made.append(box)
        tracker, start, close = self, box.start, box.close

        async def tracked_start(task):
            await start(task)
            tracker.active += 1
            tracker.peak = max(tracker.peak, tracker.active)
            if getattr(box, "root", None) is not None:
                tracker.roots.append(box.root)

        async def tracked_close():
            if getattr(box, "root", None) is not None:
                tracker.active -= 1
            await close()

        box.start, box.close = tracked_start, tracked_close
        return box

    def processes_left(self) -> list[int]:
        return [pid for box in self.made if isinstance(box, LocalSandbox) for pid in marked_processes(box.id)]


def scheduler(client, tasks=(DIGITS,), factory=None, harness=None, max_groups=None, **config) -> RolloutScheduler:
    options = {"harness": "echo", "num_generations": 4, "max_concurrent_rollouts": 4, "sandbox_retry_backoff_s": 0.01,
               **config}
    return RolloutScheduler(list(tasks), client, RolloutConfig(**options), harness=harness,
                            sandbox_factory=factory or TrackedSandboxes(), max_groups=max_groups)


async def test_a_group_scores_each_echo_answer_with_the_verifier(client, fake_engine) -> None:
    fake_engine.script.extend(Scripted(content=text) for text in ["1234", "12ab", "abcd", "99"])
    sandboxes = TrackedSandboxes()
    group = await scheduler(client, factory=sandboxes).run_group(DIGITS, 0)
    assert group.task == "harness-rl/digits" and len(group.outcomes) == 4
    assert sorted(o.env_reward for o in group.outcomes) == [0.0, 0.5, 1.0, 1.0]
    for outcome in group.outcomes:
        assert outcome.reward == outcome.env_reward and outcome.error is None and not outcome.timed_out
        assert outcome.exit_code == 0 and outcome.tool_call_count == 0
        assert outcome.completion in {"1234", "12ab", "abcd", "99"}
        assert [t.role for t in outcome.trace.validate().turns] == ["agent"]
        assert outcome.trace.metadata["task"] == "harness-rl/digits"
    sessions = await client.list_sessions()
    assert len(sessions) == 4 and all(s.closed for s in sessions)
    assert all(not root.exists() for root in sandboxes.roots) and not sandboxes.processes_left()


async def test_groups_are_handed_over_within_the_concurrency_limit(client, fake_engine) -> None:
    tasks = [DIGITS, load_task(TASKS / "write-greeting")]
    sandboxes = TrackedSandboxes()
    runner = scheduler(client, tasks, sandboxes, num_generations=2, max_concurrent_rollouts=3, max_groups=3)
    groups = [await runner.next_group() for _ in range(3)]
    assert sorted(g.group_id for g in groups) == [0, 1, 2]
    assert {g.group_id: g.task.removeprefix("harness-rl/") for g in groups} == {
        0: "digits", 1: "write-greeting", 2: "digits"}
    assert all(len(g.outcomes) == 2 for g in groups)
    assert 1 < sandboxes.peak <= 3
    assert runner.state() == SchedulerState(next_group=3)
    with pytest.raises(RuntimeError, match="no group left"):
        await runner.next_group()
    resumed = scheduler(client, tasks, num_generations=2, max_groups=4)
    resumed.restore(runner.state())
    group = await resumed.next_group()
    assert (group.group_id, group.task) == (3, "harness-rl/write-greeting")


async def test_a_restored_state_hands_over_its_finished_groups_first_and_runs_its_running_ones_again(
        client, fake_engine) -> None:
    """A checkpoint's state: group 0 finished (kept whole: the same rollout ids), group 1 was running (sampled again
    with the same seeds), group 2 is next. In lockstep they come back in the order they started."""
    tasks = [DIGITS, load_task(TASKS / "write-greeting")]
    first = scheduler(client, tasks, num_generations=2, max_groups=2, lockstep=True)
    kept, lost = await first.next_group(), await first.next_group()
    resumed = scheduler(client, tasks, num_generations=2, max_groups=3, lockstep=True)
    state = SchedulerState(next_group=2, finished=[kept], running=[1])
    resumed.restore(state)
    assert resumed.state() == state  # before it starts: what it was given
    again = [await resumed.next_group() for _ in range(3)]
    assert [g.group_id for g in again] == [0, 1, 2] and again[0] == kept
    assert [g.task for g in again] == [kept.task, lost.task, kept.task]
    assert [o.rollout_id for o in again[1].outcomes] != [o.rollout_id for o in lost.outcomes]
    seeds = sorted(s.metadata["seed"] for s in await client.list_sessions() if s.metadata["group_id"] == 1)
    assert seeds == sorted([rollout_seed(0, 1, lost.task, i) for i in range(2)] * 2)  # the same seeds, twice


async def test_in_lockstep_a_state_taken_between_syncs_starts_no_group_while_a_restored_one_is_out(
        client, fake_engine) -> None:
    """A step that synced nothing is checkpointed as the scheduler stands: in lockstep no group starts while one is
    out, so a resumed run starts none beside its restored ones either; a state taken at a sync's hold starts the
    next groups at once, as the sync's release does."""
    between = scheduler(client, num_generations=2, max_groups=9, lockstep=True)
    between.restore(SchedulerState(next_group=2, running=[1]))
    await between.next_group()
    assert between.groups_started == 2
    at_sync = scheduler(client, num_generations=2, max_groups=9, lockstep=True)
    at_sync.restore(SchedulerState(next_group=2, running=[1], at_sync=True))
    await at_sync.next_group()
    assert at_sync.groups_started > 2


async def test_a_state_survives_the_checkpoint_encoding(client, fake_engine) -> None:
    group = await scheduler(client, num_generations=2).run_group(DIGITS, 5)
    state = SchedulerState(next_group=7, finished=[group], running=[6])
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=SchedulerState)
    assert decoded == state and decoded.finished[0].outcomes[0].trace.validate().turns


class HeldBack(EchoHarness):
    """Echo, except that rollouts of `task` wait until the test lets them go."""

    def __init__(self, task_instruction: str) -> None:
        super().__init__()
        self.instruction, self.go = task_instruction, asyncio.Event()

    async def run(self, sandbox, endpoint, instruction, timeout):
        if instruction == self.instruction:
            await self.go.wait()
        return await super().run(sandbox, endpoint, instruction, timeout)


async def _until(condition, limit_s: float = 120.0) -> None:
    """Wait for a condition of the scheduler's own state (a deadline only against hanging forever)."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)


def test_each_pass_over_the_tasks_visits_every_task_once_in_an_order_seeded_by_run_and_pass() -> None:
    passes = [task_order(0, [None] * 8, epoch) for epoch in range(3)]
    assert all(sorted(order) == list(range(8)) for order in passes)
    assert passes[0] != passes[1] != passes[2] and passes[0] != list(range(8))
    assert task_order(0, [None] * 8, 1) == passes[1] and task_order(1, [None] * 8, 0) != passes[0]


def test_each_pass_spreads_every_category_evenly_so_any_stretch_of_steps_holds_each_kind_in_its_share() -> None:
    """Four kinds of six tasks, sorted by kind as a folder lists them: every pass (400 seeded ones) is six rounds
    of one task of each kind, and a plain shuffle's prefixes stray from the kinds' shares by up to 3.75 tasks."""
    categories = [kind for kind in "abcd" for _ in range(6)]
    orders = [task_order(seed, categories, epoch) for seed, epoch in itertools.product(range(200), range(2))]
    for order in orders:
        assert sorted(order) == list(range(24))
        assert all(sorted(categories[i] for i in order[start:start + 4]) == list("abcd") for start in range(0, 24, 4))
    assert len({tuple(order) for order in orders}) == len(orders)
    mixed = ["x"] * 5 + ["y"] * 2 + [None] * 3  # unequal kinds, and tasks with none: each within one of its share
    order = task_order(0, mixed, 0)
    assert sorted(order) == list(range(10)) and order == task_order(0, mixed, 0)
    for end, kind in itertools.product(range(1, 11), ("x", "y", None)):
        share = mixed.count(kind) * end / 10
        assert abs(sum(mixed[i] == kind for i in order[:end]) - share) < 1


@pytest.mark.parametrize("lockstep", [False, True])
async def test_lockstep_hands_groups_over_in_the_order_they_started(client, fake_engine, lockstep) -> None:
    """Group 0 is held back until groups 1 and 2 are done: in lockstep it still comes first, otherwise last."""
    tasks = [load_task(TASKS / name) for name in ("fix-off-by-one", "digits", "write-greeting")]
    harness = HeldBack(tasks[task_order(0, [task.category for task in tasks], 0)[0]].instruction)  # group 0's task
    runner = scheduler(client, tasks, harness=harness, num_generations=2, max_concurrent_rollouts=4, lockstep=lockstep)
    runner.max_groups = 3
    handed: list[int] = []

    async def take() -> None:
        while len(handed) < 3:
            handed.append((await runner.next_group()).group_id)

    taking = asyncio.create_task(take())
    await _until(lambda: runner.groups_started == 3 and sum(runner._groups[i].done() for i in (1, 2)
                                                             if i in runner._groups) + len(handed) == 2)
    assert handed == ([] if lockstep else [1, 2])
    harness.go.set()
    await taking
    assert handed == ([0, 1, 2] if lockstep else [1, 2, 0])


async def test_hold_waits_for_every_group_in_flight_and_starts_none_until_release(client, fake_engine) -> None:
    tasks = [load_task(TASKS / name) for name in ("fix-off-by-one", "digits", "write-greeting")]
    harness = HeldBack(tasks[task_order(0, [task.category for task in tasks], 0)[0]].instruction)  # group 0's task
    runner = scheduler(client, tasks, harness=harness, num_generations=2, max_concurrent_rollouts=4, lockstep=True)
    runner.max_groups = 5
    runner._fill()
    assert runner.groups_started == 3  # three groups in flight: the limit (ceil(4/2) + 1)
    holding = asyncio.create_task(runner.hold())
    await _until(lambda: runner._groups[1].done() and runner._groups[2].done())
    assert not holding.done()  # group 0 is still running
    harness.go.set()
    held = await holding
    for _ in range(20):  # however long the loop runs, a held scheduler starts nothing
        await asyncio.sleep(0)
    assert held.running == [] and [g.group_id for g in held.finished] == [0, 1, 2] and held.next_group == 3
    assert runner.groups_started == 3 and [(await runner.next_group()).group_id for _ in range(3)] == [0, 1, 2]
    await runner.release()
    assert [(await runner.next_group()).group_id for _ in range(2)] == [3, 4] and runner.groups_started == 5


async def test_every_rollout_session_is_seeded_from_the_run_seed(client, fake_engine) -> None:
    runner = scheduler(client, num_generations=2)
    runner.seed = 11
    group = await runner.run_group(DIGITS, 3)
    seeds = [o.trace.metadata["seed"] for o in group.outcomes]
    assert seeds == [rollout_seed(11, 3, DIGITS.name, 0), rollout_seed(11, 3, DIGITS.name, 1)]
    assert [o.trace.turns[0].sampling.seed for o in group.outcomes] == [call_seed(seed, 1) for seed in seeds]


async def test_the_reward_hook_sees_the_whole_outcome(client, fake_engine) -> None:
    fake_engine.script.extend(Scripted(content="12ab") for _ in range(2))
    seen = []

    def reward_fn(outcome):
        seen.append(outcome)
        return outcome.env_reward * 10 - len(outcome.completion)

    runner = scheduler(client, num_generations=2)
    runner.reward_fn = reward_fn
    group = await runner.run_group(DIGITS, 7)
    assert [o.reward for o in group.outcomes] == [1.0, 1.0]
    assert all(o.env_reward == 0.5 and o.trace is not None for o in seen)


class NeverStarts(LocalSandbox):
    attempts = 0

    async def start(self, task) -> None:
        NeverStarts.attempts += 1
        raise SandboxStartError("no capacity")


async def test_a_sandbox_that_never_starts_is_retried_then_unscorable(client) -> None:
    NeverStarts.attempts = 0
    runner = scheduler(client, factory=NeverStarts, num_generations=2, sandbox_start_attempts=3)
    group = await runner.run_group(DIGITS, 0)
    assert NeverStarts.attempts == 6
    for outcome in group.outcomes:
        assert outcome.env_reward is None and outcome.reward is None and outcome.trace is None
        assert "did not start after 3 attempts: no capacity" in outcome.error
    assert await client.list_sessions() == []


class StartsSecondTime(LocalSandbox):
    failures_left = 1

    async def start(self, task) -> None:
        if StartsSecondTime.failures_left:
            StartsSecondTime.failures_left -= 1
            raise SandboxStartError("flaky")
        await super().start(task)


async def test_a_flaky_sandbox_start_is_retried(client, fake_engine) -> None:
    fake_engine.script.append(Scripted(content="77"))
    group = await scheduler(client, factory=StartsSecondTime, num_generations=1).run_group(DIGITS, 0)
    assert group.outcomes[0].env_reward == 1.0 and StartsSecondTime.failures_left == 0


class AnswerThenHang(EchoHarness):
    """Asks the model once (writing the answer), then hangs forever."""

    def launch(self, sandbox: Sandbox, endpoint: Endpoint, instruction: str) -> Launch:
        launch = super().launch(sandbox, endpoint, instruction)
        return Launch(["bash", "-c", '"$@"; sleep 300', "agent", *launch.argv], launch.env, launch.files)


async def test_a_hanging_agent_is_killed_at_its_limit_and_scored_on_its_work(client, fake_engine) -> None:
    fake_engine.script.extend(Scripted(content="5555") for _ in range(2))
    sandboxes = TrackedSandboxes()
    runner = scheduler(client, factory=sandboxes, harness=AnswerThenHang(), num_generations=2, agent_timeout_s=2)
    group = await runner.run_group(DIGITS, 0)
    for outcome in group.outcomes:
        assert outcome.timed_out and outcome.exit_code is None
        assert outcome.env_reward == 1.0 and outcome.error is None
        assert 2 <= outcome.duration_s < 30
    assert not sandboxes.processes_left()


async def test_a_verifier_that_writes_nothing_is_unscorable(client, fake_engine, tmp_path) -> None:
    shutil.copytree(TASKS / "digits", tmp_path / "silent")
    (tmp_path / "silent" / "tests" / "test.sh").write_text("echo looked at it\n")
    fake_engine.script.append(Scripted(content="1"))
    group = await scheduler(client, num_generations=1).run_group(load_task(tmp_path / "silent"), 0)
    outcome = group.outcomes[0]
    assert outcome.env_reward is None and outcome.reward is None
    assert outcome.error.startswith("unscorable: the verifier wrote neither")
    assert outcome.trace is not None and outcome.exit_code == 0


async def test_an_engine_failure_makes_the_rollout_unscorable(client, fake_engine) -> None:
    fake_engine.script.extend(Scripted(status=500) for _ in range(10))
    group = await scheduler(client, num_generations=1).run_group(DIGITS, 0)
    outcome = group.outcomes[0]
    assert outcome.env_reward is None and outcome.reward is None
    assert "never reached the model" in outcome.error and outcome.exit_code not in (0, None)


async def test_cancelling_mid_run_leaves_nothing_behind(client, fake_engine) -> None:
    fake_engine.script.extend(Scripted(content="1") for _ in range(8))
    sandboxes = TrackedSandboxes()
    runner = scheduler(client, factory=sandboxes, harness=AnswerThenHang(), num_generations=2,
                       max_concurrent_rollouts=4, agent_timeout_s=300)
    waiting = asyncio.create_task(runner.next_group())
    for _ in range(600):
        if len(sandboxes.processes_left()) >= 4:
            break
        await asyncio.sleep(0.05)
    assert sandboxes.active == 4
    waiting.cancel()
    await runner.close()
    for _ in range(600):  # killed processes may take a moment to be gone on a busy machine
        if not sandboxes.processes_left():
            break
        await asyncio.sleep(0.05)
    assert sandboxes.active == 0 and not sandboxes.processes_left()
    assert all(not root.exists() for root in sandboxes.roots)
    sessions = await client.list_sessions()
    assert len(sessions) == 4 and all(s.closed for s in sessions)
    assert runner.state().finished == []


class CloudLike(LocalSandbox):
    reaches_host_loopback = False


async def test_a_cloud_sandbox_with_a_loopback_proxy_url_stops_the_run(client) -> None:
    sandboxes = TrackedSandboxes(make=CloudLike)
    runner = scheduler(client, factory=sandboxes, num_generations=3)
    with pytest.raises(RolloutConfigError, match="--advertise-url"):
        await runner.next_group()
    await runner.close()
    sessions = await client.list_sessions()
    assert sessions and all(s.closed for s in sessions)
    assert sandboxes.active == 0 and all(not root.exists() for root in sandboxes.roots)
