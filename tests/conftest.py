"""Shared, session-scoped fixtures: the tiny model (built once) and an embedded engine serving it.

Tests that change engine state (weights, pause) must use their own `Engine`, not `engine`.
Tests that script answers clear the queue first: `httpx.delete(f"{engine_url}/forced_completions")`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from fake_engine import FakeEngine

    from harness_rl.engine import Engine
    from proxy.server.app import RunningProxy

pytest_plugins = ["vllm_fixtures", "family_serving"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """Every `@pytest.mark.anyio` test runs on asyncio (the loop the proxy, the engine and the adapters use)."""
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The offline tiny model (tokenizer with chat template + random Qwen2), seed 0."""
    from harness_rl.engine import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny-0", seed=0)


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    """An in-process engine on the tiny model, served as `tiny`; do not change its weights."""
    from harness_rl.engine import Engine

    engine = Engine.from_pretrained(tiny_model_dir, served_model_name="tiny")
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def engine_url(engine: Engine) -> Iterator[str]:
    """Base URL (`http://127.0.0.1:PORT`) of `engine` behind the vLLM-compatible HTTP surface,
    forced completions enabled."""
    from harness_rl.engine import serve_in_thread

    with serve_in_thread(engine, forced_completions=True) as server:
        yield server.url


@pytest.fixture(scope="module")
def proxy_settings() -> dict[str, Any]:
    """The `ProxyConfig` fields of a module's `proxy` beside its upstream and store: none here; a module that needs
    some (a turn's token limit, a session's turns) overrides this fixture."""
    return {}


@pytest.fixture(scope="module")
def proxy(engine_url: str, proxy_settings: dict[str, Any],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningProxy]:
    """A proxy in front of `engine_url` for the whole module, logging to a fresh store, with `proxy_settings`."""
    from harness_rl.run.stack import serve_proxy
    from proxy.config import ProxyConfig

    config = ProxyConfig(upstream=engine_url, store_dir=str(tmp_path_factory.mktemp("proxy-store")),
                         **proxy_settings)
    with serve_proxy(config) as running:
        yield running


# ---------------------------------------------------------------------------------------------
# Proxy fixtures: a fast fake engine (tests/fake_engine.py) and a proxy in front of it.


@pytest.fixture(scope="session")
def fake_engine_server() -> Iterator[tuple[FakeEngine, str]]:
    """One fake vLLM-shaped engine for the whole run: (FakeEngine, url)."""
    from fake_engine import FakeEngine, run_fake_engine

    fake = FakeEngine()
    with run_fake_engine(fake) as url:
        yield fake, url


@pytest.fixture
def fake_engine(fake_engine_server: tuple[FakeEngine, str]) -> FakeEngine:
    """The fake engine, reset (`FakeEngine.reset`): every knob and record as a new one has them."""
    fake = fake_engine_server[0]
    fake.reset()
    return fake


@pytest.fixture
def fake_proxy(fake_engine_server: tuple[FakeEngine, str], fake_engine: FakeEngine,
               tmp_path: Path) -> Iterator[RunningProxy]:
    """A proxy in front of the fake engine, logging under `tmp_path / "store"`."""
    from harness_rl.run.stack import serve_proxy
    from proxy.config import ProxyConfig

    with serve_proxy(ProxyConfig(upstream=fake_engine_server[1], store_dir=str(tmp_path / "store"),
                                 retries=2, splice_check_tokens=None)) as running:  # every splice checked
        yield running


@pytest.fixture
def keepalive_proxy(fake_engine_server: tuple[FakeEngine, str], fake_engine: FakeEngine,
                    tmp_path: Path) -> Iterator[RunningProxy]:
    """A proxy that opens a slow call's stream with keep-alives after 0.1 s and never retries the engine."""
    from harness_rl.run.stack import serve_proxy
    from proxy.config import ProxyConfig

    config = ProxyConfig(upstream=fake_engine_server[1], store_dir=str(tmp_path / "store"), keepalive_s=0.1,
                         retries=0, upstream_model="fake")
    with serve_proxy(config) as running:
        yield running
