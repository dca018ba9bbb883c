"""The learner loop on a tiny model: resume exactness, micro-batching invariance, schedules, metrics."""

import json
import math
import random

import pytest
import torch
from tiny_lm import VOCAB, build_tiny_lm

from harness_rl.learner.config import LearnerConfig, LossConfig
from harness_rl.learner.learner import Learner, _schedule
from harness_rl.outcome import RolloutGroup, RolloutOutcome
from harness_rl.run.metrics import MetricsLogger
from harness_rl.trace import TrainingTrace, Turn


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_lm(tmp_path_factory.mktemp("tiny-lm"))


def agent_outcome(rng: random.Random, rid: str, reward: float, turns: int, version: int) -> RolloutOutcome:
    trace_turns, prompt = [], [rng.randrange(VOCAB) for _ in range(rng.randint(4, 12))]
    for i in range(turns):
        completion = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 10))]
        logps = [math.log(1 / VOCAB) + rng.gauss(0, 0.3) for _ in completion]
        trace_turns.append(Turn(node_id=f"{rid}.{i}", parent_id=f"{rid}.{i - 1}" if i else None,
                                prompt_token_ids=list(prompt), completion_token_ids=completion,
                                per_token_logps=[min(lp, -1e-3) for lp in logps],
                                loss_mask=[0] * len(prompt) + [1] * len(completion), policy_version=version))
        prompt = prompt + completion + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
    trace = TrainingTrace(rollout_id=rid, turns=trace_turns)
    return RolloutOutcome(rollout_id=rid, task="t", reward=reward, trace=trace)


def make_groups(n_groups: int, seed: int = 0, size: int = 4) -> list[RolloutGroup]:
    rng = random.Random(seed)
    return [RolloutGroup(group_id=g, task="t", outcomes=[
        agent_outcome(rng, f"g{g}r{i}", rng.choice([0.0, 0.5, 1.0, None]), rng.randint(1, 4), max(0, g - 1))
        for i in range(size)]) for g in range(n_groups)]


def config(loss: LossConfig | None = None, **overrides) -> LearnerConfig:
    return LearnerConfig(**{"learning_rate": 1e-3, "token_budget": 256, "lr_scheduler": "cosine",
                            "warmup_steps": 1, "max_steps": 6, "max_staleness": 4, **overrides},
                         loss=loss or LossConfig())


def test_resume_continues_exactly_as_an_uninterrupted_run(model_dir, tmp_path):
    groups = make_groups(8)
    straight = Learner(model_dir, config())
    expected = [straight.step(groups[2 * i:2 * i + 2])["loss"] for i in range(4)]

    first = Learner(model_dir, config(), output_dir=tmp_path)
    for i in range(2):
        first.step(groups[2 * i:2 * i + 2])
    first.extra_state = {"next_group": 4, "in_flight": [4, 5]}
    path = first.save()
    assert path.name == "step-00000002" and (path / "state").is_dir() and not (path / "model").exists()
    torch.manual_seed(1234)  # the restored RNG must not depend on what happened in between

    resumed = Learner(model_dir, config())
    assert resumed.load(path) == {"next_group": 4, "in_flight": [4, 5]}
    assert (resumed.step_count, resumed.policy_version) == (2, 2)
    losses = [resumed.step(groups[2 * i:2 * i + 2])["loss"] for i in (2, 3)]
    assert losses == pytest.approx(expected[2:], abs=1e-6)
    assert expected[2] != pytest.approx(expected[3], abs=1e-6)
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_micro_batching_does_not_change_the_step(model_dir):
    groups = make_groups(2, seed=3)
    params, metrics = [], []
    for budget in (40, 4096):
        learner = Learner(model_dir, config(LossConfig(normalization="rollout"), token_budget=budget))
        metrics.append(learner.step(groups))
        params.append(torch.cat([p.detach().flatten() for p in learner.model.parameters()]))
    assert metrics[0]["batch/microbatches_per_step"] > 2 and metrics[1]["batch/microbatches_per_step"] == 1
    assert (params[0] - params[1]).abs().max().item() < 1e-6
    for key in ("loss", "kl", "entropy", "clip_ratio/region_mean", "sampling/importance_sampling_ratio/max",
                "sampling/importance_sampling_ratio/min", "clip_ratio/low_min", "clip_ratio/high_max"):
        assert metrics[0][key] == pytest.approx(metrics[1][key], abs=1e-6), key


