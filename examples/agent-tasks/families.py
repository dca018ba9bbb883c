"""The agent tasks as families with parameters: every task in `warmup/`, `train/` and `heldout/` is drawn here.

A family is one skill (copy a file into a new directory, count a file's lines, ...) whose instances
differ in their names and line counts, drawn per task from fixed pools with a fixed seed. `warmup/`
holds the instances tiny-agent is warm-started on (the teacher's demonstrations), `train/` those GRPO
trains on (the teacher shows them too), and `heldout/` new instances of the same families whose
instructions no other split has, so a model that learned the skill, not the string, solves them.
Every name is one token of the tiny model's tokenizer, drawn from one pool for files, directories and
words alike, and written after a space in the instruction and in the commands: the skill asked of a
tiny model is to copy tokens of the instruction into the right places of its commands.

    python examples/agent-tasks/families.py           # (re)write warmup/, train/ and heldout/
    python examples/agent-tasks/families.py --check   # exit 1 if the checked-in tasks differ from the draw

Each task is a Harbor task directory: `task.toml` (its family is `[metadata] category`), `instruction.md`,
`environment/` (Dockerfile and the workspace's files), `solution/solve.sh` (one command per line: the
teacher replays each line as one tool call) and `tests/test.sh` (the verifier, writing 1 or 0).
"""

from __future__ import annotations

import argparse
import random
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from filecmp import dircmp
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 0
SPLITS = {"warmup": 12, "train": 6, "heldout": 5}  # instances per family
NAMES = ["data", "report", "memo", "items", "words", "table", "labels", "entries", "results", "values", "numbers",
         "names"]
LINES = ["alpha", "bravo", "delta", "echo", "golf", "hotel", "india", "kilo", "lima", "oscar", "papa", "sierra"]


@dataclass(frozen=True)
class Instance:
    """One task: what the agent reads, the files it starts with, the reference commands, the verifier's check."""

    instruction: str
    files: dict[str, str]
    solution: list[str]
    check: str  # a bash condition, run in /app, true when the task is solved
    describe: str  # the check in words, for the verifier's comment


def _lines(rng: random.Random, count: int) -> str:
    """`count` distinct words of LINES in an order that is not sorted, one per line."""
    words = rng.sample(LINES, count)
    while words == sorted(words):
        rng.shuffle(words)
    return "\n".join(words) + "\n"


def _expect(path: str, text: str) -> str:
    """A bash condition: `path` holds exactly `text` (as `$(cat)` reads it: trailing newlines dropped)."""
    return f'[ -f {path} ] && [ "$(cat {path})" = "$(printf %s {shlex.quote(text.rstrip(chr(10)))})" ]'


def copy_into(rng: random.Random) -> Instance:
    name, folder = rng.sample(NAMES, 2)
    text = _lines(rng, 3)
    return Instance(f"Copy {name}.txt into a new directory {folder}.", {f"{name}.txt": text},
                    [f"cat {name}.txt", f"mkdir {folder}", f"cp {name}.txt {folder}/"],
                    f"{_expect(f'{folder}/{name}.txt', text)} && {_expect(f'{name}.txt', text)}",
                    f"{folder}/{name}.txt is a copy of the untouched {name}.txt")


def count_lines(rng: random.Random) -> Instance:
    name, out = rng.sample(NAMES, 2)
    count = rng.randint(3, 9)
    text = _lines(rng, count)
    return Instance(f"Write the number of lines in {name}.txt to {out}.txt.", {f"{name}.txt": text},
                    [f"wc -l {name}.txt", f"wc -l < {name}.txt > {out}.txt"],
                    f'[ -f {out}.txt ] && [ "$(tr -d "[:space:]" < {out}.txt)" = "{count}" ]',
                    f"{out}.txt holds {count}, whitespace ignored")


def sort_lines(rng: random.Random) -> Instance:
    name, out = rng.sample(NAMES, 2)
    text = _lines(rng, rng.randint(3, 6))
    ordered = "\n".join(sorted(text.split())) + "\n"
    return Instance(f"Write the lines of {name}.txt sorted into {out}.txt.", {f"{name}.txt": text},
                    [f"cat {name}.txt", f"sort {name}.txt > {out}.txt"],
                    _expect(f"{out}.txt", ordered), f"{out}.txt holds the lines of {name}.txt in order")


