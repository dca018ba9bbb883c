"""Harbor-format tasks: loading them from a directory or a Hugging Face dataset.

A task is a directory holding `instruction.md` (what the agent is told), `task.toml` (limits and
environment), `environment/` (how to build its machine), `tests/test.sh` (the verifier, run by
`adapters.verifier`) and optionally `solution/solve.sh` (the reference solution, Harbor's oracle).

`task.toml` is checked when the task loads, as typed sections (`TaskConfig`): a value of the wrong
type is one line naming the file, the field and the value, before any run starts, rather than a
rollout failing (or a timeout silently falling back to a default) mid-run. Keys we do not read are
allowed, as Harbor's format has many more. `tests/test.sh` need not be executable: every sandbox runs
it as `bash tests/test.sh`, and uploads copy its bytes, not its mode.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec

DEFAULT_WORKDIR = "/app"
DEFAULT_VERIFIER_TIMEOUT_S = 600.0
WORKSPACE_SEED_DIR = "workspace"
SOLUTION_SCRIPT = "solution/solve.sh"
VERIFIER_SCRIPT = "tests/test.sh"
HF_REPO_ID = re.compile(r"^hf://(datasets/)?[\w.-]+/[\w.-]+$")

Seconds = Annotated[float, msgspec.Meta(gt=0)]
ABSOLUTE_PATTERN = "^/"
AbsolutePath = Annotated[str, msgspec.Meta(pattern=ABSOLUTE_PATTERN)]


class TaskError(ValueError):
    """A task directory or dataset that cannot be used (missing files, bad task.toml)."""


class TaskSection(msgspec.Struct, kw_only=True):
    """`[task]`: what the task is called (the directory's name when unset)."""

    name: str | None = None


class AgentSection(msgspec.Struct, kw_only=True):
    """`[agent]`: the agent's time limit (unset: the run's)."""

    timeout_sec: Seconds | None = None


class VerifierSection(msgspec.Struct, kw_only=True):
    """`[verifier]`: the verifier's time limit and environment."""

    timeout_sec: Seconds = DEFAULT_VERIFIER_TIMEOUT_S
    env: dict[str, str] = {}


class EnvironmentSection(msgspec.Struct, kw_only=True):
    """`[environment]`: where the agent works and its environment variables."""

    workdir: AbsolutePath = DEFAULT_WORKDIR
    env: dict[str, str] = {}


class MetadataSection(msgspec.Struct, kw_only=True):
    """`[metadata]`: the task's category (Harbor's; our generated tasks name their family with it)."""

    category: str | None = None


class TaskConfig(msgspec.Struct, kw_only=True):
    """The sections of Harbor's `task.toml` that harness-rl reads; unknown keys are allowed."""

    task: TaskSection = msgspec.field(default_factory=TaskSection)
    metadata: MetadataSection = msgspec.field(default_factory=MetadataSection)
    agent: AgentSection = msgspec.field(default_factory=AgentSection)
    verifier: VerifierSection = msgspec.field(default_factory=VerifierSection)
    environment: EnvironmentSection = msgspec.field(default_factory=EnvironmentSection)


@dataclass(frozen=True)
class Task:
    """One task directory, read once."""

    name: str
    path: Path
    instruction: str
    config: TaskConfig = field(default_factory=TaskConfig)

    @property
    def workdir(self) -> str:
        return self.config.environment.workdir

    @property
    def category(self) -> str | None:
        return self.config.metadata.category

    @property
    def agent_timeout_s(self) -> float | None:
        return self.config.agent.timeout_sec

    @property
    def verifier_timeout_s(self) -> float:
        return self.config.verifier.timeout_sec

    @property
    def verifier_env(self) -> dict[str, str]:
        return self.config.verifier.env

    @property
    def environment_env(self) -> dict[str, str]:
        return self.config.environment.env

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
    """Read one task directory; fail with the missing piece, or the bad task.toml value, named.
    Messages show the path as given."""
    shown = Path(path)
    if not (shown / "instruction.md").is_file():
        raise TaskError(f"{shown} is not a Harbor task: instruction.md is missing")
    if not (shown / VERIFIER_SCRIPT).is_file():
        raise TaskError(f"{shown} is not a Harbor task: {VERIFIER_SCRIPT} (the verifier) is missing")
    config = read_task_config(shown / "task.toml")
    path = shown.resolve()
    return Task(name=config.task.name or path.name, path=path, instruction=(path / "instruction.md").read_text(),
                config=config)


def read_task_config(toml_file: Path) -> TaskConfig:
    """A task.toml's sections, checked; the defaults when the file is absent."""
    if not toml_file.is_file():
        return TaskConfig()
    try:
        raw = tomllib.loads(toml_file.read_text())
    except tomllib.TOMLDecodeError as error:
        raise TaskError(f"{toml_file}: {error}") from None
    try:
        return msgspec.convert(raw, TaskConfig)
    except msgspec.ValidationError as error:
        raise TaskError(f"{toml_file}: {_explain(str(error), raw)}") from None


# msgspec's names of the types in TaskConfig: what to call each, and what TOML value is one
KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "float": ("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "object": ("a table", lambda v: isinstance(v, dict)),
}
VALIDATION = re.compile(r"^Expected `(?P<kinds>[^`]+)`(?:, got `[^`]+`)?(?P<bound>.*?)(?: - at `\$(?P<at>[^`]*)`)?$")


def _explain(message: str, raw: dict[str, Any]) -> str:
    """msgspec's "Expected `float | null`, got `str` - at `$.agent.timeout_sec`" as
    `agent.timeout_sec: expected a number, got "two minutes"` (TOML has no null; the value is the file's)."""
    found = VALIDATION.match(message)
    if found is None:
        return message
    kinds = [kind for kind in found["kinds"].split(" | ") if kind != "null"]
    names, value = _locate(raw, found["at"] or "", kinds)
    if found["bound"] == f" matching regex '{ABSOLUTE_PATTERN}'":
        expected = "an absolute path"
    else:  # "Expected `float` > 0.0": a number > 0
        expected = " or ".join(KINDS[kind][0] if kind in KINDS else kind for kind in kinds)
        expected += re.sub(r"(\d)\.0\b", r"\1", found["bound"])
    return f"{'.'.join(names)}: expected {expected}, got {_shown(value)}"


def _locate(raw: dict[str, Any], at: str, kinds: list[str]) -> tuple[list[str], Any]:
    """The dotted field names and the file's value at msgspec's path (`.agent.timeout_sec`, `.verifier.env[...]`);
    `[...]` (some entry of a table) is its first entry of none of the expected kinds."""
    names: list[str] = []
    value: Any = raw
    for part in re.findall(r"\.[^.\[]+|\[\.\.\.\]", at):
        if part == "[...]" and isinstance(value, dict) and value:
            matches = [KINDS[kind][1] for kind in kinds if kind in KINDS]
            key = next((k for k, v in value.items() if not any(match(v) for match in matches)), next(iter(value)))
        else:
            key = part.lstrip(".")
        names.append(str(key))
        value = value.get(key) if isinstance(value, dict) else None
    return names, value


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


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
    """One task, or every task directly under `path` (or its `tasks/`): a directory holding any of a task's
    files is a task, so one missing its instruction.md is named, not skipped."""
    if not path.is_dir():
        raise TaskError(f"{path} is a file; give a Harbor task directory, a directory of them, or hf://org/name")
    if _looks_like_task(path):
        return [load_task(path)]
    root = path / "tasks" if (path / "tasks").is_dir() else path
    tasks = [load_task(d) for d in sorted(root.iterdir()) if _looks_like_task(d)]
    if not tasks:
        raise TaskError(f"{path} holds no Harbor tasks (no */instruction.md)")
    return tasks


def _looks_like_task(path: Path) -> bool:
    return any((path / name).is_file() for name in ("instruction.md", "task.toml", VERIFIER_SCRIPT))


def _download_dataset(source: str, cache_dir: str | Path | None) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as error:
        raise TaskError("loading tasks from the Hub needs huggingface_hub: pip install huggingface_hub") from error
    repo_id = source.removeprefix("hf://").removeprefix("datasets/")
    local_dir = Path(cache_dir or Path.home() / ".cache" / "harness-rl" / "tasks") / repo_id.replace("/", "__")
    try:
        snapshot_download(repo_id, repo_type="dataset", local_dir=local_dir, allow_patterns=["tasks/**"])
    except Exception as error:  # the hub library's errors run to many lines, their cause chained behind
        raise TaskError(f"could not download dataset {repo_id!r} from the Hugging Face Hub: "
                        f"{_hub_refusal(error)}") from None
    return local_dir


def _hub_refusal(error: Exception) -> str:
    """What the Hub's error means, in one line with what to do."""
    from huggingface_hub import constants, errors

    if isinstance(error, errors.GatedRepoError):
        return "it is gated: accept its terms on huggingface.co, then log in (hf auth login, or set HF_TOKEN)"
    if isinstance(error, errors.RepositoryNotFoundError):
        return "no such dataset (a private one needs a login: hf auth login, or set HF_TOKEN)"
    if isinstance(error, errors.LocalEntryNotFoundError):  # the Hub not asked, or not answering, and nothing cached
        if constants.HF_HUB_OFFLINE:
            return "it is not downloaded yet and HF_HUB_OFFLINE is set: unset it, or pass the tasks' directory"
        return (f"{_first_line(error.__cause__ or error)}: check the network (or HF_ENDPOINT), or pass the tasks' "
                "directory")
    return _first_line(error)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
