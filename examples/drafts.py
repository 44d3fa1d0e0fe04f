"""Draft-conditioned RL: refine drafts (ThinkTwice, arXiv 2604.01591) or learn from mismatched wrong drafts
(arXiv 2605.17314). Evaluation never shows drafts.

Real run (GPU):  python examples/drafts.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset trl-lib/DeepMath-103K
                 python examples/drafts.py --source model --draft-model Qwen/Qwen2.5-0.5B-Instruct --mismatched-wrong
Offline (CPU):   python examples/drafts.py --tiny            (tiny random model, built-in dataset, seconds)
                 python examples/drafts.py --smollm2         (SmolLM2-135M-Instruct offline, the addition task)
Options:         --source self | model | column   --mode alternate | refine | mix   --mismatched-wrong
"""

import argparse

from trl_grpo_ext import DraftGRPOConfig, DraftGRPOTrainer
from trl_grpo_ext.testing import CPU_KWARGS

# ---- hyper-parameters: 8 rollouts a problem, one draft shown, solve and refine batches alternating (ThinkTwice);
# the mismatched-wrong recipe trains with Dr. GRPO; the run's length and logging ----
HPARAMS = dict(num_generations=8, per_device_train_batch_size=8, max_completion_length=2048, learning_rate=1e-6,
               max_steps=500, logging_steps=10, report_to="none", draft_max_new_tokens=1024)  # fmt: skip
SMALL_HPARAMS = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=24, learning_rate=3e-5,
                     max_steps=10, logging_steps=1, save_strategy="no", **CPU_KWARGS)  # fmt: skip
TINY_HPARAMS = {**SMALL_HPARAMS, "max_steps": 4, "max_completion_length": 16, "learning_rate": 5e-3}
MISMATCHED_WRONG = dict(draft_match="mismatched", draft_keep="wrong", loss_type="dr_grpo")


def odd_length(completions, **kwargs):
    """A stand-in correctness for the random tiny model (it never answers right): the text's length is odd."""
    from trl_grpo_ext.rewards import completion_text

    return [float(len(completion_text(c)) % 2) for c in completions]


odd_length.correctness = True


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-1.5B-Instruct")
    parser.add_argument("--dataset", default="trl-lib/DeepMath-103K")
    parser.add_argument("--tiny", action="store_true", help="offline: tiny random model and built-in dataset")
    parser.add_argument("--smollm2", action="store_true", help="offline: SmolLM2-135M-Instruct on the addition task")
    parser.add_argument("--source", choices=["self", "model", "column"], default="self")
    parser.add_argument("--draft-model", help="with --source model (default offline: the policy's own start)")
    parser.add_argument("--mode", choices=["alternate", "refine", "mix"], default="alternate")
    parser.add_argument("--mismatched-wrong", action="store_true", help="wrong drafts of other problems, Dr. GRPO")
    parser.add_argument("--output-dir", default="outputs/drafts")
    args = parser.parse_args()

    processing_class, hparams = None, HPARAMS
    if args.tiny:
        from trl_grpo_ext.testing import load_tiny_model, tiny_dataset

        model, processing_class = load_tiny_model(f"{args.output_dir}/tiny-model")
        train_dataset, rewards, reward, hparams = tiny_dataset(16), [odd_length], "odd_length", TINY_HPARAMS
    elif args.smollm2:
        from trl_grpo_ext.tasks import addition_dataset
        from trl_grpo_ext.testing import real_model

        model, train_dataset = real_model(), addition_dataset("train", repeats=10)
        rewards, reward, hparams = ["last_integer"], "last_integer", SMALL_HPARAMS
    else:
        from datasets import load_dataset

        model, train_dataset = args.model, load_dataset(args.dataset, split="train")
        rewards, reward = ["accuracy", "draft_copy_penalty:n=4"], "accuracy"

    extra = dict(MISMATCHED_WRONG) if args.mismatched_wrong else {}
    if args.source == "model":
        extra["draft_model"] = args.draft_model or (model if isinstance(model, str) else None)
    if args.source == "column":  # a column of drafts: here every problem's draft is a wrong guess, "0"
        train_dataset = train_dataset.add_column("draft", ["The answer is 0."] * len(train_dataset))
    config = DraftGRPOConfig(output_dir=args.output_dir, draft_source=args.source, draft_mode=args.mode,
                             draft_reward=reward, **extra, **hparams)  # fmt: skip
    trainer = DraftGRPOTrainer(model=model, reward_funcs=rewards, args=config, train_dataset=train_dataset,
                               processing_class=processing_class)  # fmt: skip
    trainer.train()
    trainer.save_model(args.output_dir)
    logs = [log for log in trainer.state.log_history if "drafts/refine_fraction" in log]
    refine = [log for log in logs if log["drafts/refine_fraction"] > 0]
    mean = lambda key: sum(log.get(key, 0.0) for log in refine) / max(len(refine), 1)  # noqa: E731
    print(f"refine steps {len(refine)} of {len(logs)}; improvement rate {mean('drafts/improvement_rate'):.2f}; "
          f"copy rate {mean('drafts/copy_rate'):.2f}; problems in the draft store {len(trainer.extension('drafts').store)}")  # fmt: skip
    print(f"saved to {args.output_dir}")


if __name__ == "__main__":
    main()
