"""GRPO math: advantages and loss against hand-computed values and against TRL 1.16's own loss code."""

import math
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from harness_rl.learner.config import LossConfig
from harness_rl.learner.grpo import LossStats, Mismatch, group_advantages, grpo_loss, k3_kl, token_weights


def test_advantages_exclude_unscorable_from_the_baseline():
    adv = group_advantages([1.0, 0.0, None, 1.0])
    # scorable [1, 0, 1]: mean 2/3, population std sqrt(2)/3
    assert adv[2] is None
    assert adv[0] == pytest.approx(1 / math.sqrt(2), abs=1e-7)
    assert adv[1] == pytest.approx(-math.sqrt(2), abs=1e-7)
    assert adv[3] == adv[0]


@pytest.mark.parametrize("rewards", [[1.0, 1.0, 1.0], [0.5, None, 0.5], [1.0, None], [None, None], []])
def test_groups_without_variance_teach_nothing(rewards):
    assert group_advantages(rewards) is None


def test_token_weights_sum_to_one_per_token_or_per_rollout():
    assert token_weights({"a": 2, "b": 6, "c": 0}, "token") == {"a": 0.125, "b": 0.125}
    weights = token_weights({"a": 2, "b": 6}, "rollout")
    assert weights == {"a": 0.25, "b": pytest.approx(1 / 12)}
    assert 2 * weights["a"] + 6 * weights["b"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="normalisation"):
        token_weights({"a": 1}, "sequence")


def test_loss_values_gradients_and_metrics_by_hand():
    behaviour = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    ratios = torch.tensor([1.5, 0.5, 1.1, 5.0])
    logps = (behaviour + ratios.log()).requires_grad_()
    advantages = torch.tensor([1.0, -1.0, 2.0, -1.0])
    weights = torch.full((4,), 0.25)
    config = LossConfig(epsilon=0.2, tis_cap=3.0, decoupled=False)
    loss, stats = grpo_loss(logps, behaviour, advantages, weights, config)
    # high-clipped: -1.2; low-clipped: +0.8; unclipped: -1.1*2; truncated at 3: -(3 * -1)
    assert loss.item() == pytest.approx(0.25 * (-1.2 + 0.8 - 2.2 + 3.0), abs=1e-6)
    loss.backward()
    assert logps.grad.tolist() == pytest.approx([0.0, 0.0, -0.25 * 2.2, 0.25 * 3.0], abs=1e-6)
    assert stats.tokens == 4
    assert stats.sums["ratio"] == pytest.approx(8.1, abs=1e-5)
    assert stats.sums["clip_ratio/low_mean"] == 1
    assert stats.sums["clip_ratio/high_mean"] == 1
    assert stats.sums["clip_ratio/region_mean"] == 2
    assert stats.sums["tis/truncated_frac"] == 1
    assert stats.minima["sampling/importance_sampling_ratio/min"] == pytest.approx(0.5)
    assert stats.maxima["sampling/importance_sampling_ratio/max"] == pytest.approx(5.0)
    assert stats.sums["kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 5.0)), abs=1e-5)



def test_statistics_combine_by_their_kind_not_their_name():
    """A sum whose name says max (or an extremum whose name says neither) combines as its kind does."""
    first = LossStats(2.0, sums={"max_length_hits": 1.0}, maxima={"peak": 3.0}, minima={"floor": 1.0})
    second = LossStats(2.0, sums={"max_length_hits": 2.0, "new": 4.0}, maxima={"peak": 2.0}, minima={"floor": 0.5})
    total = first + second
    assert total == LossStats(4.0, {"max_length_hits": 3.0, "new": 4.0}, {"peak": 3.0}, {"floor": 0.5})
    assert total.metrics() == {"max_length_hits": 0.75, "new": 1.0, "peak": 3.0, "floor": 0.5}

def test_epsilon_high_is_asymmetric():
    behaviour = torch.zeros(2)
    logps = torch.log(torch.tensor([1.25, 1.25])).requires_grad_()
    advantages = torch.tensor([1.0, 1.0])
    asymmetric = LossConfig(epsilon=0.2, epsilon_high=0.28, decoupled=False)
    _, stats = grpo_loss(logps, behaviour, advantages, torch.ones(2), asymmetric)
    assert stats.sums["clip_ratio/high_mean"] == 0
    _, stats = grpo_loss(logps, behaviour, advantages, torch.ones(2), LossConfig(epsilon=0.2, decoupled=False))
    assert stats.sums["clip_ratio/high_mean"] == 2


def test_k3_kl_penalty_by_hand():
    logps = torch.tensor([-1.0]).requires_grad_()
    ref = torch.tensor([-1.5])
    config = LossConfig(beta=0.1, decoupled=False)
    loss, stats = grpo_loss(logps, logps.detach(), torch.zeros(1), torch.ones(1), config, ref)
    expected_kl = math.exp(-0.5) + 0.5 - 1
    assert loss.item() == pytest.approx(0.1 * expected_kl, abs=1e-7)
    assert stats.sums["ref_kl"] == pytest.approx(expected_kl, abs=1e-7)
    assert k3_kl(torch.tensor([-2.0]), torch.tensor([-2.0])).item() == 0.0
    with pytest.raises(ValueError, match="reference"):
        grpo_loss(logps, logps.detach(), torch.zeros(1), torch.ones(1), LossConfig(beta=0.1, decoupled=False))


# ---------------------------------------------------------------------------------------------
# TRL 1.16's GRPOTrainer._compute_loss, called on the same inputs


def batch(seed=0, rows=4, length=7):
    """A padded (B, T) batch: behaviour and current logprobs, ragged completion masks, advantages."""
    g = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(rows, length, generator=g) * 3
    logps = behaviour + torch.randn(rows, length, generator=g) * 0.4
    lengths = torch.tensor([length, 3, 5, 1][:rows])
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    advantages = torch.randn(rows, generator=g)
    ref = behaviour + torch.randn(rows, length, generator=g) * 0.2
    return logps, behaviour, mask, advantages, ref


def trl_loss(logps, mask, advantages, *, loss_type, eps_low, eps_high, beta=0.0, old=None, ref=None,
             is_ratio=None):
    """Run TRL's own `_compute_loss` with the model forward replaced by the given logprobs."""
    from trl import GRPOTrainer

    accelerator = SimpleNamespace(reduce=lambda t, reduction: t, gather=lambda t: t,
                                  gather_for_metrics=lambda t: t, num_processes=1)
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=beta, args=SimpleNamespace(use_bias_correction_kl=False, delta=None), loss_type=loss_type,
        epsilon_low=eps_low, epsilon_high=eps_high, use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=True, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)}, accelerator=accelerator,
    )
    rows, length = logps.shape
    inputs = {
        "prompt_ids": torch.zeros(rows, 2, dtype=torch.long), "prompt_mask": torch.ones(rows, 2),
        "completion_ids": torch.zeros(rows, length, dtype=torch.long), "completion_mask": mask,
        "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
        "importance_sampling_ratio": is_ratio,
    }
    loss = GRPOTrainer._compute_loss(fake, None, inputs)
    return loss, {k: v[0] for k, v in fake._metrics["train"].items()}


