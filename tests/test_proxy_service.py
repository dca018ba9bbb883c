"""`harness-rl serve proxy` as a long-lived service, run as a real process: it listens while it waits for its
engine (and says so), and it keeps its admin token across restarts."""

from __future__ import annotations

import os
import queue
import re
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from harness_rl.engine import Engine, serve_in_thread
from harness_rl.learner.weight_sync import free_port

SERVE = [sys.executable, "-m", "harness_rl.cli", "serve", "proxy", "--port", "0"]
DEADLINE_S = 120.0  # bounds a failure only: each wait below ends as soon as its condition holds


class ProxyProcess:
    """`harness-rl serve proxy` in a child process, its stdout read line by line as it comes."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen([*SERVE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put("")  # the end

    def line(self) -> str:
        """The next line it prints (waiting up to DEADLINE_S)."""
        try:
            line = self.lines.get(timeout=DEADLINE_S)
        except queue.Empty:
            raise AssertionError("the proxy printed nothing in time") from None
        assert line, f"the proxy ended (exit {self.process.wait(10)}): {self.process.stderr.read()}"  # type: ignore[union-attr]
        return line

    def stop(self) -> str:
        """SIGTERM; its stderr, once it ended cleanly."""
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(DEADLINE_S) == 0
        return self.process.stderr.read()  # type: ignore[union-attr]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def url_of(line: str) -> str:
    """The proxy's URL in its "harness-rl proxy on URL ..." line."""
    assert line.startswith("harness-rl proxy on "), line
    return line.split()[3].rstrip(",")


