"""A new method written against the extension API (docs/extending.md walks through it): hinted rollouts.

Half of each group is generated with a hint from the dataset as context (not trained, not seen by the rewards); the
other half without. All rows train as usual; the method logs how much the hint helps (`hints/reward_gain`) and can
take the hinted rows out of the loss, so that the policy learns only from its own unaided attempts
(`hints_train_hinted=False`).

A method is one module: its config section, its extension, its `Method` record. Nothing in the trainer changes.

Real run (GPU):  python examples/custom_method.py --model Qwen/Qwen2.5-0.5B-Instruct
Offline (CPU):   python examples/custom_method.py --tiny
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from trl_grpo_ext import Extension, GRPOExtConfig, GRPOExtTrainer, Method, RolloutPlan, register_method
from trl_grpo_ext.testing import CPU_KWARGS


# ---- 1. The config section: fields, their help, their validation (before any model loads).
@dataclass
class HintsConfig:
    """Config section: hinted rollouts (an example method).

    > Parameters of hinted rollouts (`examples/custom_method.py`)

    hints_column (`str`, *optional*):
        Dataset column with a hint; setting it switches the method on.
    hints_train_hinted (`bool`, *optional*, defaults to `True`):
        Train on the hinted rows too; False takes them out of the loss.
    """

    hints_column: str | None = field(default=None, metadata={"help": "Dataset column with a hint (switches it on)."})
    hints_train_hinted: bool = field(default=True, metadata={"help": "Train on the hinted rows too."})

    def __post_init__(self):
        super().__post_init__()
        if self.hints_column is not None and self.num_generations < 2:
            raise ValueError(
                f"hints_column needs num_generations >= 2 (half the group is hinted), got {self.num_generations}."
            )


@dataclass
class HintsGRPOConfig(HintsConfig, GRPOExtConfig):
    """`GRPOExtConfig` with the hints section (a package method's section is in `GRPOExtConfig` itself)."""


# ---- 2. The extension: the hooks it needs, and nothing of the trainer's internals.
class Hints(Extension):
    name = "hints"  # also the metric prefix: hints/...

    def __init__(self, column: str, train_hinted: bool = True):
        self.column, self.train_hinted = column, train_hinted

    def check(self, inputs):
        names = getattr(inputs.train_dataset, "column_names", None)
        if names is not None and self.column not in names:
            raise ValueError(f"hints_column={self.column!r}, but the dataset has no such column (columns: {names}).")

    def prepare(self, plan: RolloutPlan) -> None:
        # Rows are in TRL's order: the G rows of a prompt are contiguous. The second half of each group gets the hint.
        g = plan.num_generations
        hinted = [i % g >= g // 2 for i in range(len(plan.rows))]
        tokenizer = self.trainer.tokenizer
        plan.add_context(
            [
                tokenizer(row[self.column], add_special_tokens=False)["input_ids"] if h else []
                for row, h in zip(plan.rows, hinted, strict=True)
            ]
        )

    def after_scoring(self, batch) -> None:
        g = batch.num_generations
        hinted = (torch.arange(batch.rewards.numel()) % g >= g // 2).to(batch.rewards.device)  # (N,)
        self.log("reward_gain", (batch.rewards[hinted].nanmean() - batch.rewards[~hinted].nanmean()).item())
        if not self.train_hinted and batch.mode == "train":
            batch.drop_rows(batch.local(hinted))  # the loss is then normalised over the unhinted rows


# ---- 3. The record: the model card names it, and the config switches it on.
def _from_config(args):
    column = getattr(args, "hints_column", None)
    return None if column is None else Hints(column, args.hints_train_hinted)


register_method(Method(name="hints", title="Hinted rollouts (an example)", arxiv=None, extension=_from_config))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--tiny", action="store_true", help="offline: the tiny random model")
    parser.add_argument("--output-dir", default="outputs/hints")
    args = parser.parse_args()
    from trl_grpo_ext.testing import load_tiny_model, tiny_dataset

    dataset = tiny_dataset(32).map(lambda row: {"hint": "<think>Add the two numbers.</think>"})
    model, processing_class = load_tiny_model(f"{args.output_dir}/tiny-model") if args.tiny else (args.model, None)
    config = HintsGRPOConfig(output_dir=args.output_dir, hints_column="hint", hints_train_hinted=False, max_steps=4,
                             per_device_train_batch_size=8, num_generations=4, max_completion_length=24,
                             learning_rate=1e-3 if args.tiny else 1e-6, logging_steps=1, report_to="none",
                             **(CPU_KWARGS if args.tiny else {}))  # fmt: skip
    trainer = GRPOExtTrainer(model=model, reward_funcs=["contains_solution"], args=config, train_dataset=dataset,
                             processing_class=processing_class)  # fmt: skip
    trainer.train()
    gains = [log["hints/reward_gain"] for log in trainer.state.log_history if "hints/reward_gain" in log]
    print(f"reward gain from the hint, per step: {[round(g, 3) for g in gains]}")


if __name__ == "__main__":
    main()
