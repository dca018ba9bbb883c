"""The Hugging Face Jobs launcher: the job it would submit, the commands of each GPU group, and the servers it
would start (no cloud here)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "hf_jobs_launcher.py"
TASKS = ROOT / "examples" / "tasks"


@pytest.fixture(scope="module")
def launcher():
    spec = importlib.util.spec_from_file_location("hf_jobs_launcher", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def dry_run(launcher, capsys, *flags: str) -> tuple[dict, list[str], str]:
    """The job spec, the job's command lines (comments left out) and what went to stderr."""
    assert launcher.main(["submit", "--model", "Qwen/Qwen3-8B", "--dry-run", *flags]) == 0
    out, err = capsys.readouterr()
    spec_text, _, commands = out.partition("\n# inside the job, per GPU group:\n")
    return json.loads(spec_text), [line for line in commands.splitlines() if not line.startswith("#")], err


def test_the_job_reruns_the_script_and_installs_this_checkout_with_the_tasks_shipped(launcher, capsys) -> None:
    spec, _, err = dry_run(launcher, capsys, "--tasks", str(TASKS), "--push-to", "me/runs", "--",
                           "--harness", "opencode", "--max-steps", "5")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    wheel = f"harness_rl-{version}-py3-none-any.whl"
    assert spec["script"] == str(SCRIPT) and spec["flavor"] == "h200x2"
    assert spec["dependencies"] == [f"harness-rl[train,vllm] @ file:///data/{wheel}"]
    args = spec["script_args"]
    assert args[0] == "run" and args[args.index("--model") + 1] == "Qwen/Qwen3-8B"
    assert args[args.index("--gpus") + 1] == "2" and args[args.index("--push-to") + 1] == "me/runs"
    assert args[args.index("--wheel") + 1] == f"/data/{wheel}"  # a local file argument: HF Jobs ships it there
    assert args[args.index("--tasks") + 1] == "/data/tasks.tar.gz"
    assert args[args.index("--") + 1:] == ["--harness", "opencode", "--max-steps", "5"]
    assert f"builds {wheel}" in err and f"ships {TASKS} with the job" in err and "warning" not in err


def test_a_package_and_hub_tasks_are_passed_as_given(launcher, capsys) -> None:
    spec, lines, err = dry_run(launcher, capsys, "--tasks", "hf://me/tasks", "--push-to", "me/runs", "--package",
                               "harness-rl[train,vllm] @ git+https://example.invalid/h.git")
    assert spec["dependencies"] == ["harness-rl[train,vllm] @ git+https://example.invalid/h.git"]
    assert "--wheel" not in spec["script_args"] and err == ""
    assert spec["script_args"][spec["script_args"].index("--tasks") + 1] == "hf://me/tasks"
    assert " --tasks hf://me/tasks " in lines[-1]


def test_h200x8_runs_four_vllm_servers_and_a_4_way_fsdp_learner_exactly(launcher, capsys) -> None:
    _, lines, _ = dry_run(launcher, capsys, "--flavor", "h200x8", "--tasks", "hf://me/tasks", "--push-to", "me/r",
                          "--", "--max-steps", "100")
    model = "/tmp/harness-rl/model"
    assert lines[0] == f"hf download Qwen/Qwen3-8B --local-dir {model}"
    assert lines[1:5] == [f"CUDA_VISIBLE_DEVICES={gpu} harness-rl serve vllm {model} --host 127.0.0.1 --port "
                          f"{8000 + gpu} --served-model-name Qwen3-8B --tensor-parallel-size 1" for gpu in range(4)]
    engines = " ".join(f"--engine http://127.0.0.1:{8000 + gpu}" for gpu in range(4))
    assert lines[5] == (f"CUDA_VISIBLE_DEVICES=4,5,6,7 torchrun --standalone --nproc-per-node 4 -m harness_rl train "
                        f"--preset real --model {model} {engines} --tasks hf://me/tasks "
                        "--output-dir /tmp/harness-rl/run --max-steps 100")
    assert len(lines) == 6


