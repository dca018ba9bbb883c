"""`harness-rl train`: the embedded default learns, resumes where it stopped, and survives Ctrl-C cleanly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness_rl.cli import main
from harness_rl.learner.checkpoint import checkpoint_dir
from harness_rl.run.config import load_file, resolve
from harness_rl.run.train import restored_rollouts

TRAIN = [sys.executable, "-m", "harness_rl.cli", "train"]


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def session_logs(output_dir: Path) -> list[str]:
    return [path.read_text() for path in (output_dir / "proxy").glob("*.jsonl")]


@pytest.mark.slow
def test_the_default_run_learns_the_demo_task(tmp_path: Path) -> None:
    out = tmp_path / "run"
    started = time.monotonic()
    done = subprocess.run([*TRAIN, "--output-dir", str(out)], capture_output=True, text=True, timeout=600)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    print(f"default run: {took:.0f}s, reward {summary['reward_first_steps']:.3f} -> {summary['reward_last_steps']:.3f}")
    # once every answer earns the same reward a group teaches nothing: that step skips the update
    trained = [row for row in read_metrics(out) if row["batch/trained_tokens_per_step"] > 0]
    assert summary["steps"] == 40 and summary["policy_version"] == len(trained) >= 10
    assert summary["reward_first_steps"] < 0.15
    assert summary["reward_last_steps"] > summary["reward_first_steps"] + 0.4
    assert (out / "training.png").stat().st_size > 10_000
    final = checkpoint_dir(out, 40) / "model"
    assert (final / "config.json").is_file() and (final / "tokenizer.json").is_file()
    assert "mean reward over the first/last 3 steps" in done.stdout
    assert all('"kind":"closed"' in log for log in session_logs(out))
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    traces = sorted((out / "traces").glob("*.json"))
    assert len(records) == 40 * 8 and len(traces) == len(records) == len({r["rollout_id"] for r in records})
    assert main(["traces", "validate", *map(str, traces)]) == 0
    assert {r["step"] for r in records} == set(range(1, 41))


@pytest.mark.slow
def test_the_same_seed_gives_the_same_rewards_step_by_step(tmp_path: Path) -> None:
    """The demo runs in lockstep and every rollout's session is seeded: two runs with --seed 3 sample the
    same tokens and get the same reward at every step (the embedded engine's sampling ignores its batch)."""
    rewards, samples = [], []
    for attempt in ("a", "b"):
        out = tmp_path / attempt
        done = subprocess.run([*TRAIN, "--seed", "3", "--max-steps", "8", "--output-dir", str(out),
                               "--report-to", "none"], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        rewards.append([row["reward"] for row in read_metrics(out)])
        records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
        samples.append(sorted((r["step"], r["group_id"], r["reward"]) for r in records))
    assert rewards[0] == rewards[1] and len(rewards[0]) == 8
    assert samples[0] == samples[1]


@pytest.mark.slow
def test_resume_continues_the_step_count_and_the_task_cursor(tmp_path: Path) -> None:
    out = tmp_path / "run"
    common = [*TRAIN, "--output-dir", str(out), "--num-generations", "4", "--max-concurrent-rollouts", "4",
              "--save-every", "1"]
    first = subprocess.run([*common, "--max-steps", "2"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    state = _checkpoint_state(checkpoint_dir(out, 2))
    assert state["step"] == 2 and restored_rollouts(state["extra"]).next_group >= 2
    second = subprocess.run([*common, "--max-steps", "4", "--resume"], capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert [int(row["step"]) for row in read_metrics(out)] == [1, 2, 3, 4]
    resumed = _checkpoint_state(checkpoint_dir(out, 4))
    assert restored_rollouts(resumed["extra"]).next_group > restored_rollouts(state["extra"]).next_group


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) for every live process (zombies are dead, only not yet reaped)."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            table[int(stat.parent.name)] = (int(fields[1]), fields[19])
    return table


def descendants(root: int) -> dict[int, str]:
    """Every process below `root`, with its start time (so a reused pid is not mistaken for it)."""
    table = _process_table()
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, started) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = started
                frontier.append(pid)
    return found


def alive(pid: int, started: str) -> bool:
    entry = _process_table().get(pid)
    return entry is not None and entry[1] == started


def _checkpoint_state(path: Path) -> dict:
    import torch

    from harness_rl.learner.checkpoint import STATE_FILE

    return torch.load(path / STATE_FILE, weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("save_every", [1, 0])
def test_ctrl_c_closes_every_session_and_sandbox_and_keeps_the_checkpoint(tmp_path: Path, save_every: int) -> None:
    out = tmp_path / "run"
    # A shell without job control starts background commands with SIGINT ignored, and Python then never turns
    # it into KeyboardInterrupt: the run starts with SIGINT's default, as from a terminal
    process = subprocess.Popen([*TRAIN, "--output-dir", str(out), "--max-steps", "1000", "--save-every",
                                str(save_every)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in process.stdout:  # type: ignore[union-attr]
            if line.startswith("step 2 "):
                break
        children: dict[int, str] = {}
        deadline = time.monotonic() + 120
        while not children and time.monotonic() < deadline:  # the next group's agents are running (lockstep:
            children = descendants(process.pid)  # they start once step 2's weights are in)
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        output = process.communicate(timeout=120)[0]
    finally:
        process.kill()
    assert process.returncode == 130, output[-3000:]
    assert "interrupted" in output and "Traceback" not in output
    logs = session_logs(out)
    assert logs and all('"kind":"closed"' in log for log in logs)
    assert children and [pid for pid in children if alive(pid, children[pid])] == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] >= 2 and (out / "training.png").is_file() and summary["stopped"] == "interrupted"
    # with or without periodic checkpoints, the stop saves the last step it finished
    checkpoints = sorted((out / "checkpoints").iterdir())
    assert checkpoints and not any(path.name.endswith(".partial") for path in checkpoints)
    assert _checkpoint_state(checkpoints[-1])["step"] == summary["steps"] >= 2
    assert f"checkpoint {checkpoints[-1]} (step {summary['steps']}): continue with" in output


@pytest.mark.slow
def test_a_run_that_cannot_go_on_stops_with_one_line_and_says_why_in_its_summary(tmp_path: Path) -> None:
    """Every rollout of step 1 fails for a setup reason (sandbox options that cannot work together): the run
    stops (exit 1) naming it, and summary.json records why it stopped."""
    config = tmp_path / "run.toml"
    config.write_text('[rollouts]\nsandbox_options = {isolation = "none", network = "proxy-only"}\n')
    out = tmp_path / "run"
    done = subprocess.run([*TRAIN, "--config", str(config), "--output-dir", str(out), "--report-to", "none"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    reason = "every rollout of step 1 failed for a setup reason: SandboxError: network='proxy-only' needs bubblewrap"
    assert f"harness-rl train: stopped: {reason}" in done.stderr and "Traceback" not in done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"].startswith(f"RunStopped: {reason}") and summary["steps"] == 0


@pytest.mark.slow
def test_a_run_whose_engine_dies_stops_with_one_line_naming_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The engine (served in its own process) is killed once a step is done: the run stops, saying so, instead of
    failing every rollout against it."""
    import re

    from harness_rl.learner.weight_sync import free_port
    from harness_rl.tools.vllm_server import health_failure

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = subprocess.Popen([sys.executable, "-m", "harness_rl.cli", "serve", "engine", "--model",
                               str(tiny_model_dir), "--served-model-name", "tiny", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = tmp_path / "run"
    try:
        deadline = time.monotonic() + 300  # bounds on failure only
        while health_failure(url) is not None:
            assert engine.poll() is None and time.monotonic() < deadline, "the engine never answered"
            time.sleep(0.5)
        run = subprocess.Popen([*TRAIN, "--preset", "demo", "--engine", url, "--model", str(tiny_model_dir),
                                "--max-steps", "1000", "--save-every", "0", "--output-dir", str(out)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
            time.sleep(0.5)
        engine.kill()
        engine.wait()
        stderr = run.communicate(timeout=300)[1]
    finally:
        engine.kill()
    assert run.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    assert re.fullmatch(rf"harness-rl train: stopped: the engine at {url} is gone: GET {url}/health failed: "
                        r"\[Errno \d+\] Connection (refused|reset by peer)", stderr.strip().splitlines()[-1])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"].startswith(f"RunStopped: the engine at {url} is gone: ") and summary["steps"] >= 1


def test_config_file_sets_defaults_and_flags_override(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[rollouts]\nharness = "opencode"\n[learner]\nmax-steps = 7\nlearning_rate = 0.5\n')
    config = resolve(load_file(path), {"learner": {"max_steps": 9}})
    assert (config.rollouts.harness, config.learner.max_steps, config.learner.learning_rate) == ("opencode", 9, 0.5)
    assert config.preset == "demo" and config.engine.model == "tiny"
    assert resolve({"engine": {"model": "/models/qwen"}}).learner.learning_rate == 1e-6


def test_the_real_preset_never_inherits_demo_settings() -> None:
    real = resolve({"engine": {"model": "Qwen/Qwen3-8B", "engine": "http://127.0.0.1:8000"}})
    assert real.preset == "real"
    assert real.rollouts.max_tokens_per_turn is None
    assert real.learner.learning_rate == 1e-6 and real.learner.loss.decoupled is True
    assert real.rollouts.tasks == "" and real.rollouts.harness == "opencode"
    demo = resolve({})
    assert (demo.preset, demo.engine.model, demo.rollouts.harness) == ("demo", "tiny", "echo")
    assert demo.rollouts.max_tokens_per_turn == 16 and demo.learner.learning_rate == 1e-2
    assert resolve({"preset": "real", "engine": {"model": "tiny"}}).rollouts.max_tokens_per_turn is None


def test_print_config_shows_no_cap_for_a_real_model_and_loads_back(tmp_path: Path) -> None:
    done = subprocess.run([*TRAIN, "--print-config", "--model", "Qwen/Qwen3-8B", "--engine", "http://127.0.0.1:8000"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "# max_tokens_per_turn = none" in done.stdout and "max_tokens_per_turn = 16" not in done.stdout
    for flags in ([], ["--model", "Qwen/Qwen3-8B", "--num-generations", "4", "--max-tokens-per-turn", "none"],
                  ["--preset", "real", "--model", "tiny", "--temperature", "0.7"]):
        printed = main_output(["train", "--print-config", *flags])
        path = tmp_path / "printed.toml"
        path.write_text(printed)
        assert main_output(["train", "--print-config", "--config", str(path)]) == printed


def main_output(argv: list[str]) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def test_every_flag_shows_its_fields_default_in_help() -> None:
    from harness_rl.commands.train import FLAGS
    from harness_rl.flags import show

    text = " ".join(main_help(["train", "--help"]).split())
    for flag in FLAGS:
        assert flag.name in text
        assert f"(default: {' '.join(show(flag.default).split())}" in text, flag.name
    assert "(default: 1e-06; demo preset: 0.01; agent preset: 0.001)" in text


def main_help(argv: list[str]) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(argv)
    return out.getvalue()


@pytest.mark.parametrize("flags, setting", [
    (["--tasks", "/nonexistent"], "--tasks"),
    (["--harness", "nosuch"], "--harness"),
    (["--model", "nosuch"], "--model"),
    (["--num-generations", "0"], "--num-generations"),
    (["--num-generations", "1"], "--num-generations"),
    (["--sandbox", "nosuch"], "--sandbox"),
    (["--sandbox", "harbor"], "--sandbox"),
    (["--max-steps", "-1"], "--max-steps"),
    (["--max-steps", "many"], "--max-steps"),
    (["--learning-rate", "0"], "--learning-rate"),
    (["--engine", "gpu-box"], "--engine"),
    (["--engine", "http://127.0.0.1:9", "--engine", "embedded"], "--engine"),
    (["--engine", "http://127.0.0.1:9", "--engine", "http://127.0.0.1:9/"], "--engine"),
    (["--engine", "http://127.0.0.1:9"], "--engine"),  # tiny is built for it; nothing answers there
    (["--weight-sync", "nccl"], "--weight-sync"),
    (["--temperature", "none"], "--temperature"),
    (["--resume"], "--resume"),
    (["--config", "/nonexistent.toml"], "--config"),
    (["--lr-scheduler", "cosine", "--warmup-steps", "50"], "--lr-scheduler"),
    (["--report-to", "wandb"], "--report-to"),
    # mistakes a new user made: a mistyped task directory (never taken for a hub id), an agent CLI not installed
    (["--tasks", "examples/taskz"], "--tasks"),
    (["--tasks", str(Path(__file__).resolve().parents[1] / "examples" / "tasks"), "--harness", "opencode",
      "--model", "tiny"], "--harness"),
])
def test_each_bad_setting_is_one_line_exit_2_offline_and_leaves_no_run_folder(
        tmp_path: Path, flags: list[str], setting: str) -> None:
    """One line naming the flag, exit 2, no run folder, and no network connection attempted (any attempt
    to reach beyond loopback is recorded by a sitecustomize hook and fails the test)."""
    if setting == "--sandbox" and flags[-1] == "harbor" and sys.version_info >= (3, 12):
        pytest.skip("harbor is allowed on Python 3.12")
    hook, attempts = tmp_path.parent / f"{tmp_path.name}-hook", tmp_path.parent / f"{tmp_path.name}-network"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(NETWORK_TRAP.format(log=str(attempts)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), *sys.path]),
           "HARNESS_RL_TOOLS_DIR": str(tmp_path.parent / f"{tmp_path.name}-no-tools")}
    done = subprocess.run([*TRAIN, *flags], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and setting in lines[0], done.stderr
    assert not attempts.exists(), attempts.read_text()
    assert os.listdir(tmp_path) == []


NETWORK_TRAP = """
import socket
_connect = socket.socket.connect
def connect(self, address, *args):
    if isinstance(address, tuple) and address[0] not in ("127.0.0.1", "localhost", "::1"):
        with open({log!r}, "a") as log:
            log.write(repr(address) + "\\n")
    return _connect(self, address, *args)
socket.socket.connect = connect
"""


def test_an_existing_run_is_never_overwritten(tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text("")
    assert main(["train", "--output-dir", str(tmp_path / "old")]) == 2
    assert main(["train", "--resume", "--output-dir", str(tmp_path / "old")]) == 2
    assert os.listdir(tmp_path / "old") == ["metrics.jsonl"]


@pytest.mark.slow
def test_train_with_the_real_opencode_cli_runs_to_the_end(tmp_path: Path) -> None:
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("npm/node are not installed: opencode cannot be installed")
    root = Path(__file__).resolve().parent.parent
    subprocess.run([str(root / "scripts" / "install_agents.sh")], check=True, capture_output=True, timeout=900)
    out = tmp_path / "run"
    done = subprocess.run([*TRAIN, "--harness", "opencode", "--model", "tiny", "--max-steps", "2",
                           "--output-dir", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert [int(row["step"]) for row in read_metrics(out)] == [1, 2]
    # two groups of 8; each opencode run's agent call (the one offering tools) is captured. Its title call
    # is opencode's own background request, which it sometimes drops on exit: not counted.
    traces = [json.loads(path.read_text()) for path in (out / "traces").glob("*.json")]
    assert len(traces) == 16 and all(any(turn.get("tools") for turn in trace["turns"]) for trace in traces)


@pytest.mark.slow
@pytest.mark.parametrize(("harness", "dialect"), [("codex", "openai_responses"), ("gemini-cli", "google_gemini")])
def test_train_with_the_responses_and_gemini_clis_runs_to_the_end(tmp_path: Path, harness: str, dialect: str) -> None:
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip(f"npm/node are not installed: {harness} cannot be installed")
    root = Path(__file__).resolve().parent.parent
    subprocess.run([str(root / "scripts" / "install_agents.sh")], check=True, capture_output=True, timeout=900)
    out = tmp_path / "run"
    done = subprocess.run([*TRAIN, "--harness", harness, "--model", "tiny", "--max-steps", "1",
                           "--output-dir", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert [int(row["step"]) for row in read_metrics(out)] == [1]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 8 and all(r["error"] is None and r["reward"] is not None for r in rollouts)
    for rollout in rollouts:
        turns = json.loads((out / rollout["trace"]).read_text())["turns"]
        assert turns and all(t["metadata"]["dialect"] == dialect for t in turns)


def test_the_proxy_of_a_run_knows_the_models_vocabulary(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    from harness_rl.run.models import vocab_size

    assert vocab_size(tiny_model_dir) == AutoConfig.from_pretrained(tiny_model_dir).vocab_size > 0
    (tmp_path / "config.json").write_text('{"text_config": {"vocab_size": 151936}}')  # a multimodal model's layout
    assert vocab_size(tmp_path) == 151936
    assert vocab_size(tmp_path / "missing") is None
