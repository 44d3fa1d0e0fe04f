"""BiCC + RCC (arXiv 2603.13134): learn from right and wrong answers side by side.

Real run (GPU):  python examples/bicc.py --model Qwen/Qwen3-4B-Instruct-2507 --dataset trl-lib/DeepMath-103K
Offline (CPU):   python examples/bicc.py --tiny            (tiny random model, built-in dataset, seconds)
                 python examples/bicc.py --smollm2         (SmolLM2-135M-Instruct offline, the addition task)
Options:         --pairing random | all | confident        --no-rcc (GRPO's own group baseline)
"""

import argparse

from trl_grpo_ext import BiCCGRPOConfig, BiCCGRPOTrainer
from trl_grpo_ext.testing import CPU_KWARGS

# ---- hyper-parameters: the paper's setting (8 rollouts a question, the opposite answer cut to 40% of the context
# budget, one random opposite per answer); the run's length and logging ----
HPARAMS = dict(num_generations=8, per_device_train_batch_size=8, max_completion_length=2048, learning_rate=1e-6,
               max_steps=500, logging_steps=10, report_to="none", bicc_context_fraction=0.4)  # fmt: skip
SMALL_HPARAMS = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=24, learning_rate=3e-5,
                     max_steps=10, logging_steps=1, save_strategy="no", **CPU_KWARGS)  # fmt: skip
TINY_HPARAMS = {**SMALL_HPARAMS, "max_steps": 3, "max_completion_length": 16, "learning_rate": 5e-3}


def alternating(completions, **kwargs):
    """A stand-in correctness for the random tiny model (it never answers right): every other answer is right."""
    return [float(i % 2) for i in range(len(completions))]


alternating.correctness = True


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen3-4B-Instruct-2507")
    parser.add_argument("--dataset", default="trl-lib/DeepMath-103K")
    parser.add_argument("--tiny", action="store_true", help="offline: tiny random model and built-in dataset")
    parser.add_argument("--smollm2", action="store_true", help="offline: SmolLM2-135M-Instruct on the addition task")
    parser.add_argument("--pairing", choices=["random", "all", "confident"], default="random")
    parser.add_argument("--no-rcc", action="store_true", help="keep GRPO's group baseline")
    parser.add_argument("--output-dir", default="outputs/bicc")
    args = parser.parse_args()

    processing_class, hparams = None, HPARAMS
    if args.tiny:
        from trl_grpo_ext.testing import load_tiny_model, tiny_dataset

        model, processing_class = load_tiny_model(f"{args.output_dir}/tiny-model")
        train_dataset, rewards, reward, hparams = tiny_dataset(16), [alternating], "alternating", TINY_HPARAMS
    elif args.smollm2:
        from trl_grpo_ext.tasks import addition_dataset
        from trl_grpo_ext.testing import real_model

        model, train_dataset = real_model(), addition_dataset("train", repeats=10)
        rewards, reward, hparams = ["last_integer"], "last_integer", SMALL_HPARAMS
    else:
        from datasets import load_dataset

        model, train_dataset = args.model, load_dataset(args.dataset, split="train")
        rewards, reward = ["accuracy"], "accuracy"

    config = BiCCGRPOConfig(output_dir=args.output_dir, bicc_reward=reward, bicc_pairing=args.pairing,
                            advantage_estimator="group" if args.no_rcc else "rcc", **hparams)  # fmt: skip
    trainer = BiCCGRPOTrainer(model=model, reward_funcs=rewards, args=config, train_dataset=train_dataset,
                              processing_class=processing_class)  # fmt: skip
    trainer.train()
    trainer.save_model(args.output_dir)
    logs = [log for log in trainer.state.log_history if "bicc/rows_added" in log]
    added = sum(log["bicc/rows_added"] for log in logs) / max(len(logs), 1)
    mixed = sum(log["bicc/mixed_groups"] for log in logs) / max(len(logs), 1)
    print(f"mixed groups {mixed:.2f}; conditioned rows added per step {added:.1f}")
    print(f"saved to {args.output_dir}")


if __name__ == "__main__":
    main()
