"""`harness-rl serve proxy` as a real process: SIGKILL and restart loses no answered turn; clean SIGTERM/SIGINT."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from proxy_agent import TOOLS

from harness_rl.trace import TrainingTrace

ADMIN = {"Authorization": "Bearer s3cret-admin-token"}


@contextmanager
def serve_proxy(upstream: str, store: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    token_file = store.parent / "admin-token"
    token_file.write_text("s3cret-admin-token\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "harness_rl.cli", "serve", "proxy", "--upstream", upstream, "--port", "0",
         "--store", str(store), "--admin-token-file", str(token_file), "--no-engine-check"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = process.stdout.readline()
        assert first.startswith("harness-rl proxy on "), first + process.stderr.read()
        assert "s3cret-admin-token" not in first  # the token itself is never printed
        yield process, first.split()[3]
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def trace(url: str, session_id: str) -> TrainingTrace:
    got = httpx.get(f"{url}/sessions/{session_id}/trace", headers=ADMIN)
    assert got.status_code == 200, got.text
    return TrainingTrace.from_json(got.content).validate()


def test_sigkill_and_restart_serve_every_completed_turn(fake_engine_server: tuple, fake_engine: object,
                                                        tmp_path: Path) -> None:
    upstream = fake_engine_server[1]
    with serve_proxy(upstream, tmp_path / "store") as (process, url):
        sessions = [httpx.post(f"{url}/sessions", headers=ADMIN, json={"metadata": {"n": i}}).json() for i in range(2)]
        for session in sessions:
            messages = [{"role": "user", "content": f"task {session['id']}"}]
            for step in range(3):
                got = httpx.post(f"{session['openai_base_url']}/chat/completions",
                                 json={"model": "m", "messages": messages, "tools": TOOLS},
                                 headers={"Authorization": f"Bearer {session['key']}"})
                assert got.status_code == 200
                messages += [got.json()["choices"][0]["message"], {"role": "user", "content": f"next {step}"}]
        before = {s["id"]: trace(url, s["id"]).to_json() for s in sessions}
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    with serve_proxy(upstream, tmp_path / "store") as (process, url):
        for session in sessions:
            assert trace(url, session["id"]).to_json() == before[session["id"]]
            assert [t.parent_id is None for t in trace(url, session["id"]).turns] == [True, False, False]
        key = sessions[0]["key"]
        again = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": "m", "messages": [{"role": "user", "content": "after restart"}]})
        assert again.status_code == 200
        assert len(trace(url, sessions[0]["id"]).turns) == 4


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_clean_shutdown_on_signal(fake_engine_server: tuple, tmp_path: Path, sig: signal.Signals) -> None:
    with serve_proxy(fake_engine_server[1], tmp_path / "store") as (process, url):
        assert httpx.get(f"{url}/health").status_code == 200
        process.send_signal(sig)
        assert process.wait(10) == 0
        assert "harness-rl proxy stopped" in process.stdout.read()


def test_proxy_modules_and_command_never_import_torch() -> None:
    code = ("import sys, proxy, proxy.server.app, proxy.client, harness_rl.commands.serve_proxy\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_serve_proxy_refuses_an_engine_that_cannot_capture_exactly(fake_engine_server: tuple, tmp_path: Path) -> None:
    """The doctor's start-up check: the fake engine has no processed top logprobs, no max_model_len, and its
    derender refuses ids it never sampled; each failure is one line, and nothing is served (exit 1)."""
    fake_engine = fake_engine_server[1]
    done = subprocess.run([sys.executable, "-m", "harness_rl.cli", "serve", "proxy", "--upstream", fake_engine,
                           "--port", "0", "--store", str(tmp_path / "store")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert f"the engine at {fake_engine} cannot capture exactly" in done.stderr
    failed = [line.split()[1:3] for line in done.stderr.splitlines() if line.strip().startswith("FAIL")]
    assert failed == [["processed", "logprobs"], ["max", "model"], ["token-in", "routes"]]


def test_serve_proxy_waits_for_an_engine_then_names_it_when_it_never_answers(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        silent = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, never listening: connection refused
        done = subprocess.run([sys.executable, "-m", "harness_rl.cli", "serve", "proxy", "--upstream", silent,
                               "--port", "0", "--store", str(tmp_path / "store"), "--engine-wait", "3"],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    [waiting] = done.stdout.splitlines()  # it listened meanwhile, and said so at start
    assert waiting.startswith("harness-rl proxy on http://127.0.0.1:")
    assert waiting.endswith(f", waiting for the engine at {silent}: 0 of 3 s")
    first, failed = done.stderr.splitlines()
    assert first == f"harness-rl serve proxy: the engine at {silent} cannot capture exactly:"
    assert failed.startswith("  FAIL  engine answers") and "GET /v1/models" in failed


def test_a_port_in_use_is_one_line_and_exit_1(fake_engine_server: tuple, tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "harness_rl.cli", "serve", "proxy", "--upstream", fake_engine_server[1],
             "--port", str(port), "--store", str(tmp_path / "store"), "--no-engine-check"], capture_output=True,
            text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"harness-rl serve proxy: [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
        "address already in use"]  # no "Unclosed client session" after it
