"""Dynamic sampling: zero-variance groups leave the loss; refills are bounded."""

import logging

import pytest
import torch

from trl_grpo_ext import GRPOExtTrainer
from trl_grpo_ext.advantages import group_advantages
from trl_grpo_ext.sampling import splice_rows, varied_groups
from trl_grpo_ext.testing import tiny_dataset

from .conftest import make_config, varied_reward


def test_varied_groups_hand_computed():
    nan = float("nan")
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, nan, 0.5, nan, nan, 2.0])
    # [1,1,1] flat; [0,1,0] varies; [0.5,NaN,0.5] flat once NaN is ignored; [NaN,NaN,2] one scored row: flat
    assert varied_groups(rewards, 3).tolist() == [False, True, False, False]


def test_splice_rows_pads_to_a_common_width():
    base = {
        "prompt_ids": torch.tensor([[9, 1, 2], [1, 2, 3]]),  # left-padded with 9
        "completion_ids": torch.tensor([[4, 9], [5, 6]]),  # right-padded with 9
        "advantages": torch.tensor([0.5, -0.5]),
        "num_items_in_batch": torch.tensor(3.0),
    }
    extra = {
        "prompt_ids": torch.tensor([[7, 8]]),
        "completion_ids": torch.tensor([[1, 2, 3, 4]]),
        "advantages": torch.tensor([2.0]),
        "num_items_in_batch": torch.tensor(4.0),
    }
    out = splice_rows(base, extra, {1: 0}, {"prompt_ids": 9, "completion_ids": 9}, left_padded={"prompt_ids"})
    assert out["prompt_ids"].tolist() == [[9, 1, 2], [9, 7, 8]]
    assert out["completion_ids"].tolist() == [[4, 9, 9, 9], [1, 2, 3, 4]]
    assert out["advantages"].tolist() == [0.5, 2.0]
    assert out["num_items_in_batch"].item() == 3.0  # scalars are recomputed by the caller
    with pytest.raises(ValueError, match="different keys"):
        splice_rows(base, {"advantages": extra["advantages"]}, {1: 0}, {}, set())


def flat_for_small_sums(completions, solution, **kwargs):
    """Constant 1.0 for problems whose answer is below 8 (their groups have zero variance); varied otherwise."""
    varied = varied_reward(completions)
    return [1.0 if int(s) < 8 else v for s, v in zip(solution, varied)]


def always_one(completions, **kwargs):
    return [1.0] * len(completions)


def _trainer(tiny_model_path, tokenizer, tmp_path, reward, dataset, **overrides):
    args = make_config(tmp_path, dynamic_sampling=True, per_device_train_batch_size=8, **overrides)
    return GRPOExtTrainer(model=str(tiny_model_path), reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer)  # fmt: skip


def _rows(rows, group=4):
    return [dict(row) for row in rows for _ in range(group)]


def test_drops_exactly_the_zero_variance_groups(tiny_model_path, tokenizer, tmp_path):
    dataset = tiny_dataset(16)
    small = next(row for row in dataset if int(row["solution"]) < 8)
    large = next(row for row in dataset if int(row["solution"]) >= 8)
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, flat_for_small_sums, dataset)
    trainer.model.train()
    out = trainer._generate_and_score_completions(_rows([small, large]))
    rewards = trainer.last_scoring["rewards_per_func"][:, 0]
    assert rewards[:4].tolist() == [1.0] * 4 and rewards[4:].std() > 0
    assert out["advantages"][:4].tolist() == [0.0] * 4
    assert out["tool_mask"][:4].sum() == 0 and out["tool_mask"][4:].eq(1).all()  # dropped rows leave the loss
    # The kept group's advantages are TRL's, untouched: (r - mean) / (std + 1e-4) over its 4 rows.
    assert torch.allclose(out["advantages"][4:], group_advantages(rewards[4:], 4), atol=1e-6)
    assert out["num_items_in_batch"].item() == out["completion_mask"][4:].sum().item()
    assert trainer._metrics["train"]["dynamic_sampling/kept_fraction"] == [0.5]


def test_refill_replaces_dropped_groups_with_fresh_prompts(tiny_model_path, tokenizer, tmp_path):
    dataset = tiny_dataset(16)
    small = next(row for row in dataset if int(row["solution"]) < 8)
    large = next(row for row in dataset if int(row["solution"]) >= 8)
    large_only = dataset.filter(lambda row: int(row["solution"]) >= 8)  # refills can only draw varied prompts
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, flat_for_small_sums, large_only,
                       dynamic_sampling_max_rounds=2)  # fmt: skip
    trainer.model.train()
    out = trainer._generate_and_score_completions(_rows([small, large]))
    assert out["tool_mask"].eq(1).all(), "the flat group was replaced, so no row is dropped"
    assert out["advantages"][:4].abs().sum() > 0
    prompt = tokenizer.decode(out["prompt_ids"][0][out["prompt_mask"][0].bool()])
    assert f"What is {small['prompt'][1]['content'][8:]}" not in prompt  # row 0 now holds another problem
    assert trainer._metrics["train"]["dynamic_sampling/refill_rounds"] == [1]
    assert trainer._metrics["train"]["dynamic_sampling/final_kept_fraction"] == [1.0]
    assert out["num_items_in_batch"].item() == out["completion_mask"].sum().item()


def test_refill_is_bounded_then_drops_and_warns(tiny_model_path, tokenizer, tmp_path, caplog):
    dataset = tiny_dataset(8)
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, always_one, dataset, dynamic_sampling_max_rounds=3)
    trainer.model.train()
    calls = []
    original = trainer._score_batch
    trainer._score_batch = lambda inputs: calls.append(len(inputs)) or original(inputs)
    with caplog.at_level(logging.WARNING, logger="trl_grpo_ext"):
        out = trainer._generate_and_score_completions(_rows(list(dataset)[:2]))
    assert calls == [8, 8, 8, 8]  # the batch, then exactly 3 refill rounds of 2 groups
    assert out["tool_mask"].sum() == 0 and out["advantages"].abs().sum() == 0
    assert "2 group(s) still have zero reward variance after dynamic_sampling_max_rounds=3" in caplog.text
    assert trainer._metrics["train"]["dynamic_sampling/final_kept_fraction"] == [0.0]


def test_dynamic_sampling_trains_and_logs(tiny_model_path, tokenizer, tmp_path):
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, flat_for_small_sums, tiny_dataset(16), max_steps=2,
                       dynamic_sampling_max_rounds=1)  # fmt: skip
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [log for log in trainer.state.log_history if "dynamic_sampling/kept_fraction" in log]
    assert len(logs) == 2 and all(0 <= log["dynamic_sampling/kept_fraction"] <= 1 for log in logs)
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_dynamic_sampling_config_errors(tmp_path):
    with pytest.raises(ValueError, match="dynamic_sampling=False"):
        make_config(tmp_path, dynamic_sampling_max_rounds=2)
    with pytest.raises(ValueError, match="dynamic_sampling_max_rounds=-1"):
        make_config(tmp_path, dynamic_sampling=True, dynamic_sampling_max_rounds=-1)
