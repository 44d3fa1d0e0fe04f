"""`trl-grpo-ext`: the command line.

    trl-grpo-ext train [--config recipe.yaml] [--flag value ...]
    trl-grpo-ext push OUTPUT_DIR REPO_ID [--private]

`train` parses its arguments the way TRL's own `trl grpo` does, with TRL's `TrlParser` over four dataclasses: the
script arguments below, the named trainer's config (`GRPOExtConfig` or a method's subclass), TRL's `ModelConfig`
(model, LoRA, quantization) and TRL's `DatasetMixtureConfig`. Every field is a `--flag` and a YAML key. With no model
named it trains the built-in quickstart offline (the tiny random model of `trl_grpo_ext.testing` on the built-in
arithmetic dataset), then says where the result went.

Every input is checked before a model loads or `output_dir` is written; a bad one ends the command with exit
status 2 and one line on stderr naming the problem and the fix. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import os
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import torch
from accelerate import PartialState
from datasets import DatasetDict, load_dataset
from huggingface_hub.utils import validate_repo_id
from transformers import TrainingArguments
from trl import (
    DatasetMixtureConfig,
    ModelConfig,
    ScriptArguments,
    TrlParser,
    get_dataset,
    get_peft_config,
    get_quantization_config,
)

from . import hub
from .config import GRPOExtConfig, ProRLConfig, PTAGRPOConfig
from .rewards import get_reward
from .testing import load_tiny_model, tiny_dataset
from .trainer import GRPOExtTrainer
from .trainers import CurriculumGRPOTrainer, ProRLTrainer, PTAGRPOTrainer, SegmentGRPOTrainer

logger = logging.getLogger(__name__)

# --trainer NAME -> (trainer class, its config class); a new named trainer adds a row. The config class gives the
# flags their defaults (ProRLConfig: ProRL's recipe). A method's trainer is named by its key in `hub.METHODS`, which
# also prefixes its metrics (`curriculum/budget`).
TRAINERS = {
    "grpo_ext": (GRPOExtTrainer, GRPOExtConfig),
    "curriculum": (CurriculumGRPOTrainer, GRPOExtConfig),
    "prorl": (ProRLTrainer, ProRLConfig),
    "pta": (PTAGRPOTrainer, PTAGRPOConfig),
    "segment": (SegmentGRPOTrainer, GRPOExtConfig),
}
# `grpo_ext` without --reward_funcs; the other named trainers bring their method's own rewards.
DEFAULT_REWARDS = ["tag_format", "accuracy", "contains_solution"]

# What makes a run on the tiny model take seconds on a CPU. `--tiny` puts it over a recipe's values (the command line
# still wins). The batch shape is left to the recipe: methods constrain it (PTA-GRPO: m·z rows a group).
TINY = {
    "max_steps": 20,
    "max_completion_length": 24,
    "learning_rate": 5e-3,
    "logging_steps": 5,
    "save_strategy": "no",
    "report_to": "none",
    "seed": 0,
}
# The quickstart has no recipe: the tiny sizes, a small batch, and an output directory.
QUICKSTART_DEFAULTS = {
    "output_dir": "outputs/quickstart",
    "per_device_train_batch_size": 8,
    "num_generations": 4,
    **TINY,
}
# TRL defaults bf16=True and gradient checkpointing on; neither suits a CPU. Recent transformers call the latter
# `activation_checkpointing` and warn on the old name.
_CHECKPOINTING = (
    "activation_checkpointing"
    if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)
CPU_DEFAULTS = {"bf16": False, _CHECKPOINTING: False, "dataloader_pin_memory": False}

# What GRPOTrainer._calculate_rewards passes every reward function besides the dataset's columns.
TRL_REWARD_ARGUMENTS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"}

# TRL's config errors name the problem; these add the fix.
CONFIG_ERROR_FIXES = {
    "must be divisible by num_generations": "make per_device_train_batch_size × number of processes × "
    "steps_per_generation (or generation_batch_size) a multiple of num_generations, so that every prompt's group "
    "is generated in one batch",
}


@dataclass
class TrainScriptArguments(ScriptArguments):
    """Arguments of `trl-grpo-ext train` beyond the trainer's config, TRL's `ModelConfig` and dataset mixture."""

    trainer: str = field(
        default="grpo_ext",
        metadata={"help": f"Named trainer: {', '.join(TRAINERS)}. Each parses its own config class's defaults."},
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Rewards: registry names with optional parameters ('tag_format:tags=plan,think,answer'), dotted "
            "import paths ('my_module.my_reward'), or reward model ids (anything with a '/'). Default: the "
            f"trainer's own; for grpo_ext {' '.join(DEFAULT_REWARDS)}."
        },
    )
    tiny: bool = field(
        default=False,
        metadata={
            "help": "Offline smoke test: the tiny model and the built-in dataset, whatever model and dataset are "
            "named, with small sizes over the recipe's (flags still win)."
        },
    )
    data_files: str | None = field(default=None, metadata={"help": "Data files, for local datasets ('json' ...)."})
    tools: list[str] | None = field(
        default=None,
        metadata={"help": "Tools the model may call: dotted import paths of functions with Google-style docstrings."},
    )
    system_prompt: str | None = field(
        default=None,
        metadata={"help": "System message for every prompt (replaces the dataset's own); may use {budget}."},
    )
    cache_dir: str | None = field(
        default=None, metadata={"help": "Where the tiny model is built (default: ~/.cache/trl_grpo_ext)."}
    )


class CLIError(Exception):
    """A bad input. The message is one line that names the problem and the fix."""


class _OneLineErrors:
    def error(self, message):
        # argparse would print its whole usage block and exit; our errors are one line, raised to `main`.
        raise CLIError(f"{message}; see `{self.prog} --help`")


class _Parser(_OneLineErrors, TrlParser):
    """`TrlParser` with one-line errors, whose `overrides` beat the YAML config (the command line beats both)."""

    def __init__(self, dataclass_types, defaults: dict | None = None, overrides: dict | None = None, **kwargs):
        super().__init__(dataclass_types, prog="trl-grpo-ext train", allow_abbrev=False, **kwargs)
        self.overrides = dict(overrides or {})
        self.applied = {**(defaults or {}), **self.overrides}
        self.config_keys: set[str] = set()
        self.set_defaults(**self.applied)

    def set_defaults_with_config(self, **config) -> list[str]:
        self.config_keys = set(config)
        return super().set_defaults_with_config(**{**config, **self.overrides})

    def given(self, argv: list[str], parsed: tuple) -> dict:
        """The settings the run was given (YAML, flags, our defaults), as parsed: a recipe that reproduces it."""
        keys = self.config_keys | set(self.applied)
        for token in argv:
            action = self._option_string_actions.get(token.split("=", 1)[0])
            if action is not None:
                keys.add(action.dest)
        values = {}
        for obj in parsed:
            for f in dataclasses.fields(obj):
                if f.name in keys:
                    values[f.name] = "<hidden>" if f.name.endswith("_token") else _plain(getattr(obj, f.name))
        return values


def _plain(value):
    """`value` as YAML / JSON can write it."""
    if isinstance(value, Enum):
        return value.value
    if dataclasses.is_dataclass(value):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _one_line(exc: BaseException) -> str:
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    text = " ".join(str(text).split())
    for problem, fix in CONFIG_ERROR_FIXES.items():
        if problem in text:
            text = f"{text.rstrip('.')}; {fix}."
    return text


# ---------------------------------------------------------------------------------------------------- parsing
def parse_train_args(argv: list[str]):
    """Parse `train ARGS`: (trainer class, script args, training config, ModelConfig, DatasetMixtureConfig, given)."""
    # A first pass reads only what picks the parser of the second: the trainer (its config class) and whether the
    # tiny model runs (its defaults); the rest of the arguments wait for the second.
    first = _Parser((TrainScriptArguments, ModelConfig), add_help=False)
    try:
        script_args, model_args, _ = first.parse_args_and_config(args=argv, return_remaining_strings=True)
    except (ValueError, TypeError) as exc:
        raise CLIError(_one_line(exc)) from exc
    trainer_cls, config_cls = _trainer_classes(script_args.trainer)
    tiny_model = script_args.tiny or model_args.model_name_or_path is None
    defaults = {**_device_defaults(), **(QUICKSTART_DEFAULTS if tiny_model else {})}
    parser = _Parser(
        (TrainScriptArguments, config_cls, ModelConfig, DatasetMixtureConfig),
        defaults=defaults,
        overrides=TINY if script_args.tiny else None,
    )
    try:
        parsed = parser.parse_args_and_config(args=argv)
    except (ValueError, TypeError, KeyError) as exc:
        raise CLIError(_one_line(exc)) from exc
    return (trainer_cls, *parsed, parser.given(argv, parsed))


def _device_defaults() -> dict:
    if torch.cuda.is_available():
        return {}
    if torch.backends.mps.is_available():
        return dict(CPU_DEFAULTS)
    # Without use_cpu, accelerate does not see the processes that torchrun / accelerate launch start on a CPU-only
    # machine (it would train each process alone instead of MULTI_CPU with gloo).
    return {**CPU_DEFAULTS, "use_cpu": True}


def _trainer_classes(name: str):
    if name not in TRAINERS:
        raise CLIError(f"--trainer {name!r} is unknown; use one of: {', '.join(TRAINERS)}")
    return TRAINERS[name]


def parse_reward_spec(spec: str) -> tuple[str, dict]:
    """Split a `--reward_funcs` entry into a name and its parameters.

    `name:key=value,key=value`; a comma-separated item without `=` continues the previous value as a list. Values
    become ints, floats, booleans (true/false) or None (none/null) where they read as such, else strings.

    >>> parse_reward_spec("tag_format:tags=plan,think,answer")
    ('tag_format', {'tags': ['plan', 'think', 'answer']})
    >>> parse_reward_spec("budget_length:shape=band,width=0.3")
    ('budget_length', {'shape': 'band', 'width': 0.3})
    """
    name, _, rest = spec.partition(":")
    name = name.strip()
    if not name:
        raise CLIError(f"--reward_funcs {spec!r} has no reward name before ':'; write 'name:key=value'")
    params: dict[str, list] = {}
    key = None
    for item in rest.split(",") if rest.strip() else []:
        head, eq, value = item.partition("=")
        if eq:
            key = head.strip()
            if not key or key in params:
                problem = "an empty parameter name" if not key else f"parameter {key!r} twice"
                raise CLIError(f"--reward_funcs {spec!r} has {problem}; write 'name:key=value,key2=value2'")
            params[key] = [_parse_value(value)]
        elif key is None:
            raise CLIError(f"--reward_funcs {spec!r}: {item!r} is not key=value; write 'name:key=value,key2=value2'")
        else:
            params[key].append(_parse_value(item))
    return name, {k: v[0] if len(v) == 1 else v for k, v in params.items()}


def _parse_value(text: str):
    text = text.strip()
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def resolve_rewards(specs: list[str] | None) -> list | None:
    """Reward callables (or reward-model ids) for `--reward_funcs` entries; a bad entry raises `CLIError`."""
    if specs is None:
        return None
    rewards = []
    for spec in specs:
        if "/" in spec and ":" not in spec:
            rewards.append(spec)  # a reward model id or path: TRL loads it
            continue
        name, params = parse_reward_spec(spec)
        try:
            rewards.append(get_reward(name, **params))
        except TypeError as exc:
            raise CLIError(
                f"--reward_funcs {spec!r}: {_one_line(exc)}; use the parameters the reward takes (its docstring, or "
                f"`help(trl_grpo_ext.get_reward)`)"
            ) from exc
        except (KeyError, ValueError) as exc:
            raise CLIError(f"--reward_funcs {spec!r}: {_one_line(exc)}") from exc
    return rewards


def required_columns(reward) -> list[str]:
    """Dataset columns a reward function needs: its parameters without defaults that TRL does not fill itself."""
    if isinstance(reward, str):
        return []
    try:
        parameters = inspect.signature(reward).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [
        p.name
        for p in parameters
        if p.kind in kinds and p.default is inspect.Parameter.empty and p.name not in TRL_REWARD_ARGUMENTS
    ]


def check_columns(dataset, where: str, reward_funcs: list | None, training_args) -> None:
    """Raise `CLIError` if `dataset` lacks the prompt column, a reward's column or a prefix column."""
    columns = dataset.column_names
    if columns is None:  # a streamed dataset may not know its columns before the first row
        return
    if "prompt" not in columns:
        raise CLIError(
            f"{where} has no 'prompt' column (columns: {columns}); GRPO generates from `prompt`: rename your "
            "prompt column to 'prompt' (`dataset.rename_column`) or pick a dataset in TRL's prompt format"
        )
    for reward in reward_funcs or []:
        for column in required_columns(reward):
            if column not in columns:
                name = getattr(reward, "__name__", type(reward).__name__)
                raise CLIError(
                    f"reward {name!r} needs a {column!r} column, but {where} has only {columns}; add or rename the "
                    "column, or leave the reward out of --reward_funcs"
                )
    for option in ("context_prefix_column", "completion_prefix_column"):
        column = getattr(training_args, option, None)
        if column is not None and column not in columns:
            raise CLIError(
                f"--{option} {column!r}, but {where} has no such column (columns: {columns}); add it or unset "
                f"--{option}"
            )