@pytest.mark.parametrize(("flavor", "flags", "servers", "learner"), [
    ("h200x2", [], [("0", "1", [])], ("1", 1)),
    ("a100x4", [], [("0", "1", []), ("1", "1", [])], ("2,3", 2)),
    ("h200x8", [], [(str(g), "1", []) for g in range(4)], ("4,5,6,7", 4)),
    ("h200x8", ["--tensor-parallel-size", "2"], [("0,1", "2", []), ("2,3", "2", [])], ("4,5,6,7", 4)),
    ("h200x8", ["--data-parallel", "vllm"], [("0,1,2,3", "1", ["--data-parallel-size", "4"])], ("4,5,6,7", 4)),
    ("h200x8", ["--data-parallel", "vllm", "--tensor-parallel-size", "2", "--inference-gpus", "4"],
     [("0,1,2,3", "2", ["--data-parallel-size", "2"])], ("4,5,6,7", 4)),
    ("h200x8", ["--inference-gpus", "2", "--tensor-parallel-size", "2"], [("0,1", "2", [])], ("2,3,4,5,6,7", 6)),
])
def test_each_gpu_group_gets_its_command(launcher, capsys, flavor: str, flags: list[str],
                                         servers: list[tuple[str, str, list[str]]], learner: tuple[str, int]) -> None:
    _, lines, _ = dry_run(launcher, capsys, "--flavor", flavor, "--tasks", "hf://me/tasks", "--push-to", "me/r",
                          *flags)
    served = lines[1:-1]
    assert len(served) == len(servers)
    for index, (line, (gpus, tp, extra)) in enumerate(zip(served, servers, strict=True)):
        assert line.startswith(f"CUDA_VISIBLE_DEVICES={gpus} harness-rl serve vllm ")
        assert f" --port {8000 + index} " in line
        assert line.endswith(" ".join(["--tensor-parallel-size", tp, *extra]))
    gpus, processes = learner
    train = lines[-1]
    assert train.startswith(f"CUDA_VISIBLE_DEVICES={gpus} " + (
        f"torchrun --standalone --nproc-per-node {processes} -m harness_rl train " if processes > 1
        else "harness-rl train "))
    assert train.count("--engine ") == len(servers)
    assert all(f"--engine http://127.0.0.1:{8000 + i} " in train for i in range(len(servers)))
    used = [int(g) for line in lines[1:] for g in line.split()[0].removeprefix("CUDA_VISIBLE_DEVICES=").split(",")]
    assert sorted(used) == list(range(int(flavor.rsplit("x", 1)[1])))  # every GPU in exactly one group


@pytest.mark.parametrize(("flags", "message"), [
    (["--flavor", "a100-large"], "--flavor a100-large: 1 GPU"),
    (["--flavor", "h200x8", "--inference-gpus", "8"], "--inference-gpus 8: between 1 and 7"),
    (["--flavor", "h200x4", "--tensor-parallel-size", "3"], "--tensor-parallel-size 3 does not divide"),
    (["--tasks", "examples/taskz"], "--tasks examples/taskz: no such directory here"),
    (["--", "--tasks", "x"], "give --tasks to the launcher"),
])
def test_a_submission_that_cannot_run_is_one_line_before_any_network(launcher, flags: list[str],
                                                                     message: str) -> None:
    tasks = [] if flags[0] == "--tasks" else ["--tasks", str(TASKS)]
    with pytest.raises(SystemExit) as stopped:
        launcher.main(["submit", "--model", "Qwen/Qwen3-8B", "--push-to", "me/r", *tasks, *flags])
    assert message in str(stopped.value) and "\n" not in str(stopped.value)


def test_without_push_to_the_dry_run_warns_and_a_submission_is_refused(launcher, capsys) -> None:
    _, _, err = dry_run(launcher, capsys, "--tasks", "hf://me/tasks")
    assert "warning: without --push-to the run directory stays in the job's container and is lost" in err
    with pytest.raises(SystemExit, match="pass --push-to <you>/<repo> \\(or --no-push"):
        launcher.main(["submit", "--model", "Qwen/Qwen3-8B", "--tasks", "hf://me/tasks"])


def test_inside_the_job_the_shipped_tasks_are_unpacked_and_trained_on(launcher, capsys, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "WORK", str(tmp_path / "work"))
    archive = tmp_path / "tasks.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(TASKS, arcname="tasks")
    assert launcher.main(["run", "--model", "Qwen/Qwen3-8B", "--gpus", "4", "--tasks", str(archive), "--dry-run",
                          "--", "--max-steps", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (tmp_path / "work" / "tasks" / "tasks" / "digits" / "task.toml").is_file()
    assert f" --tasks {tmp_path / 'work' / 'tasks' / 'tasks'} " in lines[-1]
    assert lines[-1].startswith("CUDA_VISIBLE_DEVICES=2,3 torchrun --standalone --nproc-per-node 2 -m harness_rl ")


def test_a_server_that_dies_before_it_is_ready_fails_fast(launcher) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    started = time.monotonic()
    with pytest.raises(SystemExit, match="exited with status 3"):
        launcher.wait_healthy("http://127.0.0.1:9/health", dead, timeout_s=60)
    assert time.monotonic() - started < 10


def test_stop_ends_the_whole_process_group(launcher) -> None:
    sleeper = "import time; time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, "
                               f"'-c', {sleeper!r}]); {sleeper}"], start_new_session=True)
    deadline = time.monotonic() + 30
    while len(subprocess.run(["pgrep", "-g", str(parent.pid)], capture_output=True, text=True).stdout.split()) < 2:
        assert time.monotonic() < deadline, "the child never started"  # until the group holds parent and child
        time.sleep(0.05)
    launcher.stop(parent, grace_s=5)
    assert parent.returncode is not None
    deadline = time.monotonic() + 5
    while subprocess.run(["pgrep", "-g", str(parent.pid)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "a process of the group outlived stop()"
        time.sleep(0.1)
