"""`harness-rl eval`: sample an agent on tasks and measure it; no learner, the weights never change.

It starts what a training run starts (the engine, the intercept proxy and the rollout scheduler, from
the same engine, proxy and rollouts settings), runs `num_samples` rollouts of every task of every
split (one split per `--tasks` source, labelled by its folder name), and measures per task and per
split: success rate, mean reward, agent turns, tool calls, generated tokens, and the share of agent
turns after the first that chain onto their predecessor (`rollout_stats`).

Output: `RUN/eval.json` (`EvalReport`), and `RUN/rollouts.jsonl` + `RUN/traces/` in a training run's
format (`run_files`, step 0), so `harness-rl sft --traces RUN/traces` learns from its successes.
Every rollout's proxy session is seeded from (seed, task, sample), and the proxy seeds each engine call
from it, so the same command samples the same rollouts again.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from harness_rl.outcome import RolloutGroup, RolloutOutcome
from harness_rl.run.config import EvalConfig
from harness_rl.run.run_files import RunFiles
from harness_rl.trace.stats import trace_stats

if TYPE_CHECKING:
    from adapters.harnesses import Harness
    from adapters.sandboxes import Sandbox
    from adapters.tasks import Task
    from harness_rl.run.rollouts import RolloutScheduler

EVAL_FILE = "eval.json"
T = TypeVar("T")


@dataclass(frozen=True)
class Job:
    """One rollout to run: the `index`-th sample of a task (its group) in a split."""

    split: str
    group_id: int
    task: Task
    index: int


class Measures(msgspec.Struct, kw_only=True):
    """One task's or one split's figures, over all its rollouts."""

    samples: int
    scorable: int  # rollouts with a reward (the others failed to run or to verify: see their errors)
    successes: int  # reward >= success_reward
    success_rate: float  # successes / samples: an unscorable rollout counts as a failure
    mean_reward: float | None  # over the scorable rollouts
    mean_turns: float  # agent turns (engine calls) per rollout
    mean_tool_calls: float
    mean_generated_tokens: float  # completion tokens of agent turns per rollout
    later_turns: int  # agent turns after each rollout's first
    chained_turns: int  # of those, the ones that chain onto their predecessor
    chained_share: float | None  # chained_turns / later_turns
    spliced_turns: int  # agent turns the proxy sent to the engine as spliced token ids


class TaskResult(Measures, kw_only=True):
    split: str
    task: str
    errors: list[str]  # distinct errors of its rollouts, if any


class SplitResult(Measures, kw_only=True):
    split: str
    source: str
    tasks: int


class CategoryResult(Measures, kw_only=True):
    """A split's tasks of one category (task.toml's `[metadata] category`: the family of generated tasks)."""

    split: str
    category: str
    tasks: int


class EvalReport(msgspec.Struct, kw_only=True):
    model: str
    harness: str
    num_samples: int
    seed: int
    temperature: float | None
    success_reward: float
    splits: list[SplitResult]
    categories: list[CategoryResult] = []  # empty when no task names one
    tasks: list[TaskResult]
    output_dir: str
    duration_s: float
    load_average: list[float]  # 1, 5 and 15 minute load averages at the end (a shared machine is noisy)


def split_labels(sources: Sequence[str]) -> list[str]:
    """Each task source's folder name (or dataset name), made unique with -2, -3... when repeated."""
    labels: list[str] = []
    for source in sources:
        base = Path(source.removeprefix("hf://").rstrip("/")).name or source
        label, n = base, 1
        while label in labels:
            n += 1
            label = f"{base}-{n}"
        labels.append(label)
    return labels