# ---------------------------------------------------------------------------------------------------- data and model
def load_datasets(script_args, dataset_args, training_args, builtin: bool):
    """(train dataset, eval dataset or None, a name for messages), as TRL's `trl grpo` loads them."""
    if builtin:
        dataset = DatasetDict({"train": tiny_dataset(64), "test": tiny_dataset(16, seed=1)})
        name = "the built-in dataset"
    else:
        dataset, name = _load_named_dataset(script_args, dataset_args)
    splits = [("train", script_args.dataset_train_split)]
    if training_args.eval_strategy != "no":
        splits.append(("eval", script_args.dataset_test_split))
    system = script_args.system_prompt
    loaded = []
    for role, split in splits:
        if split not in dataset:
            option = "--dataset_train_split" if role == "train" else "--dataset_test_split (or set test_split_size)"
            raise CLIError(f"{name} has no split {split!r} to {role} on (splits: {list(dataset)}); set {option}")
        part = dataset[split]
        if system is not None:
            part = part.map(lambda row: {"prompt": with_system_prompt(row["prompt"], system)})
        loaded.append(part)
    train_dataset, eval_dataset = loaded[0], (loaded[1] if len(loaded) > 1 else None)
    return train_dataset, eval_dataset, name


def _load_named_dataset(script_args, dataset_args):
    if dataset_args.datasets:
        if script_args.dataset_name:
            logger.warning("Both `datasets` and `dataset_name` are given: the `datasets` mixture is used, as in TRL.")
        load, name = (lambda: get_dataset(dataset_args)), "the `datasets` mixture"
    else:
        name = f"dataset {script_args.dataset_name!r}"

        def load():
            return load_dataset(
                script_args.dataset_name,
                name=script_args.dataset_config,
                data_files=script_args.data_files,
                streaming=script_args.dataset_streaming,
            )

    try:
        return load(), name
    except Exception as exc:  # the loaders raise many kinds (offline, not found, bad files); all mean the same here
        raise CLIError(
            f"{name} could not be loaded: {_one_line(exc)}; check the name, config and data files, or pass --tiny to "
            "train offline on the built-in dataset"
        ) from exc