def append_word(rng: random.Random) -> Instance:
    name, word = rng.sample(NAMES, 2)
    text = _lines(rng, 3)
    return Instance(f"Add the line {word} at the end of {name}.txt.", {f"{name}.txt": text},
                    [f"cat {name}.txt", f"echo {word} >> {name}.txt"],
                    _expect(f"{name}.txt", text + word + "\n"), f"{name}.txt ends with the line {word}")


FAMILIES: dict[str, Callable[[random.Random], Instance]] = {
    "copy-into": copy_into, "count-lines": count_lines, "sort-lines": sort_lines, "append-word": append_word}


def draw() -> dict[str, list[tuple[str, str, Instance]]]:
    """Every task by split: (directory name, family, instance); instructions never repeat, within or across splits."""
    rng = random.Random(SEED)
    splits: dict[str, list[tuple[str, str, Instance]]] = {split: [] for split in SPLITS}
    seen: set[str] = set()
    for family, make in FAMILIES.items():
        number = 0
        for split, count in SPLITS.items():
            for _ in range(count):
                instance = make(rng)
                while instance.instruction in seen:
                    instance = make(rng)
                seen.add(instance.instruction)
                number += 1
                splits[split].append((f"{family}-{number}", family, instance))
    return splits


def write_task(root: Path, name: str, family: str, instance: Instance) -> None:
    task = root / name
    (task / "environment" / "workspace").mkdir(parents=True)
    (task / "solution").mkdir()
    (task / "tests").mkdir()
    (task / "task.toml").write_text(
        f'version = "1.0"\n\n[task]\nname = "harness-rl/{name}"\n\n[metadata]\ncategory = "{family}"\n'
        f'tags = ["agent", "files", "generated"]\n\n[agent]\ntimeout_sec = 120\n\n[verifier]\ntimeout_sec = 30\n\n'
        '[environment]\nworkdir = "/app"\ncpus = 1\nmemory_mb = 512\n')
    (task / "instruction.md").write_text(instance.instruction + "\n")
    (task / "environment" / "Dockerfile").write_text("FROM python:3.12-slim\nWORKDIR /app\nCOPY workspace/ /app/\n")
    for file, text in instance.files.items():
        (task / "environment" / "workspace" / file).write_text(text)
    (task / "solution" / "solve.sh").write_text(
        "#!/usr/bin/env bash\n# The reference solution, run in the task's workdir: one command per line, "
        "one agent tool call each.\n" + "".join(f"{line}\n" for line in instance.solution))
    (task / "tests" / "test.sh").write_text(
        f"#!/usr/bin/env bash\n# Reward 1 when {instance.describe}, else 0.\nmkdir -p /logs/verifier\ncd /app\n"
        f"if {instance.check}; then\n    echo 1 > /logs/verifier/reward.txt\nelse\n"
        "    echo 0 > /logs/verifier/reward.txt\nfi\n")
    for script in (task / "solution" / "solve.sh", task / "tests" / "test.sh"):
        script.chmod(0o755)


def write_all(root: Path) -> None:
    for split, tasks in draw().items():
        shutil.rmtree(root / split, ignore_errors=True)
        for name, family, instance in tasks:
            write_task(root / split, name, family, instance)


def _differences(left: Path, right: Path) -> list[str]:
    compared = dircmp(left, right)
    found = [f"{left / n}" for n in compared.left_only + compared.right_only + compared.diff_files]
    return found + [d for sub in compared.common_dirs for d in _differences(left / sub, right / sub)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare the checked-in tasks with a fresh draw")
    if not parser.parse_args().check:
        write_all(HERE)
        return
    with tempfile.TemporaryDirectory() as fresh:
        write_all(Path(fresh))
        differences = [d for split in SPLITS for d in _differences(HERE / split, Path(fresh) / split)]
    if differences:
        sys.exit("the checked-in tasks differ from families.py's draw (run it to rewrite them): "
                 + ", ".join(differences[:5]))


if __name__ == "__main__":
    main()
