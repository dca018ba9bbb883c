"""Mistakes a user makes, each run as the real command: exit 2 (found before anything starts) or 1 (after), at
most two lines on stderr naming the problem and its fix, and nothing left behind (the working directory as it
was, no process of the command's session alive).

The table has one row per mistake: the command line, the exit code, a fragment of the message. `{name}` in
either is filled in from `PLACES` (paths in the working directory, servers this module runs); rows that need
an environment say so. Mistakes caught before the engine starts take about a second each (the CLI's import
cost); the few that need a started stack are the slow tests at the end.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import shlex
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

if TYPE_CHECKING:
    from harness_rl.engine import Engine

CLI = [sys.executable, "-m", "harness_rl.cli"]
EXAMPLE_TASKS = Path(__file__).resolve().parents[1] / "examples" / "tasks"
# What every row's working directory holds before the command runs (and must hold, unchanged, after it).
WORKDIR = {
    "afile": "not a directory\n",
    "empty/": "",
    "notoml.toml": "engine = [\n",
    "unknown.toml": "[learner]\nlearning_rat = 0.1\n",
    "wrongtype.toml": '[learner]\nmax_steps = "many"\n',
    "evaluated/eval.json": "{}\n",
}
OFFLINE = {"HF_HUB_OFFLINE": "1"}


@dataclass(frozen=True)
class Mistake:
    command: str  # as typed after `harness-rl`, with `{place}`s
    code: int
    fragment: str  # a part of the message that names the problem or its fix, with `{place}`s
    env: dict[str, str] = field(default_factory=dict)  # `{place}`s allowed in values


MISTAKES: dict[str, Mistake] = {
    # flags and values
    "unknown flag": Mistake("train --bogus", 2, "unrecognized arguments: --bogus"),
    "not a number": Mistake("train --max-steps many", 2, "argument --max-steps: expected int, got 'many'"),
    "negative steps": Mistake("train --max-steps -1", 2, "--max-steps: expected int >= 1"),
    "one generation": Mistake("train --num-generations 1", 2, "--num-generations: expected int >= 2"),
    "zero learning rate": Mistake("train --learning-rate 0", 2, "--learning-rate: expected float > 0"),
    "negative staleness": Mistake("train --max-staleness -1", 2, "--max-staleness: expected int >= 0"),
    "unknown preset": Mistake("train --preset nosuch", 2, "argument --preset: invalid choice: 'nosuch'"),
    "processes not a number": Mistake("train --nproc-per-node x", 2,
                                      "argument --nproc-per-node: expected int, got 'x'"),
    "no processes": Mistake("train --nproc-per-node 0", 2, "--nproc-per-node: expected int >= 1"),
    "no temperature": Mistake("train --temperature none", 2, "--temperature: training needs one pinned sampling "
                                                             "temperature"),
    "schedule ends in warmup": Mistake("train --lr-scheduler cosine --warmup-steps 50", 2,
                                       "--lr-scheduler: a cosine schedule needs --max-steps greater than "
                                       "--warmup-steps"),
    "unknown metrics backend": Mistake("train --report-to nosuch", 2, "unknown --report-to backend 'nosuch': "
                                                                      "choose from jsonl"),
    "reward function not importable": Mistake("train --reward-fn nosuch:score", 2,
                                              "--reward-fn: cannot import 'nosuch' for nosuch:score"),
    "sync the embedded engine cannot take": Mistake("train --weight-sync nccl", 2,
                                                    "--weight-sync: 'nccl' does not fit --engine embedded; use one "
                                                    "of auto, inprocess, none"),
    "GPU sharing with no GPU": Mistake("train --engine http://127.0.0.1:9 --weight-sync ipc", 2,
                                       "--weight-sync: ipc shares a CUDA GPU with vLLM, and torch sees none on this "
                                       "machine: on CPUs use gloo or reload"),
    "GPU sharing with two learners": Mistake("train --engine http://127.0.0.1:9 --weight-sync ipc --nproc-per-node 2",
                                             2, "--weight-sync: ipc shares one GPU between vLLM and one learner "
                                                "process, not 2: use nccl"),
    "device not a name": Mistake("train --device gpu", 2, "--device: 'gpu' is not a device: use auto, cpu, cuda, "
                                                          "cuda:N or mps"),
    "a CUDA device not here": Mistake("train --device cuda:99", 2, "--device: cuda:99: torch sees"),
    "no Apple GPU": Mistake("train --device mps", 2, "--device: mps: this machine has no Apple GPU (MPS)"),
    # harnesses and sandboxes
    "unknown harness": Mistake("train --harness nosuch", 2, "'nosuch' is not a harness; `harness-rl harnesses` "
                                                            "lists them all"),
    "agent CLI not installed": Mistake("train --harness opencode", 2, "--harness: opencode: npm opencode-ai@",
                                       {"HARNESS_RL_TOOLS_DIR": "{workdir}/no-tools"}),
    "built model for another harness": Mistake("train --model tiny-agent --harness echo", 2,
                                               "--model: tiny-agent is built for mini-swe-agent"),
    "harbor on an old Python": Mistake("train --sandbox harbor", 2, "--sandbox: harbor needs Python >= 3.12"),
    "unknown sandbox": Mistake("train --sandbox nosuch", 2, "argument --sandbox: invalid choice: 'nosuch'"),
    "cloud sandbox without a public URL": Mistake("train --sandbox e2b", 2, "--advertise-url: an e2b sandbox needs "
                                                                          "a public URL"),
    "cloud sandbox given loopback": Mistake("train --sandbox e2b --advertise-url http://127.0.0.1:8100", 2,
                                            "http://127.0.0.1:8100 is this machine's loopback, which an e2b "
                                            "sandbox cannot reach"),
    "cloud sandbox without a key": Mistake("train --sandbox e2b --advertise-url https://proxy.example", 2,
                                           "--sandbox: e2b creates sandboxes only with an API key: set E2B_API_KEY",
                                           {"E2B_API_KEY": ""}),
    # models and engines
    "unknown model": Mistake("train --model nosuch", 2, "'nosuch' is neither one of tiny, tiny-agent nor a local "
                                                        "model directory"),
    "model folder without config.json": Mistake("train --model empty", 2, "empty is neither a model directory (no "
                                                                          "config.json)"),
    "hub id without an engine": Mistake("train --model Qwen/Qwen3-8B", 2,
                                        "Qwen/Qwen3-8B is a hub id, which an engine at a URL serves: start vLLM "
                                        "with `harness-rl serve vllm DIR`"),
    "hub id for a vLLM started here": Mistake("train --engine vllm --model Qwen/Qwen3-8B", 2,
                                              "--engine vllm starts vLLM on a local directory only"),
    "engine neither kind nor URL": Mistake("train --engine gpu-box", 2, "'gpu-box' is neither embedded, vllm nor an "
                                                                        "http(s) URL"),
    "engines of two kinds": Mistake("train --engine {refusing} --engine embedded", 2,
                                    "several engines must all be http(s) URLs of running engines, not 'embedded'"),
    "engine given twice": Mistake("train --engine {refusing} --engine {refusing}/", 2, "{refusing} is given twice"),
    "engine not started": Mistake("train --engine {refusing} --model tiny", 2,
                                  "--engine: {refusing} is not reachable (GET /v1/models: [Errno 111] Connection "
                                  "refused): start the engine there, or correct the URL"),
    "engine URL of a web server": Mistake("train --engine {web} --model tiny", 2,
                                          "--engine: {web} answered HTTP 404 on GET /v1/models: not an inference "
                                          "engine (is it the proxy, or a wrong port?)"),
    "engine URL answering JSON": Mistake("train --engine {web}/json --model tiny", 2,
                                         "{web}/json answered GET /v1/models without a model list: not an "
                                         "inference engine"),
    "engine URL of the proxy": Mistake("train --engine {proxy} --model tiny", 2,
                                       "{proxy} answered HTTP 401 on GET /v1/models: not an inference engine (is "
                                       "it the proxy"),
    "eval against no engine": Mistake("eval --engine {web} --model tiny", 2, "{web} answered HTTP 404"),
    "doctor without an engine": Mistake("doctor", 2, "the following arguments are required: --engine"),
    "serve a model that is not there": Mistake("serve engine --model nosuch --port 0", 2,
                                               "--model nosuch: model directory nosuch does not exist"),
    "build an unknown model": Mistake("build-model nosuch", 2, "argument name: invalid choice: 'nosuch'"),
    # paths and files
    "output dir is a file": Mistake("train --output-dir afile", 2, "--output-dir: {workdir}/afile is a file: name "
                                                                  "a directory (it is made if missing)"),
    "output dir inside a file": Mistake("train --output-dir afile/run", 2,
                                        "{workdir}/afile is a file (on the way to afile/run)"),
    "eval output dir is a file": Mistake("eval --output-dir afile", 2, "--output-dir: {workdir}/afile is a file"),
    "eval output holds an evaluation": Mistake("eval --output-dir evaluated", 2,
                                               "evaluated already holds an evaluation; choose another directory"),
    "eval baseline missing": Mistake("eval --baseline nosuch", 2, "--baseline: no evaluation at nosuch"),
    "eval no samples": Mistake("eval --num-samples 0", 2, "--num-samples: expected int >= 1"),
    "resume without a run": Mistake("train --resume", 2, "--resume: needs --output-dir"),
    "config file missing": Mistake("train --config nosuch.toml", 2, "--config: cannot read nosuch.toml"),
    "config file not TOML": Mistake("train --config notoml.toml", 2, "--config: notoml.toml is not valid TOML"),
    "config key unknown": Mistake("train --config unknown.toml", 2,
                                  "--config: unknown.toml: unknown setting learner.learning_rat"),
    "config value of a wrong type": Mistake("train --config wrongtype.toml", 2, "--max-steps: expected int"),
    "sft without its settings": Mistake("sft", 2, "--traces, --model, --output-dir: required"),
    "sft traces missing": Mistake("sft --traces nosuch --model tiny --output-dir out", 2,
                                  "no trace files match 'nosuch'"),
    "sft output a file": Mistake("sft --traces nosuch --model tiny --output-dir afile", 2,
                                 "--output-dir afile is a file: name a new directory"),
    "proxy engine not a URL": Mistake("serve proxy --upstream nonsense", 2,
                                      "--upstream: engine 'nonsense' is not an http(s) URL"),
    "traces action unknown": Mistake("traces inspect x", 2, "invalid choice: 'inspect'"),
    # tasks
    "tasks folder missing": Mistake("train --tasks nosuch", 2, "--tasks: no task directory 'nosuch'"),
    "tasks path mistyped": Mistake("train --tasks examples/taskz", 2, "no task directory 'examples/taskz' (a "
                                                                      "Hugging Face dataset is written "
                                                                      "hf://examples/taskz)"),
    "tasks is a file": Mistake("train --tasks afile", 2, "--tasks: afile is a file; give a Harbor task directory"),
    "tasks folder empty": Mistake("train --tasks empty", 2, "empty holds no Harbor tasks"),
    "eval tasks missing": Mistake("eval --tasks nosuch", 2, "--tasks: no task directory 'nosuch'"),
    "dataset id malformed": Mistake("train --tasks hf://justone", 2, "'hf://justone' is not a dataset repo id"),
    "dataset offline": Mistake("train --tasks hf://someorg/tasks", 2,
                               "could not download dataset 'someorg/tasks' from the Hugging Face Hub: it is not "
                               "downloaded yet and HF_HUB_OFFLINE is set: unset it", OFFLINE),
    "dataset hub unreachable": Mistake("train --tasks hf://someorg/tasks", 2,
                                       "Connection refused: check the network (or HF_ENDPOINT), or pass the tasks' "
                                       "directory", {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "{refusing}"}),
    "dataset not on the hub": Mistake("train --tasks hf://someorg/tasks", 2,
                                      "from the Hugging Face Hub: no such dataset (a private one needs a login",
                                      {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "{web}/missing"}),
    "dataset gated": Mistake("eval --tasks hf://someorg/tasks", 2, "it is gated: accept its terms on huggingface.co",
                             {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "{web}/gated"}),
    # ports
    "proxy port busy": Mistake("train --proxy-port {busy}", 2, "--proxy-port: port {busy} on 127.0.0.1 is in use "
                                                               "(another run or proxy?): choose another, or 0"),
    "eval proxy port busy": Mistake("eval --proxy-port {busy}", 2, "--proxy-port: port {busy} on 127.0.0.1 is in "
                                                                   "use"),
    "proxy port out of range": Mistake("train --proxy-port 70000", 2, "--proxy-port: expected int <= 65535"),
    "proxy host not this machine's": Mistake("train --proxy-host 192.0.2.1", 2,
                                             "--proxy-host: cannot listen on 192.0.2.1"),
    "proxy host unknown": Mistake("train --proxy-host nohost.invalid", 2,
                                  "--proxy-host: 'nohost.invalid' is no address of this machine"),
    "serve proxy on a busy port": Mistake("serve proxy --port {busy} --upstream {refusing}", 1,
                                          "address already in use"),
}


class _Web(http.server.BaseHTTPRequestHandler):
    """Not an engine: 404 everywhere, JSON that is no model list under /json, and a Hub that refuses a dataset
    under /missing (not found) and /gated (gated), as huggingface.co does."""

    def do_GET(self) -> None:
        hub = next((code for prefix, code in (("/missing/", "RepoNotFound"), ("/gated/", "GatedRepo"))
                    if self.path.startswith(prefix)), None)
        status = 200 if self.path.startswith("/json/") else 403 if hub == "GatedRepo" else 401 if hub else 404
        body = b'{"object": "list"}' if status == 200 else b'{"error": "no"}'
        self.send_response(status)
        if hub:
            self.send_header("X-Error-Code", hub)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _web() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Web)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """What `{place}`s name: a URL nothing listens on, a web server that is no engine, a real proxy, a busy port."""
    from fake_engine import FakeEngine, run_fake_engine

    from harness_rl.run.stack import serve_proxy
    from proxy.config import ProxyConfig

    with contextlib.ExitStack() as stack:
        refusing = stack.enter_context(socket.socket())  # bound, never listening: every connection refused
        refusing.bind(("127.0.0.1", 0))
        busy = stack.enter_context(socket.socket())
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        engine = stack.enter_context(run_fake_engine(FakeEngine()))
        proxy = stack.enter_context(serve_proxy(ProxyConfig(upstream=engine, store_dir=str(
            tmp_path_factory.mktemp("proxy-store")))))
        yield {"refusing": f"http://127.0.0.1:{refusing.getsockname()[1]}", "web": stack.enter_context(_web()),
               "proxy": proxy.url, "busy": str(busy.getsockname()[1])}


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` and its bytes (None for a folder)."""
    return {str(path.relative_to(root)): None if path.is_dir() else path.read_bytes() for path in root.rglob("*")}


