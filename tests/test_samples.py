"""From groups to samples: baseline over scorable rollouts, dropped groups, staleness, token weights."""

import pytest

from harness_rl.learner.samples import build_samples
from harness_rl.outcome import RolloutGroup, RolloutOutcome
from harness_rl.trace import Sampling, TrainingTrace, Turn, VersionSpan


def outcome(rid, reward, versions=(0,), n_completion=2):
    turns, prompt = [], [1, 2]
    for i, version in enumerate(versions):
        completion = [10 + i] * n_completion
        turns.append(Turn(node_id=f"{rid}-{i}", parent_id=f"{rid}-{i - 1}" if i else None,
                          prompt_token_ids=list(prompt), completion_token_ids=completion,
                          per_token_logps=[-0.5] * n_completion,
                          loss_mask=[0] * len(prompt) + [1] * n_completion, policy_version=version))
        prompt = prompt + completion + [3]
    return RolloutOutcome(rollout_id=rid, task="t", reward=reward, trace=TrainingTrace(rollout_id=rid, turns=turns))


def test_unscorable_rollouts_leave_the_baseline_and_are_not_trained():
    group = RolloutGroup(group_id=7, task="t", outcomes=[outcome("a", 1.0), outcome("b", 0.0), outcome("c", None)])
    samples, metrics = build_samples([group], policy_version=0, max_staleness=4, normalization="token")
    assert [(s.rollout_key, round(s.advantage, 6)) for s in samples] == [("7/a", 1.0), ("7/b", -1.0)]
    assert [s.weight for s in samples] == [0.25, 0.25]
    assert metrics["sample/unscorable_total"] == 1
    assert metrics["reward"] == 0.5


def test_groups_without_variance_and_zero_advantage_rollouts_produce_nothing():
    flat = RolloutGroup(group_id=1, task="t", outcomes=[outcome("a", 1.0), outcome("b", 1.0)])
    middle = RolloutGroup(group_id=2, task="t", outcomes=[outcome("c", 0.0), outcome("d", 0.5), outcome("e", 1.0)])
    samples, metrics = build_samples([flat, middle], policy_version=0, max_staleness=None, normalization="token")
    assert [s.rollout_key for s in samples] == ["2/c", "2/e"]
    assert metrics["sample/zero_std_groups_total"] == 1


def test_invalid_or_missing_traces_count_in_the_baseline_but_are_not_trained():
    broken = outcome("b", 0.0)
    broken.trace.turns[0].per_token_logps = [0.5, -0.5]  # a positive logprob breaks the contract
    missing = RolloutOutcome(rollout_id="m", task="t", reward=0.0)
    group = RolloutGroup(group_id=0, task="t", outcomes=[outcome("a", 1.0), broken, missing])
    samples, metrics = build_samples([group], policy_version=0, max_staleness=None, normalization="token")
    assert [s.rollout_key for s in samples] == ["0/a"]
    assert samples[0].advantage == pytest.approx(2 ** 0.5, abs=1e-6)  # baseline mean 1/3 over three rewards
    assert metrics["sample/invalid_traces_total"] == 2


def test_stale_tokens_are_dropped_per_turn_and_stay_as_context():
    group = RolloutGroup(group_id=0, task="t", outcomes=[outcome("a", 1.0, versions=(1, 4, 6)),
                                                         outcome("b", 0.0, versions=(6,))])
    samples, metrics = build_samples([group], policy_version=6, max_staleness=2, normalization="token")
    row = samples[0].row
    assert row.tokens == [1, 2, 10, 10, 3, 11, 11, 3, 12, 12]
    assert row.mask == [0, 0, 0, 0, 0, 1, 1, 0, 1, 1]
    assert metrics["sample/dropped_stale_total"] == 2
    assert metrics["sample/staleness_max"] == 2
    assert metrics["sample/staleness_mean"] == pytest.approx(2 * 2 / 6)


def test_a_completion_that_straddled_a_sync_is_treated_token_by_token():
    straddled = outcome("a", 1.0, versions=(2,), n_completion=4)
    turn = straddled.trace.turns[0]
    turn.version_spans = [VersionSpan(version=2, start=0, end=3), VersionSpan(version=5, start=3, end=4)]
    group = RolloutGroup(group_id=0, task="t", outcomes=[straddled, outcome("b", 0.0, versions=(6,))])
    samples, metrics = build_samples([group], policy_version=6, max_staleness=2, normalization="token")
    row = samples[0].row
    assert row.mask == [0, 0, 0, 0, 0, 1]  # the 3 tokens of version 2 are 4 versions old, the last is 1
    assert row.versions[-1] == 5 and metrics["sample/dropped_stale_total"] == 3
    assert turn.token_versions == [2, 2, 2, 5] and straddled.trace.validate()
    turn.version_spans = [VersionSpan(version=2, start=0, end=3)]
    assert straddled.trace.violations()[0].rule == "invalid_policy_version"


def test_per_rollout_normalisation_weighs_rollouts_equally():
    group = RolloutGroup(group_id=0, task="t", outcomes=[outcome("a", 1.0, versions=(0, 0, 0)), outcome("b", 0.0)])
    samples, _ = build_samples([group], policy_version=0, max_staleness=None, normalization="rollout")
    assert [(s.row.n_trained, s.weight) for s in samples] == [(6, pytest.approx(1 / 12)), (2, 0.25)]


def test_turns_sampled_at_another_temperature_are_context_only():
    a = outcome("a", 1.0, versions=(0, 0))
    a.trace.turns[0].sampling = Sampling(temperature=0.7)
    a.trace.turns[1].sampling = Sampling(temperature=1.0)
    group = RolloutGroup(group_id=0, task="t", outcomes=[a, outcome("b", 0.0)])
    samples, metrics = build_samples([group], policy_version=0, max_staleness=None, normalization="token",
                                     temperature=1.0)
    assert samples[0].row.mask == [0, 0, 0, 0, 0, 1, 1]
    assert metrics["sample/temperature_mismatch_total"] == 2
    assert a.trace.turns[0].role == "agent"  # the caller's trace is left alone
