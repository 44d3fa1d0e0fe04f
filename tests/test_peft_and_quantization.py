"""LoRA and 4-bit bases train with GRPOExtTrainer, with an extension switched on."""

import torch
from peft import LoraConfig
from transformers import BitsAndBytesConfig

from trl_grpo_ext import GRPOExtTrainer
from trl_grpo_ext.testing import tiny_dataset

from .conftest import make_config, varied_reward
from .test_estimator import dr_grpo_like


def _lora():
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def test_lora_trains_adapter_only(tiny_model_path, tokenizer, tmp_path):
    trainer = GRPOExtTrainer(
        model=str(tiny_model_path),
        reward_funcs=varied_reward,
        args=make_config(tmp_path, advantage_estimator=dr_grpo_like),
        train_dataset=tiny_dataset(8),
        processing_class=tokenizer,
        peft_config=_lora(),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    adapter = [n for n in before if "lora_" in n]
    base = [n for n in before if "lora_" not in n]
    assert adapter and base
    assert all(torch.equal(before[n], after[n]) for n in base), "a base weight moved under LoRA"
    assert any(not torch.equal(before[n], after[n]) for n in adapter if "lora_B" in n)


def test_4bit_lora_trains_and_evaluates_on_cpu(tiny_model_path, tokenizer, tmp_path):
    args = make_config(
        tmp_path,
        advantage_estimator=dr_grpo_like,
        max_steps=2,
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=4,
    )
    trainer = GRPOExtTrainer(
        model=str(tiny_model_path),
        reward_funcs=varied_reward,
        args=args,
        train_dataset=tiny_dataset(8),
        eval_dataset=tiny_dataset(4, seed=1),
        processing_class=tokenizer,
        peft_config=_lora(),
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32),
    )
    assert getattr(trainer.model, "is_loaded_in_4bit", False)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    # Eval-mode forwards (generation, evaluate) run between training steps: on AVX512-BF16 CPUs bitsandbytes
    # would repack the 4-bit weights there and break the next training step.
    trainer.train()
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics and "eval_reward" in metrics
    trainer.train(resume_from_checkpoint=None)  # training still works after evaluate()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in before)