def with_system_prompt(prompt, system: str):
    """`prompt` with `system` as its system message (conversational) or first line (standard)."""
    if isinstance(prompt, str):
        return f"{system}\n{prompt}"
    rest = [m for m in prompt if m.get("role") != "system"]
    return [{"role": "system", "content": system}, *rest]


def _import_tool(path: str):
    from .registry import _import_path

    try:
        return _import_path(path, "tool")
    except (KeyError, TypeError) as exc:
        raise CLIError(f"--tools {path!r}: {_one_line(exc)}; give the dotted import path of a function") from exc


def _tiny_model(script_args):
    cache = Path(script_args.cache_dir or os.environ.get("TRL_GRPO_EXT_CACHE", "~/.cache/trl_grpo_ext")).expanduser()
    with PartialState().main_process_first():  # the first process builds it; the others then find it built
        return load_tiny_model(cache / "tiny-model")


# ---------------------------------------------------------------------------------------------------- commands
def train(argv: list[str]) -> Path:
    """Parse `argv` like `trl-grpo-ext train ARGS`, check it, train, save, and return the output directory."""
    trainer_cls, script_args, training_args, model_args, dataset_args, given = parse_train_args(argv)
    reward_funcs, train_dataset, eval_dataset = _checked_inputs(
        trainer_cls, script_args, training_args, model_args, dataset_args
    )
    tools = [_import_tool(path) for path in script_args.tools or []] or None

    # Checked: from here on models load and output_dir is written.
    tiny_model = script_args.tiny or model_args.model_name_or_path is None
    if tiny_model:
        model, processing_class = _tiny_model(script_args)
    else:
        model, processing_class = model_args.model_name_or_path, None
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    # One upload at the end, with our model card, instead of Trainer's repo creation at start and pushes on save.
    push_to_hub, training_args.push_to_hub = training_args.push_to_hub, False
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=processing_class,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
        tools=tools,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    out = Path(training_args.output_dir).resolve()
    trainer.save_model(str(out))
    if not trainer.is_world_process_zero():
        return out
    model_name = "tiny" if tiny_model else model_args.model_name_or_path
    if _builtin_data(script_args, dataset_args):
        dataset_name = "built-in"
    else:
        dataset_name = "mixture" if dataset_args.datasets else script_args.dataset_name
    hub.save_run(trainer, out, trainer_name=script_args.trainer, model=model_name, dataset=dataset_name, config=given)
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    summary = f"mean reward {rewards[0]:.3f} -> {rewards[-1]:.3f}; " if rewards else ""
    print(f"Trained {trainer.state.global_step} steps; {summary}saved to {out}")
    if push_to_hub:
        repo_id = training_args.hub_model_id or out.name
        url = _push(out, repo_id, private=training_args.hub_private_repo, token=training_args.hub_token)
        print(f"Pushed to {url}")
    return out


