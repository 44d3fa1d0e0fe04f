"""`trl-grpo-ext`: the command line, on TRL's own pieces.

    trl-grpo-ext train [--config recipe.yaml] [--flag value ...]
    trl-grpo-ext sft [--config recipe.yaml] [--flag value ...]
    trl-grpo-ext trees [--config trees.yaml] [--flag value ...]
    trl-grpo-ext push OUTPUT_DIR REPO_ID [--private]
    trl-grpo-ext sweep [--config recipe.yaml] --grid field=v1,v2 [field=...] [--output_dir DIR] [--flag value ...]

Each command builds its parser in a `make_*_parser(subparsers=None)` function, as TRL's scripts do. `train` parses
with TRL's `TrlParser` over our `ScriptArguments` subclass, the named trainer's config class, TRL's `ModelConfig` and
`DatasetMixtureConfig`: every field is a `--flag` and a YAML key. The `--trainer` names come from the method records
(`trl_grpo_ext.list_methods()`); rewards are resolved by the trainer's own resolver (names, `name:key=value`, YAML
mappings `{name: {key: value}}`, import paths). Every input is checked before a model loads or `output_dir` is
written; a bad one ends the command with exit status 2 and one line on stderr naming the problem and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
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
    GRPOConfig,
    GRPOTrainer,
    ModelConfig,
    ScriptArguments,
    TrlParser,
    get_dataset,
    get_peft_config,
    get_quantization_config,
)

import trl_grpo_ext

from . import hub
from .__main__ import main
from .config import check_generation_lengths
from .data.driving import driving_dataset, driving_sft_dataset
from .data.trees import SAMPLE_TREES, questions_dataset
from .extension import list_methods
from .registry import _import_path
from .rewards import resolve_rewards
from .rewards.guard import required_columns
from .tasks import (
    DRIVING_HELDOUT_SIZE,
    HELDOUT_SIZE,
    RG_HELDOUT_SIZE,
    RG_INSTALL,
    RG_PREFIX,
    TASK_REWARD_WEIGHTS,
    HeldoutAccuracy,
    HeldoutDrivingScore,
    RGHeldoutAccuracy,
    RGTask,
    addition_dataset,
    addition_problems,
    driving_task_dataset,
    import_reasoning_gym,
)
from .tasks import TASK_REWARDS as TASK_REWARDS_DEFAULT
from .testing import SMOLLM2, load_tiny_model, load_tiny_vlm, real_model, tiny_dataset
from .tools import calculator

# Without --reward_funcs: the trainers whose method brings no rewards of its own get these.
DEFAULT_REWARDS = ["tag_format", "accuracy", "contains_solution"]
# The built-in task (`trl_grpo_ext.tasks`): what the main job trains, on the real model, when no dataset is named.
# Defaults, under a recipe's values and the flags: 30 steps of 8 completions (4 a prompt) of at most 24 tokens.
TASK = {"per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 24, "max_steps": 30,
        "learning_rate": 3e-5, "beta": 0.0, "logging_steps": 5, "save_strategy": "no", "report_to": "none", "seed": 0}  # fmt: skip
# Each named trainer at CPU size, on the tiny model and on the built-in task (defaults, under a recipe and the flags).
# With them and the fits of `_fit_presets` (PTA's plans to the group size, the curriculum's drops to the run's
# length), `--trainer NAME` alone is a working run of that method.
METHOD_PRESETS = {
    "prorl": {"beta": 1e-4},  # ProRL keeps a small KL term (resets need a reference)
    "pta": {"max_completion_length": 32, "plan_max_tokens": 16},
    "curriculum": {"budget_start": 24, "budget_end": 8, "budget_decays": 2, "budget_caps_generation": True},
    # the toy hierarchy (router, calculator agent, QA agent); 2 node groups of 2 alternatives per question
    "hima": {"hima_hierarchy": "toy", "hima_alternatives": 2, "max_completion_length": 48},
}
# ... and on the built-in task: the task's correctness reward, where a method reads one, and Tree-OPO's trees.
TASK_METHODS = {
    "pta": {"pta_outcome_reward": "last_integer"},
    "tree_opo": {"prefix_trees": SAMPLE_TREES},  # the shipped scripted-teacher trees of the 40 training additions
    "bicc": {"bicc_reward": "last_integer"},
    "drafts": {"draft_reward": "last_integer"},  # scores the drafts, as it scores the answers
    "hima": {"hima_accuracy_reward": "last_integer"},
}
TASK_REWARDS = {
    "curriculum": (["last_integer", "budget_length"], [1.0, 0.5]),
    "pta": (None, None),
    "hima": (None, None),
}
# ... and on a reasoning-gym task (`--task rg:NAME`): its verifier `rg_score` alone (default), or in those places.
RG_TASK_REWARDS = {
    "curriculum": (["rg_score", "budget_length"], [1.0, 0.5]),
    "pta": (None, None),
    "hima": (None, None),
}
# The driving task (text-only scenes of `trl_grpo_ext.data.driving`; NoRD's default): the trajectory reward, room for
# 4 waypoints (SmolLM2 writes a short preamble first), its held-out driving score.
DRIVING_TASK = {"max_completion_length": 48}
# What makes a run on the tiny model take seconds on a CPU; `--tiny` puts it over a recipe's values (flags still win).
TINY = {"max_steps": 20, "max_completion_length": 24, "learning_rate": 5e-3, "save_strategy": "no", "report_to": "none",
        "seed": 0}  # fmt: skip
QUICKSTART = {"per_device_train_batch_size": 8, "num_generations": 4, "logging_steps": 5, **TINY}
# Where a run saves when no --output_dir is given: one folder per trainer and model, never another run's.
OUTPUT_DIR = "outputs/{trainer}-{model}"
# The data flags of a dataset run; `--tiny` and `--task` bring their own data, so these would go unused with them.
DATA_FLAGS = ("--dataset_name", "--data_files", "--dataset_config", "--datasets")
# TRL defaults bf16=True and gradient checkpointing on; neither suits a CPU (newer transformers: "activation_").
_CHECKPOINTING = next(n for n in ("activation_checkpointing", "gradient_checkpointing")
                      if n in TrainingArguments.__dataclass_fields__)  # fmt: skip
CPU_DEFAULTS = {"bf16": False, _CHECKPOINTING: False, "dataloader_pin_memory": False}


def trainers() -> dict[str, tuple[type, type]]:
    """`--trainer` name -> (trainer class, config class), from the method records; `trl` is TRL's own `GRPOTrainer`
    (no extension, no field of ours), the baseline that sweeps and benchmarks compare against."""
    named = {"grpo_ext": (trl_grpo_ext.GRPOExtTrainer, trl_grpo_ext.GRPOExtConfig), "trl": (GRPOTrainer, GRPOConfig)}
    for method in list_methods():
        if method.trainer:
            config = getattr(trl_grpo_ext, method.config or "GRPOExtConfig")
            named[method.cli_name or method.name] = (getattr(trl_grpo_ext, method.trainer), config)
    return named


@dataclass
class _ScriptArguments(ScriptArguments):
    """TRL's script arguments (dataset name, config, splits, streaming), plus local data files and the tiny model."""

    data_files: str | None = field(default=None, metadata={"help": "Data files, for local datasets ('json' ...)."})
    tiny: bool = field(default=False, metadata={"help": "Offline smoke test: the tiny model and built-in data."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where the tiny model is built."})

    def tiny_model(self, vision: bool = False):
        """The tiny model and its tokenizer (`vision`: the tiny Qwen2.5-VL and its processor), built once."""
        cache = Path(self.cache_dir or os.environ.get("TRL_GRPO_EXT_CACHE", "~/.cache/trl_grpo_ext")).expanduser()
        with PartialState().main_process_first():  # the first process builds it; the others then find it built
            return load_tiny_vlm(cache / "tiny-vlm") if vision else load_tiny_model(cache / "tiny-model")


@dataclass
class TrainScriptArguments(_ScriptArguments):
    """Arguments of `trl-grpo-ext train` beyond the trainer's config, TRL's `ModelConfig` and dataset mixture."""

    trainer: str = field(default="grpo_ext", metadata={"help": "Named trainer (its config class gives the defaults)."})
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Rewards: registry names, 'name:key=value,...', dotted import paths or reward model ids "
                  "(in YAML also {name: {key: value}}). Default: the trainer's own, else " + " ".join(DEFAULT_REWARDS)},
    )  # fmt: skip
    task: str | None = field(
        default=None,
        metadata={"help": "A task instead of a dataset: its data, its rewards and a held-out evaluation. 'addition', "
                  "'driving' (built in; the default when no dataset is named: driving for --trainer nord, else "
                  "addition) or 'rg:NAME', a reasoning-gym dataset (rg:chain_sum; pip install "
                  "\"trl-grpo-ext[tasks]\")."},
    )  # fmt: skip
    task_args: str | None = field(
        default=None,
        metadata={"help": "The rg: task's config as a YAML mapping: '{min_terms: 3, max_terms: 3}' (in YAML also a "
                  "mapping); `seed` and `size` pick the training problems (default 0 and 1000)."},
    )  # fmt: skip
    heldout_size: int | None = field(
        default=None,
        metadata={
            "help": f"Held-out problems of the task: rg: tasks default {RG_HELDOUT_SIZE}, addition {HELDOUT_SIZE} (at "
            f"most), driving {DRIVING_HELDOUT_SIZE} scenes."
        },
    )
    heldout_every: int | None = field(
        default=None,
        metadata={"help": "With a task: evaluate held-out accuracy every N steps too (default: before and after)."},
    )
    tools: list[str] | None = field(
        default=None,
        metadata={"help": "Tools the model may call: dotted import paths of typed, documented functions."},
    )
    system_prompt: str | None = field(
        default=None, metadata={"help": "System message for every prompt ({budget} ok)."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Replace the model of a finished run in --output_dir (without it, such a run is refused)."},
    )


@dataclass
class _RunShape:
    """What the first pass of `train` reads besides the script arguments: the run's length and group size, to which
    the named trainers' presets are fitted (`_fit_presets`)."""

    max_steps: int = -1
    num_generations: int | None = None


class CLIError(Exception):
    """A bad input. The message is one line that names the problem and the fix."""


class Parser(TrlParser):
    """`TrlParser` with one-line errors, whose `overrides` beat the YAML config (the command line beats both)."""

    def __init__(self, dataclass_types, defaults=None, overrides=None, **kwargs):
        super().__init__(dataclass_types, allow_abbrev=False, **kwargs)
        self.overrides, self.config_keys = dict(overrides or {}), set()
        self.applied = {**(defaults or {}), **self.overrides}
        self.set_defaults(**self.applied)

    def set_defaults_with_config(self, **config) -> list[str]:
        self.config_keys = set(config)
        return super().set_defaults_with_config(**{**config, **self.overrides})

    def parse(self, argv: list[str], **kwargs):
        argv = list(argv)
        if "--config" in argv[:-1]:
            at = argv.index("--config") + 1
            argv[at] = resolve_recipe(argv[at])
        try:
            return self.parse_args_and_config(args=list(argv), **kwargs)
        except (ValueError, TypeError, KeyError) as exc:
            raise CLIError(self._unknown_names(str(exc)) or _one_line(exc)) from exc

    def _unknown_names(self, message: str) -> str | None:
        """HfArgumentParser's "not used" / TrlParser's "Unknown arguments from config file", as one line naming each
        unknown key or flag with the closest known one."""
        if "not used by the HfArgumentParser" in message:
            where = "flag"
        elif "Unknown arguments from config file" in message:
            where = "YAML key"
        else:
            return None
        return self._closest(re.findall(r"'--([^'=]+)", message), where)

    def _closest(self, names: list[str], where: str) -> str | None:
        """`unknown flags: --a (did you mean --b?), ...` for `names`, or None when there are none."""
        if not names:
            return None
        known = sorted({action.dest for action in self._actions})
        dash, parts = "--" if where == "flag" else "", []
        for name in names:
            close = difflib.get_close_matches(name, known, n=1)
            parts.append(f"{dash}{name}" + (f" (did you mean {dash}{close[0]}?)" if close else ""))
        return (f"unknown {where}{'s' if len(parts) > 1 else ''}: {', '.join(parts)}; fix the name, or see "
                f"`{self.prog} --help` for every field")  # fmt: skip

    def error(self, message):
        if message.startswith(("unrecognized arguments", "ambiguous option")):
            flags = [t.split("=")[0] for t in message.split(":", 1)[-1].split() if t.startswith("--")]
            if line := self._closest([flag.removeprefix("--") for flag in flags], "flag"):
                raise CLIError(line)
        raise CLIError(f"{message}; see `{self.prog} --help`")

    def given(self, argv: list[str], parsed: tuple) -> dict:
        """The settings the run was given (YAML, flags, our defaults), as parsed: a recipe that reproduces it."""
        keys = self.config_keys | set(self.applied)
        keys |= {a.dest for t in argv if (a := self._option_string_actions.get(t.split("=", 1)[0])) is not None}
        return {f.name: "<hidden>" if f.name.endswith("_token") else _plain(getattr(obj, f.name))
                for obj in parsed for f in dataclasses.fields(obj) if f.name in keys}  # fmt: skip


RECIPES = Path(__file__).resolve().parent / "recipes"


def recipes() -> dict[str, Path]:
    """The shipped recipes by name (file name without `.yaml`): `pta_grpo`, `prorl`, `pta_cold_start.sft`, ..."""
    return {path.name.removesuffix(".yaml"): path for path in sorted(RECIPES.glob("*.yaml"))}


def resolve_recipe(value: str) -> str:
    """`--config VALUE`: a YAML file's path, a shipped recipe's name (`pta_grpo`), or a trainer's name whose recipe it
    is (`pta`: the one recipe with `trainer: pta`). Anything else is a `CLIError` listing the recipe names."""
    if os.path.isfile(value):
        return value
    shipped = recipes()
    if value in shipped:
        return str(shipped[value])
    import yaml

    for_trainer = [path for name, path in shipped.items() if not name.endswith(".sft")
                   and (yaml.safe_load(path.read_text()) or {}).get("trainer", "grpo_ext") == value]  # fmt: skip
    if len(for_trainer) == 1:
        return str(for_trainer[0])
    close = difflib.get_close_matches(value, shipped, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise CLIError(f"--config {value}: no such file or recipe; {hint}give the path of a YAML file or a recipe name: "
                   f"{', '.join(shipped)}")  # fmt: skip


def _plain(value):
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value):
        return _plain(dataclasses.asdict(value))
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc).split())
    if "must be divisible by num_generations" in text:
        text = (f"{text.rstrip('.')}; make per_device_train_batch_size × number of processes × steps_per_generation "
                "(or generation_batch_size) a multiple of num_generations, so that every prompt's group is generated "
                "in one batch.")  # fmt: skip
    return text


