"""PTA-GRPO: plan values, per-token advantages, staged rollouts that share each plan, cold-start data."""

import pytest
import torch
from trl import GRPOTrainer

from trl_grpo_ext import GRPOExtConfig, PTAGRPOConfig, PTAGRPOTrainer, get_reward
from trl_grpo_ext.advantages import plan_values, pta_token_advantages
from trl_grpo_ext.data import pta_sft_dataset, pta_sft_example
from trl_grpo_ext.rewards import PlanValueReward
from trl_grpo_ext.rollouts import truncate_at_tag
from trl_grpo_ext.testing import cpu_test_config_kwargs, tiny_dataset


def test_plan_values_hand_computed():
    outcomes = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, float("nan")])
    plan_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    # plan 0: (1 + 0 + 1) / 3 = 2/3; plan 1: 0; plan 2: NaN left out -> (1 + 1) / 2 = 1
    expected = torch.tensor([2 / 3] * 3 + [0.0] * 3 + [1.0] * 3)
    assert torch.allclose(plan_values(outcomes, plan_ids), expected)
    # plan ids need not be sorted or contiguous
    assert plan_values(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([7, 3, 7])).tolist() == [0.5, 0.0, 0.5]


def test_pta_group_token_advantages_hand_computed():
    # One PTA group, m = 2 plans x z = 2 continuations. Rewards r = outcome + plan value (format left out):
    # plan 0: outcomes 1, 0 -> value 0.5 -> r = 1.5, 0.5; plan 1: outcomes 0, 0 -> value 0 -> r = 0, 0
    rewards = torch.tensor([1.5, 0.5, 0.0, 0.0])
    # mean 0.5; sample std sqrt((1 + 0 + 0.25 + 0.25) / 3) = sqrt(0.5) = 0.7071
    row = (rewards - 0.5) / (0.5**0.5 + 1e-4)  # [1.4140, 0, -0.7070, -0.7070]
    segments = torch.tensor([[0, 0, 1, 1, -1], [0, 0, 1, -1, -1], [0, 1, 1, 1, 1], [0, 1, -1, -1, -1]])
    out = pta_token_advantages(row, torch.tensor([0, 0, 1, 1]), segments)
    plan0, plan1 = (row[0] + row[1]) / 2, (row[2] + row[3]) / 2  # 0.7070 and -0.7070
    expected = torch.tensor(
        [
            [plan0, plan0, row[0], row[0], 0.0],  # plan tokens share the plan's mean; continuation keeps its own
            [plan0, plan0, row[1], 0.0, 0.0],
            [plan1, row[2], row[2], row[2], row[2]],
            [plan1, row[3], 0.0, 0.0, 0.0],
        ]
    )
    assert torch.allclose(out, expected, atol=1e-6)
    assert out[0, 0].item() == pytest.approx(0.7070, abs=1e-3)


def test_plan_value_reward_and_normalisation():
    outcome = get_reward("contains_solution")
    completions = ["7", "x", "7", "x", "x", "x"]
    kwargs = dict(solution=["7"] * 6, plan_id=[0, 0, 1, 1, 2, 2], plan_group=[0] * 6)
    # plan values 0.5, 0.5, 0
    assert PlanValueReward(outcome)(completions, **kwargs) == [0.5, 0.5, 0.5, 0.5, 0.0, 0.0]
    # across the 3 plans: mean 1/3, sample std sqrt((1/36 + 1/36 + 1/9) / 2) = 0.2887
    normalised = PlanValueReward(outcome, normalize=True)(completions, **kwargs)
    assert normalised[0] == pytest.approx((0.5 - 1 / 3) / (0.288675 + 1e-4), abs=1e-4)
    assert normalised[4] == pytest.approx((0 - 1 / 3) / (0.288675 + 1e-4), abs=1e-4)
    with pytest.raises(ValueError, match="needs `plan_id`"):
        PlanValueReward(outcome)(completions, solution=["7"] * 6)