def _builtin_data(script_args, dataset_args) -> bool:
    return script_args.tiny or (not script_args.dataset_name and not dataset_args.datasets)


def _checked_inputs(trainer_cls, script_args, training_args, model_args, dataset_args):
    """(reward functions, train dataset, eval dataset), once every input is checked; raises `CLIError`."""
    specs = script_args.reward_funcs
    if specs is None and trainer_cls is GRPOExtTrainer:
        specs = DEFAULT_REWARDS
    reward_funcs = resolve_rewards(specs)
    weights = training_args.reward_weights
    if weights is not None and reward_funcs is not None and len(weights) != len(reward_funcs):
        raise CLIError(
            f"--reward_weights has {len(weights)} values for {len(reward_funcs)} reward functions "
            f"({' '.join(specs)}); give one weight per reward, in order"
        )
    if training_args.push_to_hub:
        try:
            validate_repo_id(training_args.hub_model_id or Path(training_args.output_dir).resolve().name)
        except ValueError as exc:
            raise CLIError(f"--hub_model_id: {_one_line(exc)}; set --hub_model_id to 'user/name'") from exc
    if (model_args.load_in_4bit or model_args.load_in_8bit) and not model_args.use_peft:
        raise CLIError("a quantized base (--load_in_4bit / --load_in_8bit) cannot be trained itself; add --use_peft")
    builtin = _builtin_data(script_args, dataset_args)
    train_dataset, eval_dataset, name = load_datasets(script_args, dataset_args, training_args, builtin=builtin)
    check_columns(train_dataset, name, reward_funcs, training_args)
    if eval_dataset is not None:
        check_columns(eval_dataset, f"{name} (eval split)", reward_funcs, training_args)
    return reward_funcs, train_dataset, eval_dataset