def _device_defaults() -> dict:
    if torch.cuda.is_available():
        return {}
    # Without use_cpu, accelerate does not see the processes torchrun starts on a CPU-only machine.
    return dict(CPU_DEFAULTS) if torch.backends.mps.is_available() else {**CPU_DEFAULTS, "use_cpu": True}


# ---------------------------------------------------------------------------------------------------- train
def make_train_parser(config_class=None, subparsers=None, **defaults) -> Parser:
    """The `train` parser for a trainer's config class (without it: the first pass, which reads `--trainer`).

    With `subparsers` (an `add_subparsers(parser_class=Parser)` action, as TRL's own CLI builds them), it is added
    to them as the `train` command."""
    types = (TrainScriptArguments, config_class or _RunShape, ModelConfig, DatasetMixtureConfig)
    if subparsers is not None:
        return subparsers.add_parser("train", help="train a named trainer", dataclass_types=types, **defaults)
    return Parser(types, prog="trl-grpo-ext train", add_help=config_class is not None, **defaults)


@dataclass
class TrainRun:
    """`trl-grpo-ext train ARGS` parsed and checked: everything but the data and the model, none of them loaded."""

    script_args: TrainScriptArguments
    args: TrainingArguments
    model_args: ModelConfig
    dataset_args: DatasetMixtureConfig
    given: dict
    trainer_cls: type
    rewards: list | None
    tiny: bool
    task: str | None
    rg: RGTask | None = None  # the reasoning-gym task (`--task rg:NAME`), checked


