"""PTA-GRPO: plan values, per-token advantages, staged rollouts that share each plan, cold-start data."""

from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer

from trl_grpo_ext import GRPOExtConfig, PlanValueReward, PTAGRPOConfig, PTAGRPOTrainer, Rollout, get_reward
from trl_grpo_ext.advantages import plan_values, tree_token_advantages
from trl_grpo_ext.data import pta_sft_dataset, pta_sft_example
from trl_grpo_ext.methods.pta import truncate_at_tag
from trl_grpo_ext.rollout import token_owners
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
    # Plans: rows 0, 1 share a plan of 2 tokens, rows 2, 3 one of 1 token; the rows hold their whole trajectories.
    owners = token_owners(parents=[-1, 0, -1, 2], shared=[0, 2, 0, 1], lengths=[4, 3, 5, 2], width=5)
    nodes = torch.where(owners >= 0, owners * 5 + torch.arange(5), -1)
    out = tree_token_advantages(row, nodes)
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


def _scoring(roots_of_plans, group):
    """A stand-in trainer scoring a rollout whose rows share plans: `roots_of_plans[i]` is row i's first plan row."""
    rows = len(roots_of_plans)
    parents = [-1 if r == i else r for i, r in enumerate(roots_of_plans)]
    rollout = Rollout(prompt_ids=[[1]] * rows, completion_ids=[[5, 6]] * rows, completions=[""] * rows,
                      parents=parents, shared=[0 if p < 0 else 1 for p in parents])  # fmt: skip
    return SimpleNamespace(current_rollout=rollout, num_generations=group, model=SimpleNamespace(training=True))


def test_plan_value_reward_reads_the_plans_from_the_rollout():
    outcome = get_reward("contains_solution")
    completions = ["7", "x", "7", "x", "x", "x"]
    reward = PlanValueReward(outcome)
    reward.trainer = _scoring([0, 0, 2, 2, 4, 4], group=6)
    # plan values: (1 + 0) / 2, (1 + 0) / 2, 0 -- no plan id column: the rows that share a root share a plan
    assert reward(completions, solution=["7"] * 6) == [0.5, 0.5, 0.5, 0.5, 0.0, 0.0]
    # across the 3 plans: mean 1/3, sample std sqrt((1/36 + 1/36 + 1/9) / 2) = 0.2887
    normalised = PlanValueReward(outcome, normalize=True)
    normalised.trainer = reward.trainer
    values = normalised(completions, solution=["7"] * 6)
    assert values[0] == pytest.approx((0.5 - 1 / 3) / (0.288675 + 1e-4), abs=1e-4)
    assert values[4] == pytest.approx((0 - 1 / 3) / (0.288675 + 1e-4), abs=1e-4)
    with pytest.raises(ValueError, match="use it in a trl_grpo_ext trainer"):
        PlanValueReward(outcome)(completions, solution=["7"] * 6)


def test_truncate_at_tag(tokenizer):
    ids = tokenizer("<plan>add them</plan><think>3</think>", add_special_tokens=False)["input_ids"]
    cut, closed = truncate_at_tag(ids, tokenizer, "</plan>")
    assert closed and tokenizer.decode(cut) == "<plan>add them</plan>"
    assert truncate_at_tag(ids[:3], tokenizer, "</plan>") == (ids[:3], False)


def test_config_requires_m_times_z_equal_num_generations(tmp_path):
    kwargs = dict(output_dir=str(tmp_path), **cpu_test_config_kwargs())
    with pytest.raises(
        ValueError, match=r"num_plans \* continuations_per_plan \(3\*3=9\) must equal num_generations \(8\)"
    ):
        GRPOExtConfig(num_plans=3, continuations_per_plan=3, **kwargs)
    with pytest.raises(ValueError, match="continuations_per_plan=None must be a whole number"):
        GRPOExtConfig(num_plans=2, num_generations=4, **kwargs)
    config = PTAGRPOConfig(**kwargs)
    assert (config.num_plans, config.continuations_per_plan, config.num_generations) == (3, 3, 9)


