"""Swap one class in a TRL GRPO script, and plug in your own advantage estimator.

Real run (GPU):   python examples/quickstart.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset trl-lib/DeepMath-103K
Offline (CPU):    python examples/quickstart.py --tiny
Options:          --lora, --load-in-4bit, --estimator {group,centred_token_ramp}, --shared-prefix (the group's prompt
                  runs once in the loss forward: `shared_prefix_forward`)
"""

import argparse

import torch
from peft import LoraConfig
from transformers import BitsAndBytesConfig

from trl_grpo_ext import GRPOExtConfig, GRPOExtTrainer, RolloutBatch, register_advantage
from trl_grpo_ext.advantages import group_advantages
from trl_grpo_ext.testing import CPU_KWARGS

# ---- hyper-parameters (the tiny run overrides a few so it finishes in seconds on a CPU) ----
HPARAMS = dict(
    learning_rate=1e-6,
    per_device_train_batch_size=8,
    num_generations=8,
    max_completion_length=512,
    max_steps=200,
    beta=0.0,
    logging_steps=10,
    report_to="none",
)
TINY_HPARAMS = dict(
    learning_rate=5e-3,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=16,
    max_steps=3,
    logging_steps=1,
    **CPU_KWARGS,
)
REWARDS = ["tag_format", "accuracy", "contains_solution"]  # registry names; see trl_grpo_ext.list_rewards()


@register_advantage("centred_token_ramp")
def centred_token_ramp(batch: RolloutBatch):
    """An example (B, T) estimator: Dr. GRPO's centred reward, growing along the completion, first token unweighted."""
    rows = batch.local(group_advantages(batch.rewards, batch.num_generations, scale="none"))  # (B,)
    ramp = torch.linspace(0.5, 1.5, batch.completion_ids.size(1), device=rows.device)  # (T,)
    weights = torch.ones_like(batch.completion_mask, dtype=torch.float32)  # (B, T)
    weights[:, 0] = 0.0
    return rows.unsqueeze(1) * ramp, weights


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--dataset", default="trl-lib/DeepMath-103K")
    parser.add_argument("--tiny", action="store_true", help="offline: tiny random model and built-in dataset")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--load-in-4bit", action="store_true")
    parser.add_argument("--estimator", default="group")
    parser.add_argument("--shared-prefix", action="store_true", help="shared_prefix_forward=True")
    parser.add_argument("--output-dir", default="outputs/quickstart-example")
    args = parser.parse_args()

    processing_class = None
    if args.tiny:
        from trl_grpo_ext.testing import load_tiny_model, tiny_dataset

        model, processing_class = load_tiny_model(f"{args.output_dir}/tiny-model")
        train_dataset = tiny_dataset(16)
    else:
        from datasets import load_dataset

        model = args.model
        train_dataset = load_dataset(args.dataset, split="train")

    config = GRPOExtConfig(
        output_dir=args.output_dir,
        advantage_estimator=args.estimator,
        shared_prefix_forward=args.shared_prefix,
        **{**HPARAMS, **(TINY_HPARAMS if args.tiny else {})},
    )
    trainer = GRPOExtTrainer(
        model=model,
        reward_funcs=REWARDS,
        args=config,
        train_dataset=train_dataset,
        processing_class=processing_class,
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear") if args.lora else None,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
        if args.load_in_4bit
        else None,
    )
    trainer.train()
    trainer.save_model(args.output_dir)
    print(f"saved to {args.output_dir}")


if __name__ == "__main__":
    main()