def ours(logps, behaviour, mask, advantages, config, ref=None, mode="token"):
    keep = mask.bool()
    per_row = mask.sum(-1)
    row_ids = torch.arange(mask.shape[0])[:, None].expand_as(mask)[keep]
    weights = token_weights({str(i): int(n) for i, n in enumerate(per_row)}, mode)
    w = torch.tensor([weights[str(int(i))] for i in row_ids])
    adv = advantages[:, None].expand_as(mask)[keep]
    return grpo_loss(logps[keep], behaviour[keep], adv, w, config, None if ref is None else ref[keep])


@pytest.mark.parametrize("loss_type,mode", [("bnpo", "token"), ("grpo", "rollout")])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_clipped_surrogate_equals_trl_with_behaviour_as_old_policy(loss_type, mode, beta):
    logps, behaviour, mask, advantages, ref = batch()
    ours_in = logps.clone().requires_grad_()
    trl_in = logps.clone().requires_grad_()
    config = LossConfig(epsilon=0.2, epsilon_high=0.28, tis_cap=None, beta=beta, decoupled=False)
    loss, stats = ours(ours_in, behaviour, mask, advantages, config, ref, mode)
    expected, metrics = trl_loss(trl_in, mask, advantages, loss_type=loss_type, eps_low=0.2, eps_high=0.28,
                                 beta=beta, old=behaviour, ref=ref)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    loss.backward()
    expected.backward()
    assert torch.allclose(ours_in.grad, trl_in.grad, atol=1e-7)
    n = stats.tokens
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert stats.sums[name] / n == pytest.approx(metrics[name], abs=1e-7)
    assert stats.sums["clip_ratio/region_mean"] > 0
    if beta:
        assert stats.sums["ref_kl"] / n == pytest.approx(metrics["kl"], abs=1e-6)


@pytest.mark.parametrize("config", [LossConfig(epsilon=100.0, tis_cap=1.3, decoupled=False),
                                    LossConfig(epsilon=0.2, tis_cap=1.3, decoupled=True)],
                         ids=["clip-out-of-play", "decoupled"])
def test_truncated_importance_sampling_equals_trl_vllm_token_truncate(config):
    logps, behaviour, mask, advantages, _ = batch(seed=1)
    ours_in = logps.clone().requires_grad_()
    trl_in = logps.clone().requires_grad_()
    cap = 1.3
    # TRL's token_truncate ratio, as `_generate_and_score_completions` builds it (old = current policy).
    is_ratio = torch.clamp(torch.exp(torch.nan_to_num((logps - behaviour) * mask, nan=0.0)), min=None, max=cap)
    assert (is_ratio == cap).any() and (is_ratio < 1).any()
    loss, stats = ours(ours_in, behaviour, mask, advantages, config)
    assert stats.sums["clip_ratio/region_mean"] == 0
    expected, _ = trl_loss(trl_in, mask, advantages, loss_type="bnpo", eps_low=0.2, eps_high=0.2,
                           is_ratio=is_ratio)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    loss.backward()
    expected.backward()
    assert torch.allclose(ours_in.grad, trl_in.grad, atol=1e-7)


