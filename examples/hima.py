"""HiMA-R1 (arXiv 2506.19846): a hierarchy of agents (a router, a calculator agent, a QA agent) trained together.

Real run (GPU):  python examples/hima.py --model Qwen/Qwen2.5-3B-Instruct --dataset trl-lib/DeepMath-103K
Offline (CPU):   python examples/hima.py --tiny            (tiny random model, built-in dataset, seconds)
                 python examples/hima.py --smollm2         (SmolLM2-135M-Instruct offline, the addition task)
Options:         --adapters (one LoRA adapter per agent on one base)   --top-k N (node groups kept per question)
                 --hierarchy FILE (your own agents, YAML; docs/hima.md)
"""

import argparse

import torch
from peft import LoraConfig

from trl_grpo_ext import Agent, Hierarchy, HiMAConfig, HiMATrainer, load_hierarchy
from trl_grpo_ext.testing import CPU_KWARGS
from trl_grpo_ext.tools import calculator

# ---- hyper-parameters: 8 rows a question = 2 node slots x 4 alternatives (G); the run's length and logging ----
HPARAMS = dict(num_generations=8, per_device_train_batch_size=8, max_completion_length=512, learning_rate=1e-6,
               max_steps=500, logging_steps=10, report_to="none", hima_alternatives=4)  # fmt: skip
SMALL_HPARAMS = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=24, learning_rate=3e-5,
                     max_steps=6, logging_steps=1, save_strategy="no", hima_alternatives=2, **CPU_KWARGS)  # fmt: skip
TINY_HPARAMS = {**SMALL_HPARAMS, "max_steps": 2, "max_completion_length": 12, "learning_rate": 5e-3}


def answer_length(completions, **kwargs):
    """A stand-in accuracy for the random tiny model (it never answers right): the system answer's length, mod 3."""
    return [(len(c[0]["content"]) % 3) / 2 for c in completions]


def hierarchy() -> Hierarchy:
    """The hierarchy in Python (the same as `hima_hierarchy: toy`): the router sends arithmetic to calc."""
    return Hierarchy(
        [
            Agent(
                "router", "You route questions. Arithmetic goes to calc, anything else to qa.", routes=["calc", "qa"]
            ),
            Agent("calc", "You solve arithmetic with the calculator tool.", tools=[calculator], max_tokens=64),
            Agent("qa", "You answer the question with just the answer.", memory=True, max_tokens=32),
        ],
        master="router",
        max_calls=3,
        max_tokens=160,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-3B-Instruct")
    parser.add_argument("--dataset", default="trl-lib/DeepMath-103K")
    parser.add_argument("--tiny", action="store_true", help="offline: tiny random model and built-in dataset")
    parser.add_argument("--smollm2", action="store_true", help="offline: SmolLM2-135M-Instruct on the addition task")
    parser.add_argument("--adapters", action="store_true", help="one LoRA adapter per agent (named after it)")
    parser.add_argument("--top-k", default="all", help="node groups kept per question: a number or 'all'")
    parser.add_argument("--hierarchy", help="a YAML / JSON hierarchy file (default: the router/calc/qa toy)")
    parser.add_argument("--output-dir", default="outputs/hima")
    args = parser.parse_args()

    processing_class, hparams = None, HPARAMS
    if args.tiny:
        from trl_grpo_ext.testing import load_tiny_model, tiny_dataset

        model, processing_class = load_tiny_model(f"{args.output_dir}/tiny-model")
        train_dataset, accuracy, hparams = tiny_dataset(16), answer_length, TINY_HPARAMS
    elif args.smollm2:
        from trl_grpo_ext.tasks import addition_dataset
        from trl_grpo_ext.testing import real_model

        model, train_dataset = real_model(), addition_dataset("train", repeats=10)
        accuracy, hparams = "last_integer", SMALL_HPARAMS
    else:
        from datasets import load_dataset

        model, train_dataset, accuracy = args.model, load_dataset(args.dataset, split="train"), "accuracy"

    agents = load_hierarchy(args.hierarchy) if args.hierarchy else hierarchy()
    config = HiMAConfig(output_dir=args.output_dir, hima_top_k=args.top_k, hima_agent_adapters=args.adapters,
                        **hparams)  # fmt: skip
    rewards = [accuracy, "hima_format", "hima_efficiency"]  # R = R_accuracy + R_format - R_efficiency
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]) if args.adapters else None
    trainer = HiMATrainer(model=model, reward_funcs=rewards, args=config, train_dataset=train_dataset,
                          processing_class=processing_class, hierarchy=agents, peft_config=lora)  # fmt: skip
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    trainer.save_model(args.output_dir)

    logs = [log for log in trainer.state.log_history if "hima/node_groups" in log]
    built = sum(log["hima/node_groups"] for log in logs)
    kept = sum(log["hima/selected_groups"] for log in logs)
    print(f"node groups: {built:.0f} built, {kept:.0f} kept by the top-K filter (hima_top_k={args.top_k})")
    for agent in trainer.extension("hima").hierarchy.order():
        rows = sum(log[f"hima/rows_{agent}"] for log in logs) / max(len(logs), 1)
        print(f"  {agent}: {rows:.2f} of the training rows")
    print(f"calls per system trajectory {sum(log['hima/calls'] for log in logs) / max(len(logs), 1):.2f}, "
          f"bad routes {sum(log['hima/bad_routes'] for log in logs) / max(len(logs), 1):.2f}")  # fmt: skip
    if args.adapters:
        moved = sorted({name for name in trainer.adapters for n, p in trainer.model.named_parameters()
                        if f".{name}." in n and n in before and not torch.equal(p, before[n])})  # fmt: skip
        print(f"adapters: {', '.join(trainer.adapters)}; updated: {', '.join(moved) or 'none'}")
    print(f"saved to {args.output_dir}")


if __name__ == "__main__":
    main()
