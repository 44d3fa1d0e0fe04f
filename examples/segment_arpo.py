"""GPG / ARPO (arXiv 2512.10365, 2507.19849): a tool-using agent trained with segment-level credit.

Real run (GPU):  python examples/segment_arpo.py --model Qwen/Qwen2.5-7B-Instruct --dataset trl-lib/DeepMath-103K
Offline (CPU):   python examples/segment_arpo.py --tiny

Rollouts branch after tool results where the entropy rises (ARPO); a token shared by several trajectories gets the
mean advantage of all of them ("hard"), or each tool-call turn is scored on its own ("--mode reward": outcome
advantage + λ · tool-call validity). Tool results are never trained. With --tiny, a short SFT first teaches the
random model the tool-call format, so that it calls the calculator and the branching has tool results to branch at.
"""

import argparse
from pathlib import Path

from datasets import Dataset

from trl_grpo_ext import GRPOExtConfig, SegmentGRPOTrainer
from trl_grpo_ext.testing import CPU_KWARGS
from trl_grpo_ext.tools import calculator

# ---- hyper-parameters (ARPO: M = 16, N = 8, α = 0.5, β = 0.2) ----
HPARAMS = dict(segment_by="tool_calls", arpo=True, num_generations=16, per_device_train_batch_size=16,
               arpo_initial_rollouts=8, arpo_beam_size=2, arpo_entropy_tokens=20, arpo_alpha=0.5, arpo_beta=0.2,
               max_completion_length=1024, learning_rate=1e-6, max_steps=500, logging_steps=10, report_to="none")  # fmt: skip
TINY_HPARAMS = dict(num_generations=4, per_device_train_batch_size=8, arpo_initial_rollouts=2, arpo_beam_size=2,
                    arpo_entropy_tokens=4, max_completion_length=96, learning_rate=1e-3, max_steps=4, logging_steps=1,
                    temperature=0.3,  # the tiny model samples well-formed calls only at a low temperature
                    **CPU_KWARGS)  # fmt: skip
SYSTEM = "Use the calculator tool for arithmetic. Give the final answer in <answer></answer>."


def tool_format_rows(n=32):
    """Cold-start rows for the tiny model: a question (rendered with the tool schema, as in RL), and an assistant
    turn that calls the calculator."""
    from transformers.utils import get_json_schema

    prompts, completions = [], []
    for i in range(n):
        a, b = 2 + i % 7, 1 + i % 5
        call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a} + {b}"}}}}\n</tool_call>'
        prompts.append([{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} + {b}?"}])
        completions.append([{"role": "assistant", "content": call}])
    return Dataset.from_dict(
        {"prompt": prompts, "completion": completions, "tools": [[get_json_schema(calculator)]] * n}
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-7B-Instruct")
    parser.add_argument("--dataset", default="trl-lib/DeepMath-103K")
    parser.add_argument("--tiny", action="store_true", help="offline: tiny model, a tool-format cold start")
    parser.add_argument("--mode", choices=["hard", "soft", "reward"], default="hard")
    parser.add_argument("--output-dir", default="outputs/segment-arpo")
    args = parser.parse_args()
    out = Path(args.output_dir)

    processing_class = None
    if args.tiny:
        from trl import SFTConfig, SFTTrainer

        from trl_grpo_ext.testing import load_tiny_model, tiny_dataset

        base, processing_class = load_tiny_model(out / "tiny-model")
        sft = SFTTrainer(model=base, train_dataset=tool_format_rows(), processing_class=processing_class,
                         args=SFTConfig(output_dir=str(out / "sft"), num_train_epochs=15, learning_rate=1e-2,
                                        per_device_train_batch_size=8, report_to="none", save_strategy="no",
                                        **CPU_KWARGS))  # fmt: skip
        sft.train()
        sft.save_model(str(out / "sft"))
        model = str(out / "sft")
        train_dataset = tiny_dataset(32).map(lambda row: {"prompt": [{"role": "system", "content": SYSTEM},
                                                                     row["prompt"][1]]})  # fmt: skip
    else:
        from datasets import load_dataset

        model = args.model
        train_dataset = load_dataset(args.dataset, split="train")

    hparams = {**HPARAMS, **(TINY_HPARAMS if args.tiny else {}), "segment_advantage": args.mode}
    if args.mode == "reward":
        hparams.update(segment_reward_funcs=["tool_call_validity"], segment_reward_lambda=0.5)
    trainer = SegmentGRPOTrainer(
        model=model,
        reward_funcs=["contains_solution", "accuracy"],
        args=GRPOExtConfig(output_dir=str(out / "rl"), **hparams),
        train_dataset=train_dataset,
        processing_class=processing_class,
        tools=[calculator],
    )
    trainer.train()
    trainer.save_model(str(out / "rl"))
    for log in trainer.state.log_history:
        if "arpo/branches" in log:
            print(f"step {log['step']}: tool calls/completion {log.get('tools/call_frequency', 0):.2f}, "
                  f"segments/completion {log['segments/per_completion']:.2f}, branches {log['arpo/branches']:.0f}, "
                  f"tokens not regenerated {log['arpo/generated_tokens_saved']:.0f}, reward {log['reward']:.3f}")  # fmt: skip
    print(f"saved to {out / 'rl'}")


if __name__ == "__main__":
    main()
