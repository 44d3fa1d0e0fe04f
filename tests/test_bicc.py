"""BiCC (conditioned rows after scoring) and RCC (the reward-confidence-corrected baseline), arXiv 2603.13134."""

import logging

import pytest
import torch
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from trl_grpo_ext import BiCCGRPOConfig, BiCCGRPOTrainer, GRPOExtTrainer, ProRLResetCallback
from trl_grpo_ext.advantages import rcc_advantages
from trl_grpo_ext.methods.bicc import pair_rows, with_context
from trl_grpo_ext.rewards import completion_text
from trl_grpo_ext.testing import tiny_dataset
from trl_grpo_ext.trainer import KEPT_ROWS, KEPT_TOTAL

from .conftest import make_config, script_generation


# ---------------------------------------------------------------------------------------------------- RCC by hand
def test_rcc_one_group_by_hand():
    # r = (1, 0, 1, 0), δ = (2, 0, 1, -3): mean r 0.5, mean δ 0; Cov = (0.5·2 - 0.5·0 + 0.5·1 - 0.5·-3) / 4 = 0.75;
    # b = 0.5 + 1.5 = 2.0; A = r - 2.
    rewards, ratio = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([2.0, 0.0, 1.0, -3.0])
    advantages = rcc_advantages(rewards, ratio, torch.zeros(4, dtype=torch.long))
    assert advantages.tolist() == pytest.approx([-1.0, -2.0, -1.0, -2.0])


def test_rcc_several_groups_by_hand():
    # Group 0: r = (1, 0), δ = (1, -1): Cov 0.5, b = 1.5. Group 1: r = (0, 0, 3), δ = (0, 3, 0): mean r 1, mean δ 1,
    # Cov = ((-1)(-1) + (-1)(2) + (2)(-1)) / 3 = -1, b = 1 - 2 = -1.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0])
    ratio = torch.tensor([1.0, -1.0, 0.0, 3.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 1])
    assert rcc_advantages(rewards, ratio, groups).tolist() == pytest.approx([-0.5, -1.5, 1.0, 1.0, 4.0])


def test_rcc_with_zero_covariance_is_mean_centring():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.2, 0.4])
    ratio = torch.tensor([0.3, 0.3, 0.3, 0.3, -1.0, -1.0])  # constant within each group: Cov = 0
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    assert rcc_advantages(rewards, ratio, groups).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, -0.1, 0.1])


def test_rcc_leaves_unscored_rows_out():
    rewards = torch.tensor([1.0, float("nan"), 0.0])
    advantages = rcc_advantages(rewards, torch.tensor([1.0, 50.0, -1.0]), torch.zeros(3, dtype=torch.long))
    assert advantages.tolist() == pytest.approx([-0.5, 0.0, -1.5])  # as the group (1, 0) with δ (1, -1)
    with pytest.raises(ValueError, match="shapes"):
        rcc_advantages(rewards, torch.zeros(2), torch.zeros(3, dtype=torch.long))


# ---------------------------------------------------------------------------------------------------- pairing
def test_pairing_rules():
    generator = torch.Generator().manual_seed(0)
    assert pair_rows([True, True], "random", generator) == []  # not mixed: nothing
    correct = [True, False, False, True]
    for _ in range(20):
        pairs = pair_rows(correct, "random", generator)
        assert [i for i, _ in pairs] == [0, 1, 2, 3] and all(correct[i] != correct[j] for i, j in pairs)
    assert pair_rows(correct, "all", generator, cap=16) == [(0, 1), (0, 2), (1, 0), (1, 3), (2, 0), (2, 3), (3, 1),
                                                            (3, 2)]  # fmt: skip
    capped = pair_rows(correct, "all", generator, cap=3)
    assert len(capped) == 3 and all(correct[i] != correct[j] for i, j in capped)
    assert pair_rows(correct, "confident", generator, [0.0, -1.0, -0.5, 0.0]) == [(0, 2), (1, 0), (2, 0), (3, 2)]