def test_serve_proxy_listens_while_its_engine_loads_and_serves_once_it_is_up(engine: Engine,
                                                                            tmp_path: Path) -> None:
    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"  # nothing there yet: the engine is "loading"
    token_file = tmp_path / "token"
    token_file.write_text("admin-secret\n")
    admin = {"Authorization": "Bearer admin-secret"}
    proxy = ProxyProcess("--upstream", engine_url, "--store", str(tmp_path / "store"), "--admin-token-file",
                         str(token_file), "--engine-wait", "600")
    try:
        first = proxy.line()
        url = url_of(first)
        assert first == f"harness-rl proxy on {url}, waiting for the engine at {engine_url}: 0 of 600 s"
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503
        assert health.json()["status"] == "unavailable"
        assert health.json()["reason"].startswith(f"waiting for the engine at {engine_url}: ")
        assert health.json()["reason"].endswith(" of 600 s")
        session = httpx.post(f"{url}/sessions", headers=admin, json={}).json()  # the control API works meanwhile
        key = {"Authorization": f"Bearer {session['key']}"}
        chat = httpx.post(f"{session['openai_base_url']}/chat/completions", headers=key,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert chat.status_code == 503 and chat.headers["Retry-After"]
        assert chat.json()["error"]["message"].startswith(f"waiting for the engine at {engine_url}: ")
        messages = httpx.post(f"{session['anthropic_base_url']}/v1/messages", headers=key,
                              json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert messages.status_code == 503
        assert messages.json()["type"] == "error"  # Anthropic's error shape
        assert messages.json()["error"]["message"].startswith(f"waiting for the engine at {engine_url}: ")

        with serve_in_thread(engine, port=port, return_tokens_as_token_ids=True):
            serving = proxy.line()
            while "waiting for the engine" in serving:  # a line every 30 s until the engine answers
                serving = proxy.line()
            assert serving.startswith(f"harness-rl proxy on {url} -> {engine_url} "), serving
            assert proxy.line() == (f"harness-rl proxy: prompts are rendered in the proxy with the tokenizer and "
                                    f"chat template in {engine.model_root} (the engine's model directory)")
            assert httpx.get(f"{url}/health").status_code == 200
            assert httpx.get(f"{url}/health").json()["reason"] is None
            chat = httpx.post(f"{session['openai_base_url']}/chat/completions", headers=key, timeout=60,
                              json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                    "max_tokens": 4})
            assert chat.status_code == 200, chat.text
            assert proxy.stop() == ""  # the probe found the proxy's renders equal to the engine's: nothing to say
    finally:
        proxy.kill()


@pytest.mark.slow
def test_serve_proxy_says_its_wait_every_30_s(tmp_path: Path) -> None:
    """A line at start and one per 30 s, each with the seconds waited of --engine-wait (polled every 2 s)."""
    engine_url = f"http://127.0.0.1:{free_port()}"
    proxy = ProxyProcess("--upstream", engine_url, "--store", str(tmp_path / "store"))
    try:
        url = url_of(proxy.line())
        second = proxy.line()
        assert re.fullmatch(rf"harness-rl proxy on {url}, waiting for the engine at {engine_url}: 3[0-2] of 300 s",
                            second), second
        assert proxy.stop() == ""  # nothing on stderr: no probe of the engine is logged while the proxy waits
        assert proxy.line() == "harness-rl proxy stopped"
    finally:
        proxy.kill()


def started_token(store: Path, fake_engine_url: str, *flags: str) -> tuple[str, str]:
    """Start the proxy on `store`, check its admin token works, stop it: (the token in the store, its line)."""
    proxy = ProxyProcess("--upstream", fake_engine_url, "--store", str(store), "--no-engine-check", *flags)
    try:
        line = proxy.line()
        token = (store / "admin-token").read_text().strip()
        listed = httpx.get(f"{url_of(line)}/sessions", headers={"Authorization": f"Bearer {token}"})
        assert listed.status_code == 200, listed.text
        assert token not in line  # never printed
        assert proxy.stop() == ""
    finally:
        proxy.kill()
    return token, line


def test_the_admin_token_is_made_once_per_store_and_kept_until_rotated(fake_engine_server: tuple,
                                                                        tmp_path: Path) -> None:
    store, upstream = tmp_path / "store", fake_engine_server[1]
    first, line = started_token(store, upstream)
    assert f"admin token from {store / 'admin-token'} (new), {first[:4]}…)" in line
    assert stat.S_IMODE((store / "admin-token").stat().st_mode) == 0o600
    for _ in range(2):  # the same token over three starts: clients holding it keep working
        again, line = started_token(store, upstream)
        assert again == first and f"admin token from {store / 'admin-token'}, {first[:4]}…)" in line
    rotated, line = started_token(store, upstream, "--rotate-admin-token")
    assert rotated != first and len(rotated) == len(first) and "(new)" in line
    assert stat.S_IMODE((store / "admin-token").stat().st_mode) == 0o600
    assert started_token(store, upstream)[0] == rotated


@pytest.mark.parametrize("source", ["file", "env"])
def test_rotating_a_token_the_store_does_not_hold_is_refused(fake_engine_server: tuple, tmp_path: Path,
                                                             source: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("mine\n")
    flags = ["--admin-token-file", str(token_file)] if source == "file" else []
    env = {**os.environ, "HARNESS_RL_ADMIN_TOKEN": "mine"} if source == "env" else None
    done = subprocess.run([*SERVE, "--upstream", fake_engine_server[1], "--store", str(tmp_path / "store"),
                           "--no-engine-check", "--rotate-admin-token", *flags], capture_output=True, text=True,
                          env=env, timeout=DEADLINE_S)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("harness-rl serve proxy: --rotate-admin-token: rotates STORE/admin-token, but the token "
                           "comes from --admin-token-file or $HARNESS_RL_ADMIN_TOKEN: drop one of them\n")
    assert not (tmp_path / "store" / "admin-token").exists()


def test_a_started_proxy_waits_until_opened(fake_engine_server: tuple, fake_engine: object, tmp_path: Path) -> None:
    """In process: `start_proxy(waiting=...)` listens and refuses calls with that reason until `open()`; Google's
    dialect gets its own error shape."""
    from harness_rl.background import BackgroundLoop
    from proxy.config import ProxyConfig
    from proxy.server.app import start_proxy

    with BackgroundLoop("waiting-proxy") as loop:
        config = ProxyConfig(upstream=fake_engine_server[1], store_dir=str(tmp_path / "store"), admin_token="a")
        running = loop.run(start_proxy(config, waiting="waiting for the engine at E: 3 of 9 s"))
        try:
            session = httpx.post(f"{running.url}/sessions", headers={"Authorization": "Bearer a"}, json={}).json()
            gemini = httpx.post(f"{session['gemini_base_url']}/v1beta/models/m:generateContent",
                                headers={"x-goog-api-key": session["key"]},
                                json={"contents": [{"role": "user", "parts": [{"text": "hi"}]}]})
            assert gemini.status_code == 503
            assert gemini.json()["error"] == {"code": 503, "message": "waiting for the engine at E: 3 of 9 s",
                                              "status": "UNAVAILABLE"}
            assert httpx.get(f"{running.url}/health").json()["reason"] == "waiting for the engine at E: 3 of 9 s"
            loop.run(running.proxy.engine.open())
            assert httpx.get(f"{running.url}/health").status_code == 200
            gemini = httpx.post(f"{session['gemini_base_url']}/v1beta/models/m:generateContent",
                                headers={"x-goog-api-key": session["key"]},
                                json={"contents": [{"role": "user", "parts": [{"text": "hi"}]}]})
            assert gemini.status_code == 200, gemini.text
        finally:
            loop.run(running.stop())