def trl_async_loss(logps, behaviour, advantages, segment_id, eps_low, eps_high):
    """TRL's AsyncGRPOTrainer.compute_loss on flat (packed) tokens, its fused-head model replaced by
    one that returns the given logprobs (every position is a trained token)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "you are importing from trl.experimental"
        from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

    n = logps.shape[0]
    accelerator = SimpleNamespace(reduce=lambda t, reduction: t, gather=lambda t: t, num_processes=1)
    fake = SimpleNamespace(
        aux_loss_enabled=False, epsilon_low=eps_low, epsilon_high=eps_high, accelerator=accelerator,
        current_gradient_accumulation_steps=1, _metrics={"train": defaultdict(list)}, _step_forward_tokens=0.0,
        _step_trained_tokens=0.0, _step_seq_len_weighted=0.0, _step_samples=0.0, _step_forward_s=0.0,
    )

    def model(**kwargs):
        return SimpleNamespace(log_probs=logps[None], entropy=torch.ones(1, n))

    inputs = {
        "attention_mask": torch.ones(1, n), "token_index": torch.arange(n)[None], "input_ids": torch.zeros(1, n),
        "position_ids": torch.arange(n)[None], "shift_labels": torch.zeros(1, n), "old_log_probs": behaviour[None],
        "advantages": advantages[None], "segment_id": segment_id[None],
        "tree_kv_index": torch.tensor([-1]), "tree_cu_seqlens_q": torch.tensor([-1]),
        "tree_cu_seqlens_k": torch.tensor([-1]), "tree_max_seqlens": torch.tensor([[0, 0]]),
        "global_n_tokens": torch.tensor([float(n)]), "global_n_forward_tokens": torch.tensor([float(n)]),
        "mean_seq_len": torch.tensor([float(n)]),
    }
    loss = AsyncGRPOTrainer.compute_loss(fake, model, inputs)
    return loss, {k: v[0] for k, v in fake._metrics["train"].items()}


def test_token_loss_and_metrics_equal_trl_async_grpo_trainer():
    logps, behaviour, mask, advantages, _ = batch(seed=2)
    keep = mask.bool()
    flat_logps, flat_behaviour = logps[keep], behaviour[keep]
    segment_id = torch.arange(mask.shape[0])[:, None].expand_as(mask)[keep]
    flat_adv = advantages[:, None].expand_as(mask)[keep]
    ours_in = flat_logps.clone().requires_grad_()
    trl_in = flat_logps.clone().requires_grad_()
    n = flat_logps.numel()
    loss, stats = grpo_loss(ours_in, flat_behaviour, flat_adv, torch.full((n,), 1.0 / n),
                            LossConfig(epsilon=0.2, epsilon_high=0.28, tis_cap=None, decoupled=False),
                            row_index=segment_id)
    expected, metrics = trl_async_loss(trl_in, flat_behaviour, flat_adv, segment_id, 0.2, 0.28)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    loss.backward()
    expected.backward()
    assert torch.allclose(ours_in.grad, trl_in.grad, atol=1e-7)
    for name in ("ratio", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert stats.sums[name] / n == pytest.approx(metrics[name], abs=1e-6), name
    assert stats.minima["clip_ratio/low_min"] == pytest.approx(metrics["clip_ratio/low_min"], abs=1e-6)
    assert stats.maxima["clip_ratio/high_max"] == pytest.approx(metrics["clip_ratio/high_max"], abs=1e-6)
    assert stats.maxima["clip_ratio/high_max"] > 0
    assert stats.sums["clip_ratio/region_mean"] > 0


def test_mismatch_k3_kl_and_largest_difference_by_hand():
    learner = torch.tensor([-1.0, -0.5, -2.0], dtype=torch.float64)
    behaviour = torch.tensor([-1.2, -0.5, -1.0], dtype=torch.float64)
    # δ = learner − behaviour = [0.2, 0, −1]; k3 = e^δ − δ − 1 (samples from the behaviour policy)
    k3 = [math.exp(0.2) - 1.2, 0.0, math.exp(-1.0)]
    metrics = Mismatch.of(learner, behaviour).metrics()
    assert metrics["mismatch_kl"] == pytest.approx(sum(k3) / 3, abs=1e-12)
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(1.2 / 3, abs=1e-12)
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(1.0, abs=1e-12)
    # micro-batches add up to the whole step
    split = Mismatch.of(learner[:1], behaviour[:1]) + Mismatch.of(learner[1:], behaviour[1:])
    assert split.metrics() == pytest.approx(metrics)
    # equal logprobs: no mismatch; no tokens: no metrics
    assert set(Mismatch.of(behaviour, behaviour).metrics().values()) == {0.0}
    assert (Mismatch() + Mismatch.of(torch.empty(0), torch.empty(0))).metrics() == {}
    with pytest.raises(ValueError, match="2 learner logprobs for 3 behaviour"):
        Mismatch.of(learner[:2], behaviour)
