"""Harbor-format tasks: loading them from a directory or a Hugging Face dataset.

A task is a directory holding `instruction.md` (what the agent is told), `task.toml` (limits and
environment), `environment/` (how to build its machine), `tests/test.sh` (the verifier, run by
`adapters.verifier`) and optionally `solution/solve.sh` (the reference solution, Harbor's oracle).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_WORKDIR = "/app"
DEFAULT_VERIFIER_TIMEOUT_S = 600.0
WORKSPACE_SEED_DIR = "workspace"
SOLUTION_SCRIPT = "solution/solve.sh"
HF_REPO_ID = re.compile(r"^hf://(datasets/)?[\w.-]+/[\w.-]+$")


class TaskError(ValueError):
    """A task directory or dataset that cannot be used (missing files, bad task.toml)."""


@dataclass(frozen=True)
class Task:
    """One task directory, read once."""

    name: str
    path: Path
    instruction: str
    config: dict[str, Any] = field(default_factory=dict)

    def _section(self, name: str) -> dict[str, Any]:
        section = self.config.get(name, {})
        return section if isinstance(section, dict) else {}

    @property
    def workdir(self) -> str:
        return str(self._section("environment").get("workdir") or DEFAULT_WORKDIR)

    @property
    def agent_timeout_s(self) -> float | None:
        value = self._section("agent").get("timeout_sec")
        return float(value) if value is not None else None

    @property
    def verifier_timeout_s(self) -> float:
        return float(self._section("verifier").get("timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S))

    @property
    def verifier_env(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in self._section("verifier").get("env", {}).items()}

    @property
    def environment_env(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in self._section("environment").get("env", {}).items()}

    @property
    def environment_dir(self) -> Path:
        return self.path / "environment"

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def workspace_seed(self) -> Path | None:
        """Starting files for sandboxes that cannot build the Dockerfile (local, e2b base template).

        Our tasks keep them in `environment/workspace/`, which their Dockerfile copies to the same
        workdir, so the task behaves the same in Harbor's docker environments.
        """
        seed = self.environment_dir / WORKSPACE_SEED_DIR
        return seed if seed.is_dir() else None

    @property
    def solution_steps(self) -> list[str]:
        """The reference solution as separate commands, run in the workdir: `solution/solve.sh`'s lines
        that are neither blank nor comments, one agent tool call each (our tasks' convention, which
        keeps the script valid for Harbor's oracle); empty when the task ships no solution."""
        script = self.path / SOLUTION_SCRIPT
        if not script.is_file():
            return []
        lines = (line.strip() for line in script.read_text().splitlines())
        return [line for line in lines if line and not line.startswith("#")]


def load_task(path: str | Path) -> Task:
    """Read one task directory; fail with the missing piece named."""
    path = Path(path).resolve()
    instruction = path / "instruction.md"
    if not instruction.is_file():
        raise TaskError(f"{path} is not a Harbor task: instruction.md is missing")
    if not (path / "tests" / "test.sh").is_file():
        raise TaskError(f"{path} is not a Harbor task: tests/test.sh (the verifier) is missing")
    config: dict[str, Any] = {}
    toml_file = path / "task.toml"
    if toml_file.is_file():
        try:
            config = tomllib.loads(toml_file.read_text())
        except tomllib.TOMLDecodeError as error:
            raise TaskError(f"{toml_file}: {error}") from error
    name = str(config.get("task", {}).get("name") or path.name)
    return Task(name=name, path=path, instruction=instruction.read_text(), config=config)


def load_tasks(source: str | Path, cache_dir: str | Path | None = None) -> list[Task]:
    """Tasks from a task directory, a directory of tasks, or a Hugging Face dataset repo.

    A dataset repo is written `hf://org/name` (or `hf://datasets/org/name`), never bare: a mistyped
    local path is then an error, not a network call. It is laid out as `tasks/<name>/` and
    downloaded with `local_dir` so no cache symlinks dangle.
    """
    path = Path(source).expanduser()
    if path.exists():
        return _tasks_in(path)
    if HF_REPO_ID.match(str(source)):
        return _tasks_in(_download_dataset(str(source), cache_dir))
    raise TaskError(missing_tasks(str(source)))


def missing_tasks(source: str) -> str:
    """What to say of a task source that is neither a local directory nor `hf://org/name`."""
    if source.startswith("hf://"):
        return f"{source!r} is not a dataset repo id (hf://org/name)"
    hint = f" (a Hugging Face dataset is written hf://{source})" if re.match(r"^[\w.-]+/[\w.-]+$", source) else ""
    return f"no task directory {source!r}{hint}"


def _tasks_in(path: Path) -> list[Task]:
    if (path / "instruction.md").is_file():
        return [load_task(path)]
    root = path / "tasks" if (path / "tasks").is_dir() else path
    tasks = [load_task(d) for d in sorted(root.iterdir()) if (d / "instruction.md").is_file()]
    if not tasks:
        raise TaskError(f"{path} holds no Harbor tasks (no */instruction.md)")
    return tasks


def _download_dataset(source: str, cache_dir: str | Path | None) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as error:
        raise TaskError("loading tasks from the Hub needs huggingface_hub: pip install huggingface_hub") from error
    repo_id = source.removeprefix("hf://").removeprefix("datasets/")
    local_dir = Path(cache_dir or Path.home() / ".cache" / "harness-rl" / "tasks") / repo_id.replace("/", "__")
    try:
        snapshot_download(repo_id, repo_type="dataset", local_dir=local_dir, allow_patterns=["tasks/**"])
    except Exception as error:
        raise TaskError(f"could not download dataset {repo_id!r} from the Hugging Face Hub: {error}") from error
    return local_dir
