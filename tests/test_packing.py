"""Packing: first-fit decreasing bins, exact targets, and packed logprobs equal to per-row logprobs."""

import random

import pytest
import torch
from tiny_lm import VOCAB, build_tiny_lm

from harness_rl.learner.packing import fill_fraction, pack, packed_logprobs, plan_bins
from harness_rl.learner.rows import Row
from harness_rl.learner.samples import Sample


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_lm(tmp_path_factory.mktemp("tiny-lm"))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def sample(tokens, mask, advantage=1.0, weight=0.5, seed=0):
    rng = random.Random(seed)
    logprobs = [-rng.random() if m else 0.0 for m in mask]
    return Sample(Row("r", list(tokens), list(mask), logprobs, [0 if m else -1 for m in mask]), "0/r",
                  advantage, weight)


def test_first_fit_decreasing_fills_bins_and_isolates_oversize_items():
    assert plan_bins([5, 3, 7, 2, 4, 12], 10) == [[5], [2, 1], [0, 4], [3]]
    assert plan_bins([], 10) == []


def test_collated_batch_restarts_positions_and_points_targets_one_back():
    a = sample([10, 11, 12, 13], [0, 0, 1, 1], advantage=2.0, weight=0.1)
    b = sample([20, 21, 22], [0, 1, 0], advantage=-1.0, weight=0.3, seed=1)
    (batch,) = pack([b, a], token_budget=16)
    assert batch.input_ids.tolist() == [[10, 11, 12, 13, 20, 21, 22]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert batch.target_index.tolist() == [1, 2, 4]
    assert batch.target_ids.tolist() == [12, 13, 21]
    assert batch.behaviour_logps.tolist() == pytest.approx([a.row.logprobs[2], a.row.logprobs[3], b.row.logprobs[1]])
    assert batch.advantages.tolist() == [2.0, 2.0, -1.0]
    assert batch.weights.tolist() == pytest.approx([0.1, 0.1, 0.3])
    assert batch.row_lengths == [4, 3]
    assert batch.row_index.tolist() == [0, 0, 1]
    assert fill_fraction([batch], 16) == 7 / 16


def unpacked_logprobs(model, batch, temperature: float) -> torch.Tensor:
    """Each row of the batch forwarded on its own; the logprob of every next token, laid out packed."""
    out = []
    for row in batch.input_ids[0].split(batch.row_lengths):
        with torch.no_grad():
            logits = model(input_ids=row[None]).logits[0].float() / temperature
        next_ids = torch.cat([row[1:], row[:1]])  # the last position predicts nothing we train
        out.append(torch.log_softmax(logits, -1).gather(-1, next_ids[:, None])[:, 0])
    return torch.cat(out)[batch.target_index]


@pytest.mark.parametrize("attn,split_rows", [("sdpa", False), ("eager", False), ("sdpa", True)])
def test_packed_logprobs_equal_unpacked_per_row_logprobs(model, attn, split_rows):
    model.config._attn_implementation = attn  # both CPU attention kernels must respect the row borders
    rng = random.Random(0)
    samples = []
    for i in range(7):
        n = rng.randint(2, 60)
        tokens = [rng.randrange(VOCAB) for _ in range(n)]
        mask = [0] + [rng.randint(0, 1) for _ in range(n - 1)]
        mask[-1] = 1
        samples.append(sample(tokens, mask, seed=i))
    batches = pack(samples, token_budget=128)
    assert len(batches) > 1 and any(len(b.row_lengths) > 1 for b in batches)
    for temperature in (1.0, 0.7):
        for batch in batches:
            with torch.no_grad():
                logps, entropy = packed_logprobs(model, batch, temperature, chunk_size=5, split_rows=split_rows)
            assert (logps - unpacked_logprobs(model, batch, temperature)).abs().max().item() < 1e-5
            assert entropy.shape == logps.shape and (entropy > 0).all()
    model.config._attn_implementation = "sdpa"


def test_packed_logprobs_carry_gradients_through_the_checkpointed_head(model):
    batch = pack([sample([3, 4, 5, 6], [0, 1, 1, 1])], token_budget=8)[0]
    logps, _ = packed_logprobs(model, batch, chunk_size=2)
    logps.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_under_bf16_autocast_the_head_and_logprobs_stay_float32(model):
    batch = pack([sample([3, 4, 5, 6, 7, 8], [0, 1, 1, 0, 1, 1])], token_budget=8)[0]
    with torch.no_grad():
        exact, _ = packed_logprobs(model, batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed, _ = packed_logprobs(model, batch)
    assert mixed.dtype == torch.float32
    assert (mixed - exact).abs().max().item() < 0.05


def test_one_packed_forward_only_with_flash_attention_and_attention_in_every_layer(model):
    from harness_rl.learner.packing import varlen_packing

    config = model.config
    saved = config._attn_implementation, getattr(config, "layer_types", None)
    try:
        assert not varlen_packing(model)  # sdpa: rows are forwarded one by one
        config._attn_implementation = "flash_attention_2"
        config.layer_types = ["full_attention", "sliding_attention"]
        assert varlen_packing(model)
        config.layer_types = ["linear_attention", "full_attention"]  # a hybrid model's recurrent layers
        assert not varlen_packing(model)
    finally:
        config._attn_implementation, config.layer_types = saved
