"""harness-rl sessions behind TRL's harness trainer (`trl.experimental.async_grpo.openenv_harness`, TRL 1.16).

TRL's `HarnessRolloutWorker`, in loop-owning mode (`harness_adapter=None`), calls its
`harness_session_factory(sampling=...)` once in its rollout process, then for every rollout
`factory.create(prompt, seed=group_id, episode_id=...)`, `session.wait_for_completion()`,
`session.fetch_training_trace()` (OpenEnv's `TrainingTrace`), `session.verify(transcript)` and
`session.close()`. `HarnessRLSessionFactory` answers that contract with harness-rl's own parts: a session
is one rollout run exactly as `harness-rl train` runs it (`RolloutScheduler.run_rollout`: a sandbox, a
capture session at our proxy, the real agent CLI on the task the prompt names, the task's verifier),
and its trace reaches TRL in OpenEnv's form, token for token as the proxy captured it.

TRL's sampling policy (`training_sampling`: a temperature, every truncating knob at its no-op) becomes
the proxy's `SamplingPolicy`: the temperature is pinned at the proxy, knobs an agent sends that would
truncate the distribution are neutralised (or refused, with `truncation="reject"`), and every trained
turn is checked to have been sampled at TRL's temperature before TRL sees it. Where that differs from
OpenEnv's capture proxy: `logit_bias`, `response_format` and guided-decoding fields are never sent
to the engine (named on the turn as ignored) rather than refused; a forced `tool_choice` reaches the
chat template only, never a constrained decoder; `max_tokens` is capped by the session's
`max_tokens_per_turn` (no silent 8192 clamp) and refused above the engine's context; and each engine
call is seeded from the rollout's seed (`proxy.sampling.call_seed`), not at random.

What TRL receives: the trace's agent turns (auxiliary calls such as titles and discarded retries are
never trained, so they are left out rather than sent with zero masks), depth first through the
capture tree. With TRL's lossless reconciliation (`fork_threshold_tokens=0`) that order rebuilds
harness-rl's own rows: one sequence per chain of the tree, every sampled agent token eligible once.
A rollout that failed before the agent ran (no sandbox, no proxy) raises `RolloutFailed` from
`fetch_training_trace`, which TRL scores as an empty, unscorable rollout; a verifier that leaves no
reward gives `env_reward` None, never 0.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import logging
import math
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from adapters.tasks import Task, load_tasks
from harness_rl.background import BackgroundLoop
from harness_rl.outcome import RolloutOutcome
from harness_rl.run.rollouts import RolloutConfig, RolloutScheduler
from harness_rl.trace import TrainingTrace, Turn
from harness_rl.wire import ADMIN_TOKEN_ENV
from proxy.client import ProxyClient
from proxy.config import ProxyConfig
from proxy.sampling import SamplingPolicy
from proxy.server.app import RunningProxy

try:
    from openenv.core.env_server.mcp_types import Tool
    from openenv.core.harness import ResourceSession, ResourceSessionFactory, ToolResult, VerifyResult
    from openenv.core.harness import TrainingTrace as OpenEnvTrace
    from openenv.core.harness.capture.upstream import training_sampling
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("harness_rl.integrations.trl needs TRL and OpenEnv: pip install 'harness-rl[trl]' "
                      f"(trl>=1.16, openenv==0.10.0): {error}") from error

log = logging.getLogger(__name__)
TASK_TAG = "harness-rl task: "  # a prompt's system message naming its task, as `prompt_rows` writes it
CLOSE_TIMEOUT_S = 120.0


class RolloutFailed(RuntimeError):
    """The rollout left no trace (its sandbox or capture session never came up): TRL scores it as empty."""


def proxy_sampling(sampling: dict[str, Any], base: SamplingPolicy | None = None) -> SamplingPolicy:
    """TRL's sampling policy as the proxy's: validated by OpenEnv's own rule (`training_sampling`: a finite
    temperature > 0, every truncating knob at its no-op), then the temperature pinned. `base` keeps its
    `truncation` choice (neutralise by default; reject also keeps the distribution whole)."""
    policy = training_sampling(dict(sampling))
    return SamplingPolicy(temperature=float(policy["temperature"]),
                          truncation=base.truncation if base is not None else "neutralise")


def depth_first(turns: Sequence[Turn]) -> list[Turn]:
    """The turns depth first through the capture tree (roots and children in recorded order): the order in
    which harness-rl's rows take them, so TRL's chain reconciler rebuilds the same rows."""
    by_id = {turn.node_id: turn for turn in turns}
    children: dict[str | None, list[Turn]] = collections.defaultdict(list)
    for turn in turns:
        children[turn.parent_id if turn.parent_id in by_id else None].append(turn)
    order: list[Turn] = []
    stack = list(reversed(children[None]))
    while stack:
        turn = stack.pop()
        order.append(turn)
        stack.extend(reversed(children[turn.node_id]))
    return order


def openenv_training_trace(trace: TrainingTrace, temperature: float | None = None) -> OpenEnvTrace:
    """The trace as OpenEnv's validated `TrainingTrace` for TRL: its agent turns, depth first, each one's parent
    the nearest agent turn above it. With `temperature`, a turn sampled at any other raises `ValueError`
    (TRL's loss divides the logits by its own temperature; the behaviour logprobs must match it)."""
    ordered = depth_first(trace.turns)
    kept = {turn.node_id for turn in ordered if turn.role == "agent"}
    by_id = {turn.node_id: turn for turn in trace.turns}
    agents = []
    for turn in ordered:
        if turn.node_id not in kept:
            continue
        if temperature is not None:
            _check_temperature(turn, temperature)
        parent = turn.parent_id
        while parent is not None and parent not in kept:
            parent = by_id[parent].parent_id if parent in by_id else None
        agents.append(msgspec.structs.replace(turn, parent_id=parent))
    exported = TrainingTrace(rollout_id=trace.rollout_id, turns=agents, metadata=trace.metadata)
    return OpenEnvTrace.model_validate(exported.to_openenv())


def _check_temperature(turn: Turn, temperature: float) -> None:
    if turn.sampling is None:
        raise ValueError(f"turn {turn.node_id} records no sampling, so its behaviour logprobs cannot be checked "
                         f"against TRL's temperature {temperature}")
    sampled = turn.sampling.temperature if turn.sampling.temperature is not None else 1.0
    if not math.isclose(sampled, temperature, rel_tol=1e-6):
        raise ValueError(f"turn {turn.node_id} was sampled at temperature {sampled}, but TRL trains at "
                         f"{temperature}: start `harness-rl serve proxy --temperature {temperature}` (or give the "
                         "factory an engine_url, and it pins TRL's temperature itself)")


class HarnessRLSessionFactory(ResourceSessionFactory["HarnessRLSession"]):
    """Sessions that run a real agent CLI through harness-rl's proxy, for TRL's `HarnessRolloutWorker`.

    Built with the tasks (a Harbor task dir, a dir of them, `hf://org/name`, or `Task`s), the harness and
    the sandbox, and exactly one of `engine_url` (a vLLM serving the policy: the factory starts its own
    proxy in front of it, set by `proxy`, after `harness-rl doctor`'s checks of exact capture) or
    `proxy_url` (a running `harness-rl serve proxy`; its admin token from `admin_token` or
    $HARNESS_RL_ADMIN_TOKEN). Any other field of `RolloutConfig` is a keyword (`max_turns`,
    `max_tokens_per_turn`, `agent_timeout_s`, `reward_key`, `sandbox_options`, ...).

    Hand the instance itself to TRL (`harness_session_factory=factory`) and build the dataset from
    `prompt_rows()`: TRL pickles it into its rollout process and calls it with its sampling policy, which
    starts the proxy there, so a bad engine stops the worker at once instead of failing every rollout.
    """

    def __init__(self, tasks: str | Path | Iterable[Task], *, engine_url: str | None = None,
                 proxy_url: str | None = None, admin_token: str | None = None,
                 sampling: dict[str, Any] | None = None, harness: str = "opencode", sandbox: str = "local",
                 proxy: ProxyConfig | None = None, seed: int = 0, engine_check: bool = True,
                 **rollout_options: Any) -> None:
        if (engine_url is None) == (proxy_url is None):
            raise ValueError("give the factory an engine_url (it starts its own proxy in front of that engine) or "
                             "the proxy_url of a running `harness-rl serve proxy`, not both")
        if proxy_url is not None and proxy is not None:
            raise ValueError("proxy settings apply to the factory's own proxy; a running proxy has its own flags")
        self.tasks: list[Task] = load_tasks(tasks) if isinstance(tasks, str | Path) else list(tasks)
        if not self.tasks:
            raise ValueError("the factory has no tasks")
        self.rollouts = msgspec.convert({**rollout_options, "harness": harness, "sandbox": sandbox,
                                         "tasks": str(tasks) if isinstance(tasks, str | Path) else ""},
                                        RolloutConfig)
        self.engine_url, self.proxy_url, self.engine_check, self.seed = engine_url, proxy_url, engine_check, seed
        self.admin_token = admin_token or (os.environ.get(ADMIN_TOKEN_ENV) if proxy_url is not None else None)
        if proxy_url is not None and not self.admin_token:
            raise ValueError(f"a running proxy needs its admin token: pass admin_token or set ${ADMIN_TOKEN_ENV}")
        self.proxy = msgspec.structs.replace(proxy or ProxyConfig(), upstream=engine_url or "")
        self.temperature: float | None = None  # TRL's, once it has given its sampling policy
        self._use_sampling(sampling)
        self._by_name = {task.name: task for task in self.tasks}
        self._by_instruction: dict[str, list[Task]] = collections.defaultdict(list)
        for task in self.tasks:
            self._by_instruction[task.instruction.strip()].append(task)
        self._setup()

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._runtime: _Runtime | None = None
        self._created: collections.Counter[int] = collections.Counter()

    def __getstate__(self) -> dict[str, Any]:
        """Plain settings and tasks only: TRL pickles the factory into its rollout process, which starts its own."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_runtime", "_created")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    def __call__(self, *, sampling: dict[str, Any] | None = None) -> HarnessRLSessionFactory:
        """What TRL's worker calls: a copy of this factory with TRL's sampling policy, started."""
        clone = copy.copy(self)
        clone._use_sampling(sampling)
        return clone.start()

    def _use_sampling(self, sampling: dict[str, Any] | None) -> None:
        """Pin TRL's policy at the proxy this factory starts, and check every trained turn against it."""
        if sampling is None:
            return
        policy = proxy_sampling(sampling, self.proxy.sampling)
        self.temperature = policy.temperature
        self.proxy = msgspec.structs.replace(self.proxy, sampling=policy)

    def prompt_rows(self) -> list[dict[str, Any]]:
        """Dataset rows for TRL: a system message naming the task (how `create` finds it: TRL forwards only the
        prompt) and the task's instruction; `task_name` is a column for logging."""
        return [{"prompt": [{"role": "system", "content": TASK_TAG + task.name},
                            {"role": "user", "content": task.instruction}], "task_name": task.name}
                for task in self.tasks]

    def task_for(self, prompt: Any) -> Task:
        """The task a prompt names: by `prompt_rows`' system message, else by its last user message matching
        exactly one task's instruction."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
        for message in messages:
            content = str(message.get("content") or "")
            if message.get("role") == "system" and content.startswith(TASK_TAG):
                name = content.removeprefix(TASK_TAG).strip()
                if name not in self._by_name:
                    raise KeyError(f"the prompt names task {name!r}, which this factory does not have")
                return self._by_name[name]
        users = [str(m.get("content") or "") for m in messages if m.get("role") == "user"]
        matches = self._by_instruction.get(users[-1].strip(), []) if users else []
        if len(matches) != 1:
            which = "matches no task's instruction" if not matches else \
                f"is the instruction of {len(matches)} tasks ({', '.join(t.name for t in matches)})"
            raise KeyError(f"the prompt {which}: build the dataset from factory.prompt_rows(), which names each task")
        return matches[0]

    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> HarnessRLSession:
        """One idle session on the task `task` (TRL's prompt) names. A group's rollouts share its prompt, so its
        task; `seed` is TRL's group id, which with the rollout's place in the group seeds its sampling
        (`rollout_seed`)."""
        chosen = self.task_for(task)
        group_id = seed if seed is not None else 0
        runtime = self.start()._runtime
        assert runtime is not None
        with self._lock:
            index = self._created[group_id]
            self._created[group_id] += 1
        return HarnessRLSession(runtime, chosen, group_id, index, episode_id, self.temperature)

    def start(self) -> HarnessRLSessionFactory:
        """Start the proxy (or connect to the running one), once; `create` calls it when TRL has not."""
        with self._lock:
            if self._runtime is None:
                self._runtime = _Runtime.start(self)
        return self

    def close(self) -> None:
        """Stop what `start` started (sessions still open should be closed first)."""
        with self._lock:
            runtime, self._runtime = self._runtime, None
        if runtime is not None:
            runtime.close()

    def __enter__(self) -> HarnessRLSessionFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Runtime:
    """What a started factory runs: a loop on a thread, the proxy client, the scheduler, and its own proxy."""

    loop: BackgroundLoop
    client: ProxyClient
    scheduler: RolloutScheduler
    proxy: RunningProxy | None

    @classmethod
    def start(cls, factory: HarnessRLSessionFactory) -> _Runtime:
        from proxy.server.app import start_proxy

        loop = BackgroundLoop("harness-rl-trl")
        with contextlib.ExitStack() as undo:
            undo.callback(loop.close)
            proxy: RunningProxy | None = None
            if factory.engine_url is not None:
                config = factory.proxy
                if factory.engine_check:
                    from harness_rl.tools.doctor import MIN_RUN_CONTEXT, require_exact_capture

                    require_exact_capture(factory.engine_url, model=config.upstream_model,
                                          min_context=MIN_RUN_CONTEXT, weight_sync="none")
                running = proxy = loop.run(start_proxy(config), timeout=120)
                undo.callback(lambda: loop.run(running.stop(), timeout=60))
                client = ProxyClient(running.url, running.admin_token)
            else:
                assert factory.proxy_url is not None and factory.admin_token is not None
                client = ProxyClient(factory.proxy_url, factory.admin_token)
                try:
                    loop.run(client.health(), timeout=60)
                except Exception as error:
                    raise RuntimeError(f"cannot use the harness-rl proxy at {factory.proxy_url}: {error}") from error
            undo.callback(lambda: loop.run(client.close(), timeout=30))
            scheduler = RolloutScheduler(factory.tasks, client, factory.rollouts, seed=factory.seed)
            undo.pop_all()
        return cls(loop, client, scheduler, proxy)

    def close(self) -> None:
        with contextlib.ExitStack() as closing:
            closing.callback(self.loop.close)
            if self.proxy is not None:
                closing.callback(lambda: self.loop.run(self.proxy.stop(), timeout=60))  # type: ignore[union-attr]
            closing.callback(lambda: self.loop.run(self.client.close(), timeout=30))


class HarnessRLSession(ResourceSession):
    """One rollout: created idle, run by `wait_for_completion`, read by `fetch_training_trace` and `verify`."""

    def __init__(self, runtime: _Runtime, task: Task, group_id: int, index: int, episode_id: str | None,
                 temperature: float | None) -> None:
        self.task, self.group_id, self.index, self.episode_id = task, group_id, index, episode_id
        self.outcome: RolloutOutcome | None = None
        self._runtime, self._temperature = runtime, temperature
        self._running: asyncio.Task[Any] | None = None
        self._closed = False

    # ResourceSession: the agent owns its loop in its sandbox, so there is nothing to step.
    def initial_messages(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": self.task.instruction}]

    def list_tools(self) -> list[Tool]:
        return []

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult(error="a harness-rl session runs an agent CLI that calls its own tools in its sandbox")

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        """Run the rollout (agent, then verifier) and return the agent's exit code (1 when none ran). An agent
        stopped at its time limit (`timeout_s`, else the configured or the task's own) raises `TimeoutError`
        after its turns and its score are kept, as TRL expects."""
        if self.outcome is None:
            self.outcome = self._runtime.loop.run(self._run(timeout_s))
            log.debug("TRL episode %s is harness-rl rollout %s", self.episode_id, self.outcome.rollout_id)
        if self.outcome.timed_out:
            raise TimeoutError(f"the agent on {self.task.name} ran past its time limit (rollout "
                               f"{self.outcome.rollout_id}); its turns and its verifier score are kept")
        return self.outcome.exit_code if self.outcome.exit_code is not None else 1

    async def _run(self, timeout_s: float | None) -> RolloutOutcome:
        self._running = asyncio.current_task()
        if self._closed:
            raise asyncio.CancelledError
        return await self._runtime.scheduler.run_rollout(self.task, self.group_id, self.index,
                                                         agent_timeout_s=timeout_s)

    def fetch_training_trace(self) -> OpenEnvTrace:
        """The captured trace in OpenEnv's form (see `openenv_training_trace`); `RolloutFailed` when the rollout
        left none, `ValueError` when a turn was sampled at another temperature than TRL's."""
        outcome = self._finished()
        if outcome.trace is None:
            raise RolloutFailed(f"rollout {outcome.rollout_id} on {self.task.name} left no trace: {outcome.error}")
        return openenv_training_trace(outcome.trace, self._temperature)

    def verify(self, transcript: list[dict[str, Any]], final_state: Any | None = None) -> VerifyResult:
        """The task's own verifier score, from the run (`transcript` is not needed: the sandbox was judged). None
        when the rollout is unscorable (never 0), with the reason in `artifacts["error"]`."""
        outcome = self.outcome
        if outcome is None:
            return VerifyResult(env_reward=None, done=True, artifacts={"error": "the rollout never ran"})
        return VerifyResult(
            env_reward=outcome.env_reward, done=True,
            metrics={"tool_call_count": outcome.tool_call_count, "tool_failure_count": outcome.tool_failure_count,
                     "timed_out": outcome.timed_out, "duration_s": outcome.duration_s},
            artifacts={"rollout_id": outcome.rollout_id, "task": outcome.task, "error": outcome.error})

    def close(self) -> None:
        """Stop a rollout still running (from any thread): its sandbox and capture session are released before
        this returns."""
        self._closed = True
        running = self._running
        if running is not None and not running.done():
            self._runtime.loop.run(_cancel(running), timeout=CLOSE_TIMEOUT_S)

    def _finished(self) -> RolloutOutcome:
        if self.outcome is None:
            raise RuntimeError("call wait_for_completion() first: the rollout has not run")
        return self.outcome


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.wait({task})