def _push(folder: Path, repo_id: str, private: bool | None = None, token: str | None = None) -> str:
    try:
        return hub.push(folder, repo_id, private=private, token=token)
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(_one_line(exc)) from exc
    except Exception as exc:  # the Hub's errors (auth, network, permissions) all leave the run on disk
        raise CLIError(
            f"pushing {folder} to {repo_id!r} failed: {_one_line(exc)}; the run is saved: log in (`hf auth login`) or "
            f"fix the repo id, then run `trl-grpo-ext push {folder} {repo_id}`"
        ) from exc


class _PushParser(_OneLineErrors, argparse.ArgumentParser):
    pass


def push(argv: list[str]) -> str:
    """`trl-grpo-ext push OUTPUT_DIR REPO_ID`: write the model card and upload the saved run."""
    parser = _PushParser(
        prog="trl-grpo-ext push",
        description="Upload a run saved by `trl-grpo-ext train` (model or LoRA adapter) to the Hugging Face Hub, "
        "with a model card naming its methods, papers, config and final metrics.",
    )
    parser.add_argument("output_dir", help="the run's output_dir")
    parser.add_argument("repo_id", help="Hub repository, 'user/name' (created if missing)")
    parser.add_argument("--private", action="store_true", help="create the repository private")
    args = parser.parse_args(argv)
    url = _push(Path(args.output_dir).resolve(), args.repo_id, private=args.private or None)
    print(f"Pushed {args.output_dir} to {url}")
    return url