def test_training_raises_the_rewarded_completion_and_lowers_the_other(model_dir):
    prompt = [5, 6, 7]

    def rollout(rid, completion, reward):
        turn = Turn(node_id=rid, prompt_token_ids=prompt, completion_token_ids=completion,
                    per_token_logps=[math.log(1 / VOCAB)] * len(completion), loss_mask=[0, 0, 0, 1, 1],
                    policy_version=0)
        trace = TrainingTrace(rollout_id=rid, turns=[turn])
        return RolloutOutcome(rollout_id=rid, task="t", reward=reward, trace=trace)

    learner = Learner(model_dir, config(lr_scheduler="constant", warmup_steps=0, max_staleness=None))

    def logp(completion):
        with torch.no_grad():
            logits = learner.model(input_ids=torch.tensor([prompt + completion])).logits[0, 2:4]
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).sum().item()

    good, bad = [11, 12], [21, 22]
    before = logp(good), logp(bad)
    for _ in range(5):
        learner.step([RolloutGroup(group_id=0, task="t", outcomes=[rollout("a", good, 1.0), rollout("b", bad, 0.0)])])
    assert logp(good) > before[0] + 1.0
    assert logp(bad) < before[1] - 1.0


def test_every_step_logs_a_console_line_and_a_jsonl_record(model_dir, tmp_path, capsys):
    learner = Learner(model_dir, config(), output_dir=tmp_path)
    logger = MetricsLogger(tmp_path)
    logger.log(1, learner.step(make_groups(2)))
    flat = RolloutGroup(group_id=9, task="t", outcomes=[agent_outcome(random.Random(0), "x", 1.0, 1, 0)] * 2)
    skipped = learner.step([flat])
    logger.log(2, skipped)
    logger.close()
    learner.close()
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("step 1 | loss ") and "reward" in line and "clip" in line
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for key in ("loss", "grad_norm", "learning_rate", "kl", "entropy", "ratio", "clip_ratio/low_mean",
                "clip_ratio/high_mean", "clip_ratio/region_mean", "sample/dropped_stale_total",
                "batch/row_fill_frac", "perf/trained_tok_s_wall_clock", "reward", "policy_version"):
        assert key in records[0], key
    assert skipped["sample/zero_std_groups_total"] == 1 and skipped["batch/trained_tokens_per_step"] == 0
    assert (learner.step_count, learner.policy_version) == (2, 1)


