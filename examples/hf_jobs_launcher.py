# /// script
# requires-python = ">=3.11"
# dependencies = ["huggingface_hub>=2.4"]
# ///
"""Run harness-rl training on Hugging Face Jobs: vLLM on some of a flavor's GPUs, the learner on the rest.

From a laptop, `submit` sends this very script to HF Jobs; inside the job it runs itself again with
`run`, which downloads the model, starts vLLM on its GPU group(s) with `harness-rl serve vllm` (the
flags exact capture and weight sync need live there, nowhere else), runs the learner on the other
GPUs (`torchrun --nproc-per-node N -m harness_rl train`, FSDP, when it has more than one) against
every vLLM server (weights synced over NCCL after every step), and uploads the run directory to a
Hub repo at the end, also when training fails. The agents run in the job's own container with the
local sandbox, so they reach the proxy on loopback and no tunnel is needed.

    python examples/hf_jobs_launcher.py submit --flavor h200x8 --model Qwen/Qwen3-8B \\
        --tasks examples/agent-tasks/train --push-to <you>/harness-rl-runs -- \\
        --harness mini-swe-agent --max-steps 100

GPU layout (`--inference-gpus`, `--tensor-parallel-size`, `--data-parallel`), by default:
2 GPUs: vLLM on GPU 0, the learner on GPU 1; 4 GPUs: two vLLM servers on GPUs 0 and 1, a 2-way
FSDP learner on 2-3; 8 GPUs: four vLLM servers on 0-3, a 4-way FSDP learner on 4-7. Each vLLM
server is one engine behind the run's proxy, which keeps every agent session on one server (its
prefix cache); `--data-parallel vllm` makes one server with vLLM's own data parallelism instead (the
proxy keeps each session on one of its copies too; a failure takes them all down at once).
`--dry-run` prints the job and the exact commands of every GPU group.

By default the job installs this checkout: `submit` builds it into a wheel and ships it with the job
(`--package` takes any pip requirement instead). A local `--tasks` directory is shipped the same way;
a dataset on the Hub is `--tasks hf://<you>/<dataset>`. Everything after `--` goes to
`harness-rl train` unchanged. opencode and Claude Code need Node.js in the image (`--image`);
mini-swe-agent and the echo harness need only Python.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

FIRST_PORT = 8000
JOB_FILES = "/data"  # where HF Jobs mounts the local files a job is submitted with
WORK = "/tmp/harness-rl"
CHECKOUT = Path(__file__).resolve().parents[1]
LOCAL_PACKAGE = "local"
EXTRAS = "train,vllm"
LOST_OUTPUTS = "without --push-to the run directory stays in the job's container and is lost when the job ends"


@dataclass(frozen=True)
class Group:
    """One command on a set of GPUs."""

    role: str
    gpus: tuple[int, ...]
    argv: list[str]

    def line(self) -> str:
        devices = ",".join(map(str, self.gpus))
        return f"CUDA_VISIBLE_DEVICES={devices} {shlex.join(self.argv)}"


@dataclass(frozen=True)
class Plan:
    """What the job runs: the model download, the vLLM servers, the learner."""

    download: list[str]
    servers: list[Group]
    learner: Group
    urls: list[str]

    def lines(self) -> list[str]:
        out = [f"# download the model\n{shlex.join(self.download)}"]
        out += [f"# {g.role} (GPUs {','.join(map(str, g.gpus))})\n{g.line()}" for g in self.servers]
        out.append(f"# {self.learner.role} (GPUs {','.join(map(str, self.learner.gpus))})\n{self.learner.line()}")
        return out


class LayoutError(ValueError):
    """A GPU layout that cannot run; the message is one line naming the flag to change."""


def flavor_gpus(flavor: str) -> int:
    """GPUs of a Jobs flavor (`h200x8` → 8, `a100-large` → 1)."""
    found = re.search(r"x(\d+)$", flavor)
    return int(found.group(1)) if found else 1


def default_inference_gpus(gpus: int) -> int:
    """Half the GPUs for vLLM, half for the learner: 2 → 1 + 1, 4 → 2 + 2, 8 → 4 + 4."""
    return max(1, gpus // 2)


def plan(args: argparse.Namespace) -> Plan:
    """The job's commands for `args` (the same on a laptop's `--dry-run` as in the job); raises LayoutError."""
    gpus = args.gpus or flavor_gpus(args.flavor)
    inference = args.inference_gpus or default_inference_gpus(gpus)
    tp = args.tensor_parallel_size
    if gpus < 2:
        raise LayoutError(f"--flavor {args.flavor}: {gpus} GPU; vLLM and the learner need one each at least")
    if not 1 <= inference < gpus:
        raise LayoutError(f"--inference-gpus {inference}: between 1 and {gpus - 1} of the {gpus} GPUs, so the learner "
                          "keeps at least one")
    if inference % tp:
        raise LayoutError(f"--tensor-parallel-size {tp} does not divide --inference-gpus {inference}")
    model_dir = f"{WORK}/model"
    download = ["hf", "download", args.model, "--local-dir", model_dir]
    name = served_name(args.model)
    replicas = inference // tp
    per_server = inference if args.data_parallel == "vllm" else tp
    servers = []
    for index in range(1 if args.data_parallel == "vllm" else replicas):
        port = FIRST_PORT + index
        vllm_args = ["--tensor-parallel-size", str(tp)]
        if args.data_parallel == "vllm":
            vllm_args += ["--data-parallel-size", str(replicas)]
        argv = ["harness-rl", "serve", "vllm", model_dir, "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", name, *vllm_args, *(["--", *shlex.split(args.vllm_args)] if args.vllm_args
                                                           else [])]
        role = (f"vLLM, tensor parallel {tp} x data parallel {replicas}" if args.data_parallel == "vllm"
                else f"vLLM server {index + 1} of {replicas}, tensor parallel {tp}")
        servers.append(Group(role, tuple(range(index * per_server, (index + 1) * per_server)), argv))
    urls = [f"http://127.0.0.1:{FIRST_PORT + i}" for i in range(len(servers))]
    learners = gpus - inference
    train = ["train", "--preset", "real", "--model", model_dir, *[a for url in urls for a in ("--engine", url)],
             "--tasks", args.job_tasks, "--output-dir", args.output_dir, *args.train_args]
    head = ["torchrun", "--standalone", "--nproc-per-node", str(learners), "-m", "harness_rl"] if learners > 1 \
        else ["harness-rl"]
    role = f"learner, FSDP over {learners} processes" if learners > 1 else "learner"
    return Plan(download, servers, Group(role, tuple(range(inference, gpus)), head + train), urls)


def served_name(model: str) -> str:
    """A leaf name without '/': Claude Code rejects model names with a slash."""
    return model.rstrip("/").rsplit("/", 1)[-1]


def wheel_name() -> str:
    """The wheel `submit` builds from this checkout (name and version from its pyproject.toml)."""
    project = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"]
    return f"{project['name'].replace('-', '_')}-{project['version']}-py3-none-any.whl"


def job_spec(args: argparse.Namespace, wheel: Path | None, tasks_archive: Path | None) -> dict:
    """What `submit` sends: this script, re-run with `run`, on the chosen hardware. Local files among the script's
    arguments (the wheel, the tasks archive) are shipped with the job and appear under /data in it."""
    script_args = ["run", "--model", args.model, "--gpus", str(flavor_gpus(args.flavor)), "--output-dir",
                   args.output_dir, "--tensor-parallel-size", str(args.tensor_parallel_size), "--data-parallel",
                   args.data_parallel]
    if args.inference_gpus:
        script_args += ["--inference-gpus", str(args.inference_gpus)]
    if args.vllm_args:
        script_args += ["--vllm-args", args.vllm_args]
    script_args += ["--tasks", str(tasks_archive) if tasks_archive else args.tasks]
    if wheel is not None:
        script_args += ["--wheel", str(wheel)]
    if args.push_to:
        script_args += ["--push-to", args.push_to]
    script_args += ["--", *args.train_args]
    package = args.package if args.package != LOCAL_PACKAGE else \
        f"harness-rl[{EXTRAS}] @ file://{JOB_FILES}/{wheel_name()}"
    spec = {"script": str(Path(__file__).resolve()), "script_args": script_args, "dependencies": [package],
            "flavor": args.flavor, "timeout": args.timeout, "secrets": {"HF_TOKEN": None},
            "env": {"HF_HUB_ENABLE_HF_TRANSFER": "1", "PYTHONUNBUFFERED": "1"}}
    if args.image:
        spec["image"] = args.image
    return spec


def check_tasks(tasks: str) -> None:
    """`--tasks` is a Hub dataset (`hf://…`) or a local task directory that exists; else one line, exit 2."""
    if tasks.startswith("hf://") or Path(tasks).is_dir():
        return
    raise SystemExit(f"launcher: --tasks {tasks}: no such directory here; a dataset on the Hub is written "
                     f"hf://<owner>/<name>")


def submit(args: argparse.Namespace) -> int:
    check_tasks(args.tasks)
    if not args.push_to and not args.no_push and not args.dry_run:
        raise SystemExit(f"launcher: {LOST_OUTPUTS}: pass --push-to <you>/<repo> (or --no-push to accept it)")
    local_tasks = not args.tasks.startswith("hf://")
    args.job_tasks = f"{WORK}/tasks/{Path(args.tasks).resolve().name}" if local_tasks else args.tasks
    try:
        layout = plan(args)
    except LayoutError as error:
        raise SystemExit(f"launcher: {error}") from None
    if args.dry_run:  # the job as it will run: shipped files under /data
        shipped = Path(JOB_FILES)
        spec = job_spec(args, shipped / wheel_name() if args.package == LOCAL_PACKAGE else None,
                        shipped / "tasks.tar.gz" if local_tasks else None)
        print(json.dumps(spec, indent=2))
        print("\n# inside the job, per GPU group:\n" + "\n".join(layout.lines()))
        if args.package == LOCAL_PACKAGE:
            print(f"# submit builds {wheel_name()} from {CHECKOUT} and ships it with the job", file=sys.stderr)
        if local_tasks:
            print(f"# submit ships {args.tasks} with the job as tasks.tar.gz", file=sys.stderr)
        if not args.push_to:
            print(f"launcher: warning: {LOST_OUTPUTS}", file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        staged = Path(scratch)
        wheel = staged / wheel_name() if args.package == LOCAL_PACKAGE else None
        archive = staged / "tasks.tar.gz" if local_tasks else None
        spec = job_spec(args, wheel, archive)
        if wheel is not None:
            build_wheel(staged)
        if archive is not None:
            with tarfile.open(archive, "w:gz") as tar:
                tar.add(args.tasks, arcname=Path(args.tasks).resolve().name)
        if not args.push_to:
            print(f"launcher: warning: {LOST_OUTPUTS}", file=sys.stderr)
        from huggingface_hub import get_token, run_uv_job

        spec["secrets"] = {"HF_TOKEN": get_token()}
        job = run_uv_job(**spec)
    print(f"submitted job {job.id}: {job.url}")
    return 0


def build_wheel(out_dir: Path) -> None:
    """This checkout as a wheel in `out_dir` (uv when on PATH, else pip)."""
    command = ["uv", "build", "--wheel", "--out-dir", str(out_dir), str(CHECKOUT)] if _on_path("uv") else \
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out_dir), str(CHECKOUT)]
    subprocess.run(command, check=True)


def _on_path(program: str) -> bool:
    import shutil

    return shutil.which(program) is not None


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Wait for `url` to answer 200; fail fast if the server process dies first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"launcher: vLLM exited with status {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"launcher: vLLM not healthy after {timeout_s:.0f}s at {url}")


def stop(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the whole process group, SIGKILL what is left after the grace period."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def run(args: argparse.Namespace) -> int:
    """Inside the job: the tasks unpacked, the model downloaded, every vLLM server up, then the learner."""
    tasks = Path(args.tasks)
    if tasks.name.endswith(".tar.gz") and tasks.is_file():
        with tarfile.open(tasks) as tar:
            tar.extractall(f"{WORK}/tasks", filter="data")
            args.job_tasks = f"{WORK}/tasks/{tar.getnames()[0].split('/')[0]}"
    else:
        args.job_tasks = args.tasks
    layout = plan(args)
    print("\n".join(layout.lines()), flush=True)
    if args.dry_run:
        return 0
    bin_dir = str(Path(sys.executable).parent)  # harness-rl and torchrun of the job's environment
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    subprocess.run(layout.download, env=env, check=True)
    servers: list[subprocess.Popen] = []
    status = 1
    try:
        for group in layout.servers:
            servers.append(subprocess.Popen(group.argv, start_new_session=True,
                                            env={**env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, group.gpus))}))
        for url, server in zip(layout.urls, servers, strict=True):
            wait_healthy(f"{url}/health", server, args.vllm_timeout)
        learner = layout.learner
        status = subprocess.call(learner.argv, env={**env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, learner.gpus))})
    finally:
        for server in servers:
            stop(server)
        if args.push_to and Path(args.output_dir).is_dir():
            push(args.output_dir, args.push_to)
    return status


def push(output_dir: str, repo: str) -> None:
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo, exist_ok=True, private=True)
    api.upload_folder(repo_id=repo, folder_path=output_dir, path_in_repo=Path(output_dir).name)
    print(f"launcher: uploaded {output_dir} to {repo}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    for mode in ("submit", "run"):
        sub = modes.add_parser(mode)
        sub.add_argument("--model", required=True, help="hub id served by vLLM and trained")
        sub.add_argument("--tasks", required=True, help="a local task directory (shipped with the job) or "
                                                        "hf://<owner>/<dataset>")
        sub.add_argument("--inference-gpus", type=int, default=None,
                         help="GPUs for vLLM, the rest train (default: half: 1 of 2, 2 of 4, 4 of 8)")
        sub.add_argument("--tensor-parallel-size", type=int, default=1,
                         help="GPUs per vLLM replica (default: 1; 2 or more for a 32B model on 80 GB cards)")
        sub.add_argument("--data-parallel", choices=("servers", "vllm"), default="servers",
                         help="replicas as one vLLM server each (default; one failing is taken out alone), or as "
                              "one server with vLLM's --data-parallel-size; either way the proxy keeps a session on "
                              "one replica")
        sub.add_argument("--vllm-args", default="", help="extra vLLM arguments (one shell-quoted string)")
        sub.add_argument("--output-dir", default=f"{WORK}/run")
        sub.add_argument("--push-to", default=None, help="Hub repo that receives the run directory")
        sub.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
        sub.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then flags for `harness-rl train`")
    submit_parser, run_parser = modes.choices["submit"], modes.choices["run"]
    submit_parser.add_argument("--flavor", default="h200x2")
    submit_parser.add_argument("--package", default=LOCAL_PACKAGE,
                               help="pip requirement that installs harness-rl in the job (default: local, this "
                                    f"checkout built into a wheel, with the {EXTRAS} extras)")
    submit_parser.add_argument("--no-push", action="store_true", help="submit without --push-to (outputs are lost)")
    submit_parser.add_argument("--timeout", default="4h")
    submit_parser.add_argument("--image", default=None, help="container image (needs Node.js for opencode/Claude)")
    submit_parser.set_defaults(handler=submit, gpus=None)
    run_parser.add_argument("--gpus", type=int, required=True, help="GPUs of the job's flavor")
    run_parser.add_argument("--wheel", default=None, help="the wheel submit shipped (installed by uv before start)")
    run_parser.add_argument("--vllm-timeout", type=float, default=1800.0)
    run_parser.set_defaults(handler=run, flavor="")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.train_args[:1] == ["--"]:
        args.train_args = args.train_args[1:]
    if "--tasks" in args.train_args or "--engine" in args.train_args:
        raise SystemExit("launcher: give --tasks to the launcher, not after `--`; the engines are its vLLM servers")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
