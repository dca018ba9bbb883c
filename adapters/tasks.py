"""Harbor-format tasks: loading them and scoring a sandbox with the task's own verifier.

A task is a directory holding `instruction.md` (what the agent is told), `task.toml` (limits and
environment), `environment/` (how to build its machine), `tests/test.sh` (the verifier) and
optionally `solution/solve.sh` (the reference solution, Harbor's oracle). The
verifier runs inside the sandbox after the agent and writes `/logs/verifier/reward.json` (a flat
map of numbers) or `/logs/verifier/reward.txt` (one number); JSON wins when both exist.

A reward we cannot read (no file, an empty file, not a number, NaN/inf, no usable key) is `None`,
meaning unscorable: it must never be mistaken for a 0 reward.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from adapters.sandboxes.base import Sandbox

DEFAULT_WORKDIR = "/app"
DEFAULT_VERIFIER_TIMEOUT_S = 600.0
WORKSPACE_SEED_DIR = "workspace"
SOLUTION_SCRIPT = "solution/solve.sh"
HF_REPO_ID = re.compile(r"^(hf://)?(datasets/)?[\w.-]+/[\w.-]+$")


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
    def docker_image(self) -> str | None:
        return self._section("environment").get("docker_image")

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
    """Tasks from a task directory, a directory of tasks, or a Hugging Face dataset repo id.

    A dataset repo (`org/name`, optionally `hf://datasets/org/name`) is laid out as
    `tasks/<name>/`; it is downloaded with `local_dir` so no cache symlinks dangle. A local
    directory is tried first, so a local path that looks like `org/name` still wins.
    """
    path = Path(source).expanduser()
    if path.exists():
        return _tasks_in(path)
    if HF_REPO_ID.match(str(source)):
        return _tasks_in(_download_dataset(str(source), cache_dir))
    raise TaskError(f"no task directory or dataset named {source!r}")


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


@dataclass(frozen=True)
class Reward:
    """What the verifier's files said. `value` is None when the rollout is unscorable, and `error` says why."""

    value: float | None
    rewards: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def parse_reward(json_text: str | None, txt_text: str | None, reward_key: str | None = None) -> Reward:
    """Harbor's reward files → one number, or None with the reason.

    `reward.json` wins over `reward.txt`. From the JSON map, `reward_key` (a comma-separated
    preference list) picks; without it, the only key, else `reward`. Non-finite entries are dropped.
    """
    if json_text is not None:
        return _parse_reward_json(json_text, reward_key)
    if txt_text is None:
        return Reward(None, error="the verifier wrote neither reward.json nor reward.txt")
    if not txt_text.strip():
        return Reward(None, error="reward.txt is empty")
    try:
        value = float(txt_text.strip())
    except ValueError:
        return Reward(None, error=f"reward.txt does not hold a number: {txt_text.strip()[:80]!r}")
    if not math.isfinite(value):
        return Reward(None, error=f"reward.txt holds a non-finite number: {value}")
    return Reward(value, {"reward": value})


def _parse_reward_json(text: str, reward_key: str | None) -> Reward:
    if not text.strip():
        return Reward(None, error="reward.json is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        return Reward(None, error=f"reward.json is not JSON: {error}")
    if not isinstance(data, dict):
        return Reward(None, error="reward.json must be a flat map of numbers")
    rewards = {
        str(k): float(v)
        for k, v in data.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
    if reward_key:
        wanted = [key.strip() for key in reward_key.split(",") if key.strip()]
        chosen = next((key for key in wanted if key in rewards), None)
        if chosen is None:
            return Reward(None, rewards, f"reward.json has no finite value for {reward_key!r} (keys: {sorted(data)})")
    elif len(data) == 1:
        chosen = next(iter(data))
    elif "reward" in data:
        chosen = "reward"
    else:
        return Reward(None, rewards, f"reward.json has several keys {sorted(data)}: choose one with reward_key")
    if chosen not in rewards:
        return Reward(None, rewards, f"reward.json's {chosen!r} is not a finite number: {data[chosen]!r}")
    return Reward(rewards[chosen], rewards)


@dataclass(frozen=True)
class Verification:
    """The verifier's run and the reward it left."""

    reward: Reward
    exit_code: int | None
    timed_out: bool
    output: str


async def verify(task: Task, sandbox: Sandbox, reward_key: str | None = None) -> Verification:
    """Copy the task's tests into the sandbox, run `tests/test.sh`, and read the reward files."""
    verifier_dir = str(PurePosixPath(sandbox.logs_dir) / "verifier")
    await sandbox.exec(["mkdir", "-p", verifier_dir, sandbox.tests_dir], timeout=30)
    await sandbox.exec(["rm", "-f", f"{verifier_dir}/reward.json", f"{verifier_dir}/reward.txt"], timeout=30)
    await sandbox.upload(task.tests_dir, sandbox.tests_dir)
    run = await sandbox.exec(
        ["bash", str(PurePosixPath(sandbox.tests_dir) / "test.sh")],
        env=task.verifier_env,
        timeout=task.verifier_timeout_s,
        cwd=sandbox.workdir,
    )
    reward = parse_reward(
        await sandbox.read_text(f"{verifier_dir}/reward.json"),
        await sandbox.read_text(f"{verifier_dir}/reward.txt"),
        reward_key,
    )
    return Verification(reward, run.exit_code, run.timed_out, (run.stdout + run.stderr)[-4000:])
