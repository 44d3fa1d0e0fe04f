"""Custom advantage estimators: (B,) and (B, T) results, loss weights, and their path into TRL's loss."""

import pytest
import torch

from trl_grpo_ext import GRPOExtTrainer, RolloutBatch, register_advantage
from trl_grpo_ext.advantages import group_advantages
from trl_grpo_ext.testing import tiny_dataset

from .conftest import make_config, varied_reward

SEEN: list[RolloutBatch] = []


@register_advantage("test_ramp")
def ramp_estimator(batch: RolloutBatch):
    """(B, T): the row's centred reward times a ramp over positions; token 0 weighted out of the loss."""
    SEEN.append(batch)
    rows = batch.local(group_advantages(batch.rewards, batch.num_generations, scale="none"))  # (B,)
    positions = torch.arange(batch.completion_ids.size(1), dtype=torch.float32) + 1.0  # (T,)
    advantages = rows.unsqueeze(1) * positions.unsqueeze(0)  # (B, T)
    advantages[:, 0] = 0.0
    weights = torch.ones_like(advantages)
    weights[:, 0] = 0.0
    return advantages, weights


@register_advantage("test_bad_shape")
def bad_shape_estimator(batch):
    return torch.zeros(3, 2)


def _trainer(tiny_model_path, tokenizer, tmp_path, estimator, **overrides):
    return GRPOExtTrainer(
        model=str(tiny_model_path),
        reward_funcs=varied_reward,
        args=make_config(tmp_path, advantage_estimator=estimator, **overrides),
        train_dataset=tiny_dataset(8),
        processing_class=tokenizer,
    )


def _generation_batch(trainer, n_prompts=1):
    rows = [dict(x) for x in tiny_dataset(n_prompts)]
    return [row for row in rows for _ in range(trainer.num_generations)]


def _grads(trainer, inputs):
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop; this test calls the loss directly
    trainer.model.zero_grad()
    trainer.compute_loss(trainer.model, inputs).backward()
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]).clone()


def test_token_level_advantages_and_weights_reach_the_loss(tiny_model_path, tokenizer, tmp_path):
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, "test_ramp", max_completion_length=6)
    trainer.model.train()
    SEEN.clear()
    out = trainer._generate_and_score_completions(_generation_batch(trainer))
    batch = SEEN[-1]
    assert batch.rewards.shape == (4,) and batch.rewards_per_func.shape == (4, 1)
    assert batch.completion_ids.shape == out["completion_ids"].shape
    assert out["advantages"].shape == out["completion_ids"].shape  # (B, T) reached TRL's output
    assert torch.equal(out["tool_mask"][:, 0], torch.zeros(4))  # the weights joined the loss mask
    assert out["num_items_in_batch"].item() == (out["completion_mask"][:, 1:]).sum().item()
    assert out["advantages"].abs().sum() > 0, "varied rewards should give non-zero advantages"

    base = _grads(trainer, out)
    assert base.abs().sum() > 0
    # Token 0 has weight 0: whatever its advantage, the gradient does not move.
    poked = dict(out, advantages=out["advantages"].clone())
    poked["advantages"][:, 0] = 100.0
    assert torch.equal(_grads(trainer, poked), base)
    # Token 1 has weight 1: its advantage is in the gradient.
    poked["advantages"][:, 1] += 1.0
    assert not torch.allclose(_grads(trainer, poked), base)


def test_token_level_estimator_trains(tiny_model_path, tokenizer, tmp_path):
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, "test_ramp")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    SEEN.clear()
    trainer.train()
    assert len(SEEN) == 3  # one generation batch per step
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)]
    assert "model.layers.1.self_attn.q_proj.weight" in changed
    # The completions table logs the advantages the loss used (row means over weighted tokens), not TRL's.
    logged = list(trainer._logs["advantages"])[-4:]
    assert any(abs(a) > 0 for a in logged)


def test_row_level_estimator_by_dotted_path(tiny_model_path, tokenizer, tmp_path):
    trainer = _trainer(
        tiny_model_path, tokenizer, tmp_path, "tests.test_estimator.dr_grpo_like", scale_rewards="group"
    )
    trainer.model.train()
    out = trainer._generate_and_score_completions(_generation_batch(trainer, 2))
    rewards = trainer.last_batch.rewards_per_func[:, 0]
    assert torch.allclose(out["advantages"], group_advantages(rewards, 4, scale="none"))
    assert "tool_mask" not in out  # no weights returned: the loss mask is TRL's own


def dr_grpo_like(batch):
    return batch.local(group_advantages(batch.rewards, batch.num_generations, scale="none"))


def test_group_advantages_match_trl(tiny_model_path, tokenizer, tmp_path):
    seen = []

    def spy(batch):
        seen.append(batch)
        return batch.advantages

    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, spy)
    trainer.model.train()
    trainer._generate_and_score_completions(_generation_batch(trainer, 2))
    batch = seen[0]
    assert torch.allclose(group_advantages(batch.rewards, 4), batch.advantages, atol=1e-6)


def test_bad_estimator_shape_is_a_clear_error(tiny_model_path, tokenizer, tmp_path):
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, "test_bad_shape")
    trainer.model.train()
    with pytest.raises(
        ValueError,
        match=r"'bad_shape_estimator' returned advantages of shape \(3, 2\); expected a tensor of shape \(4,\)",
    ):
        trainer._generate_and_score_completions(_generation_batch(trainer))


def scaled(batch, factor=1.0):
    return batch.advantages * factor


def test_a_partial_estimator_pickles_with_the_config(tiny_model_path, tokenizer, tmp_path):
    import functools
    import pickle

    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, functools.partial(scaled, factor=2.0))
    assert isinstance(pickle.loads(pickle.dumps(trainer.args)).advantage_estimator, functools.partial)
    trainer.model.train()
    out = trainer._generate_and_score_completions(_generation_batch(trainer))
    assert torch.allclose(out["advantages"], 2 * trainer.last_batch.advantages)
