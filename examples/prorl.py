"""ProRL (arXiv 2505.24864): prolonged RL with reference / optimizer resets and dynamic sampling.

Real run (GPU):  python examples/prorl.py --model deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B --dataset trl-lib/DeepMath-103K
Offline (CPU):   python examples/prorl.py --tiny
Options:         --preset v1 (reset reference + optimizer when eval_reward stalls) | v2 (reference every N steps)
                 --lora (the reference becomes a frozen "ref" adapter; no base weight moves)
"""

import argparse

from peft import LoraConfig

from trl_grpo_ext import ProRLConfig, ProRLResetCallback, ProRLTrainer
from trl_grpo_ext.testing import CPU_KWARGS

# ---- hyper-parameters: ProRLConfig already holds the paper's recipe (clip 0.2/0.4, temperature 1.2, 16 rollouts,
# constant lr 2e-6, dapo loss, dynamic sampling); here only the run's length and logging ----
HPARAMS = dict(max_steps=2000, max_completion_length=8192, logging_steps=10, eval_strategy="steps", eval_steps=100,
               save_steps=200, dynamic_sampling_max_rounds=2, report_to="none")  # fmt: skip
TINY_HPARAMS = dict(max_steps=8, max_completion_length=16, num_generations=4, per_device_train_batch_size=8,
                    per_device_eval_batch_size=8, learning_rate=5e-2, beta=0.1, eval_steps=2, logging_steps=1,
                    save_strategy="no", **CPU_KWARGS)  # fmt: skip
RESET_EVERY = 300  # v2: the paper resets every 200-500 steps
REWARDS = ["accuracy", "stop_penalty"]  # correctness, and -1 for completions that never stop


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B")
    parser.add_argument("--dataset", default="trl-lib/DeepMath-103K")
    parser.add_argument("--tiny", action="store_true", help="offline: tiny random model and built-in dataset")
    parser.add_argument("--preset", choices=["v1", "v2"], default="v2")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--output-dir", default="outputs/prorl")
    args = parser.parse_args()

    processing_class = None
    if args.tiny:
        from trl_grpo_ext.testing import load_tiny_model, tiny_dataset

        model, processing_class = load_tiny_model(f"{args.output_dir}/tiny-model")
        train_dataset, eval_dataset = tiny_dataset(32), tiny_dataset(8, seed=1)
        rewards = ["contains_solution", "stop_penalty"]  # a random model never gets `accuracy`: a denser signal
        reset_every = 3
    else:
        from datasets import load_dataset

        model = args.model
        split = load_dataset(args.dataset, split="train").train_test_split(test_size=256, seed=0)
        train_dataset, eval_dataset = split["train"], split["test"]
        rewards, reset_every = REWARDS, RESET_EVERY

    if args.preset == "v1":
        resets = ProRLResetCallback.v1(patience=2 if args.tiny else 3, metric="eval_reward")
    else:
        resets = ProRLResetCallback.v2(every_n_steps=reset_every)
    config = ProRLConfig(output_dir=args.output_dir, **{**HPARAMS, **(TINY_HPARAMS if args.tiny else {})})
    trainer = ProRLTrainer(
        model=model,
        reward_funcs=rewards,
        args=config,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=processing_class,
        callbacks=[resets],
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear") if args.lora else None,
    )
    trainer.train()
    trainer.save_model(args.output_dir)
    history = trainer.extension("prorl").history
    for reset in history:
        print(f"reset at step {reset['step']}: reference={reset['reference']} optimizer={reset['optimizer']} "
              f"({reset['reason']})")  # fmt: skip
    kept = [
        log["dynamic_sampling/kept_fraction"]
        for log in trainer.state.log_history
        if "dynamic_sampling/kept_fraction" in log
    ]
    print(f"resets: {len(history)}; mean kept fraction of groups: {sum(kept) / max(len(kept), 1):.2f}")
    print(f"saved to {args.output_dir}")


if __name__ == "__main__":
    main()
