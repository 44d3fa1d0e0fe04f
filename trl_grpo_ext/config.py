"""`GRPOExtConfig`: TRL's `GRPOConfig` plus one section of fields per method, each from its method's module."""

from __future__ import annotations

import functools
import sys
import types
import typing
from dataclasses import MISSING, dataclass, field, fields

from trl import GRPOConfig

from .methods.arpo import ARPOConfig
from .methods.bicc import BiCCConfig
from .methods.curriculum import CurriculumConfig
from .methods.drafts import DraftConfig
from .methods.dynamic_sampling import DynamicSamplingConfig
from .methods.hima import HiMAConfigSection
from .methods.monitor import MonitorConfig
from .methods.nord import NoRDConfigSection
from .methods.prefixes import PrefixColumnsConfig
from .methods.pta import PTAConfig
from .methods.segments import SegmentsConfig
from .methods.tree_opo import TreeOPOConfigSection
from .shared_prefix import SharedPrefixConfig
from .tools import ToolsConfig

SECTIONS = (
    PrefixColumnsConfig,
    DynamicSamplingConfig,
    CurriculumConfig,
    PTAConfig,
    SegmentsConfig,
    ARPOConfig,
    TreeOPOConfigSection,
    BiCCConfig,
    DraftConfig,
    MonitorConfig,
    NoRDConfigSection,
    HiMAConfigSection,
    SharedPrefixConfig,
    ToolsConfig,
)


@dataclass
class GRPOExtConfig(*SECTIONS, GRPOConfig):
    r"""Configuration for [`GRPOExtTrainer`]: every field of TRL's `GRPOConfig`, plus the methods' own sections.

    With every method left at its default, training is bit for bit that of `GRPOTrainer` with the same `GRPOConfig`
    fields. All defaults inherited from `GRPOConfig` are unchanged (note TRL's `bf16=True` and
    `gradient_checkpointing=True`: turn both off to train on a CPU). Every field is validated before any model loads,
    each section by its own method's module.

    Parameters:
        > Parameters that control the advantage

        advantage_estimator (`str` or callable, *optional*, defaults to `"group"`):
            Registry name or dotted import path of the advantage estimator, or the callable itself. `"group"` keeps
            TRL's own group-normalised advantages (and its `scale_rewards`, `multi_objective_aggregation`). An
            estimator returns (B,) or (B, T) advantages; see `trl_grpo_ext.advantages`.
    """

    advantage_estimator: str = field(
        default="group",
        metadata={
            "help": "Registry name or dotted import path of the advantage estimator. 'group' keeps TRL's own "
            "group-normalised advantages; see `trl_grpo_ext.list_advantages()`."
        },
    )

    # Fields whose value may be more than their annotation says (the argument parser needs a plain type): their own
    # checks cover them. A section lists its own in `_untyped_fields` too.
    _untyped_fields = ("advantage_estimator",)

    def __post_init__(self):
        check_field_types(self)  # before any section compares a value with a number
        check_generation_lengths(self)
        super().__post_init__()
        from .advantages import list_advantages

        value = self.advantage_estimator
        if callable(value):
            return
        if not isinstance(value, str) or not value:
            raise ValueError(
                f"advantage_estimator={value!r} must be a registry name, a dotted import path or a callable; "
                f"known names: {', '.join(list_advantages())}."
            )
        if value not in list_advantages() and "." not in value:
            raise ValueError(
                f"advantage_estimator={value!r} is not a registered estimator. Known: {', '.join(list_advantages())}; "
                "register yours with `trl_grpo_ext.register_advantage` before building the config, or give its dotted "
                "import path (e.g. 'my_package.my_estimator')."
            )

    def require_whole_groups(self, what: str) -> None:
        """Raise unless each process holds whole groups (every row of a prompt's group on one process)."""
        rows = self.per_device_train_batch_size * (self.steps_per_generation or 1)
        if rows % self.num_generations:
            raise ValueError(
                f"{what} works on whole groups per process: per_device_train_batch_size * steps_per_generation "
                f"({rows}) must be a multiple of num_generations ({self.num_generations})."
            )


GRPOExtConfig.__doc__ += "".join(section.__doc__.split("\n", 1)[1] for section in SECTIONS)

_KINDS = {bool: "True or False", int: "a whole number", float: "a number", str: "a string", type(None): "None"}
_PLURALS = {bool: "booleans", int: "whole numbers", float: "numbers", str: "strings"}