def _pta_trainer(tiny_model_path, tokenizer, tmp_path, reward_funcs=None, **overrides):
    settings = dict(
        output_dir=str(tmp_path / "out"), num_plans=2, continuations_per_plan=2, num_generations=4,
        per_device_train_batch_size=8, max_completion_length=6, plan_max_tokens=5, max_steps=2, learning_rate=1e-2,
        seed=0, **cpu_test_config_kwargs(),
    )  # fmt: skip
    dataset = overrides.pop("train_dataset", tiny_dataset(8))
    args = PTAGRPOConfig(**{**settings, **overrides})
    return PTAGRPOTrainer(model=str(tiny_model_path), reward_funcs=reward_funcs, args=args, train_dataset=dataset,
                          processing_class=tokenizer)  # fmt: skip


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
    ids, mask = out["completion_ids"], out["completion_mask"]
    assert int(mask.sum(1).max()) <= 6  # plan and continuation together stay within max_completion_length
    rollout = trainer.last_batch.rollout
    assert rollout.parents == [-1, 0, -1, 2, -1, 4, -1, 6]  # each plan's second row repeats its first
    plans = []
    for start in range(0, 8, 2):
        n = rollout.shared[start + 1]
        assert 1 <= n <= 5  # plan_max_tokens
        assert ids[start, :n].tolist() == ids[start + 1, :n].tolist()  # shared token for token, held by both rows
        plans.append(tuple(ids[start, :n].tolist()))
    # The continuation rows were generated from prompt + plan.
    assert calls[1][2][0][-len(plans[0]) :] == list(plans[0])
    # Plan tokens carry the plan's advantage on each copy: the mean of its two rows' advantages; the other tokens
    # their row's own.
    adv, rows = out["advantages"], trainer.last_batch.advantages
    assert adv.shape == ids.shape
    for k, start in enumerate(range(0, 8, 2)):
        n = len(plans[k])
        assert torch.allclose(adv[start : start + 2, :n], rows[start : start + 2].mean().expand(2, n), atol=1e-6)
        for row in (start, start + 1):
            length = int(mask[row].sum())
            assert torch.allclose(adv[row, n:length], rows[row].expand(length - n), atol=1e-6)
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
    assert (
        example["completion"][0]["content"]
        == "<plan>Add the numbers.</plan><think>2 + 3 = 5</think><answer>5</answer>"
    )
    assert get_reward("tag_format", tags=["plan", "think", "answer"])(completions=[example["completion"]]) == [1.0]
    from datasets import Dataset

    rows = Dataset.from_dict({"q": ["1+1?"], "plan": ["Add."], "reasoning": ["1+1=2"], "answer": ["2"]})
    assert pta_sft_dataset(rows, question="q")[0]["completion"][0]["content"].startswith("<plan>Add.</plan>")
    with pytest.raises(KeyError, match=r"columns \['question'\] not in the dataset"):
        pta_sft_dataset(rows)
    with pytest.raises(ValueError, match="plan='' must be non-empty"):
        pta_sft_example("q", "", "r", "a")