def measure(outcomes: Sequence[RolloutOutcome], success_reward: float) -> Measures:
    stats = [trace_stats(o.trace) for o in outcomes if o.trace is not None]
    rewards = [o.reward for o in outcomes if o.reward is not None]
    later = sum(s.later_turns for s in stats)
    chained = sum(s.chained_turns for s in stats)
    samples = len(outcomes)
    successes = sum(r >= success_reward for r in rewards)
    return Measures(
        samples=samples, scorable=len(rewards), successes=successes,
        success_rate=successes / samples if samples else 0.0,
        mean_reward=sum(rewards) / len(rewards) if rewards else None,
        mean_turns=_mean([s.agent_turns for s in stats], samples),
        mean_tool_calls=_mean([o.tool_call_count for o in outcomes], samples),
        mean_generated_tokens=_mean([s.generated_tokens for s in stats], samples),
        later_turns=later, chained_turns=chained, chained_share=chained / later if later else None,
        spliced_turns=sum(s.spliced_turns for s in stats))


def _mean(values: Sequence[float], samples: int) -> float:
    """Per rollout: rollouts without a trace count as zero."""
    return sum(values) / samples if samples else 0.0


def evaluate(config: EvalConfig, model_dir: Path, *, harness: Harness | None = None,
             sandbox_factory: Callable[[], Sandbox] | None = None, progress: bool = True) -> EvalReport:
    """Run the evaluation a checked configuration describes on `model_dir`; write and return its report."""
    from tqdm import tqdm
    from transformers.utils import logging as transformers_logging

    from adapters.tasks import load_tasks
    from harness_rl.run.stack import Stack

    transformers_logging.disable_progress_bar()
    started = time.time()
    output_dir = Path(config.output_dir) if config.output_dir else default_output_dir(config)
    labels = split_labels(config.tasks)
    splits = [(label, source, load_tasks(source)) for label, source in zip(labels, config.tasks, strict=True)]
    groups_of = [(label, task) for label, _, tasks in splits for task in tasks]
    jobs = [Job(label, group_id, task, index) for group_id, (label, task) in enumerate(groups_of)
            for index in range(config.num_samples)]
    output_dir.mkdir(parents=True, exist_ok=True)
    all_tasks = [task for _, _, tasks in splits for task in tasks]
    with Stack.start(config.run_config(), model_dir, output_dir, all_tasks, harness=harness,
                     sandbox_factory=sandbox_factory, name="harness-rl-eval") as stack:
        loop, scheduler = stack.loop, stack.scheduler
        bar = tqdm(total=len(jobs), desc="eval", unit="rollout", dynamic_ncols=True, disable=not progress)
        running = loop.run(_start(_run_all(scheduler, jobs, bar.update)))
        try:
            outcomes = loop.run(_wait(running))
        except BaseException:  # Ctrl-C: every rollout closes its session and sandbox before the proxy stops
            loop.run(_cancel(running), timeout=120)
            raise
        finally:
            bar.close()

    groups = [RolloutGroup(group_id=group_id, task=task.name,
                           outcomes=[o for job, o in zip(jobs, outcomes, strict=True) if job.group_id == group_id])
              for group_id, (_, task) in enumerate(groups_of)]
    results = [TaskResult(split=label, task=task.name, errors=sorted({o.error for o in group.outcomes if o.error}),
                          **msgspec.structs.asdict(measure(group.outcomes, config.success_reward)))
               for (label, task), group in zip(groups_of, groups, strict=True)]
    files = RunFiles(output_dir, scheduler.harness.name)
    files.write(0, groups)
    files.close()
    split_results = [
        SplitResult(split=label, source=source, tasks=len(tasks),
                    **msgspec.structs.asdict(measure([o for job, o in zip(jobs, outcomes, strict=True)
                                                      if job.split == label], config.success_reward)))
        for label, source, tasks in splits]
    categories = list(dict.fromkeys((label, task.category) for label, task in groups_of if task.category is not None))
    category_results = [
        CategoryResult(split=label, category=category,
                       tasks=sum(1 for split, task in groups_of if (split, task.category) == (label, category)),
                       **msgspec.structs.asdict(measure([o for job, o in zip(jobs, outcomes, strict=True)
                                                         if (job.split, job.task.category) == (label, category)],
                                                        config.success_reward)))
        for label, category in categories]
    report = EvalReport(
        model=config.engine.model, harness=scheduler.harness.name, num_samples=config.num_samples, seed=config.seed,
        temperature=config.proxy.sampling.temperature, success_reward=config.success_reward, splits=split_results,
        categories=category_results, tasks=results, output_dir=str(output_dir),
        duration_s=round(time.time() - started, 1), load_average=[round(v, 2) for v in os.getloadavg()])
    (output_dir / EVAL_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    return report


def default_output_dir(config: EvalConfig) -> Path:
    return Path("runs") / f"eval-{config.rollouts.harness}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


async def _start(work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    return asyncio.create_task(work)


async def _wait(task: asyncio.Task[T]) -> T:
    return await asyncio.shield(task)


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _run_all(scheduler: RolloutScheduler, jobs: list[Job], tick: Callable[[], object]) -> list[RolloutOutcome]:
    """Every job's rollout, at most `max_concurrent_rollouts` at once (the scheduler's own limit)."""

    async def one(job: Job) -> RolloutOutcome:
        outcome = await scheduler.run_rollout(job.task, job.group_id, job.index)
        tick()
        return outcome

    return list(await asyncio.gather(*(one(job) for job in jobs)))


def table(report: EvalReport) -> str:
    """The report as a fixed-width table: every task, then every category of a split, then every split."""
    header = (f"{'split':<10} {'task':<24} {'n':>3} {'success':>8} {'reward':>7} {'turns':>6} {'tools':>6} "
              f"{'gen tok':>8} {'chained':>8}")
    lines = [header, "-" * len(header)]

    def line(split: str, name: str, m: Measures) -> str:
        reward = f"{m.mean_reward:.3f}" if m.mean_reward is not None else "-"
        chained = f"{m.chained_share:.1%}" if m.chained_share is not None else "-"
        return (f"{split:<10} {name:<24} {m.samples:>3} {m.success_rate:>8.1%} {reward:>7} {m.mean_turns:>6.2f} "
                f"{m.mean_tool_calls:>6.2f} {m.mean_generated_tokens:>8.1f} {chained:>8}")

    lines += [line(t.split, t.task.rpartition("/")[2], t) for t in report.tasks]
    if report.categories:
        lines.append("-" * len(header))
        lines += [line(c.split, f"{c.category} ({c.tasks} tasks)", c) for c in report.categories]
    lines.append("-" * len(header))
    lines += [line(s.split, f"(all {s.tasks} tasks)", s) for s in report.splits]
    return "\n".join(lines)


def comparison(before: EvalReport, after: EvalReport) -> str:
    """Success and mean reward of each task and split, before and after (e.g. around a training run)."""
    header = f"{'split':<10} {'task':<24} {'success before':>15} {'after':>7} {'reward before':>14} {'after':>7}"
    lines = [header, "-" * len(header)]
    old: dict[tuple[str, str], Measures] = {(t.split, t.task): t for t in before.tasks}
    old |= {(c.split, f"category {c.category}"): c for c in before.categories}
    old |= {(s.split, ""): s for s in before.splits}

    def line(split: str, name: str, key: tuple[str, str], m: Measures) -> str:
        was = old.get(key)
        success = f"{was.success_rate:>15.1%}" if was is not None else f"{'-':>15}"
        reward = f"{was.mean_reward:>14.3f}" if was is not None and was.mean_reward is not None else f"{'-':>14}"
        now = f"{m.mean_reward:>7.3f}" if m.mean_reward is not None else f"{'-':>7}"
        return f"{split:<10} {name:<24} {success} {m.success_rate:>7.1%} {reward} {now}"

    lines += [line(t.split, t.task.rpartition("/")[2], (t.split, t.task), t) for t in after.tasks]
    if after.categories:
        lines.append("-" * len(header))
        lines += [line(c.split, f"{c.category} ({c.tasks} tasks)", (c.split, f"category {c.category}"), c)
                  for c in after.categories]
    lines.append("-" * len(header))
    lines += [line(s.split, f"(all {s.tasks} tasks)", (s.split, ""), s) for s in after.splits]
    return "\n".join(lines)
