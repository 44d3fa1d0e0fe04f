"""Curriculum GRPO: the budget schedule, the length rewards, and the budget in training."""

import pytest
import torch

from trl_grpo_ext import CurriculumGRPOTrainer, GRPOExtTrainer, TokenBudgetCurriculum, TrainerInputs, get_reward
from trl_grpo_ext.methods.curriculum import band_length_score, budget_at, triangular_length_score
from trl_grpo_ext.testing import tiny_dataset

from .conftest import make_config, varied_reward

PAPER = dict(start=256, end=87, num_decays=3, total_steps=600)


def test_paper_schedule_hand_computed():
    # d = (87/256)^(1/3) = 0.6980; 256·d = 178.7 -> 179; 256·d² = 124.7 -> 125; 256·d³ = 87
    assert [budget_at(s, **PAPER) for s in (0, 150, 300, 450)] == [256, 179, 125, 87]
    # I = 600 / 4 = 150: the budget holds until the next multiple of I, and stays at the end after the last drop.
    assert [budget_at(s, **PAPER) for s in (149, 151, 299, 599, 600, 10_000)] == [256, 179, 179, 87, 87, 87]


def test_linear_schedule_hand_computed():
    # equal drops of (256 - 87) / 3 = 56.33: 256, 199.67 -> 200, 143.33 -> 143, 87
    assert [budget_at(s, **PAPER, schedule="linear") for s in (0, 150, 300, 450)] == [256, 200, 143, 87]


def test_uneven_intervals():
    # I = 10 / 4 = 2.5: steps 0-2 -> k=0, 3-4 -> 1, 5-7 -> 2, 8-9 -> 3; d = (4/16)^(1/3) = 0.63
    budgets = [budget_at(s, start=16, end=4, num_decays=3, total_steps=10) for s in range(10)]
    assert budgets == [16, 16, 16, 10, 10, 6, 6, 6, 4, 4]  # 16·0.63 = 10.08; 16·0.397 = 6.35


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(start=87, end=256, num_decays=3, total_steps=600), r"budget_end \(256\) is above budget_start \(87\)"),
        (dict(start=256, end=87, num_decays=0, total_steps=600), "budget_decays=0 must be at least 1"),
        (
            dict(start=256, end=0, num_decays=3, total_steps=600),
            "budget_end=0 must be a whole number of tokens, at least 1",
        ),
        (dict(start=0, end=0, num_decays=3, total_steps=600), "budget_start=0"),
        (dict(start=256, end=87, num_decays=3, total_steps=3), "spans 3 step.* too few for budget_decays=3"),
        (dict(start=256, end=87, num_decays=3, total_steps=600, schedule="cosine"), "budget_schedule='cosine'"),
    ],
)
def test_bad_schedules_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        budget_at(0, **kwargs)


def test_bad_schedule_rejected_in_config_and_callback(tmp_path):
    with pytest.raises(ValueError, match=r"budget_end \(300\) is above budget_start \(256\)"):
        make_config(tmp_path, budget_start=256, budget_end=300)
    with pytest.raises(ValueError, match="budget_decays=0"):
        TokenBudgetCurriculum(budget_decays=0)
    with pytest.raises(ValueError, match="budget_length_count='words'"):
        make_config(tmp_path, max_steps=100, budget_start=256, budget_length_count="words")


def test_triangular_hand_computed():
    L = 100
    assert triangular_length_score(0, L) == 0.0
    assert triangular_length_score(50, L) == 0.5  # 50/100
    assert triangular_length_score(99, L) == pytest.approx(0.99)
    assert triangular_length_score(100, L) == 1.0  # the peak at L
    assert triangular_length_score(101, L) == pytest.approx(0.99)  # 1 - 1/100
    assert triangular_length_score(150, L) == 0.5  # 1 - 50/100
    assert triangular_length_score(200, L) == 0.0  # 2L
    assert triangular_length_score(201, L) == 0.0  # beyond 2L
    assert triangular_length_score(150, L, r_max=2.0) == 1.0
    with pytest.raises(ValueError, match="budget=0"):
        triangular_length_score(1, 0)


def test_band_hand_computed():
    L = 100  # width 0.5: full score from 50 to 100 tokens
    assert [band_length_score(n, L) for n in (49, 50, 100, 101, 200)] == [0.0, 1.0, 1.0, 0.0, 0.0]
    assert band_length_score(80, L, width=0.1) == 0.0 and band_length_score(90, L, width=0.1) == 1.0


def test_budget_length_reward_reads_the_budget_column(tokenizer):
    reward = get_reward("budget_length")
    # lengths 5 and 15 against budget 10: 5/10 = 0.5 and 1 - 5/10 = 0.5; 30 tokens > 2L: 0
    assert reward(completions=["a", "b", "c"], completion_ids=[[0] * 5, [0] * 15, [0] * 30], budget=[10, 10, 10]) == [
        0.5,
        0.5,
        0.0,
    ]
    think = get_reward("budget_length", count="think", tokenizer=tokenizer)
    text = "<think>abc</think><answer>7</answer>"
    n = len(tokenizer("abc", add_special_tokens=False)["input_ids"])
    assert think(completions=[text], completion_ids=[[0] * 40], budget=[n]) == [1.0]  # only the think span counts
    with pytest.raises(ValueError, match="needs a `budget` column"):
        reward(completions=["a"], completion_ids=[[0]])
    with pytest.raises(ValueError, match="shape='square'"):
        get_reward("budget_length", shape="square")


def _budget_prompt_dataset(n=8):
    dataset = tiny_dataset(n)
    return dataset.map(lambda row: {"prompt": [{"role": "system", "content": "Use at most {budget} tokens."},
                                               row["prompt"][1]]})  # fmt: skip


