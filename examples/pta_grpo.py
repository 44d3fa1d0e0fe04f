"""PTA-GRPO (arXiv 2510.01833): cold-start SFT on plan-formatted reasoning, then RL with plans shared by their rows.

Real run (GPU):  python examples/pta_grpo.py --model Qwen/Qwen3-8B --sft-dataset my/plan-cots --dataset trl-lib/DeepMath-103K
Offline (CPU):   python examples/pta_grpo.py --tiny

Stage 1 formats rows of (question, plan, reasoning, answer) as <plan>…</plan><think>…</think><answer>…</answer>
(`trl_grpo_ext.data.pta_sft_dataset`) and runs TRL's SFTTrainer. Stage 2 runs PTAGRPOTrainer: m = 3 plans per
prompt, z = 3 continuations per plan; r = r_outcome + r_plan + r_format.
"""

import argparse
from pathlib import Path

from trl import SFTConfig, SFTTrainer

from trl_grpo_ext import PTAGRPOConfig, PTAGRPOTrainer
from trl_grpo_ext.data import pta_sft_dataset
from trl_grpo_ext.testing import CPU_KWARGS

# ---- hyper-parameters ----
SFT_HPARAMS = dict(num_train_epochs=1, learning_rate=1e-5, per_device_train_batch_size=8, report_to="none")
RL_HPARAMS = dict(num_plans=3, continuations_per_plan=3, num_generations=9, per_device_train_batch_size=9,
                  max_completion_length=1024, plan_max_tokens=256, learning_rate=1e-6, max_steps=500,
                  logging_steps=10, report_to="none")  # fmt: skip
TINY_SFT = dict(num_train_epochs=15, learning_rate=1e-2, per_device_train_batch_size=8, logging_steps=10,
                **CPU_KWARGS)  # fmt: skip
TINY_RL = dict(num_plans=2, continuations_per_plan=2, num_generations=4, per_device_train_batch_size=8,
               max_completion_length=24, plan_max_tokens=16, learning_rate=1e-3, max_steps=4, logging_steps=1,
               pta_outcome_reward="contains_solution",  # math-verify needs LaTeX answers a tiny model never writes
               **CPU_KWARGS)  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen3-8B")
    parser.add_argument("--sft-dataset", default=None, help="rows with question, plan, reasoning, answer columns")
    parser.add_argument("--dataset", default="trl-lib/DeepMath-103K", help="RL prompts with a `solution` column")
    parser.add_argument("--tiny", action="store_true", help="offline: tiny random model and synthetic data")
    parser.add_argument("--output-dir", default="outputs/pta-grpo")
    args = parser.parse_args()
    out = Path(args.output_dir)

    processing_class = None
    if args.tiny:
        from trl_grpo_ext.testing import load_tiny_model, tiny_dataset, tiny_pta_rows

        model, processing_class = load_tiny_model(out / "tiny-model")
        sft_rows, rl_dataset = tiny_pta_rows(), tiny_dataset(32)
    else:
        from datasets import load_dataset

        model = args.model
        sft_rows = load_dataset(args.sft_dataset, split="train")
        rl_dataset = load_dataset(args.dataset, split="train")

    # Stage 1: cold start.
    sft = SFTTrainer(
        model=model,
        args=SFTConfig(output_dir=str(out / "sft"), **(TINY_SFT if args.tiny else SFT_HPARAMS)),
        train_dataset=pta_sft_dataset(sft_rows),
        processing_class=processing_class,
    )
    sft.train()
    sft.save_model(str(out / "sft"))

    # Stage 2: PTA-GRPO from the cold-started model.
    trainer = PTAGRPOTrainer(
        model=str(out / "sft"),
        args=PTAGRPOConfig(output_dir=str(out / "rl"), **(TINY_RL if args.tiny else RL_HPARAMS)),
        train_dataset=rl_dataset,
        processing_class=processing_class,
    )
    trainer.train()
    trainer.save_model(str(out / "rl"))
    for log in trainer.state.log_history:
        if "pta/plans_closed" in log:
            print(f"step {log['step']}: plans closed {log['pta/plans_closed']:.2f}, generated "
                  f"{log['pta/generated_tokens']:.0f} tokens vs {log['pta/independent_tokens']:.0f} independently, "
                  f"reward {log['reward']:.3f}")  # fmt: skip
    print(f"saved to {out / 'rl'}")


if __name__ == "__main__":
    main()
