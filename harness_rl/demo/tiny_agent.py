"""`tiny-agent`: the tiny model warm-started on teacher traces, so a real agent CLI can learn on a CPU.

A random model never emits a valid tool call, so RL from `tiny` has nothing to reinforce. The recipe:
1. the offline `tiny` model (random 0.8M-parameter Qwen2 and its BPE tokenizer, `engine.tiny_model`);
2. teacher traces (`harness_rl.demo.teacher`): mini-swe-agent driven through the proxy with forced replies
   replaying the whole reference solution (the verifier scores 1) of every task of
   `examples/agent-tasks/warmup` and `train` (instances of four task families; never the held-out
   ones), and for each of them once more submitting right after its first command (scored 0: an
   imperfect teacher's habit of stopping early, on half its demonstrations of every family);
3. `harness-rl sft` in two phases: `COMPLETE` on the complete demonstrations only (reward 1: the
   model learns each family's commands, and to copy the instruction's names into them), then `HABIT`,
   a phase at a low learning rate on all of them (the model picks up the habit of stopping after the
   first command on about half its tries: measured, a teacher stopping early on the training tasks only,
   with 3 epochs of this phase, left it solving two thirds of them before RL, and RL little to show).

So tiny-agent knows the commands but is deliberately left undecided about finishing, and fails mostly
by submitting early. That one decision is shared by every task and family, so GRPO's updates from
different tasks agree, the verifier's reward teaches it to finish, and what it learns carries over to
the held-out instances of the same families.

What it is: a random model that learned, from 144 demonstrations, which shell commands each kind of
instruction in mini-swe-agent's prompt calls for, which names of the instruction go where in them, and
whether to stop. It does not reason; it solves no task outside the four families.

The build is deterministic (the teacher's prompts are the demo's own template, the same on every machine;
training runs on the CPU with one thread and a fixed seed) and keyed by a hash of everything it depends on
(`Recipe`): this recipe's version, the seed, the tiny model's recipe, the task folders with their
solutions, the harness and its installed version, the harness options, the demonstrations and both
SFT phases' settings. The repository ships the build of the current recipe (`SHIPPED`: 5 MB of weights,
its teacher traces beside them), because building it takes about 25 minutes on 2 cores and every clone
would pay that before its first `make train-agent`, CI before `test_train_agent`. A recipe that no longer
matches the shipped build (a task edited, the harness upgraded) is built on first use and cached under
`$HARNESS_RL_CACHE/tiny-agent-<seed>-<key>`; `tests/test_tiny_agent.py` fails until the shipped copy is
rebuilt (`harness-rl build-model tiny-agent --rebuild`, then copied over it).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import msgspec

from harness_rl.learner.config import SftConfig
from harness_rl.run.presets import AGENT_HARNESS_OPTIONS, AGENT_TASKS, EXAMPLES

RECIPE_VERSION = "4"
TINY_AGENT_SEED = 0  # the one build runs start from, whatever their seed (`demo.models`)
HARNESSES = ("mini-swe-agent",)
WARMUP_TASKS = AGENT_TASKS / "warmup"  # shown complete and stopped early
TRAIN_TASKS = AGENT_TASKS / "train"  # the same
EARLY_STOP_STEPS = 1  # the imperfect demonstrations submit after this many solution lines
COMPLETE = SftConfig(epochs=150, learning_rate=3e-3, token_budget=2048, min_reward=1.0)
HABIT = SftConfig(epochs=10, learning_rate=1e-3, token_budget=2048, min_reward=0.0)
SHIPPED = EXAMPLES / "models" / "tiny-agent"  # the build of the current recipe, in the repository


class TinyAgentError(RuntimeError):
    """The tiny-agent cannot be built here (its harness is missing, or the teacher failed); says why."""


class Recipe(msgspec.Struct, kw_only=True, frozen=True):
    """Everything a tiny-agent build depends on; its hash names the cache directory."""

    recipe: str
    seed: int
    tiny_recipe: str
    harness: str
    harness_version: str
    harness_options: dict[str, Any]
    tasks_sha256: str
    early_stop_steps: int
    sft: list[dict[str, Any]]  # the phases, in order

    @property
    def key(self) -> str:
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:12]


def tasks_digest(*roots: Path) -> str:
    """sha256 over every file under each of `roots` (relative path and bytes, in sorted order)."""
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
        digest.update(b"\1")
    return digest.hexdigest()


def recipe(seed: int = 0, harness: str = "mini-swe-agent") -> Recipe:
    from adapters.harnesses import harness_class
    from harness_rl.engine.tiny_model import RECIPE_VERSION as TINY_RECIPE

    if harness not in HARNESSES:
        raise TinyAgentError(f"tiny-agent is built for {', '.join(HARNESSES)}, not {harness}: its teacher scripts "
                             "and its prompts are that agent's")
    package = harness_class(harness).package
    assert package is not None
    installed = package.installed_version(Path())
    if installed is None:
        raise TinyAgentError(f"tiny-agent needs {package.spec} (pip install 'harness-rl[dev]')")
    return Recipe(recipe=RECIPE_VERSION, seed=seed, tiny_recipe=TINY_RECIPE, harness=harness,
                  harness_version=installed, harness_options=AGENT_HARNESS_OPTIONS,
                  tasks_sha256=tasks_digest(WARMUP_TASKS, TRAIN_TASKS), early_stop_steps=EARLY_STOP_STEPS,
                  sft=[_settings(COMPLETE), _settings(HABIT)])


def _settings(phase: SftConfig) -> dict[str, Any]:
    """A phase's settings that decide its result (not where its files are)."""
    settings = msgspec.structs.asdict(phase)
    for run_specific in ("traces", "model", "output_dir", "device", "seed"):
        settings.pop(run_specific)
    return settings


