"""Dynamic sampling: zero-variance groups leave the loss (normalised over the kept rows); refills are bounded."""

import logging

import pytest
import torch

from trl_grpo_ext import GRPOExtTrainer
from trl_grpo_ext.advantages import group_advantages
from trl_grpo_ext.methods.dynamic_sampling import varied_groups
from trl_grpo_ext.testing import tiny_dataset
from trl_grpo_ext.trainer import KEPT_ROWS, _splice_tensors

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
    rows, sources = torch.tensor([1]), torch.tensor([0])
    out = _splice_tensors(base, extra, rows, sources, {"prompt_ids": 9, "completion_ids": 9}, {"prompt_ids"})
    assert out["prompt_ids"].tolist() == [[9, 1, 2], [9, 7, 8]]
    assert out["completion_ids"].tolist() == [[4, 9, 9, 9], [1, 2, 3, 4]]
    assert out["advantages"].tolist() == [0.5, 2.0]
    assert out["num_items_in_batch"].item() == 3.0  # scalars are recomputed by the caller
    with pytest.raises(ValueError, match="different keys"):
        _splice_tensors(base, {"advantages": extra["advantages"]}, rows, sources, {}, set())


def flat_for_small_sums(completions, solution, **kwargs):
    """Constant 1.0 for problems whose answer is below 8 (their groups have zero variance); varied otherwise."""
    varied = varied_reward(completions)
    return [1.0 if int(s) < 8 else v for s, v in zip(solution, varied, strict=False)]


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
    rewards = trainer.last_batch.rewards_per_func[:, 0]
    assert rewards[:4].tolist() == [1.0] * 4 and rewards[4:].std() > 0
    assert out["advantages"][:4].tolist() == [0.0] * 4
    assert out["tool_mask"][:4].sum() == 0 and out["tool_mask"][4:].eq(1).all()  # dropped rows leave the loss
    assert out[KEPT_ROWS].tolist() == [0.0] * 4 + [1.0] * 4
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
    assert "tool_mask" not in out and KEPT_ROWS not in out, "the flat group was replaced, so no row is dropped"
    assert out["advantages"][:4].abs().sum() > 0
    prompt = tokenizer.decode(out["prompt_ids"][0][out["prompt_mask"][0].bool()])
    assert f"What is {small['prompt'][1]['content'][8:]}" not in prompt  # row 0 now holds another problem
    assert trainer._metrics["train"]["dynamic_sampling/refill_rounds"] == [1]
    assert trainer._metrics["train"]["dynamic_sampling/final_kept_fraction"] == [1.0]
    assert out["num_items_in_batch"].item() == out["completion_mask"].sum().item()
    # Generated tokens add the batch's 8 rows and the refill's 4 (TRL logs one mean length per batch).
    main_length, refill_length = trainer._metrics["train"]["completions/mean_length"]
    assert trainer._metrics["train"]["dynamic_sampling/generated_tokens"] == [8 * main_length + 4 * refill_length]


def test_refill_is_bounded_then_drops_and_warns(tiny_model_path, tokenizer, tmp_path, caplog):
    dataset = tiny_dataset(8)
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, always_one, dataset, dynamic_sampling_max_rounds=3)
    trainer.model.train()
    calls = []
    original = trainer.score_rows
    trainer.score_rows = lambda rows, until=None: calls.append(len(rows)) or original(rows, until)
    with caplog.at_level(logging.WARNING, logger="trl_grpo_ext"):
        out = trainer._generate_and_score_completions(_rows(list(dataset)[:2]))
    assert calls == [8, 8, 8, 8]  # the batch, then exactly 3 refill rounds of 2 groups
    assert out["tool_mask"].sum() == 0 and out["advantages"].abs().sum() == 0
    assert "2 group(s) still have zero variance after dynamic_sampling_max_rounds=3" in caplog.text
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


def _kept_only(out: dict, kept: list[int]) -> dict:
    """TRL's output dict of the kept rows alone, as if the dropped rows had never been generated."""
    rows = torch.tensor(kept)
    alone = {k: (v[rows] if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in out.items() if k != KEPT_ROWS}
    alone["tool_mask"] = torch.ones_like(alone["completion_mask"])
    alone["num_items_in_batch"] = alone["completion_mask"].sum()
    return alone


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "bnpo", "dapo"])
def test_drop_only_loss_equals_the_loss_over_the_kept_rows(tiny_model_path, tokenizer, tmp_path, loss_type):
    dataset = tiny_dataset(16)
    small = next(row for row in dataset if int(row["solution"]) < 8)
    large = next(row for row in dataset if int(row["solution"]) >= 8)
    trainer = _trainer(
        tiny_model_path, tokenizer, tmp_path, flat_for_small_sums, dataset, loss_type=loss_type, beta=0.1
    )  # fmt: skip (a KL term too: it must be averaged over the kept rows as well)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop; this test calls the loss directly
    out = trainer._generate_and_score_completions(_rows([small, large]))
    assert out[KEPT_ROWS].tolist() == [0.0] * 4 + [1.0] * 4
    with torch.no_grad():
        dropped = trainer.compute_loss(trainer.model, out)
        alone = trainer.compute_loss(trainer.model, _kept_only(out, [4, 5, 6, 7]))
        plain = trainer.compute_loss(trainer.model, {k: v for k, v in out.items() if k != KEPT_ROWS})
    assert alone.abs() > 0
    assert dropped.item() == pytest.approx(alone.item(), rel=1e-5, abs=1e-7)
    if loss_type in ("grpo", "dr_grpo"):  # per-row normalised: without the rescale the loss would shrink by 4/8
        assert plain.item() == pytest.approx(alone.item() / 2, rel=1e-5, abs=1e-7)


def correct_for_small_sums(completions, solution, **kwargs):
    """A correctness reward: always right on problems whose answer is below 8 (no signal there), alternating else."""
    return [1.0 if int(s) < 8 else float(i % 2) for i, s in enumerate(solution)]


correct_for_small_sums.correctness = True


def test_the_filter_reads_the_correctness_reward_by_default(tiny_model_path, tokenizer, tmp_path):
    dataset = tiny_dataset(16)
    small = next(row for row in dataset if int(row["solution"]) < 8)
    large = next(row for row in dataset if int(row["solution"]) >= 8)
    rewards = [correct_for_small_sums, varied_reward]  # the brevity-like term varies in every group
    for filter_reward, kept in ((None, 0.5), ("total", 1.0), ("varied_reward", 1.0),
                                ("correct_for_small_sums", 0.5)):  # fmt: skip
        trainer = _trainer(tiny_model_path, tokenizer, tmp_path, rewards, dataset,
                           dynamic_sampling_reward=filter_reward)  # fmt: skip
        trainer.model.train()
        trainer._generate_and_score_completions(_rows([small, large]))
        assert trainer._metrics["train"]["dynamic_sampling/kept_fraction"] == [kept], filter_reward
    with pytest.raises(ValueError, match="dynamic_sampling_reward='accuracy' is not one of this trainer's rewards"):
        _trainer(tiny_model_path, tokenizer, tmp_path, rewards, dataset, dynamic_sampling_reward="accuracy")