def test_the_opposite_answer_follows_the_question():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"}]
    assert with_context(chat, "3", " / ") == [chat[0], {"role": "user", "content": "1 + 1? / 3"}]
    assert chat[1]["content"] == "1 + 1?"  # the original is not touched
    assert with_context("Q: 1 + 1?", "3", "\n") == "Q: 1 + 1?\n3"
    with pytest.raises(ValueError, match="no user message"):
        with_context([{"role": "system", "content": "x"}], "3", " ")


# ---------------------------------------------------------------------------------------------------- scripted batch
def first_token_is_right(completions, **kwargs):
    """Correct when the completion starts with 'a' (the scripts below make rows 0 and 2 of each group start so)."""
    return [1.0 if completion_text(c).startswith("a") else 0.0 for c in completions]


first_token_is_right.correctness = True


def _scripts(tokenizer, words):
    return [tokenizer(w, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for w in words]


def _bicc_trainer(tiny_model_path, tokenizer, tmp_path, rewards=first_token_is_right, **overrides):
    args = make_config(tmp_path, BiCCGRPOConfig, **{"per_device_train_batch_size": 8, **overrides})
    return BiCCGRPOTrainer(model=str(tiny_model_path), reward_funcs=rewards, args=args, train_dataset=tiny_dataset(8),
                           processing_class=tokenizer)  # fmt: skip


def _generate(trainer, monkeypatch, tokenizer, words):
    script_generation(monkeypatch, trainer, _scripts(tokenizer, words))
    trainer.model.train()
    rows = [dict(row) for row in tiny_dataset(8).select([0, 1]) for _ in range(4)]
    return trainer._generate_and_score_completions(rows)


def test_rows_only_for_mixed_groups_with_context_mask_and_advantage(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    trainer = _bicc_trainer(tiny_model_path, tokenizer, tmp_path, bicc_context_fraction=0.25)  # 8 · 0.25: 2 tokens
    # Group 0 mixed (a b a b), group 1 all wrong (b ...): its rows get no partner.
    out = _generate(trainer, monkeypatch, tokenizer, ["a c d e", "b f g", "a c d e", "b f g"] + ["b f g"] * 4)
    batch = trainer.last_batch
    assert batch.num_scored == 8 and len(batch.added_from) == 4 and set(batch.added_from) == {0, 1, 2, 3}
    assert out["completion_ids"].size(0) == 12 and out[KEPT_ROWS].tolist() == [1.0] * 12
    for k, source in enumerate(batch.added_from):
        row = 8 + k
        assert torch.equal(out["completion_ids"][row], out["completion_ids"][source])
        assert torch.equal(out["completion_mask"][row], out["completion_mask"][source])
        assert out["advantages"][row] == out["advantages"][source]
        prompt = tokenizer.decode(out["prompt_ids"][row][out["prompt_mask"][row].bool()])
        question = batch.prompts[source][-1]["content"]
        opposite = tokenizer.decode(_scripts(tokenizer, ["b f g" if source in (0, 2) else "a c d e"])[0][:2])
        assert opposite in ("b ", "a ", "b f", "a c")  # the opposite answer's first 2 tokens
        assert question + "\n\nAnother answer to this question, for comparison:\n" + opposite in prompt
        assert batch.prompts[row][-1]["content"].endswith(opposite)
    assert out["advantages"][:4].abs().min() > 0  # the mixed group carries a signal, which the new rows keep
    assert out["num_items_in_batch"].item() == out["completion_mask"].sum().item()
    metrics = trainer._metrics["train"]
    assert metrics["bicc/rows_added"] == [4.0] and metrics["bicc/mixed_groups"] == [0.5]
    assert 2 <= metrics["bicc/pairs"][0] <= 4  # each row one random opposite: 2 to 4 distinct pairs
    assert len(trainer._logs["advantages"]) == 8  # the completions table holds the scored rows only


def first_group_mixed(completions, **kwargs):
    """Right, wrong, right, wrong in the first group; all wrong in the second."""
    return [float(i % 2 == 0 and i < 4) for i in range(len(completions))]


first_group_mixed.correctness = True


def _kept_rows_alone(out, rows):
    # The dict a user would build by hand from the kept rows: TRL's layout, with no row marks.
    index = torch.tensor(rows)
    alone = {k: v[index] for k, v in out.items() if isinstance(v, torch.Tensor) and v.dim() and k != KEPT_ROWS}
    alone["num_items_in_batch"] = (alone["completion_mask"] * alone["tool_mask"]).sum()
    return alone


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_the_loss_with_added_rows_is_the_loss_over_the_same_rows_built_by_hand(
    tiny_model_path, tokenizer, tmp_path, monkeypatch, loss_type
):
    # Two micro-batches per generation (steps_per_generation = accumulation = 2), pairing "all" capped at 3: 11 rows,
    # so one filler row; old log-probs (num_iterations 2) and a KL term (beta) must hold for the new contexts too.
    trainer = _bicc_trainer(tiny_model_path, tokenizer, tmp_path, rewards=first_group_mixed, loss_type=loss_type,
                            per_device_train_batch_size=4, gradient_accumulation_steps=2, bicc_pairing="all",
                            bicc_max_pairs=3, num_iterations=2, beta=0.1)  # fmt: skip
    assert trainer.args.steps_per_generation == 2
    trainer.model.train()
    out = trainer._generate_and_score_completions([dict(r) for r in tiny_dataset(8).select([0, 1]) for _ in range(4)])
    assert out["completion_ids"].size(0) == 12 and out[KEPT_ROWS].tolist() == [1.0] * 11 + [0.0]
    assert out[KEPT_TOTAL].item() == 11 and trainer._metrics["train"]["added_rows/filler"] == [1.0]
    # The new rows' old and reference log-probs are those of their completion after their own context.
    for key, reference in (("old_per_token_logps", False), ("ref_per_token_logps", True)):
        direct = trainer.completion_logps(out["prompt_ids"][8:], out["prompt_mask"][8:], out["completion_ids"][8:],
                                          out["completion_mask"][8:], reference=reference)  # fmt: skip
        mask = out["completion_mask"][8:].bool()
        assert torch.allclose(out[key][8:][mask], direct[mask], atol=1e-5)
    with torch.no_grad():
        torch.manual_seed(0)
        shuffled = shuffle_sequence_dict(dict(out))  # as TRL's `_prepare_inputs`, before it splits
        trainer.current_gradient_accumulation_steps = 2
        chunked = sum(trainer.compute_loss(trainer.model, chunk) for chunk in split_tensor_dict(shuffled, 2))
        # By hand: the 11 real rows as one micro-batch of a generation batch of their own (one step, one slice).
        trainer.current_gradient_accumulation_steps, trainer.args.steps_per_generation = 1, 1
        by_hand = trainer.compute_loss(trainer.model, _kept_rows_alone(out, list(range(11))))
    assert by_hand.abs() > 0
    assert chunked.item() == pytest.approx(by_hand.item(), rel=1e-4, abs=1e-6)


# ---------------------------------------------------------------------------------------------------- training
def test_bicc_trains_and_logs(tiny_model_path, tokenizer, tmp_path):
    trainer = _bicc_trainer(tiny_model_path, tokenizer, tmp_path, rewards=alternating_correct, max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    logs = [log for log in trainer.state.log_history if "bicc/rows_added" in log]
    assert len(logs) == 2 and all(log["bicc/rows_added"] == 8 and log["bicc/pairs"] >= 4 for log in logs)


def alternating_correct(completions, **kwargs):
    """Every group mixed: rows alternate right and wrong."""
    return [float(i % 2) for i in range(len(completions))]


alternating_correct.correctness = True


def test_bicc_composes_with_curriculum_prorl_and_dynamic_sampling(tiny_model_path, tokenizer, tmp_path):
    args = make_config(tmp_path, BiCCGRPOConfig, per_device_train_batch_size=8, max_steps=2, beta=0.01,
                       dynamic_sampling=True, budget_start=8, budget_end=4, budget_decays=1, budget_total_steps=2,
                       budget_caps_generation=True, advantage_estimator="rcc", bicc_pairing="confident")  # fmt: skip
    trainer = BiCCGRPOTrainer(model=str(tiny_model_path), reward_funcs=alternating_correct, args=args,
                              train_dataset=tiny_dataset(8), processing_class=tokenizer,
                              callbacks=[ProRLResetCallback(every_n_steps=1)])  # fmt: skip
    assert {e.name for e in trainer.extensions} >= {"bicc", "dynamic_sampling", "curriculum", "prorl"}
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    log = next(log for log in trainer.state.log_history if "bicc/rows_added" in log)
    assert log["bicc/rows_added"] == 8 and "rcc/covariance" in log and "dynamic_sampling/kept_fraction" in log


def test_rcc_builds_a_reference_at_beta_zero_and_uses_the_log_ratio(tiny_model_path, tokenizer, tmp_path, caplog):
    args = make_config(tmp_path, advantage_estimator="rcc", per_device_train_batch_size=8, max_steps=1)
    with caplog.at_level(logging.WARNING, logger="trl_grpo_ext"):
        trainer = GRPOExtTrainer(model=str(tiny_model_path), reward_funcs=alternating_correct, args=args,
                                 train_dataset=tiny_dataset(8), processing_class=tokenizer)  # fmt: skip
    assert "frozen reference is built anyway" in caplog.text
    assert trainer.ref_model is not None and trainer.beta == 0.0 and trainer.args.beta == 0.0
    with torch.no_grad():  # move the policy away from the reference, so that δ is not 0
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    trainer.model.train()
    out = trainer._generate_and_score_completions([dict(r) for r in tiny_dataset(8).select([0, 1]) for _ in range(4)])
    batch = trainer.last_batch
    args_ = (out["prompt_ids"], out["prompt_mask"], out["completion_ids"], out["completion_mask"])
    mask = out["completion_mask"]
    delta = ((trainer.completion_logps(*args_) - trainer.completion_logps(*args_, reference=True)) * mask).sum(1)
    assert delta.abs().max() > 1e-3 and torch.allclose(batch.seq_log_ratio, delta, atol=1e-4)
    expected = rcc_advantages(batch.rewards, delta, batch.group_ids)
    assert torch.allclose(out["advantages"], expected, atol=1e-4)
    assert "ref_per_token_logps" not in out  # beta = 0: no KL term in the loss
    assert trainer._metrics["train"]["rcc/covariance"]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


# ---------------------------------------------------------------------------------------------------- bad input
def test_a_reward_that_does_not_exist_fails_before_the_model_loads(tmp_path):
    args = make_config(tmp_path, BiCCGRPOConfig, bicc_reward="correctness", per_device_train_batch_size=4)
    with pytest.raises(ValueError, match=r"bicc_reward='correctness' is not one of this trainer's rewards \['length"):
        BiCCGRPOTrainer(model=str(tmp_path / "no-model"), reward_funcs=[length_reward], args=args,
                        train_dataset=tiny_dataset(4))  # fmt: skip
    with pytest.raises(ValueError, match="no reward is marked as correctness"):
        BiCCGRPOTrainer(model=str(tmp_path / "no-model"), reward_funcs=[length_reward],
                        args=make_config(tmp_path, BiCCGRPOConfig), train_dataset=tiny_dataset(4))  # fmt: skip


def length_reward(completions, **kwargs):
    return [float(len(completion_text(c))) for c in completions]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"bicc": False, "bicc_pairing": "all"}, "bicc_pairing='all' is set, but bicc=False"),
        ({"bicc_pairing": "best"}, "bicc_pairing='best' is not one of"),
        ({"bicc_context_fraction": 0.0}, r"bicc_context_fraction=0.0 must be in \(0, 1\]"),
        ({"bicc_max_pairs": 4}, "bicc_max_pairs=4 caps bicc_pairing='all'"),
        ({"bicc_context_budget": 0}, "bicc_context_budget=0 must be a whole number"),
    ],
)
def test_config_errors(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_config(tmp_path, BiCCGRPOConfig, **overrides)