def test_schedules_by_hand():
    warm_cos = _schedule(LearnerConfig(lr_scheduler="cosine", warmup_steps=1, max_steps=5))
    assert [round(warm_cos(s), 6) for s in range(6)] == [0.5, 1.0, round(0.5 * (1 + math.cos(math.pi / 4)), 6),
                                                         0.5, round(0.5 * (1 + math.cos(3 * math.pi / 4)), 6), 0.0]
    linear = _schedule(LearnerConfig(lr_scheduler="linear", max_steps=4))
    assert [linear(s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert _schedule(LearnerConfig())(100) == 1.0
    with pytest.raises(ValueError, match="max_steps"):
        _schedule(LearnerConfig(lr_scheduler="cosine", warmup_steps=3, max_steps=3))


def test_gradient_checkpointing_gives_the_same_step(model_dir):
    params = []
    for checkpointing in (False, True):
        learner = Learner(model_dir, config(gradient_checkpointing=checkpointing))
        learner.step(make_groups(2, seed=5))
        params.append(torch.cat([p.detach().flatten() for p in learner.model.parameters()]))
    assert (params[0] - params[1]).abs().max().item() < 1e-6


def test_kl_penalty_uses_a_frozen_reference_model(model_dir):
    learner = Learner(model_dir, config(LossConfig(beta=0.1)))
    first = learner.step(make_groups(2, seed=6))
    second = learner.step(make_groups(2, seed=7))
    assert first["ref_kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference
    assert second["ref_kl"] > 1e-6
    assert all(not p.requires_grad for p in learner.ref_model.parameters())


def test_save_total_limit_keeps_the_newest_checkpoints(model_dir, tmp_path):
    learner = Learner(model_dir, config(), output_dir=tmp_path, save_total_limit=2)
    for i in range(3):
        learner.step(make_groups(2, seed=i))
        learner.save()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]


class FlakySync:
    """A sync whose first `failures` pushes fail, as an engine restarting or a dropped connection would."""

    def __init__(self, failures: int) -> None:
        self.failures, self.pushed = failures, []

    def push(self, model, version: int) -> None:
        from harness_rl.learner.weight_sync import WeightSyncError

        if self.failures:
            self.failures -= 1
            raise WeightSyncError("POST /update_weights_from_bytes failed: HTTP 502")
        self.pushed.append(version)

    def close(self) -> None:
        pass


def test_a_failed_sync_is_retried_after_the_next_step_and_too_many_in_a_row_raise(model_dir, capsys):
    from harness_rl.learner.weight_sync import WeightSyncError

    sync = FlakySync(failures=2)
    learner = Learner(model_dir, config(max_sync_failures=2, max_staleness=None), weight_sync=sync)
    metrics = [learner.step(make_groups(2, seed=i)) for i in range(3)]
    assert [m["weight_sync/consecutive_failures"] for m in metrics] == [1, 2, 0]
    assert sync.pushed == [3] and "weight sync failed (2 in a row)" in capsys.readouterr().err
    learner.weight_sync = FlakySync(failures=10)
    learner.step(make_groups(2, seed=0))
    learner.step(make_groups(2, seed=0))
    with pytest.raises(WeightSyncError, match="HTTP 502"):
        learner.step(make_groups(2, seed=0))


def test_mismatch_is_measured_on_tokens_sampled_by_the_current_weights(model_dir):
    learner = Learner(model_dir, config(lr_scheduler="constant", warmup_steps=0))
    prompt, completions = [5, 6, 7], ([11, 12, 13], [21, 22, 23])

    def own_logps(completion):
        with torch.no_grad():
            logits = learner.model(input_ids=torch.tensor([prompt + completion])).logits[0, 2:5]
        return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()

    def group(version: int, shift: float) -> RolloutGroup:
        outcomes = []
        for i, completion in enumerate(completions):
            logps = [lp + shift for lp in own_logps(completion)]
            turn = Turn(node_id=f"n{i}", prompt_token_ids=prompt, completion_token_ids=completion,
                        per_token_logps=logps, loss_mask=[0, 0, 0, 1, 1, 1], policy_version=version)
            outcomes.append(RolloutOutcome(rollout_id=f"r{i}", task="t", reward=float(i),
                                           trace=TrainingTrace(rollout_id=f"r{i}", turns=[turn])))
        return RolloutGroup(group_id=0, task="t", outcomes=outcomes)

    equal = learner.step([group(version=0, shift=0.0)])
    assert equal["sampling/sampling_logp_difference/max"] < 1e-5 and equal["mismatch_kl"] < 1e-10
    shifted = learner.step([group(version=1, shift=-0.1)])  # the engine's logprobs 0.1 lower than the learner's
    assert shifted["sampling/sampling_logp_difference/max"] == pytest.approx(0.1, abs=1e-5)
    assert shifted["mismatch_kl"] == pytest.approx(math.exp(0.1) - 0.1 - 1, rel=1e-3)
    stale = learner.step([group(version=0, shift=0.0)])  # sampled two versions ago: not a same-weights measure
    assert "mismatch_kl" not in stale


def test_every_sync_is_checked_by_sampling_from_the_engine(tiny_model_dir):
    from harness_rl.background import BackgroundLoop
    from harness_rl.engine import Engine, serve_in_thread
    from harness_rl.learner.weight_sync import InProcessSync, NoSync
    from harness_rl.run.engines import EngineSampler

    engine = Engine.from_pretrained(tiny_model_dir)
    measured = {}
    with BackgroundLoop("sync-check") as loop, serve_in_thread(engine) as server:
        for seed, name, sync in ((0, "synced", InProcessSync(engine)), (1, "never synced", NoSync())):
            learner = Learner(tiny_model_dir, config(learning_rate=1e-2, lr_scheduler="constant", warmup_steps=0),
                              weight_sync=sync, sync_check=EngineSampler(lambda: [server.url], loop, 1.0))
            measured[name] = learner.step(make_groups(2, seed=seed))
            learner.close()
    engine.close()
    assert measured["synced"]["sync/logp_difference_max"] < 1e-5  # the engine serves exactly the learner's weights
    assert measured["synced"]["sync/mismatch_kl"] < 1e-10
    assert measured["never synced"]["sync/logp_difference_max"] > 1e-3  # the engine kept older weights: caught