def _budgets_logged(trainer):
    return {log["step"]: log["curriculum/budget"] for log in trainer.state.log_history if "curriculum/budget" in log}


def test_budget_in_prompt_metric_and_generation_cap(tiny_model_path, tokenizer, tmp_path):
    args = make_config(tmp_path, max_steps=8, max_completion_length=32, budget_start=16, budget_end=4,
                       budget_caps_generation=True)  # fmt: skip
    prompts_seen = []

    def spy_reward(prompts, completion_ids, budget, **kwargs):
        prompts_seen.append((prompts[0][0]["content"], budget[0], max(len(c) for c in completion_ids)))
        return varied_reward(completions=["x" * len(c) for c in completion_ids])

    trainer = GRPOExtTrainer(model=str(tiny_model_path), reward_funcs=spy_reward, args=args,
                             train_dataset=_budget_prompt_dataset(), processing_class=tokenizer)  # fmt: skip
    trainer.train()
    # I = 8 / 4 = 2: budgets 16, 10, 6, 4 from steps 0, 2, 4, 6; the log at step k reports the budget of step k - 1.
    assert _budgets_logged(trainer) == {1: 16, 2: 16, 3: 10, 4: 10, 5: 6, 6: 6, 7: 4, 8: 4}
    expected = [16, 16, 10, 10, 6, 6, 4, 4]
    assert [b for _, b, _ in prompts_seen] == expected  # the rewards' `budget` column
    assert [p for p, _, _ in prompts_seen] == [f"Use at most {b} tokens." for b in expected]  # the prompt
    assert all(longest <= b for _, b, longest in prompts_seen)  # the cap: no completion exceeds the budget
    assert trainer.generation_config.max_new_tokens == 4


def test_resume_continues_the_schedule(tiny_model_path, tokenizer, tmp_path):
    def run(out, resume=None, max_steps=8):
        args = make_config(out, max_steps=max_steps, budget_start=16, budget_end=4, budget_total_steps=8,
                           save_strategy="steps", save_steps=4)  # fmt: skip
        trainer = GRPOExtTrainer(model=str(tiny_model_path), reward_funcs=varied_reward, args=args,
                                 train_dataset=_budget_prompt_dataset(), processing_class=tokenizer)  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    first = run(tmp_path / "part", max_steps=4)
    resumed = run(tmp_path / "part", resume=str(tmp_path / "part" / "out" / "checkpoint-4"))
    assert _budgets_logged(first) == {1: 16, 2: 16, 3: 10, 4: 10}
    assert {s: b for s, b in _budgets_logged(resumed).items() if s > 4} == {5: 6, 6: 6, 7: 4, 8: 4}
    assert {s: b for s, b in _budgets_logged(full).items() if s > 4} == {5: 6, 6: 6, 7: 4, 8: 4}
    assert resumed.extension("curriculum").budget == 4


def test_curriculum_trainer_paper_defaults_train(tiny_model_path, tokenizer, tmp_path):
    args = make_config(tmp_path, max_steps=4)
    trainer = CurriculumGRPOTrainer(model=str(tiny_model_path), args=args, train_dataset=_budget_prompt_dataset(),
                                    processing_class=tokenizer)  # fmt: skip
    assert args.budget_start == 256 and args.budget_end == 87
    assert trainer.reward_func_names == ["accuracy_reward", "budget_length_triangular", "tag_format_think_answer"]
    assert trainer.reward_weights.tolist() == pytest.approx([0.6, 0.3, 0.1])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    # Over 4 steps the paper's schedule runs 256, 179, 125, 87; completions of at most 8 tokens (this run's cap)
    # score l/L <= 8/L, and exactly 8/L when none stopped early.
    key = "rewards/budget_length_triangular/mean"
    logged = [log[key] for log in trainer.state.log_history if key in log]
    bounds = [8 / 256, 8 / 179, 8 / 125, 8 / 87]
    assert len(logged) == 4 and all(0 < value <= bound + 1e-6 for value, bound in zip(logged, bounds, strict=False))
    assert logged[0] == pytest.approx(8 / 256)


def test_callback_without_trainer_is_a_clear_error():
    from transformers import TrainerControl, TrainerState

    with pytest.raises(RuntimeError, match="has no trainer"):
        TokenBudgetCurriculum().on_step_begin(None, TrainerState(max_steps=10), TrainerControl())


def test_a_budget_that_nothing_reads_is_an_error_before_the_model_loads(tokenizer, tmp_path):
    args = make_config(tmp_path, max_steps=4, budget_start=16, budget_end=4)
    # The model path does not exist: the error must come before anything loads.
    with pytest.raises(ValueError, match="nothing would act on the budget.*add 'budget_length' to reward_funcs"):
        GRPOExtTrainer(model=str(tmp_path / "no-model"), reward_funcs=varied_reward, args=args,
                       train_dataset=tiny_dataset(8), processing_class=tokenizer)  # fmt: skip
    # Any one of the three makes the budget act: a reward that reads it, {budget} in the prompts, or the cap.
    for extra, dataset in ((dict(), _budget_prompt_dataset()), (dict(budget_caps_generation=True), tiny_dataset(8))):
        curriculum = TokenBudgetCurriculum(16, 4, 3, **({"cap_generation": True} if extra else {}))
        curriculum.check(TrainerInputs(args, [varied_reward], dataset, None, None, None, None))
    TokenBudgetCurriculum(16, 4).check(TrainerInputs(args, [get_reward("budget_length")], tiny_dataset(8), None, None,
                                                     None, None))  # fmt: skip