def default_cache_dir(built: Recipe) -> Path:
    import os

    root = os.environ.get("HARNESS_RL_CACHE") or Path.home() / ".cache" / "harness-rl"
    return Path(root) / f"tiny-agent-{built.seed}-{built.key}"


def build_tiny_agent(seed: int = 0, harness: str = "mini-swe-agent", cache_dir: Path | None = None,
                     log: Any = None, rebuild: bool = False) -> Path:
    """The tiny-agent model directory for `seed`: the shipped build when it is this recipe's, else the cached
    one, else built (about 25 minutes). `rebuild` ignores both and builds into the cache afresh.

    Built in a staging directory renamed into place once complete, as `tiny` is, so concurrent builders
    never see a half-written model. The directory also keeps `teacher/` (traces and their rewards) and
    `sft.json` (the last SFT phase: what it kept and the loss per epoch).
    """
    from adapters.tasks import load_tasks
    from harness_rl.demo.teacher import Demo, teacher_traces
    from harness_rl.engine import build_tiny_model
    from harness_rl.engine import default_cache_dir as tiny_cache_dir
    from harness_rl.engine.tiny_model import is_cached, publish
    from harness_rl.learner.sft import sft

    built = recipe(seed, harness)
    expected = json.loads(msgspec.json.encode(built))
    if cache_dir is None and not rebuild and is_cached(SHIPPED, expected):
        return SHIPPED
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir(built)
    if rebuild:
        shutil.rmtree(cache_dir, ignore_errors=True)
    elif is_cached(cache_dir, expected):
        return cache_dir
    say = log or (lambda text: print(text, file=sys.stderr, flush=True))
    why = "" if rebuild or seed != TINY_AGENT_SEED else f"; {SHIPPED} is the build of another recipe"
    say(f"tiny-agent: building {cache_dir} (teacher traces of {harness} on {WARMUP_TASKS.name}/ and "
        f"{TRAIN_TASKS.name}/, then sft: about 25 minutes{why})")
    staging = cache_dir.with_name(cache_dir.name + f".building-{random.getrandbits(32):08x}")
    work = staging.with_name(staging.name + "-work")
    try:
        tiny = build_tiny_model(tiny_cache_dir(seed), seed=seed)
        shown = load_tasks(WARMUP_TASKS) + load_tasks(TRAIN_TASKS)
        demos = [Demo(task) for task in shown] + [Demo(task, EARLY_STOP_STEPS) for task in shown]
        records = teacher_traces(demos, tiny, work / "teacher", harness=harness, harness_options=built.harness_options,
                                 on_rollout=lambda r: say(f"tiny-agent: teacher {r.demo}: reward {r.reward}, "
                                                          f"{r.turns} turns, {r.seconds:.1f}s"))
        wrong = [r for r, d in zip(records, demos, strict=True)
                 if not r.replayed or r.reward != (1.0 if d.steps is None else 0.0)]
        if wrong:
            raise TinyAgentError(f"the teacher's demonstration {wrong[0].demo} went wrong (reward {wrong[0].reward}, "
                                 f"{wrong[0].unused_replies} replies unused, {wrong[0].error}); see {work}")
        model = tiny
        for n, phase in enumerate((COMPLETE, HABIT), start=1):
            out = work / f"sft-{n}" if n < 2 else staging
            summary = sft(msgspec.structs.replace(phase, traces=str(work / "teacher" / "traces"), model=str(model),
                                                  output_dir=str(out), seed=seed, device="cpu"), progress=False)
            say(f"tiny-agent: sft phase {n}: {len(summary.selection.kept)} traces, {summary.steps} steps, "
                f"loss {summary.initial_loss:.3f} -> {summary.final_loss:.3f}")
            model = out
        shutil.rmtree(work / "teacher" / "proxy", ignore_errors=True)
        (work / "teacher").rename(staging / "teacher")
        publish(staging, cache_dir, expected)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return cache_dir
