"""`tiny-agent`: the tiny model warm-started on teacher traces, so a real agent CLI can learn on a CPU.

A random model never emits a valid tool call, so RL from `tiny` has nothing to reinforce. The recipe:
1. the offline `tiny` model (random 0.8M-parameter Qwen2 and its BPE tokenizer, `engine.tiny_model`);
2. teacher traces (`harness_rl.teacher`): mini-swe-agent replaying the reference solution of every
   task in `examples/agent-tasks/train` through the proxy, its replies forced (never the held-out tasks);
3. `harness-rl sft` on those traces with `SFT`: deliberately short, so the model has the tool-call
   format and fragments of the commands but samples the right command sequence only part of the time.

What it is: a random model that memorised, imperfectly, which shell commands follow which task
instruction in mini-swe-agent's prompt. It does not reason; it cannot solve a task it was not shown.

The build is deterministic (the teacher's prompts are pinned: `config.PINNED_UNAME`; training runs on
the CPU with one thread and a fixed seed) and cached like `tiny`, under
`$HARNESS_RL_CACHE/tiny-agent-<seed>-<key>`, where the key hashes everything it depends on
(`Recipe`): this recipe's version, the seed, the tiny model's recipe, the task folders with their
solutions, the harness and its installed version, the harness options, and the SFT settings.
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

from harness_rl.config import AGENT_HARNESS_OPTIONS, AGENT_TASKS, SftConfig

RECIPE_VERSION = "1"
HARNESSES = ("mini-swe-agent",)
TEACHER_TASKS = AGENT_TASKS / "train"
SFT = SftConfig(epochs=100, learning_rate=3e-3, token_budget=2048, min_reward=1.0)
STAMP_NAME = "harness_rl_recipe.json"


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
    sft: dict[str, Any]

    @property
    def key(self) -> str:
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:12]


def tasks_digest(root: Path) -> str:
    """sha256 over every file under `root` (relative path and bytes, in sorted order)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
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
    sft = msgspec.structs.asdict(SFT)
    for run_specific in ("traces", "model", "output_dir", "device", "seed"):
        sft.pop(run_specific)
    return Recipe(recipe=RECIPE_VERSION, seed=seed, tiny_recipe=TINY_RECIPE, harness=harness,
                  harness_version=installed, harness_options=AGENT_HARNESS_OPTIONS,
                  tasks_sha256=tasks_digest(TEACHER_TASKS), sft=sft)


def default_cache_dir(built: Recipe) -> Path:
    import os

    root = os.environ.get("HARNESS_RL_CACHE") or Path.home() / ".cache" / "harness-rl"
    return Path(root) / f"tiny-agent-{built.seed}-{built.key}"


def build_tiny_agent(seed: int = 0, harness: str = "mini-swe-agent", cache_dir: Path | None = None,
                     log: Any = None) -> Path:
    """The tiny-agent model directory for `seed`: reused when its recipe's build is cached, else built (minutes).

    Built in a staging directory renamed into place once complete, as `tiny` is, so concurrent builders
    never see a half-written model. The directory also keeps `teacher/` (traces and their rewards) and
    `sft.json` (what SFT kept and the loss per epoch).
    """
    from adapters.tasks import load_tasks
    from harness_rl.engine import build_tiny_model
    from harness_rl.engine import default_cache_dir as tiny_cache_dir
    from harness_rl.sft import sft
    from harness_rl.teacher import teacher_traces

    built = recipe(seed, harness)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir(built)
    expected = json.loads(msgspec.json.encode(built))
    if _is_complete(cache_dir, expected):
        return cache_dir
    say = log or (lambda text: print(text, file=sys.stderr, flush=True))
    say(f"tiny-agent: building {cache_dir} (teacher traces of {harness} on {TEACHER_TASKS.name}/, then sft)")
    staging = cache_dir.with_name(cache_dir.name + f".building-{random.getrandbits(32):08x}")
    teacher_dir = staging.with_name(staging.name + "-teacher")
    try:
        tiny = build_tiny_model(tiny_cache_dir(seed), seed=seed)
        records = teacher_traces(load_tasks(TEACHER_TASKS), tiny, teacher_dir, harness=harness,
                                 harness_options=built.harness_options,
                                 on_rollout=lambda r: say(f"tiny-agent: teacher {r.task}: reward {r.reward}, "
                                                          f"{r.turns} turns, {r.seconds:.1f}s"))
        failed = [r for r in records if not r.solved]
        if failed:
            raise TinyAgentError(f"the teacher did not solve {', '.join(r.task for r in failed)} "
                                 f"({failed[0].error or 'reward ' + str(failed[0].reward)}); see {teacher_dir}")
        config = msgspec.structs.replace(SFT, traces=str(teacher_dir / "traces"), model=str(tiny),
                                         output_dir=str(staging), seed=seed, device="cpu")
        summary = sft(config, progress=False)
        say(f"tiny-agent: sft loss {summary.initial_loss:.3f} -> {summary.final_loss:.3f} in {summary.steps} steps")
        shutil.rmtree(teacher_dir / "proxy", ignore_errors=True)
        teacher_dir.rename(staging / "teacher")
        (staging / STAMP_NAME).write_text(json.dumps(expected, indent=2))
        if cache_dir.exists() and not _is_complete(cache_dir, expected):
            shutil.rmtree(cache_dir, ignore_errors=True)
        try:
            staging.rename(cache_dir)
        except OSError:
            if not _is_complete(cache_dir, expected):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(teacher_dir, ignore_errors=True)
    return cache_dir


def _is_complete(directory: Path, expected: dict[str, Any]) -> bool:
    try:
        return bool(json.loads((directory / STAMP_NAME).read_text()) == expected)
    except (OSError, ValueError):
        return False
