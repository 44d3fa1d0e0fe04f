"""Watch a GRPO run for reward hacking (arXiv 2512.07611): plain TRL's GRPOTrainer, or ours, with the monitor.

Real run (GPU):  python examples/monitor.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset trl-lib/DeepMath-103K
Offline (CPU):   python examples/monitor.py --tiny            (tiny random model, built-in dataset, seconds)
                 python examples/monitor.py --smollm2 --hack  (SmolLM2 on the addition task, a brevity bonus that
                                                              pays more than a right answer: the monitor fires)
Options:         --ours (GRPOExtTrainer with monitor=True instead of TRL's GRPOTrainer)   --stop (stop when it fires)
"""

import argparse
from pathlib import Path

from trl import GRPOConfig, GRPOTrainer

from trl_grpo_ext import GRPOExtConfig, GRPOExtTrainer, RewardHackingMonitor, get_reward
from trl_grpo_ext.testing import CPU_KWARGS

HPARAMS = dict(num_generations=8, per_device_train_batch_size=8, max_completion_length=1024, learning_rate=1e-6,
               max_steps=500, logging_steps=5, report_to="none")  # fmt: skip
SMALL_HPARAMS = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=24, learning_rate=3e-5,
                     max_steps=30, logging_steps=1, save_strategy="no", report_to="none", **CPU_KWARGS)  # fmt: skip
TINY_HPARAMS = {**SMALL_HPARAMS, "max_steps": 3, "max_completion_length": 8, "learning_rate": 5e-3}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--dataset", default="trl-lib/DeepMath-103K")
    parser.add_argument("--tiny", action="store_true", help="offline: tiny random model and built-in dataset")
    parser.add_argument("--smollm2", action="store_true", help="offline: SmolLM2-135M-Instruct on the addition task")
    parser.add_argument("--hack", action="store_true", help="with --smollm2: brevity (at most 2 tokens) weighted 3x")
    parser.add_argument("--ours", action="store_true", help="GRPOExtTrainer with monitor=True")
    parser.add_argument("--stop", action="store_true", help="stop training when a warning fires")
    parser.add_argument("--output-dir", default="outputs/monitor")
    args = parser.parse_args()

    processing_class, hparams, weights = None, HPARAMS, None
    if args.tiny:
        from trl_grpo_ext.testing import load_tiny_model, tiny_dataset

        model, processing_class = load_tiny_model(f"{args.output_dir}/tiny-model")
        train_dataset, hparams = tiny_dataset(16), TINY_HPARAMS
        rewards, correctness = [get_reward("accuracy"), get_reward("tag_format")], "accuracy_reward"
    elif args.smollm2:
        from trl_grpo_ext.tasks import addition_dataset, brevity_reward, last_integer_reward
        from trl_grpo_ext.testing import real_model

        model, train_dataset, hparams = real_model(), addition_dataset("train", repeats=10), SMALL_HPARAMS
        brevity = brevity_reward(max_tokens=2 if args.hack else 24)
        rewards, correctness, weights = (
            [last_integer_reward, brevity],
            "last_integer_reward",
            [1.0, 3.0 if args.hack else 0.5],
        )
        if args.hack:  # sequence-level normalisation: the loss type under which our sweep saw brevity win
            hparams = {**hparams, "loss_type": "grpo"}
    else:
        from datasets import load_dataset

        model, train_dataset = args.model, load_dataset(args.dataset, split="train")
        rewards, correctness = [get_reward("accuracy"), get_reward("think_format")], "accuracy_reward"

    stop = ["any"] if args.stop else None
    if args.ours:
        config = GRPOExtConfig(output_dir=args.output_dir, reward_weights=weights, monitor=True,
                               monitor_correctness=correctness, monitor_stop=stop, **hparams)  # fmt: skip
        trainer = GRPOExtTrainer(model=model, reward_funcs=rewards, args=config, train_dataset=train_dataset,
                                 processing_class=processing_class)  # fmt: skip
    else:
        monitor = RewardHackingMonitor(correctness=correctness, stop_on=stop)
        config = GRPOConfig(output_dir=args.output_dir, reward_weights=weights and [*weights, 0.0], **hparams)
        trainer = GRPOTrainer(model=model, reward_funcs=[*rewards, monitor.probe], args=config,
                              train_dataset=train_dataset, processing_class=processing_class)  # fmt: skip
        monitor.attach(trainer)  # first among the callbacks: its metrics reach report_to
    trainer.train()
    report = Path(args.output_dir) / "reward_hacking.md"
    print(report.read_text())
    warnings = trainer.state.log_history[-2].get("monitor/warnings", 0) if len(trainer.state.log_history) > 1 else 0
    print(f"{warnings:.0f} warning(s) after {trainer.state.global_step} steps; report in {report}")


if __name__ == "__main__":
    main()
