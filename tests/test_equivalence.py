"""With no extension on, GRPOExtTrainer trains bit for bit like GRPOTrainer."""

import torch
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

from trl_grpo_ext import GRPOExtConfig, GRPOExtTrainer
from trl_grpo_ext.testing import tiny_dataset

from .conftest import make_config, varied_reward


def _train(trainer_cls, config_cls, tiny_model_path, tokenizer, tmp_path, peft_config=None):
    args = make_config(tmp_path / trainer_cls.__name__, config_cls=config_cls)
    trainer = trainer_cls(
        model=str(tiny_model_path),
        reward_funcs=varied_reward,
        args=args,
        train_dataset=tiny_dataset(8),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    return params, rewards


def _assert_same(a, b):
    params_a, rewards_a = a
    params_b, rewards_b = b
    assert len(rewards_a) == 3
    assert rewards_a == rewards_b
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name


def test_full_finetuning_is_bit_identical(tiny_model_path, tokenizer, tmp_path):
    ours = _train(GRPOExtTrainer, GRPOExtConfig, tiny_model_path, tokenizer, tmp_path)
    trl = _train(GRPOTrainer, GRPOConfig, tiny_model_path, tokenizer, tmp_path)
    _assert_same(ours, trl)
    # The run did train: equality above is not two untouched models.
    from transformers import AutoModelForCausalLM

    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_path).named_parameters())
    assert not torch.equal(initial["model.layers.0.mlp.up_proj.weight"], ours[0]["model.layers.0.mlp.up_proj.weight"])


def test_lora_is_bit_identical(tiny_model_path, tokenizer, tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
    ours = _train(GRPOExtTrainer, GRPOExtConfig, tiny_model_path, tokenizer, tmp_path, peft_config=lora)
    trl = _train(GRPOTrainer, GRPOConfig, tiny_model_path, tokenizer, tmp_path, peft_config=lora)
    _assert_same(ours, trl)


def test_plain_grpo_config_is_accepted(tiny_model_path, tokenizer, tmp_path):
    ours = _train(GRPOExtTrainer, GRPOConfig, tiny_model_path, tokenizer, tmp_path)
    trl = _train(GRPOTrainer, GRPOConfig, tiny_model_path, tokenizer, tmp_path)
    _assert_same(ours, trl)