def _scripted_backend(monkeypatch, plan_outputs, continuation):
    """Stage 1 returns `plan_outputs[k]` for plan k; stage 2 `continuation` for every row. Records each call."""
    calls = []

    def backend(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        stage_one = self.generation_config.stop_strings is not None
        calls.append(
            (len(prompt_ids), num_generations, self.generation_config.stop_strings, [list(p) for p in prompt_ids])
        )
        outputs = plan_outputs if stage_one else [continuation] * len(prompt_ids)
        return [list(outputs[k % len(outputs)]) for k in range(len(prompt_ids))], None

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", backend)
    return calls


def test_closed_plans_are_cut_at_the_tag(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    t = tokenizer.convert_tokens_to_ids
    eos = t("<|im_end|>")
    plan_out = [t("<plan>"), 40, t("</plan>"), t("<think>"), 41]  # a backend that runs past </plan>
    answer_out = [t("<answer>"), 42, t("</answer>"), eos]
    calls = _scripted_backend(monkeypatch, [plan_out], answer_out)
    trainer = _pta_trainer(tiny_model_path, tokenizer, tmp_path, max_completion_length=8)
    trainer.model.train()
    out = trainer._generate_and_score_completions([dict(row) for row in tiny_dataset(2) for _ in range(4)])
    plan = [t("<plan>"), 40, t("</plan>")]
    assert out["completion_ids"][0, :7].tolist() == plan + answer_out  # cut right after </plan>, then continued
    assert trainer.last_batch.rollout.shared[1] == 3
    metrics = trainer._metrics["train"]
    assert metrics["pta/plans_closed"] == [1.0] and metrics["pta/plans_ended"] == [0.0]
    # generated: 4 plans x 3 kept tokens + 8 continuations x 4; independent: 8 rows x (3 + 4)
    assert metrics["pta/generated_tokens"] == [4 * 3 + 8 * 4] and metrics["pta/independent_tokens"] == [8 * 7]
    assert trainer.last_batch.rewards_per_func[:, 2].tolist() == [0.0] * 8  # no <think>: strict format fails
    # The plan stage stops at </plan> (stop strings); the continuation stage does not; both restored after.
    assert [(n, block, stop) for n, block, stop, _ in calls] == [(4, 2, ["</plan>"]), (8, 2, None)]
    assert trainer.generation_config.stop_strings is None


def test_eos_inside_a_plan_ends_its_rows(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    t = tokenizer.convert_tokens_to_ids
    eos = t("<|im_end|>")
    closed, ended = [t("<plan>"), 40, t("</plan>")], [t("<plan>"), 41, eos]  # plans 1 and 3 stop with EOS
    calls = _scripted_backend(monkeypatch, [closed, ended], [t("<answer>"), 42, eos])
    trainer = _pta_trainer(tiny_model_path, tokenizer, tmp_path, max_completion_length=8)
    trainer.model.train()
    out = trainer._generate_and_score_completions([dict(row) for row in tiny_dataset(2) for _ in range(4)])
    # Stage 2 generates only the rows of the closed plans, still in blocks of z = 2.
    assert [(n, block) for n, block, _, _ in calls] == [(4, 2), (4, 2)]
    ids, mask = out["completion_ids"], out["completion_mask"]
    for row in (2, 3, 6, 7):  # the rows of the plans that ended: the plan is the whole completion
        assert ids[row][mask[row].bool()].tolist() == ended
    for row in (0, 1, 4, 5):
        assert ids[row][mask[row].bool()].tolist() == closed + [t("<answer>"), 42, eos]
    assert trainer._metrics["train"]["pta/plans_ended"] == [0.5]


def test_plan_and_continuation_stay_within_the_cap(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    t = tokenizer.convert_tokens_to_ids
    # A backend that ignores every cap: the plan stage returns 9 tokens, the continuation 12.
    _scripted_backend(monkeypatch, [[t("<plan>"), *[40] * 7, t("</plan>")]], [41] * 12)
    trainer = _pta_trainer(tiny_model_path, tokenizer, tmp_path, max_completion_length=10, plan_max_tokens=6)
    trainer.model.train()
    out = trainer._generate_and_score_completions([dict(row) for row in tiny_dataset(2) for _ in range(4)])
    lengths = out["completion_mask"].sum(1)
    assert lengths.max().item() == 10  # the plan stage kept 6 (unclosed), the continuation the 4 left
    assert trainer.last_batch.rollout.shared[1] == 6 and trainer._metrics["train"]["pta/plans_closed"] == [0.0]


def test_context_column_reaches_both_stages(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    t = tokenizer.convert_tokens_to_ids
    calls = _scripted_backend(monkeypatch, [[t("<plan>"), 40, t("</plan>")]], [41, t("<|im_end|>")])
    dataset = tiny_dataset(2).add_column("hint", ["<think>add", "<think>sum"])
    trainer = _pta_trainer(tiny_model_path, tokenizer, tmp_path, context_prefix_column="hint", train_dataset=dataset)
    trainer.model.train()
    trainer._generate_and_score_completions([dict(row) for row in dataset for _ in range(4)])
    hints = [tokenizer(h, add_special_tokens=False)["input_ids"] for h in ("<think>add", "<think>sum")]
    plan = [t("<plan>"), 40, t("</plan>")]
    (_, _, _, stage_one), (_, _, _, stage_two) = calls
    assert [p[-len(hints[k // 2]) :] for k, p in enumerate(stage_one)] == [hints[k // 2] for k in range(4)]
    assert all(p[-len(plan) - len(hints[k // 4]) :] == hints[k // 4] + plan for k, p in enumerate(stage_two))


def test_plan_stage_stops_at_a_tag_of_several_tokens(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    from .conftest import script_generation

    # Spelt out character by character, `</plan>` is 7 tokens: the stop must come from the text, not a token id.
    chars = list(tokenizer.convert_tokens_to_ids(list("</plan>")))
    assert len(chars) == 7 and tokenizer.decode(chars) == "</plan>"
    x = tokenizer.convert_tokens_to_ids("x")
    scripts = [[x, x, *chars, *[x] * 20], [x] * 30]  # row 0 closes its plan after 9 tokens; row 1 never does
    trainer = _pta_trainer(tiny_model_path, tokenizer, tmp_path, max_completion_length=16, plan_max_tokens=16)
    script_generation(monkeypatch, trainer, scripts)
    plan = trainer.extension("pta")
    rows = [dict(row) for row in tiny_dataset(1) for _ in range(2)]
    from trl_grpo_ext import RolloutPlan

    ids, _ = trainer.generate_stage([r["prompt"] for r in rows], RolloutPlan(rows, "train", 2), num_generations=2,
                                    max_new_tokens=16, stop=[plan.close])  # fmt: skip
    pad = tokenizer.pad_token_id
    assert ids[0][:9] == [x, x, *chars] and set(ids[0][9:]) <= {pad}  # stopped right at the tag
    assert ids[1] == [x] * 16  # no tag: the stage runs to its cap
    assert truncate_at_tag(ids[0], tokenizer, plan.close) == ([x, x, *chars], True)