def run_cli(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    """The command in a session of its own; no process of that session may outlive it."""
    process = subprocess.Popen([*CLI, *argv], cwd=cwd, env={**os.environ, **env}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    finally:
        left = [p for p in psutil.process_iter(["pid", "cmdline"]) if _session(p.pid) == process.pid]
        for child in left:
            child.kill()
    assert not left, f"left running: {[p.info for p in left]}"
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:  # gone already, or not ours to ask
        return None


def assert_one_mistake(done: subprocess.CompletedProcess, code: int, fragment: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code, done.stderr[-3000:]
    assert 1 <= len(lines) <= 2 and fragment in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("mistake", MISTAKES.values(), ids=MISTAKES.keys())
def test_a_mistake_is_one_line_with_its_fix_and_leaves_nothing(mistake: Mistake, places: dict[str, str],
                                                               tmp_path: Path) -> None:
    if mistake.command == "train --sandbox harbor" and sys.version_info >= (3, 12):
        pytest.skip("harbor runs on Python 3.12")
    workdir = tmp_path / "work"
    for name, text in WORKDIR.items():
        path = workdir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith("/"):
            path.mkdir()
        else:
            path.write_text(text)
    filled = {**places, "workdir": str(workdir)}
    before = tree(workdir)
    env = {"HF_HUB_OFFLINE": "1", **{key: value.format(**filled) for key, value in mistake.env.items()}}
    done = run_cli(shlex.split(mistake.command.format(**filled)), workdir, env)
    assert_one_mistake(done, mistake.code, mistake.fragment.format(**filled))
    assert tree(workdir) == before


def test_the_table_holds_forty_mistakes_of_every_kind() -> None:
    commands = {mistake.command.split()[0] for mistake in MISTAKES.values()}
    assert len(MISTAKES) >= 40 and {"train", "eval", "serve", "sft", "traces", "doctor"} <= commands


# ---------------------------------------------------------------------------------------------
# Mistakes found once the stack has started, and what used to be one.


@pytest.mark.slow
def test_an_engine_without_the_capture_flags_stops_the_run_in_one_line(engine: Engine, tmp_path: Path) -> None:
    """The engine answers but lacks --return-tokens-as-token-ids: found when the run's stack starts (exit 1),
    every failing check and its fix on one line, no run folder, no process left."""
    from harness_rl.engine import serve_in_thread

    with serve_in_thread(engine) as server:
        done = run_cli(["train", "--engine", server.url, "--model", "tiny", "--output-dir", "run"], tmp_path,
                       OFFLINE, timeout_s=600)
    assert_one_mistake(done, 1, f"harness-rl train: stopped: the engine at {server.url} cannot capture exactly: "
                                "token-id strings: logprob tokens are text")
    assert "(fix: add --return-tokens-as-token-ids)" in done.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_engine_url_with_the_tiny_model_trains_the_model_built_offline(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`--engine URL --model tiny` used to be refused: the learner now trains the tiny model built offline (seed 0,
    as the engine serves it), and after a sync the engine samples what the learner computes."""
    import json

    from harness_rl.engine import Engine, serve_in_thread

    served = Engine.from_pretrained(tiny_model_dir, served_model_name="tiny")  # its weights change: not `engine`
    try:
        with serve_in_thread(served, return_tokens_as_token_ids=True) as server:
            done = run_cli(["train", "--engine", server.url, "--model", "tiny", "--max-steps", "2", "--output-dir",
                            "run", "--report-to", "none"], tmp_path, OFFLINE, timeout_s=600)
    finally:
        served.close()
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [step["step"] for step in steps] == [1, 2]
    assert served.policy_version >= 1  # the learner's weights reached the engine at the URL
    synced = [step["sync/logp_difference_max"] for step in steps if "sync/logp_difference_max" in step]
    assert synced and max(synced) < 1e-4  # and the engine samples as the learner computes