def test_truncate_at_tag(tokenizer):
    ids = tokenizer("<plan>add them</plan><think>3</think>", add_special_tokens=False)["input_ids"]
    cut, closed = truncate_at_tag(ids, tokenizer, "</plan>")
    assert closed and tokenizer.decode(cut) == "<plan>add them</plan>"
    assert truncate_at_tag(ids[:3], tokenizer, "</plan>") == (ids[:3], False)


def test_config_requires_m_times_z_equal_num_generations(tmp_path):
    kwargs = dict(output_dir=str(tmp_path), **cpu_test_config_kwargs())
    with pytest.raises(ValueError, match=r"num_plans \* continuations_per_plan \(3\*3=9\) must equal num_generations \(8\)"):
        GRPOExtConfig(num_plans=3, continuations_per_plan=3, **kwargs)
    with pytest.raises(ValueError, match="continuations_per_plan=None must be a whole number"):
        GRPOExtConfig(num_plans=2, num_generations=4, **kwargs)
    config = PTAGRPOConfig(**kwargs)
    assert (config.num_plans, config.continuations_per_plan, config.num_generations) == (3, 3, 9)


def _pta_trainer(tiny_model_path, tokenizer, tmp_path, reward_funcs=None, **overrides):
    args = PTAGRPOConfig(
        output_dir=str(tmp_path / "out"), num_plans=2, continuations_per_plan=2, num_generations=4,
        per_device_train_batch_size=8, max_completion_length=6, plan_max_tokens=5, max_steps=2, learning_rate=1e-2,
        seed=0, **{**cpu_test_config_kwargs(), **overrides},
    )  # fmt: skip
    return PTAGRPOTrainer(model=str(tiny_model_path), reward_funcs=reward_funcs, args=args,
                          train_dataset=tiny_dataset(8), processing_class=tokenizer)  # fmt: skip