def check_generation_lengths(config) -> None:
    """TRL's length fields, checked where they are set instead of inside generation (`max_new_tokens must be greater
    than 0`, after the model has loaded). Any `GRPOConfig` can be checked; the command line checks TRL's own too."""
    for name in ("max_completion_length", "max_prompt_length"):
        value = getattr(config, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be a whole number of tokens >= 1 (or unset for TRL's default).")


def check_field_types(config) -> None:
    """Raise a TypeError naming the field, the value and the fix when a method field's value is not of its type.

    Every field a section adds to `GRPOConfig` is checked against its annotation where that is made of `bool`, `int`,
    `float`, `str`, `None` and `list[...]` of them (an int is a float; a bool is not a number); other annotations,
    and the fields a class lists in `_untyped_fields`, are left to the sections' own checks. The argument parser
    already converts command-line and YAML values; this catches a Python caller's `arpo_alpha="0.5"` or `bicc="no"`
    (a truthy string would switch the method on) before a section compares it with a number.
    """
    for f, annotation in _typed_fields(type(config)):
        value = getattr(config, f.name)
        if not _matches(value, annotation):
            raise TypeError(
                f"{f.name}={value!r} must be {_describe(annotation)}, not {type(value).__name__}; "
                f"{_fix(f, value, annotation)}."
            )


@functools.cache
def _typed_fields(cls) -> tuple:
    """(field, annotation) of each field `check_field_types` checks on configs of class `cls`, found once."""
    trl = {f.name for f in fields(GRPOConfig)}
    untyped = {name for klass in cls.__mro__ for name in vars(klass).get("_untyped_fields", ())}
    found = ((f, _annotation(cls, f.name)) for f in fields(cls) if f.name not in trl and f.name not in untyped)
    return tuple((f, annotation) for f, annotation in found if annotation is not None)


def _annotation(cls, name: str):
    # The most derived class that annotates `name`; its annotation string is evaluated in its own module.
    for klass in cls.__mro__:
        annotation = vars(klass).get("__annotations__", {}).get(name)
        if annotation is None:
            continue
        if not isinstance(annotation, str):
            return annotation
        try:
            return eval(annotation, vars(sys.modules[klass.__module__]))  # `from __future__ import annotations`
        except Exception:  # a forward reference or a newer syntax: leave the field to its section
            return None
    return None


def _options(annotation) -> tuple:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _matches(value, annotation) -> bool:
    options = _options(annotation)
    if len(options) > 1:
        return any(_matches(value, option) for option in options)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation) or (typing.Any,)
        return isinstance(value, list | tuple) and all(_matches(v, item) for v in value)
    return True  # another annotation: the section checks it


def _describe(annotation) -> str:
    options = _options(annotation)
    if len(options) > 1:
        return " or ".join(_describe(option) for option in options)
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation) or (typing.Any,)
        return f"a list of {_PLURALS.get(item, 'values')}"
    return _KINDS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _fix(f, value, annotation) -> str:
    options = _options(annotation)
    if isinstance(value, str):
        for kind in (bool, int, float):
            if kind in options:
                parsed = _parse(value, kind)
                if parsed is not None:
                    return f"write {f.name}={parsed!r}, without quotes"
    if isinstance(value, str) and any(typing.get_origin(option) is list for option in options):
        return f"write {f.name}=[{value!r}], a list"
    if f.default is not MISSING:
        return f"e.g. {f.name}={f.default!r}, its default"
    return f"see the help of {f.name}"


def _parse(text: str, kind):
    lowered = text.strip().lower()
    if kind is bool:
        return {"true": True, "false": False}.get(lowered)
    try:
        return kind(text)
    except ValueError:
        return None


@dataclass
class ProRLConfig(GRPOExtConfig):
    r"""`GRPOExtConfig` with ProRL's recipe as defaults (arXiv 2505.24864, §3; NVIDIA's DeepSeek-R1-Distill-Qwen-1.5B
    run). Every field can still be set.

    Defaults that differ from `GRPOExtConfig`:
        epsilon (0.2) and epsilon_high (0.4): decoupled clipping ("clip-higher", from DAPO).
        beta (1e-4): a small KL penalty, kept so that reference resets have something to reset.
        temperature (1.2): high rollout temperature, for diverse samples over a long run.
        num_generations (16) and per_device_train_batch_size (16): 16 rollouts a prompt.
        learning_rate (2e-6) with lr_scheduler_type ("constant").
        loss_type ("dapo"): token-level normalisation.
        dynamic_sampling (True): groups whose rollouts all succeed or all fail are dropped.
    """

    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping bound. ProRL: 0.2."})
    epsilon_high: float | None = field(default=0.4, metadata={"help": "Upper clipping bound. ProRL: 0.4."})
    beta: float = field(default=1e-4, metadata={"help": "KL coefficient: small, as in ProRL."})
    temperature: float = field(default=1.2, metadata={"help": "Rollout temperature. ProRL: 1.2."})
    num_generations: int | None = field(default=16, metadata={"help": "Rollouts per prompt. ProRL: 16."})
    per_device_train_batch_size: int = field(default=16, metadata={"help": "Rows per device and step."})
    learning_rate: float = field(default=2e-6, metadata={"help": "Constant learning rate. ProRL: 2e-6."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "ProRL keeps the learning rate constant."})
    loss_type: str = field(default="dapo", metadata={"help": "Loss normalisation. ProRL: token-level (dapo)."})
    dynamic_sampling: bool = field(default=True, metadata={"help": "Drop zero-variance groups. ProRL: on."})


