"""Per-step time overhead of `GRPOExtTrainer` (default `GRPOExtConfig`) against TRL's `GRPOTrainer` (`GRPOConfig`).

Both trainers run in this process on the same tiny offline Qwen2 (`trl_grpo_ext.testing.build_tiny_model`), the
same dataset (`tiny_dataset`), the same seed and the same CPU settings (`cpu_test_config_kwargs`). They alternate
over `--rounds` rounds of `--steps` steps each, in the order A,B then B,A, so that machine drift hits both alike.
Round 0 is a warm-up and the first step of every run is dropped; the rest are pooled per trainer.

A step's time is TRL's logged `step_time` metric: `training_step`, i.e. generation, reward scoring, advantages,
forward and backward (not the optimiser step, which both trainers share unchanged). The result is the ratio of the
median step times, ours / TRL, checked against `--target`. Each run of a trainer repeats the same seeded steps,
so a second, secondary figure takes each step's fastest time over the measured rounds, then the median over steps:
it filters out slowdowns from other processes on a shared machine.

Run:
    python benchmarks/overhead.py                     # defaults: 5 rounds x 10 steps
    python benchmarks/overhead.py --steps 30 --strict # exit 1 when the ratio exceeds --target
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
import transformers
from transformers import PreTrainedTokenizerFast
from transformers.trainer_callback import PrinterCallback
from trl import GRPOConfig, GRPOTrainer

from trl_grpo_ext import GRPOExtConfig, GRPOExtTrainer
from trl_grpo_ext.testing import build_tiny_model, cpu_test_config_kwargs, tiny_dataset

TRAINERS = {"ours": (GRPOExtTrainer, GRPOExtConfig), "trl": (GRPOTrainer, GRPOConfig)}


def length_reward(completions, **kwargs):
    """Cheap reward with within-group variance on a random model, so advantages are not all zero."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [(len(t) % 7) / 7 for t in texts]


def run_once(name: str, model_dir: Path, tokenizer, args: argparse.Namespace, out_dir: str) -> list[float]:
    """Train one fresh trainer for `args.steps` steps; return its per-step `step_time`s, first step dropped."""
    trainer_cls, config_cls = TRAINERS[name]
    config = config_cls(
        output_dir=out_dir,
        per_device_train_batch_size=args.batch,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        max_steps=args.steps,
        learning_rate=1e-2,
        seed=0,
        **cpu_test_config_kwargs(),
    )
    trainer = trainer_cls(
        model=str(model_dir),
        reward_funcs=length_reward,
        args=config,
        train_dataset=tiny_dataset(16),
        processing_class=tokenizer,
    )
    trainer.remove_callback(PrinterCallback)  # it prints every log dict to stdout
    trainer.train()
    times = [log["step_time"] for log in trainer.state.log_history if "step_time" in log]
    del trainer
    gc.collect()
    return times[1:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps per run (first one is dropped)")
    parser.add_argument("--rounds", type=int, default=5, help="round 0 is warm-up; odd keeps orders balanced")
    parser.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size (completions per step)")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 resists noise from other processes)")
    parser.add_argument("--target", type=float, default=1.02, help="PASS when median ratio ours/TRL <= target")
    parser.add_argument("--strict", action="store_true", help="exit 1 on FAIL")
    parser.add_argument("--out-json", type=Path, help="write the numbers to this JSON file")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.steps < 2:
        parser.error("need --rounds >= 2 and --steps >= 2: round 0 and each run's first step are warm-up")

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5's gradient_checkpointing rename
    runs: dict[str, list[list[float]]] = {name: [] for name in TRAINERS}  # measured rounds x steps
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model")
        tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
        for r in range(args.rounds):
            order = ["ours", "trl"] if r % 2 == 0 else ["trl", "ours"]
            for name in order:
                step_times = run_once(name, model_dir, tokenizer, args, str(Path(tmp) / "out"))
                label = f"round {r}{' (warm-up)' if r == 0 else ''} {name}"
                print(f"{label:<22} median {1e3 * statistics.median(step_times):7.2f} ms/step", file=sys.stderr)
                if r > 0:
                    runs[name].append(step_times)

    medians = {name: statistics.median(t for run in r for t in run) for name, r in runs.items()}
    best = {name: statistics.median(min(step) for step in zip(*r, strict=False)) for name, r in runs.items()}
    ratio, best_ratio = medians["ours"] / medians["trl"], best["ours"] / best["trl"]
    passed = ratio <= args.target
    print(f"\n{'trainer':<16}{'median ms/step':>16}{'best-of-rounds':>16}{'steps':>8}")
    for name, label in (("trl", "GRPOTrainer"), ("ours", "GRPOExtTrainer")):
        print(f"{label:<16}{1e3 * medians[name]:>16.2f}{1e3 * best[name]:>16.2f}{sum(map(len, runs[name])):>8}")
    print(f"ratio ours/TRL: {ratio:.4f}  (target <= {args.target}); best-of-rounds: {best_ratio:.4f}")
    print(f"{'PASS' if passed else 'FAIL'}: overhead {100 * (ratio - 1):+.2f}%")

    if args.out_json:
        settings = {k: v for k, v in vars(args).items() if k != "out_json"}
        result = {"settings": settings, "median_step_time_s": medians, "ratio": ratio, "passed": passed}
        result |= {"best_of_rounds_step_time_s": best, "best_of_rounds_ratio": best_ratio, "step_times_s": runs}
        args.out_json.write_text(json.dumps(result, indent=2))
    return 1 if args.strict and not passed else 0


if __name__ == "__main__":
    sys.exit(main())
