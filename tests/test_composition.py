"""Methods compose: PTA-GRPO rollouts + curriculum budget + dynamic sampling + ProRL resets + KL, in one run."""

import torch

from trl_grpo_ext import PTAGRPOConfig, PTAGRPOTrainer, ProRLResetCallback, get_reward
from trl_grpo_ext.testing import cpu_test_config_kwargs, tiny_dataset

from .test_dynamic_sampling import flat_for_small_sums


def test_methods_compose(tiny_model_path, tokenizer, tmp_path):
    args = PTAGRPOConfig(
        output_dir=str(tmp_path / "out"), num_plans=2, continuations_per_plan=2, num_generations=4,
        per_device_train_batch_size=8, max_completion_length=8, plan_max_tokens=4, max_steps=3, learning_rate=1e-2,
        dynamic_sampling=True, dynamic_sampling_max_rounds=2, budget_start=16, budget_end=4, budget_decays=2,
        beta=0.05, seed=0, **cpu_test_config_kwargs(),
    )  # fmt: skip
    rewards = [flat_for_small_sums, get_reward("tag_format", tags=["plan", "think", "answer"])]
    trainer = PTAGRPOTrainer(model=str(tiny_model_path), reward_funcs=rewards, args=args,
                             train_dataset=tiny_dataset(16), processing_class=tokenizer,
                             callbacks=[ProRLResetCallback(reset="both", every_n_steps=1)])  # fmt: skip
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    logs = [log for log in trainer.state.log_history if "reward" in log]
    assert len(logs) == 3
    for prefix in ("pta/", "dynamic_sampling/", "curriculum/", "prorl/"):
        assert any(key.startswith(prefix) for key in logs[0]), prefix
    assert [log["curriculum/budget"] for log in logs] == [16, 8, 4]  # 16 · (4/16)^(k/2), k = 0, 1, 2
    assert [r["step"] for r in trainer.reset_history] == [1, 2]
    assert all(abs(log["kl"]) < 1e-6 for log in logs[1:])  # each step starts right after a reference reset