@dataclass
class SFTScriptArguments:
    """Arguments of `trl-grpo-ext sft`: a cold start on plan-formatted reasoning (PTA-GRPO's stage 1)."""

    dataset_name: str | None = field(default=None, metadata={"help": "Dataset for `datasets.load_dataset`."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    data_files: str | None = field(default=None, metadata={"help": "Data files, for local datasets ('json' ...)."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    question_column: str = field(default="question", metadata={"help": "Column with the question."})
    plan_column: str = field(default="plan", metadata={"help": "Column with the condensed plan."})
    reasoning_column: str = field(default="reasoning", metadata={"help": "Column with the reasoning."})
    answer_column: str = field(default="answer", metadata={"help": "Column with the final answer."})
    tiny: bool = field(default=False, metadata={"help": "Offline: the tiny model and synthetic plan rows."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where the tiny model is built."})


def sft(argv: list[str]) -> Path:
    """`trl-grpo-ext sft`: TRL's SFTTrainer on `(question, plan, reasoning, answer)` rows formatted as
    `<plan>…</plan><think>…</think><answer>…</answer>` (`trl_grpo_ext.data.pta_sft_dataset`); returns the output dir."""
    from trl import SFTConfig, SFTTrainer

    from .data import pta_sft_dataset

    parser = _Parser((SFTScriptArguments, SFTConfig, ModelConfig), defaults=_device_defaults())
    parser.prog = "trl-grpo-ext sft"
    try:
        script_args, sft_args, model_args = parser.parse_args_and_config(args=argv)
    except (ValueError, TypeError, KeyError) as exc:
        raise CLIError(_one_line(exc)) from exc
    columns = dict(question=script_args.question_column, plan=script_args.plan_column,
                   reasoning=script_args.reasoning_column, answer=script_args.answer_column)  # fmt: skip
    if script_args.tiny or script_args.dataset_name is None:
        from .testing import tiny_pta_rows

        rows = tiny_pta_rows()
        columns = {}
    else:
        try:
            rows = load_dataset(script_args.dataset_name, name=script_args.dataset_config,
                                data_files=script_args.data_files, split=script_args.dataset_train_split)  # fmt: skip
        except Exception as exc:  # offline, not found, bad files: all mean the same here
            raise CLIError(f"dataset {script_args.dataset_name!r} could not be loaded: {_one_line(exc)}") from exc
    try:
        dataset = pta_sft_dataset(rows, **columns)
    except (KeyError, ValueError) as exc:
        raise CLIError(f"{_one_line(exc)}; name the columns with --question_column, --plan_column, ...") from exc
    if script_args.tiny or model_args.model_name_or_path is None:
        model, processing_class = _tiny_model(script_args)
    else:
        model, processing_class = model_args.model_name_or_path, None
    trainer = SFTTrainer(model=model, args=sft_args, train_dataset=dataset, processing_class=processing_class,
                         peft_config=get_peft_config(model_args))  # fmt: skip
    trainer.train()
    out = Path(sft_args.output_dir).resolve()
    trainer.save_model(str(out))
    print(f"Cold start done ({trainer.state.global_step} steps); saved to {out}. Next: trl-grpo-ext train "
          f"--trainer pta --model_name_or_path {out}")  # fmt: skip
    return out


COMMANDS = {"train": train, "sft": sft, "push": push}
USAGE = """usage: trl-grpo-ext COMMAND [ARGS]

commands:
  train    train a named trainer (no arguments: the offline quickstart); `train --help` lists every flag
  sft      PTA-GRPO's cold start: SFT on (question, plan, reasoning, answer) rows in the plan format
  push     upload a saved run with its model card: `push OUTPUT_DIR REPO_ID`
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"trl-grpo-ext: unknown command {command!r}.\n{USAGE}", file=sys.stderr)
        return 2
    try:
        COMMANDS[command](rest)
    except CLIError as exc:
        print(f"trl-grpo-ext {command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
