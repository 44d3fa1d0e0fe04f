"""NoRD (arXiv 2602.21172): a driving policy writes its future waypoints, no reasoning, trained with Dr. GRPO on a
continuous driving score; the difficulty-bias diagnostic shows where the advantage mass goes.

Real run (GPU):  python examples/nord.py --model Qwen/Qwen2.5-VL-3B-Instruct       (rendered scenes as images)
Offline (CPU):   python examples/nord.py --tiny        (a tiny random Qwen2.5-VL on rendered scenes, seconds)
                 python examples/nord.py --smollm2     (SmolLM2-135M-Instruct on text scenes, after a cold start)
Options:         --scale-rewards group   (GRPO's std normalisation instead of Dr. GRPO's none, to compare)
"""

import argparse
import json
from pathlib import Path

from trl_grpo_ext import NoRDConfig, NoRDTrainer, get_reward
from trl_grpo_ext.data.driving import driving_dataset
from trl_grpo_ext.testing import CPU_KWARGS

# ---- hyper-parameters: 8 trajectories a scene, short completions (waypoints only), Dr. GRPO from NoRDConfig ----
HPARAMS = dict(num_generations=8, per_device_train_batch_size=8, max_completion_length=64, learning_rate=1e-6,
               max_steps=500, logging_steps=10, report_to="none", difficulty_by="kind")  # fmt: skip
SMALL_HPARAMS = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=48, learning_rate=3e-5,
                     max_steps=10, logging_steps=1, save_strategy="no", **CPU_KWARGS)  # fmt: skip
TINY_HPARAMS = {**SMALL_HPARAMS, "max_steps": 3, "max_completion_length": 16, "learning_rate": 5e-3}


def length_match(completions, future, **kwargs):
    """A stand-in for the random tiny model (it never writes a trajectory): how close its text's length comes to
    that of the ground-truth waypoints, in [0, 1]."""
    from trl_grpo_ext.data.driving import format_waypoints
    from trl_grpo_ext.rewards import completion_text

    return [max(0.0, 1 - abs(len(completion_text(c)) - len(format_waypoints(f))) / 40)
            for c, f in zip(completions, future, strict=True)]  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-VL-3B-Instruct")
    parser.add_argument("--tiny", action="store_true", help="offline: a tiny random Qwen2.5-VL on rendered scenes")
    parser.add_argument("--smollm2", action="store_true", help="offline: SmolLM2-135M-Instruct on text scenes")
    parser.add_argument("--scale-rewards", choices=["none", "group"], default="none")
    parser.add_argument("--output-dir", default="outputs/nord")
    args = parser.parse_args()

    processing_class, rewards, hparams = None, [get_reward("trajectory")], HPARAMS
    if args.tiny:
        from trl_grpo_ext.testing import load_tiny_vlm

        model, processing_class = load_tiny_vlm(f"{args.output_dir}/tiny-vlm")  # processor: tokenizer + images
        train_dataset = driving_dataset(16, images=True, image_size=56, seed=0)
        rewards, hparams = [*rewards, length_match], {**TINY_HPARAMS, "difficulty_by": "kind"}
    elif args.smollm2:
        from transformers import AutoTokenizer
        from trl import SFTConfig, SFTTrainer

        from trl_grpo_ext.data.driving import driving_sft_dataset
        from trl_grpo_ext.tasks import driving_task_dataset
        from trl_grpo_ext.testing import real_model

        # NoRD starts RL from an SFT model; 8 steps on 64 scenes teach SmolLM2 the answer format
        base, out = real_model(), f"{args.output_dir}/cold-start"
        sft = SFTTrainer(model=base, train_dataset=driving_sft_dataset(64), processing_class=AutoTokenizer.from_pretrained(base),
                         args=SFTConfig(output_dir=out, max_steps=8, learning_rate=5e-5, per_device_train_batch_size=8,
                                        report_to="none", save_strategy="no", **CPU_KWARGS))  # fmt: skip
        sft.train()
        sft.save_model(out)
        model, train_dataset, hparams = out, driving_task_dataset("train"), SMALL_HPARAMS
    else:
        model, train_dataset = args.model, driving_dataset(2048, images=True, seed=0)

    loss_type = "dr_grpo" if args.scale_rewards == "none" else "grpo"
    config = NoRDConfig(output_dir=args.output_dir, scale_rewards=args.scale_rewards, loss_type=loss_type, **hparams)
    trainer = NoRDTrainer(model, rewards, args=config, train_dataset=train_dataset, processing_class=processing_class)
    trainer.train()
    trainer.save_model(args.output_dir)

    # Where the advantage went: share of Σ|A| per bucket, under this run's advantages and under both scalings
    groups = json.loads((Path(args.output_dir) / "difficulty_bias.json").read_text())["groups"]
    print(f"advantage mass by difficulty over {len(groups)} groups (this run: scale_rewards={args.scale_rewards!r}):")
    for key in ("loss", "scaled", "unscaled"):
        total = sum(g[f"mean_abs_{key}"] for g in groups) or 1.0
        shares = {b: sum(g[f"mean_abs_{key}"] for g in groups if g["bucket"] == b) / total
                  for b in sorted({g["bucket"] for g in groups})}  # fmt: skip
        print(f"  {key:>8}: " + ", ".join(f"{b} {v:.2f}" for b, v in shares.items()))
    scores = [log["rewards/trajectory/mean"] for log in trainer.state.log_history if "rewards/trajectory/mean" in log]
    print(
        f"driving score {scores[0]:.3f} -> {scores[-1]:.3f}; plot in {args.output_dir}/difficulty_bias.png; "
        f"saved to {args.output_dir}"
    )


if __name__ == "__main__":
    main()