@dataclass
class PTAGRPOConfig(GRPOExtConfig):
    r"""`GRPOExtConfig` with PTA-GRPO's rollout tree as defaults (arXiv 2510.01833, §4: m = 3 plans, z = 3
    continuations each, one group of 9). Every field can still be set."""

    num_plans: int | None = field(default=3, metadata={"help": "Plans per prompt (m). Paper: 3."})
    continuations_per_plan: int | None = field(default=3, metadata={"help": "Continuations per plan (z). Paper: 3."})
    num_generations: int | None = field(default=9, metadata={"help": "m * z rows per prompt."})
    per_device_train_batch_size: int = field(default=9, metadata={"help": "Rows per device and step (whole groups)."})


@dataclass
class TreeOPOConfig(GRPOExtConfig):
    r"""`GRPOExtConfig` for Tree-OPO (arXiv 2509.09284): set `prefix_trees` to your trees file. Every field can be set.

    Defaults that differ from `GRPOExtConfig`:
        num_generations (4) and per_device_train_batch_size (8): a group mixes 4 prefixes of one question, each
            completed once (`treeopo_completions_per_prefix=1`, as in the paper).
        loss_type ("dr_grpo"): the staged advantages are not divided by a std, and neither is the loss by length.
    """

    num_generations: int | None = field(default=4, metadata={"help": "Rows per question: prefixes x completions."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Rows per device and step (whole groups)."})
    loss_type: str = field(default="dr_grpo", metadata={"help": "Loss normalisation. Tree-OPO: no std, dr_grpo."})


@dataclass
class BiCCGRPOConfig(GRPOExtConfig):
    r"""`GRPOExtConfig` with BiCC switched on (arXiv 2603.13134): conditioned rows for every mixed group, one random
    opposite answer per row, cut to 40% of the context budget. Every field can still be set."""

    bicc: bool = field(default=True, metadata={"help": "Add rows conditioned on an opposite answer (BiCC)."})


@dataclass
class DraftGRPOConfig(GRPOExtConfig):
    r"""`GRPOExtConfig` with draft-conditioned RL switched on, as self-refinement (ThinkTwice, arXiv 2604.01591):
    generation batches alternate solving and refining the policy's own drafts (one fresh draft per problem, plus its
    earlier answers in the store). For mismatched wrong drafts (arXiv 2605.17314) set `draft_source="model"`,
    `draft_model`, `draft_match="mismatched"`, `draft_keep="wrong"` and `loss_type="dr_grpo"`. Every field can be set."""

    draft_source: str | None = field(default="self", metadata={"help": "Drafts from 'column', 'model' or 'self'."})
    draft_mode: str = field(default="alternate", metadata={"help": "'refine', 'alternate' (solve/refine) or 'mix'."})


@dataclass
class NoRDConfig(GRPOExtConfig):
    r"""`GRPOExtConfig` with NoRD's recipe as defaults (arXiv 2602.21172): Dr. GRPO on a continuous trajectory reward,
    no reasoning text (the completion is the trajectory), and the difficulty-bias diagnostic on. Every field can be set.

    Defaults that differ from `GRPOExtConfig`:
        loss_type ("dr_grpo") and scale_rewards ("none"): A_i = r_i − mean(r), no division by the group's std, whose
            smallness on easy scenes would inflate their noise (the bias NoRD removes).
        max_completion_length (64): room for the waypoints, not for reasoning.
        num_generations (8) and per_device_train_batch_size (8): 8 trajectories a scene.
        difficulty_diagnostic (True): log the advantage mass per difficulty bucket, plot it at the end.
    """

    loss_type: str = field(default="dr_grpo", metadata={"help": "Loss normalisation. NoRD: Dr. GRPO."})
    scale_rewards: str = field(default="none", metadata={"help": "No std division (Dr. GRPO), as in NoRD."})
    max_completion_length: int | None = field(default=64, metadata={"help": "Waypoints only: no reasoning text."})
    num_generations: int | None = field(default=8, metadata={"help": "Trajectories per scene."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Rows per device and step (whole groups)."})
    difficulty_diagnostic: bool = field(default=True, metadata={"help": "Log the difficulty-bias diagnostic."})


@dataclass
class HiMAConfig(GRPOExtConfig):
    r"""`GRPOExtConfig` for HiMA-R1 (arXiv 2506.19846): set `hima_hierarchy` (a file, or `toy`), or pass `hierarchy=`
    to `HiMATrainer`. Every field can be set.

    Defaults that differ from `GRPOExtConfig`:
        num_generations (8) and per_device_train_batch_size (8): one question per step and process, 2 node groups of
            `hima_alternatives` = 4 alternatives each.
    """

    num_generations: int | None = field(default=8, metadata={"help": "Rows per question: node slots x alternatives."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Rows per device and step (whole groups)."})
