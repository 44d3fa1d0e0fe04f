"""Tree-OPO (arXiv 2509.09284): a teacher grows prefix trees, then the student learns from their prefixes.

Real run (GPU):  python examples/tree_opo.py --teacher Qwen/Qwen2.5-7B-Instruct --model Qwen/Qwen2.5-1.5B-Instruct
Offline (CPU):   python examples/tree_opo.py --tiny            (the shipped trees of the built-in addition task)
                 python examples/tree_opo.py --tiny --grow     (the tiny model grows its own trees first)
Options:         --advantage staged | sae_soft | sae_hard      --trees FILE (an existing trees file: skip growing)

Step 1 grows one tree per question (`build_prefix_trees`: sample solutions, split them into steps on a blank line,
branch again from inner nodes; resumable, so an interrupted run picks up where it stopped). Step 2 trains: each group
of 4 rows of one question starts from 4 prefixes of its tree at mixed depths, and the advantage is staged,
r - 0.5 V(prefix) centred per group (or the SAE projection onto the tree's ordering constraints). The script prints,
per logged step, the reward, the mean prefix depth, the share of the tree's ordering constraints the advantages
satisfy, and the advantage variance.
"""

import argparse
from pathlib import Path

from trl_grpo_ext import TreeOPOConfig, TreeOPOTrainer
from trl_grpo_ext.data import SAMPLE_TREES, build_prefix_trees
from trl_grpo_ext.testing import CPU_KWARGS

INSTRUCTION = "Solve the problem step by step, one step per paragraph. End with 'The answer is N.'"
# ---- hyper-parameters: the paper's GSM8K run (Qwen2.5-1.5B student, 4 prefixes per question, alpha 0.5) ----
HPARAMS = dict(
    treeopo_alpha=0.5,
    treeopo_value="expectation",
    num_generations=4,
    per_device_train_batch_size=8,
    max_completion_length=512,
    learning_rate=1e-6,
    max_steps=500,
    logging_steps=10,
    report_to="none",
)
TREE_HPARAMS = dict(width=4, max_depth=4, max_new_tokens=512, temperature=0.8)
# The tiny run: a few steps on the CPU.
TINY_HPARAMS = dict(max_steps=4, max_completion_length=16, learning_rate=5e-3, logging_steps=1, save_strategy="no",
                    **CPU_KWARGS)  # fmt: skip
TINY_TREE_HPARAMS = dict(width=2, max_depth=3, max_new_tokens=16, temperature=1.0)


def gsm8k_rows(dataset):
    """GSM8K -> rows with a chat `prompt`, the `solution` and a unique `question_id` (what the trees need)."""

    def convert(row, index):
        return {
            "prompt": [{"role": "user", "content": f"{row['question']}\n{INSTRUCTION}"}],
            "solution": row["answer"].split("####")[-1].strip(),
            "question_id": f"gsm8k-{index}",
        }

    return dataset.map(convert, with_indices=True, remove_columns=dataset.column_names)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", default="Qwen/Qwen2.5-7B-Instruct", help="the model that grows the trees")
    parser.add_argument("--model", default="Qwen/Qwen2.5-1.5B-Instruct", help="the student")
    parser.add_argument("--dataset", default="openai/gsm8k")
    parser.add_argument("--questions", type=int, default=2000, help="trees to grow (the first N questions)")
    parser.add_argument("--trees", help="an existing trees file (JSONL): skip growing")
    parser.add_argument("--grow", action="store_true", help="with --tiny: grow trees with the tiny model")
    parser.add_argument("--advantage", choices=["staged", "sae_soft", "sae_hard"], default="staged")
    parser.add_argument("--tiny", action="store_true", help="offline: tiny random model and the shipped trees")
    parser.add_argument("--output-dir", default="outputs/tree-opo")
    args = parser.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    processing_class = None
    if args.tiny:
        from transformers import AutoModelForCausalLM

        from trl_grpo_ext.tasks import addition_dataset, addition_problems
        from trl_grpo_ext.testing import load_tiny_model

        model, processing_class = load_tiny_model(out / "tiny-model")
        pairs = addition_problems("train")[:8]
        questions = addition_dataset("train").select(range(8))
        questions = questions.add_column("question_id", [f"add-{a}-{b}" for a, b in pairs])
        teacher, teacher_tokenizer, reward, tree_hparams = model, processing_class, "last_integer", TINY_TREE_HPARAMS
        trees = args.trees or (None if args.grow else SAMPLE_TREES)
        if trees is None:
            teacher = AutoModelForCausalLM.from_pretrained(model)
    else:
        from datasets import load_dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model, reward, tree_hparams, trees = args.model, "accuracy", TREE_HPARAMS, args.trees
        if trees is None:
            split = load_dataset(args.dataset, "main", split="train")
            questions = gsm8k_rows(split).select(range(min(args.questions, len(split))))
            teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype="auto", device_map="auto")
            teacher_tokenizer = AutoTokenizer.from_pretrained(args.teacher)

    if trees is None:  # step 1: the teacher grows one tree per question (resumable: rerun to continue)
        trees = out / "trees.jsonl"
        grown = build_prefix_trees(teacher, teacher_tokenizer, questions, reward, trees, **tree_hparams)
        print(f"grew {len(grown)} trees, {sum(len(t.nodes) for t in grown)} nodes, in {trees}")
        del teacher

    # step 2: train; without train_dataset the rows are the trees' questions
    config = TreeOPOConfig(output_dir=str(out), prefix_trees=str(trees), treeopo_advantage=args.advantage,
                           **{**HPARAMS, **(TINY_HPARAMS if args.tiny else {})})  # fmt: skip
    trainer = TreeOPOTrainer(
        model=model, reward_funcs=["last_integer" if args.tiny else reward], args=config,
        processing_class=processing_class,
    )  # fmt: skip
    trainer.train()
    trainer.save_model(str(out))
    for log in trainer.state.log_history:
        if "treeopo/prefix_depth" in log:
            print(f"step {log['step']}: reward {log['reward']:.3f}, prefix depth {log['treeopo/prefix_depth']:.2f}, "
                  f"constraints satisfied {log['treeopo/constraint_satisfaction']:.2f} "
                  f"(raw rewards {log['treeopo/constraint_satisfaction_before']:.2f}), "
                  f"advantage var {log['treeopo/advantage_var']:.3f}")  # fmt: skip
    print(f"saved to {args.output_dir}")


if __name__ == "__main__":
    main()
