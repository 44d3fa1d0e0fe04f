"""`trl-grpo-ext`: the command line.

`trl-grpo-ext train` with no arguments trains the built-in quickstart offline: the tiny random model from
`trl_grpo_ext.testing` on the small built-in arithmetic dataset, then says where the result went. Every field of
`GRPOExtConfig` is a `--flag`, and `--config recipe.yaml` reads them from YAML, through TRL's own `TrlParser`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

QUICKSTART_DEFAULTS = {
    "output_dir": "outputs/quickstart",
    "max_steps": 20,
    "per_device_train_batch_size": 8,
    "num_generations": 4,
    "max_completion_length": 24,
    "learning_rate": 5e-3,
    "logging_steps": 5,
    "save_strategy": "no",
    "report_to": "none",
    "seed": 0,
}


@dataclass
class TrainScriptArguments:
    """Arguments of `trl-grpo-ext train` that are not training hyper-parameters."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Hub model id or local path. Unset: the tiny offline model (the quickstart)."},
    )
    tiny: bool = field(
        default=False,
        metadata={"help": "Offline: the tiny model and the built-in dataset, whatever model and dataset are named."},
    )
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Dataset for `datasets.load_dataset` (Hub id, or 'json' with --data_files). Unset: built-in."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    data_files: str | None = field(default=None, metadata={"help": "Data files, for local datasets ('json' ...)."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["tag_format", "accuracy", "contains_solution"],
        metadata={"help": "Reward registry names or dotted import paths; see `trl_grpo_ext.list_rewards()`."},
    )
    system_prompt: str | None = field(
        default=None,
        metadata={"help": "System message for every prompt (replaces the dataset's own); may use {budget}."},
    )
    cache_dir: str | None = field(
        default=None, metadata={"help": "Where the tiny model is built (default: ~/.cache/trl_grpo_ext)."}
    )


def _parser(defaults: dict | None = None):
    from trl import TrlParser

    from .config import GRPOExtConfig

    parser = TrlParser((TrainScriptArguments, GRPOExtConfig))
    import torch

    if not torch.cuda.is_available():
        # TRL defaults bf16=True and gradient checkpointing on; neither suits a CPU.
        parser.set_defaults(bf16=False, gradient_checkpointing=False, dataloader_pin_memory=False)
    if defaults:
        parser.set_defaults(**defaults)
    return parser


def train(argv: list[str]) -> Path:
    """Parse `argv` like `trl-grpo-ext train ARGS`, train, save, and return the output directory."""
    script_args, training_args = _parser().parse_args_and_config(args=argv)
    quickstart = script_args.model_name_or_path is None or script_args.tiny
    if quickstart:
        script_args, training_args = _parser(QUICKSTART_DEFAULTS).parse_args_and_config(args=argv)

    from .rewards import get_reward
    from .trainer import GRPOExtTrainer

    reward_funcs = [get_reward(name) for name in script_args.reward_funcs]
    processing_class = None
    if quickstart:
        from transformers import PreTrainedTokenizerFast

        from .testing import build_tiny_model

        cache = Path(script_args.cache_dir or os.environ.get("TRL_GRPO_EXT_CACHE", "~/.cache/trl_grpo_ext"))
        model = str(build_tiny_model(cache.expanduser() / "tiny-model"))
        processing_class = PreTrainedTokenizerFast.from_pretrained(model)
    else:
        model = script_args.model_name_or_path
    train_dataset = _load_dataset(script_args, builtin=quickstart)

    trainer = GRPOExtTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=processing_class,
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    if processing_class is not None:
        processing_class.save_pretrained(training_args.output_dir)
    out = Path(training_args.output_dir).resolve()
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    summary = f"mean reward {rewards[0]:.3f} -> {rewards[-1]:.3f}; " if rewards else ""
    print(f"Trained {trainer.state.global_step} steps; {summary}saved to {out}")
    return out


def _load_dataset(script_args: TrainScriptArguments, builtin: bool):
    if builtin or script_args.dataset_name is None:
        from .testing import tiny_dataset

        dataset = tiny_dataset(64)
    else:
        from datasets import load_dataset

        dataset = load_dataset(
            script_args.dataset_name,
            script_args.dataset_config,
            data_files=script_args.data_files,
            split=script_args.dataset_train_split,
        )
    if script_args.system_prompt is not None:
        dataset = dataset.map(lambda row: {"prompt": with_system_prompt(row["prompt"], script_args.system_prompt)})
    return dataset


def with_system_prompt(prompt, system: str):
    """`prompt` with `system` as its system message (conversational) or first line (standard)."""
    if isinstance(prompt, str):
        return f"{system}\n{prompt}"
    rest = [m for m in prompt if m.get("role") != "system"]
    return [{"role": "system", "content": system}, *rest]


USAGE = """usage: trl-grpo-ext COMMAND [ARGS]

commands:
  train    train with GRPOExtTrainer (no arguments: the offline quickstart); `train --help` lists every flag
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        train(rest)
        return 0
    print(f"trl-grpo-ext: unknown command {command!r}.\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
