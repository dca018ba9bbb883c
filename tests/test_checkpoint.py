"""Checkpoints: everything needed to resume is restored; the newest complete one is found; old ones pruned."""

import random

import pytest
import torch
from tiny_lm import build_tiny_lm

from harness_rl.learner.checkpoint import (
    TrainerState,
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_lm(tmp_path_factory.mktemp("tiny-lm"))


def trainer(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    return model, optimizer, scheduler


def train_one(model, optimizer, scheduler):
    loss = model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def test_round_trip_restores_weights_optimizer_schedule_rng_and_state(model_dir, tmp_path):
    model, optimizer, scheduler = trainer(model_dir)
    train_one(model, optimizer, scheduler)
    path = save_checkpoint(checkpoint_dir(tmp_path, 1), model, optimizer, scheduler,
                           TrainerState(step=1, policy_version=5, extra={"next_task": 17}))
    expected_rand, expected_py = torch.rand(3), random.random()
    train_one(model, optimizer, scheduler)
    expected_weights = [p.detach().clone() for p in model.parameters()]

    model2, optimizer2, scheduler2 = trainer(model_dir)
    state = load_checkpoint(path, model2, optimizer2, scheduler2)
    assert (state.step, state.policy_version, state.extra) == (1, 5, {"next_task": 17})
    assert torch.equal(torch.rand(3), expected_rand) and random.random() == expected_py
    assert scheduler2.get_last_lr() == pytest.approx([1e-2 / 2])
    train_one(model2, optimizer2, scheduler2)
    for a, b in zip(expected_weights, model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_checkpoint_saved_before_the_first_step_changes_no_later_step(model_dir, tmp_path):
    """torch's get_state_dict gives an optimizer that never stepped the state of one step at lr 0 (AdamW's step
    count 1): kept, every later update would differ. Neither the run that saved nor the one that loads keeps it."""
    torch.manual_seed(0)
    never_saved = trainer(model_dir)
    saved = trainer(model_dir)
    path = save_checkpoint(checkpoint_dir(tmp_path, 0), *saved, TrainerState(step=0, policy_version=0))
    assert not saved[1].state
    loaded = trainer(model_dir)
    load_checkpoint(path, *loaded)
    assert not loaded[1].state
    for run in (never_saved, saved, loaded):
        train_one(*run)
        train_one(*run)
    for a, b, c in zip(*(run[0].parameters() for run in (never_saved, saved, loaded)), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert loaded[1].state[next(loaded[0].parameters())]["step"] == 2


def test_latest_skips_partial_checkpoints_and_prune_keeps_the_newest(model_dir, tmp_path):
    model, optimizer, scheduler = trainer(model_dir)
    assert latest_checkpoint(tmp_path) is None
    for step in (1, 2, 10):
        save_checkpoint(checkpoint_dir(tmp_path, step), model, optimizer, scheduler, TrainerState(step, step))
    (tmp_path / "checkpoints" / "step-00000011.partial").mkdir()  # a save that crashed midway
    assert latest_checkpoint(tmp_path).name == "step-00000010"
    assert [p.name for p in prune_checkpoints(tmp_path, keep=2)] == ["step-00000001"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*[0-9]")) == ["step-00000002",
                                                                                      "step-00000010"]


def test_loading_something_that_is_not_a_checkpoint_says_so(model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        load_checkpoint(tmp_path, *trainer(model_dir))