def parse_train(argv: list[str]) -> TrainRun:
    """Parse and check `argv` like `trl-grpo-ext train ARGS` (a bad input raises `CLIError`); loads nothing."""
    # A first pass reads what picks the second parser: the trainer (its config class), whether the tiny model runs,
    # and the run's length and group size (the presets are fitted to them).
    script_args, shape, model_args, dataset_args, _ = make_train_parser().parse(argv, return_remaining_strings=True)
    named = trainers()
    if script_args.trainer not in named:
        close = difflib.get_close_matches(script_args.trainer, named, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise CLIError(f"--trainer {script_args.trainer!r} is unknown; {hint}use one of: {', '.join(named)}")
    trainer, (trainer_cls, config_cls) = script_args.trainer, named[script_args.trainer]
    tiny = script_args.tiny
    _check_unused_flags(argv, script_args)
    # CPU-size presets on the tiny model and the built-in task only: a run on your data keeps the papers' defaults.
    defaults = {**_device_defaults(), **({**QUICKSTART, **METHOD_PRESETS.get(trainer, {})} if tiny else {})}
    overrides = dict(TINY) if tiny else {}
    if tiny and trainer == "tree_opo":  # the built-in questions need their own trees, over a recipe's
        overrides["prefix_trees"] = SAMPLE_TREES
    if tiny and trainer == "hima":  # the tiny model's answers are scored by the built-in rows' sums
        defaults.update(hima_accuracy_reward="last_integer")
    named_data = script_args.dataset_name or dataset_args.datasets
    default_task = "driving" if trainer == "nord" else "addition"
    task = None if tiny else script_args.task or (None if named_data else default_task)
    rg = _rg_task(script_args, task)
    if task:  # the task's defaults, under the recipe and the flags
        defaults.update(TASK, **(DRIVING_TASK if task == "driving" else {}), **METHOD_PRESETS.get(trainer, {}),
                        **_task_methods(trainer, rg))  # fmt: skip
    defaults.update(_fit_presets(trainer, config_cls, argv, shape, defaults, overrides))
    if "--output_dir" not in _flags(argv):
        model = "tiny" if tiny else Path(model_args.model_name_or_path or SMOLLM2).name
        defaults["output_dir"] = OUTPUT_DIR.format(trainer=trainer, model=model)
    parser = make_train_parser(config_cls, defaults=defaults, overrides=overrides)
    parsed = parser.parse(argv)
    script_args, args, model_args, dataset_args = parsed
    given = parser.given(argv, parsed)
    try:
        check_generation_lengths(args)  # ours check it on construction; TRL's own config (`--trainer trl`) here
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    _check_output_dir(args.output_dir, script_args.overwrite_output_dir, args.resume_from_checkpoint)

    specs = script_args.reward_funcs
    if specs is None and task == "driving":
        specs = ["trajectory"]
    elif specs is None and task:
        specs, weights = TASK_REWARDS.get(script_args.trainer, (TASK_REWARDS_DEFAULT, TASK_REWARD_WEIGHTS))
        if rg is not None:  # the verifier is the correctness reward; no brevity term (reasoning takes tokens)
            specs, weights = RG_TASK_REWARDS.get(script_args.trainer, (["rg_score"], [1.0]))
        args.reward_weights = args.reward_weights or weights
    elif specs is None and trainer_cls in (trl_grpo_ext.GRPOExtTrainer, trl_grpo_ext.SegmentGRPOTrainer,
                                           trl_grpo_ext.TreeOPOTrainer, GRPOTrainer):  # fmt: skip
        specs = DEFAULT_REWARDS
    try:
        rewards = resolve_rewards(specs)
    except TypeError as exc:
        raise CLIError(
            f"--reward_funcs: {_one_line(exc)}; use the parameters the reward takes (its docstring)"
        ) from exc
    except (KeyError, ValueError) as exc:
        raise CLIError(f"--reward_funcs: {_one_line(exc)}") from exc
    if args.reward_weights is not None and rewards is not None and len(args.reward_weights) != len(rewards):
        raise CLIError(f"--reward_weights has {len(args.reward_weights)} values for {len(rewards)} reward functions; "
                       "give one weight per reward, in order")  # fmt: skip
    if args.push_to_hub:
        try:
            validate_repo_id(args.hub_model_id or Path(args.output_dir).resolve().name)
        except ValueError as exc:
            raise CLIError(f"--hub_model_id: {_one_line(exc)}; set --hub_model_id to 'user/name'") from exc
    if args.push_to_hub and (reason := hub.offline_reason()):
        raise CLIError(f"--push_to_hub: {reason}, or drop --push_to_hub and run `trl-grpo-ext push` later")
    if (model_args.load_in_4bit or model_args.load_in_8bit) and not model_args.use_peft:
        raise CLIError("a quantized base (--load_in_4bit / --load_in_8bit) cannot be trained itself; add --use_peft")
    return TrainRun(script_args, args, model_args, dataset_args, given, trainer_cls, rewards, tiny, task, rg)


def _rg_task(script_args, task: str | None) -> RGTask | None:
    """`--task` checked (a built-in name or `rg:NAME`), with `--task_args` and `--heldout_size`; for `rg:NAME` the
    reasoning-gym task, its name and config checked (nothing generated yet)."""
    given = script_args.task
    if given is not None and given not in ("addition", "driving") and not given.startswith(RG_PREFIX):
        close = difflib.get_close_matches(given, ["addition", "driving"], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise CLIError(f"--task {given!r} is unknown; {hint}use addition, driving or rg:NAME, a reasoning-gym dataset "
                       "(rg:chain_sum)")  # fmt: skip
    rg_name = task[len(RG_PREFIX) :] if task and task.startswith(RG_PREFIX) else None
    if script_args.task_args is not None and rg_name is None:
        raise CLIError(f"--task_args is for a reasoning-gym task (--task rg:NAME), not "
                       f"{f'--task {task}' if task else 'a dataset run'}; drop it")  # fmt: skip
    for option in ("heldout_every", "heldout_size"):
        if getattr(script_args, option) is not None and not task:
            raise CLIError(f"--{option} is for a task run (--task), which has a held-out evaluation; drop it")
    size = script_args.heldout_size
    if size is not None and (not isinstance(size, int) or size < 1 or (task == "addition" and size > HELDOUT_SIZE)):
        most = f" to {HELDOUT_SIZE} (the addition task's held-out problems)" if task == "addition" else " or more"
        raise CLIError(f"--heldout_size {size!r}: choose 1{most}")
    if rg_name is None:
        return None
    try:
        import_reasoning_gym()
    except ImportError as exc:
        raise CLIError(f"--task {task} needs the reasoning-gym package, an optional extra: {RG_INSTALL}") from exc
    task_args = script_args.task_args
    if isinstance(task_args, str):
        import yaml

        try:
            task_args = yaml.safe_load(task_args)
        except yaml.YAMLError as exc:
            raise CLIError(f"--task_args {script_args.task_args!r} is not YAML: {_one_line(exc)}; write a mapping such "
                           "as '{min_terms: 3, max_terms: 3}'") from exc  # fmt: skip
    if task_args is not None and not isinstance(task_args, dict):
        raise CLIError(f"--task_args {script_args.task_args!r} is not a mapping; write one such as "
                       "'{min_terms: 3, max_terms: 3}'")  # fmt: skip
    try:
        return RGTask(rg_name, task_args, heldout_size=script_args.heldout_size or RG_HELDOUT_SIZE)
    except ValueError as exc:
        raise CLIError(f"--task {task}: {_one_line(exc)}") from exc


def _task_methods(trainer: str, rg: RGTask | None) -> dict:
    """`TASK_METHODS[trainer]` for the task: on a reasoning-gym task the correctness reward is `rg_score`, and
    Tree-OPO's shipped trees (of the addition problems) do not apply."""
    preset = dict(TASK_METHODS.get(trainer, {}))
    if rg is not None:
        preset = {k: "rg_score" if v == "last_integer" else v for k, v in preset.items() if k != "prefix_trees"}
    return preset


def _flags(argv: list[str]) -> set[str]:
    """The `--flags` given on the command line (`--name value` and `--name=value`)."""
    return {token.split("=", 1)[0] for token in argv if token.startswith("--")}


def _check_unused_flags(argv: list[str], script_args) -> None:
    """A flag that the run would not use is an error, never dropped: `--tiny` and `--task` bring their own data."""
    given = _flags(argv)
    data = [flag for flag in DATA_FLAGS if flag in given]
    if script_args.tiny and data:
        raise CLIError(f"{data[0]} is not used with --tiny, which trains on its built-in rows; to train the tiny model "
                       f"on your data, replace --tiny with --model_name_or_path tiny")  # fmt: skip
    if script_args.tiny and "--model_name_or_path" in given:
        raise CLIError("--model_name_or_path is not used with --tiny, which trains the tiny random model; drop one of "
                       "them (--model_name_or_path tiny trains the tiny model on any data)")  # fmt: skip
    if script_args.tiny and "--task" in given:
        raise CLIError(f"--task {script_args.task} is not used with --tiny, which trains on its built-in rows; to train "
                       f"the tiny model on the task, replace --tiny with --model_name_or_path tiny")  # fmt: skip
    if "--task" in given and data:
        raise CLIError(
            f"--task {script_args.task} brings its own data, so {data[0]} would not be used; drop one of them"
        )
    if "--data_files" in given and not (script_args.dataset_name or "--datasets" in given):
        raise CLIError("--data_files needs --dataset_name, the loader that reads them (json, csv, parquet, text)")


def _fit_presets(trainer: str, config_cls, argv: list[str], shape, defaults: dict, overrides: dict) -> dict:
    """Named trainers' defaults fitted to the run (under a recipe's values and the flags, like every default).

    PTA-GRPO: `num_plans` x `continuations_per_plan` = `num_generations` (the paper's 3 x 3 needs 9 rows a prompt).
    Curriculum GRPO: at most `max_steps - 1` budget drops (each budget stage needs a step); a one-step run keeps one
    drop over a two-step schedule and trains at `budget_start`."""
    fields = config_cls.__dataclass_fields__
    if "--max_steps" in _flags(argv) or "max_steps" not in overrides:
        steps = shape.max_steps if shape.max_steps > 0 else defaults.get("max_steps")
    else:
        steps = overrides["max_steps"]
    if "--num_generations" in _flags(argv) or shape.num_generations is not None:
        generations = shape.num_generations
    else:
        generations = defaults.get("num_generations", fields["num_generations"].default)
    fitted = {}
    if trainer == "pta" and generations:
        plans = max(d for d in range(1, int(generations**0.5) + 1) if generations % d == 0)
        fitted.update(num_plans=plans, continuations_per_plan=generations // plans)
    if trainer == "curriculum" and steps:
        decays = defaults.get("budget_decays", fields["budget_decays"].default)
        fitted["budget_decays"] = max(1, min(decays, steps - 1))
        if steps == 1 and "--budget_decays" not in _flags(argv) and "budget_decays" not in overrides:
            fitted["budget_total_steps"] = 2  # the user's own decays are checked against the run as given
    return fitted


def _check_output_dir(output_dir: str, overwrite: bool, resume) -> None:
    """A finished run's model is never replaced without --overwrite_output_dir (TRL's old convention)."""
    folder = Path(output_dir)
    finished = [name for name in ("trl_grpo_ext_run.json", "adapter_config.json", "config.json")
                if (folder / name).is_file()]  # fmt: skip
    if finished and not overwrite and not resume:
        raise CLIError(f"--output_dir {folder} already holds a finished run ({finished[0]}); pass "
                       "--overwrite_output_dir to replace it, or choose another --output_dir")  # fmt: skip


def train(argv: list[str]) -> Path:
    """Parse `argv` like `trl-grpo-ext train ARGS`, check it, train, save, and return the output directory."""
    run = parse_train(argv)
    script_args, args, model_args, dataset_args, given = (run.script_args, run.args, run.model_args,
                                                          run.dataset_args, run.given)  # fmt: skip
    trainer_cls, rewards, tiny, task = run.trainer_cls, run.rewards, run.tiny, run.task
    train_dataset, eval_dataset, name = _datasets(script_args, dataset_args, args, tiny, task, run.rg)
    for dataset, where in ((train_dataset, name), (eval_dataset, f"{name} (eval split)")):
        if dataset is not None:
            _check_columns(dataset, where, rewards, args)
    tools = [_tool(path) for path in script_args.tools or []] or None
    if tools is None and trainer_cls is trl_grpo_ext.SegmentGRPOTrainer and args.segment_by in (None, "tool_calls"):
        tools = [calculator]  # segments by tool calls need a tool: the built-in calculator

    tiny_model = tiny or model_args.model_name_or_path == "tiny"
    if tiny_model:
        model, processing_class = script_args.tiny_model(vision=trainer_cls is trl_grpo_ext.NoRDTrainer and tiny)
    else:
        model, processing_class = model_args.model_name_or_path or _real_model(script_args), None
    args.model_init_kwargs = {"revision": model_args.model_revision, "trust_remote_code": args.trust_remote_code,
                              "attn_implementation": model_args.attn_implementation, "dtype": model_args.dtype,
                              **(args.model_init_kwargs or {})}  # fmt: skip
    # One upload at the end, with our model card, instead of Trainer's repo creation at start and pushes on save.
    push_to_hub, args.push_to_hub = args.push_to_hub, False
    every, length = script_args.heldout_every, args.max_completion_length
    if run.rg is not None:
        probe = RGHeldoutAccuracy(run.rg, every=every, max_new_tokens=length, system=script_args.system_prompt)
    else:
        probe = (HeldoutDrivingScore if task == "driving" else HeldoutAccuracy)(every=every, max_new_tokens=length,
                                                                                size=script_args.heldout_size)  # fmt: skip
    # HiMA's answers come from the system, not one call: TRL's evaluation runs it (eval_strategy), not this probe
    heldout = [probe] if task and script_args.trainer != "hima" else None
    try:
        trainer = trainer_cls(model=model, reward_funcs=rewards, args=args, train_dataset=train_dataset,
                              eval_dataset=eval_dataset, processing_class=processing_class, tools=tools,
                              peft_config=get_peft_config(model_args), callbacks=heldout,
                              quantization_config=get_quantization_config(model_args))  # fmt: skip
    except (ValueError, TypeError, NotImplementedError) as exc:  # the extensions' checks, before the model loads
        raise CLIError(_one_line(exc)) from exc
    if not isinstance(trainer, trl_grpo_ext.GRPOExtTrainer):  # TRL's own trainer does not attach our callbacks
        for callback in heldout or []:
            callback.attach(trainer)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    out = Path(args.output_dir).resolve()
    trainer.save_model(str(out))
    trainer.save_state()  # trainer_state.json: the log history (what `sweep` tabulates), also without checkpoints
    dataset_name = "built-in" if tiny else task or ("mixture" if dataset_args.datasets else script_args.dataset_name)
    model_name = "tiny" if tiny_model else model_args.model_name_or_path or SMOLLM2
    trainer.run_info = {"trainer": script_args.trainer, "model": model_name,
                        "dataset": dataset_name, "config": given}  # fmt: skip
    if heldout:
        (before, after), metric = (heldout[0].history[0][1], heldout[0].history[-1][1]), heldout[0].key.split("/")[1]
        trainer.run_info["results"] = {f"heldout_{metric}_before": before, f"heldout_{metric}_after": after,
                                       f"heldout_{metric}_history": [list(p) for p in heldout[0].history]}  # fmt: skip
        if heldout[0].correct and heldout[0].correct[-1] is not None:  # per evaluation, per problem: 1 right, 0 not
            trainer.run_info["results"]["heldout_correct"] = heldout[0].correct
    if push_to_hub:
        args.hub_model_id = args.hub_model_id or out.name
        try:
            trainer.push_to_hub()  # writes our model card (create_model_card), then uploads output_dir
        except Exception as exc:  # the Hub's errors (auth, network, permissions) all leave the run on disk
            raise CLIError(
                f"pushing {out} to {args.hub_model_id!r} failed: {hub.push_failure(exc)}; the run is saved: then "
                f"run `trl-grpo-ext push {out} {args.hub_model_id}`"
            ) from exc
        print(f"Pushed to https://huggingface.co/{trainer.hub_model_id}")
    else:
        trainer.create_model_card()
    if trainer.is_world_process_zero():
        rewards_logged = [log["reward"] for log in trainer.state.log_history if "reward" in log]
        summary = f"mean reward {rewards_logged[0]:.3f} -> {rewards_logged[-1]:.3f}; " if rewards_logged else ""
        if heldout:
            (_, before), (_, after) = heldout[0].history[0], heldout[0].history[-1]
            summary += f"{heldout[0].label} {before:.3f} -> {after:.3f}; "
        print(f"Trained {trainer.state.global_step} steps; {summary}saved to {out}")
    # Under torchrun: every process reaches here, then the process group closes. Left to the interpreter's exit, gloo's
    # threads were torn down with it and a rank could abort ("terminate called without an active exception", seen on CI).
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    return out


def _datasets(script_args, dataset_args, args, tiny: bool, task: str | None, rg: RGTask | None = None):
    """(train dataset, eval dataset or None, a name for messages), as TRL's `trl grpo` loads them."""
    trees = getattr(args, "prefix_trees", None)
    if trees and (tiny or not (script_args.dataset_name or dataset_args.datasets)):  # Tree-OPO: one row per tree
        try:
            questions = questions_dataset(trees)
        except (OSError, ValueError) as exc:
            raise CLIError(f"--prefix_trees: {_one_line(exc)}") from exc
        test = addition_dataset("heldout") if task else questions.select(range(min(16, len(questions))))
        dataset, name = DatasetDict({"train": questions, "test": test}), f"the questions of {trees}"
    elif rg is not None:  # the held-out problems are the eval split: another seed, none a training question
        try:
            dataset = DatasetDict({"train": rg.dataset("train"), "test": rg.dataset("heldout")})
        except ValueError as exc:
            raise CLIError(_one_line(exc)) from exc
        name = f"the reasoning-gym task {task}"
    elif task == "driving":  # the held-out scenes are the eval split: never trained on
        dataset = DatasetDict({"train": driving_task_dataset("train"), "test": driving_task_dataset("heldout")})
        name = "the built-in driving task"
    elif task:
        # The held-out problems are the eval split: never trained on.
        dataset = DatasetDict({"train": addition_dataset("train", repeats=10), "test": addition_dataset("heldout")})
        name = f"the built-in {task} task"
    elif tiny and script_args.trainer == "nord":  # the tiny vision-language model drives from the images
        dataset = DatasetDict({"train": driving_dataset(32, image_size=56), "test": driving_dataset(8, image_size=56,
                                                                                                     seed=1)})  # fmt: skip
        name = "the built-in driving scenes (images)"
    elif tiny:
        dataset, name = (
            DatasetDict({"train": tiny_dataset(64), "test": tiny_dataset(16, seed=1)}),
            "the built-in dataset",
        )
    else:
        name = "the `datasets` mixture" if dataset_args.datasets else f"dataset {script_args.dataset_name!r}"
        try:
            dataset = get_dataset(dataset_args) if dataset_args.datasets else load_dataset(
                script_args.dataset_name, name=script_args.dataset_config, data_files=script_args.data_files,
                streaming=script_args.dataset_streaming)  # fmt: skip
        except Exception as exc:  # offline, not found, bad files: all mean the same here
            raise CLIError(f"{name} could not be loaded: {_one_line(exc)}; check the name, config and data files, or "
                           "pass --tiny to train offline on the built-in dataset") from exc  # fmt: skip
    splits = [("train", script_args.dataset_train_split)]
    if args.eval_strategy != "no":
        splits.append(("eval", script_args.dataset_test_split))
    loaded = []
    for role, split in splits:
        if split not in dataset:
            option = "--dataset_train_split" if role == "train" else "--dataset_test_split (or set test_split_size)"
            raise CLIError(f"{name} has no split {split!r} to {role} on (splits: {list(dataset)}); set {option}")
        part = dataset[split]
        if script_args.system_prompt is not None:
            part = part.map(lambda row: {"prompt": with_system_prompt(row["prompt"], script_args.system_prompt)})
        loaded.append(part)
    return loaded[0], (loaded[1] if len(loaded) > 1 else None), name


def with_system_prompt(prompt, system: str):
    """`prompt` with `system` as its system message (conversational) or first line (standard)."""
    if isinstance(prompt, str):
        return f"{system}\n{prompt}"
    return [{"role": "system", "content": system}, *(m for m in prompt if m.get("role") != "system")]


def _check_columns(dataset, where: str, rewards, args) -> None:
    columns = dataset.column_names
    if columns is None:  # a streamed dataset may not know its columns before the first row
        return
    if "prompt" not in columns:
        raise CLIError(f"{where} has no 'prompt' column (columns: {columns}); GRPO generates from `prompt`: rename "
                       "your prompt column to 'prompt' (`dataset.rename_column`) or pick a dataset in TRL's format")  # fmt: skip
    for reward in rewards or []:
        for column in required_columns(reward):
            if column not in columns:
                name = getattr(reward, "__name__", type(reward).__name__)
                raise CLIError(f"reward {name!r} needs a {column!r} column, but {where} has only {columns}; add or "
                               "rename the column, or leave the reward out of --reward_funcs")  # fmt: skip
    for option in ("context_prefix_column", "completion_prefix_column"):
        column = getattr(args, option, None)
        if column is not None and column not in columns:
            raise CLIError(f"--{option} {column!r}, but {where} has no such column (columns: {columns}); add it or "
                           f"unset --{option}")  # fmt: skip


def _real_model(script_args) -> str:
    try:
        with PartialState().main_process_first():  # the first process builds it; the others then find it built
            return real_model(script_args.cache_dir)
    except RuntimeError as exc:
        raise CLIError(f"{_one_line(exc)}; or pass --tiny for the random tiny model") from exc


def _tool(path: str):
    try:
        return _import_path(path, "tool")
    except (KeyError, TypeError) as exc:
        raise CLIError(f"--tools {path!r}: {_one_line(exc)}; give the dotted import path of a function") from exc


# ---------------------------------------------------------------------------------------------------- sft
@dataclass
class SFTScriptArguments(_ScriptArguments):
    """Arguments of `trl-grpo-ext sft`: a cold start on plan-formatted reasoning (PTA-GRPO's stage 1)."""

    question_column: str = field(default="question", metadata={"help": "Column with the question."})
    plan_column: str = field(default="plan", metadata={"help": "Column with the condensed plan."})
    reasoning_column: str = field(default="reasoning", metadata={"help": "Column with the reasoning."})
    answer_column: str = field(default="answer", metadata={"help": "Column with the final answer."})
    task: str | None = field(
        default=None,
        metadata={"help": "A built-in cold start instead of plan rows: 'driving' (64 scenes with their ground-truth "
                  "waypoints, for --trainer nord; default model SmolLM2-135M-Instruct).", "choices": ["driving"]},
    )  # fmt: skip


def make_sft_parser(subparsers=None) -> Parser:
    from trl import SFTConfig

    types = (SFTScriptArguments, SFTConfig, ModelConfig)
    if subparsers is not None:
        return subparsers.add_parser(
            "sft", help="a cold start (SFT): PTA-GRPO's plans, or --task driving", dataclass_types=types
        )
    return Parser(types, prog="trl-grpo-ext sft", defaults=_device_defaults())


def sft(argv: list[str]) -> Path:
    """`trl-grpo-ext sft`: TRL's SFTTrainer on `(question, plan, reasoning, answer)` rows formatted as
    `<plan>…</plan><think>…</think><answer>…</answer>` (`trl_grpo_ext.data.pta_sft_dataset`); returns the output dir."""
    from trl import SFTTrainer

    from .data import pta_sft_dataset
    from .testing import tiny_pta_rows

    script_args, sft_args, model_args = make_sft_parser().parse(argv)
    columns = dict(question=script_args.question_column, plan=script_args.plan_column,
                   reasoning=script_args.reasoning_column, answer=script_args.answer_column)  # fmt: skip
    tiny = script_args.tiny or script_args.dataset_name is None
    driving = script_args.task == "driving"
    try:
        if driving:  # the tiny model is a vision-language one: the scenes' images, then
            dataset = driving_sft_dataset(64, images=script_args.tiny, image_size=56)
        elif tiny:
            dataset = pta_sft_dataset(tiny_pta_rows())
        else:
            rows = load_dataset(script_args.dataset_name, name=script_args.dataset_config,
                                data_files=script_args.data_files, split=script_args.dataset_train_split)  # fmt: skip
            dataset = pta_sft_dataset(rows, **columns)
    except (KeyError, ValueError) as exc:
        raise CLIError(f"{_one_line(exc)}; name the columns with --question_column, --plan_column, ...") from exc
    except Exception as exc:  # offline, not found, bad files: all mean the same here
        raise CLIError(f"dataset {script_args.dataset_name!r} could not be loaded: {_one_line(exc)}") from exc
    tiny_model = script_args.tiny or (model_args.model_name_or_path is None and not driving)
    if tiny_model:
        model, processing_class = script_args.tiny_model(vision=driving)
    else:
        model, processing_class = model_args.model_name_or_path or _real_model(script_args), None
    trainer = SFTTrainer(model=model, args=sft_args, train_dataset=dataset, processing_class=processing_class,
                         peft_config=get_peft_config(model_args))  # fmt: skip
    trainer.train()
    out = Path(sft_args.output_dir).resolve()
    trainer.save_model(str(out))
    print(f"Cold start done ({trainer.state.global_step} steps); saved to {out}. Next: trl-grpo-ext train "
          f"--trainer {'nord' if driving else 'pta'} --model_name_or_path {out}")  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------- trees
@dataclass
class TreesArguments(_ScriptArguments):
    """Arguments of `trl-grpo-ext trees`: grow Tree-OPO prefix trees with a teacher model (resumable)."""

    output: str = field(default="prefix_trees.jsonl", metadata={"help": "The trees file (JSONL) to write or resume."})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "The teacher model (default: SmolLM2-135M-Instruct offline; 'tiny')."}
    )
    reward: str = field(default="last_integer", metadata={"help": "Registry reward that marks a solution correct."})
    threshold: float = field(default=1.0, metadata={"help": "A solution is correct when its reward is >= this."})
    question_column: str = field(default="question_id", metadata={"help": "Column with a unique id per question."})
    width: int = field(default=4, metadata={"help": "Solutions sampled per expanded node."})
    max_depth: int = field(default=3, metadata={"help": "Steps per path at most (later steps join the last)."})
    delimiter: str = field(default="\n\n", metadata={"help": "What separates two steps (default a blank line)."})
    max_new_tokens: int = field(default=256, metadata={"help": "Tokens per sampled solution at most."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature of the teacher."})
    limit: int | None = field(default=None, metadata={"help": "Grow trees for the first N questions only."})
    seed: int = field(default=0, metadata={"help": "Sampling seed."})


def make_trees_parser(subparsers=None) -> Parser:
    if subparsers is not None:
        return subparsers.add_parser("trees", help="grow Tree-OPO prefix trees", dataclass_types=(TreesArguments,))
    return Parser((TreesArguments,), prog="trl-grpo-ext trees")


def trees(argv: list[str]) -> Path:
    """`trl-grpo-ext trees`: grow one prefix tree per question with a teacher (`build_prefix_trees`); returns the file.

    Without a dataset: the 40 training questions of the built-in addition task (ids `add-A-B`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .data.trees import build_prefix_trees

    (args,) = make_trees_parser().parse(argv)
    if args.dataset_name is None:
        pairs = addition_problems("train")
        dataset = addition_dataset("train").add_column("question_id", [f"add-{a}-{b}" for a, b in pairs])
    else:
        try:
            dataset = load_dataset(args.dataset_name, name=args.dataset_config, data_files=args.data_files,
                                   split=args.dataset_train_split)  # fmt: skip
        except Exception as exc:  # offline, not found, bad files: all mean the same here
            raise CLIError(f"dataset {args.dataset_name!r} could not be loaded: {_one_line(exc)}") from exc
    if args.limit is not None:
        dataset = dataset.select(range(min(args.limit, len(dataset))))
    if args.tiny or args.model_name_or_path == "tiny":
        model, tokenizer = args.tiny_model()
        model = AutoModelForCausalLM.from_pretrained(model)
    else:
        path = args.model_name_or_path or _real_model(args)
        model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    try:
        grown = build_prefix_trees(model, tokenizer, dataset, args.reward, args.output, width=args.width,
                                   max_depth=args.max_depth, delimiter=args.delimiter.encode().decode("unicode_escape"),
                                   max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                   threshold=args.threshold, question_column=args.question_column, seed=args.seed)  # fmt: skip
    except (KeyError, ValueError) as exc:
        raise CLIError(_one_line(exc)) from exc
    out = Path(args.output).resolve()
    nodes = sum(len(t.nodes) for t in grown)
    print(f"{len(grown)} prefix trees ({nodes} nodes) in {out}. Next: trl-grpo-ext train --trainer tree_opo "
          f"--prefix_trees {out}")  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------- push
def make_push_parser(subparsers=None) -> argparse.ArgumentParser:
    description = ("Upload a run saved by `trl-grpo-ext train` (model or LoRA adapter) to the Hugging Face Hub, with "
                   "a model card naming its methods, papers, config and final metrics.")  # fmt: skip
    if subparsers is not None:
        parser = subparsers.add_parser("push", help="upload a saved run with its model card", description=description)
    else:
        parser = _PushParser(prog="trl-grpo-ext push", description=description)
    parser.add_argument("output_dir", help="the run's output_dir")
    parser.add_argument("repo_id", help="Hub repository, 'user/name' (created if missing)")
    parser.add_argument("--private", action="store_true", help="create the repository private")
    return parser


class _PushParser(argparse.ArgumentParser):
    def error(self, message):
        raise CLIError(f"{message}; see `{self.prog} --help`")


def push(argv: list[str]) -> str:
    """`trl-grpo-ext push OUTPUT_DIR REPO_ID`: write the model card and upload the saved run."""
    args = make_push_parser().parse_args(argv)
    folder = Path(args.output_dir).resolve()
    try:
        hub.check_push(folder, args.repo_id)
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(_one_line(exc)) from exc
    if reason := hub.offline_reason():
        raise CLIError(f"cannot push {folder} to {args.repo_id!r}: {reason}, then run this command again")
    try:
        url = hub.push(folder, args.repo_id, private=args.private or None)
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(_one_line(exc)) from exc
    except Exception as exc:  # the Hub's errors (auth, network, permissions) all leave the run on disk
        raise CLIError(
            f"pushing {folder} to {args.repo_id!r} failed: {hub.push_failure(exc)}; then run `trl-grpo-ext push "
            f"{folder} {args.repo_id}` again"
        ) from exc
    print(f"Pushed {args.output_dir} to {url}")
    return url


# ---------------------------------------------------------------------------------------------------- sweep
def sweep(argv: list[str]) -> int:
    """`trl-grpo-ext sweep`: see `trl_grpo_ext.sweep`."""
    from .sweep import sweep as run_sweep

    return run_sweep(argv)


# ---------------------------------------------------------------------------------------------------- main
# The front door (`trl-grpo-ext`, `python -m trl_grpo_ext`) is `main`, in `trl_grpo_ext.__main__`: it answers --help and
# typos without importing this module; `python -m trl_grpo_ext.cli` (what `sweep` and `torchrun -m` run) goes through it.

if __name__ == "__main__":
    sys.exit(main())
