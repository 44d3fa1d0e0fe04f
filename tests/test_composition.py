"""Methods compose: PTA-GRPO rollouts + a context column + curriculum budget + dynamic sampling + ProRL resets + KL."""

import torch
from trl import GRPOTrainer

from trl_grpo_ext import ProRLResetCallback, PTAGRPOConfig, PTAGRPOTrainer, get_reward
from trl_grpo_ext.testing import cpu_test_config_kwargs, tiny_dataset

from .test_dynamic_sampling import flat_for_small_sums


def test_methods_compose(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    calls = []
    original = GRPOTrainer._generate_single_turn

    def spy(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        calls.append((self.generation_config.stop_strings, [list(p) for p in prompt_ids]))
        return original(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", spy)
    args = PTAGRPOConfig(
        output_dir=str(tmp_path / "out"), num_plans=2, continuations_per_plan=2, num_generations=4,
        per_device_train_batch_size=8, max_completion_length=8, plan_max_tokens=4, max_steps=3, learning_rate=1e-2,
        dynamic_sampling=True, dynamic_sampling_max_rounds=2, budget_start=16, budget_end=4, budget_decays=2,
        beta=0.05, seed=0, context_prefix_column="hint", **cpu_test_config_kwargs(),
    )  # fmt: skip
    rewards = [flat_for_small_sums, get_reward("tag_format", tags=["plan", "think", "answer"])]
    dataset = tiny_dataset(16).map(
        lambda row: {"prompt": [{"role": "system", "content": "Plan in at most {budget} tokens."}, row["prompt"][1]],
                     "hint": "<think>"}
    )  # fmt: skip
    trainer = PTAGRPOTrainer(model=str(tiny_model_path), reward_funcs=rewards, args=args, train_dataset=dataset,
                             processing_class=tokenizer,
                             callbacks=[ProRLResetCallback(reset="both", every_n_steps=1)])  # fmt: skip
    assert [e.name for e in trainer.extensions] == ["curriculum", "dynamic_sampling", "prefix_columns", "pta", "prorl"]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    logs = [log for log in trainer.state.log_history if "reward" in log]
    assert len(logs) == 3
    for prefix in ("pta/", "dynamic_sampling/", "curriculum/", "prorl/"):
        assert any(key.startswith(prefix) for key in logs[0]), prefix
    assert [log["curriculum/budget"] for log in logs] == [16, 8, 4]  # 16 · (4/16)^(k/2), k = 0, 1, 2
    assert [r["step"] for r in trainer.extension("prorl").history] == [1, 2]
    assert all(abs(log["kl"]) < 1e-6 for log in logs[1:])  # each step starts right after a reference reset
    # The context column reached every generation the PTA rollout made (plans and continuations, refills too), after
    # the budget filled into the system prompt.
    hint = tokenizer("<think>", add_special_tokens=False)["input_ids"]
    plan_stages = [prompts for stop, prompts in calls if stop == ["</plan>"]]
    assert len(plan_stages) >= 3 and all(p[-len(hint) :] == hint for prompts in plan_stages for p in prompts)
    decoded = tokenizer.decode(plan_stages[-1][0])
    assert "Plan in at most 4 tokens." in decoded
    continuation = next(prompts for stop, prompts in calls if stop is None)
    assert all(hint[0] in p[-(len(hint) + 4) :] for p in continuation)  # hint, then a plan of at most 4 tokens