def test_staged_rollout_shares_each_plan(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    calls = []
    original = GRPOTrainer._generate_single_turn

    def spy(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        calls.append((len(prompt_ids), num_generations, [list(p) for p in prompt_ids]))
        return original(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", spy)
    trainer = _pta_trainer(tiny_model_path, tokenizer, tmp_path)
    assert trainer.reward_func_names == ["accuracy_reward", "plan_value", "tag_format_plan_think_answer"]
    trainer.model.train()
    rows = [dict(row) for row in tiny_dataset(2) for _ in range(4)]
    out = trainer._generate_and_score_completions(rows)
    # Stage 1: 2 prompts x 2 plans, blocks of m = 2; stage 2: 8 rows in blocks of z = 2.
    assert [(n, block) for n, block, _ in calls] == [(4, 2), (8, 2)]
    ids, segments = out["completion_ids"], out["segment_ids"]
    plans = []
    for row in range(8):
        plan = ids[row][segments[row] == 0].tolist()
        assert 1 <= len(plan) <= 5  # plan_max_tokens
        plans.append(tuple(plan))
    # Exactly m = 2 plan prefixes per prompt, each shared token for token by its z = 2 rows.
    for prompt in range(2):
        block = plans[prompt * 4 : prompt * 4 + 4]
        assert block[0] == block[1] and block[2] == block[3]
        assert len(set(block)) == 2 or block[0] == block[2]  # two samples may coincide by chance, never split
    # The continuation rows were generated from prompt + plan.
    assert calls[1][2][0][-len(plans[0]) :] == list(plans[0])
    # Plan tokens carry the plan's advantage: equal across its z rows.
    adv = out["advantages"]
    assert adv.shape == ids.shape
    for start in range(0, 8, 2):
        n = len(plans[start])
        assert segments[start, n] == 1 and segments[start + 1, n] == 1  # both rows continue the plan
        # the first continuation token carries the row's own advantage; the plan tokens, the mean of the two
        assert torch.allclose(adv[start : start + 2, :n], adv[start : start + 2, n].mean().expand(2, n), atol=1e-6)
    metrics = trainer._metrics["train"]
    assert metrics["pta/generated_tokens"][0] < metrics["pta/independent_tokens"][0]
    assert 0 < metrics["pta/tokens_saved_fraction"][0] < 1


def test_unclosed_plan_is_handled_and_trains(tiny_model_path, tokenizer, tmp_path):
    from .conftest import varied_reward

    # The random tiny model never writes </plan> within 5 tokens: every plan is unclosed.
    rewards = [varied_reward, get_reward("tag_format", tags=["plan", "think", "answer"])]
    trainer = _pta_trainer(tiny_model_path, tokenizer, tmp_path, reward_funcs=rewards)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["pta/plans_closed"] == 0.0
    assert log["rewards/tag_format_plan_think_answer/mean"] == 0.0  # the documented rule: no format reward
    assert log["pta/generated_tokens"] < log["pta/independent_tokens"]
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_cold_start_formatter():
    example = pta_sft_example("What is 2 + 3?", "Add the numbers.", "2 + 3 = 5", "5")
    assert example["prompt"][0]["role"] == "system" and example["prompt"][1]["content"] == "What is 2 + 3?"
    assert example["completion"][0]["content"] == "<plan>Add the numbers.</plan><think>2 + 3 = 5</think><answer>5</answer>"
    assert get_reward("tag_format", tags=["plan", "think", "answer"])(completions=[example["completion"]]) == [1.0]
    from datasets import Dataset

    rows = Dataset.from_dict({"q": ["1+1?"], "plan": ["Add."], "reasoning": ["1+1=2"], "answer": ["2"]})
    assert pta_sft_dataset(rows, question="q")[0]["completion"][0]["content"].startswith("<plan>Add.</plan>")
    with pytest.raises(KeyError, match=r"columns \['question'\] not in the dataset"):
        pta_sft_dataset(rows)
    with pytest.raises(ValueError, match="plan='' must be non-empty"):
        pta_sft_example("q", "", "r", "a")


def test_closed_plans_are_cut_at_the_tag(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    t = tokenizer.convert_tokens_to_ids
    eos = t("<|im_end|>")
    plan_out = [t("<plan>"), 40, t("</plan>"), t("<think>"), 41]  # the model runs past </plan>
    answer_out = [t("<answer>"), 42, t("</answer>"), eos]

    stops = []

    def backend(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        stage_one = num_generations == 2 and len(prompt_ids) == 4
        stops.append((list(self.eos_token_ids), list(self.generation_config.eos_token_id)))
        return [list(plan_out if stage_one else answer_out) for _ in prompt_ids], None

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", backend)
    trainer = _pta_trainer(tiny_model_path, tokenizer, tmp_path)
    trainer.model.train()
    out = trainer._generate_and_score_completions([dict(row) for row in tiny_dataset(2) for _ in range(4)])
    plan = [t("<plan>"), 40, t("</plan>")]
    assert out["completion_ids"][0, :7].tolist() == plan + answer_out  # cut right after </plan>, then continued
    assert out["segment_ids"][0, :7].tolist() == [0, 0, 0, 1, 1, 1, 1]
    metrics = trainer._metrics["train"]
    assert metrics["pta/plans_closed"] == [1.0]
    # generated: 4 plans x 5 tokens + 8 continuations x 4; independent: 8 rows x (3 + 4)
    assert metrics["pta/generated_tokens"] == [4 * 5 + 8 * 4] and metrics["pta/independent_tokens"] == [8 * 7]
    assert trainer.last_scoring["rewards_per_func"][:, 2].tolist() == [0.0] * 8  # no <think>: strict format fails
    # The plan stage stops generating at </plan> (a single token here); the continuation stage does not.
    (plan_eos, plan_config_eos), (cont_eos, cont_config_eos) = stops
    assert t("</plan>") in plan_eos and t("</plan>") in plan_config_eos
    assert t("</plan>") not in cont_eos and t("</plan>") not in cont_config_eos
    assert t("</plan>") not in trainer.eos_token_ids  # restored after the stage
