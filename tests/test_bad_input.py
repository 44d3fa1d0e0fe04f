"""Bad inputs fail before any model loads, with one clear error that names the field, the value and the fix; a
reward function that raises during training names itself and the row, and no checkpoint is lost.

How the table is kept complete: `test_every_constrained_field_has_a_row` probes every field a method section adds to
`GRPOConfig` (its own, and any added later) with values of its annotated type, the method switched on and off. A
field that some such value makes the config reject has a constraint beyond its type, and must have a row in one of
the tables; a value of another type must be refused by the generic type check with a TypeError naming the field and
the value. A new section fails the test until its switch is in `SWITCH_ON`, so that its fields are probed with the
method on. Errors that only the trainer's inputs reveal (reward names, tools, the named trainers' needs) are in
`TRAINER_ROWS`, and the dataset columns each method needs in `COLUMN_ROWS`: the methods' `check` hooks and the
reward-column check raise them in the trainer's `__init__`, before TRL's loads the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import os
import traceback
from dataclasses import dataclass

import pytest
import torch
import transformers
from trl import GRPOConfig

from trl_grpo_ext import (
    BiCCGRPOConfig,
    BiCCGRPOTrainer,
    CurriculumGRPOTrainer,
    DraftGRPOConfig,
    DraftGRPOTrainer,
    GRPOExtConfig,
    GRPOExtTrainer,
    HiMAConfig,
    HiMATrainer,
    NoRDConfig,
    NoRDTrainer,
    ProRLResetCallback,
    ProRLTrainer,
    PTAGRPOConfig,
    PTAGRPOTrainer,
    RewardFunctionError,
    SegmentGRPOTrainer,
    TreeOPOConfig,
    TreeOPOTrainer,
    get_reward,
)
from trl_grpo_ext.config import SECTIONS, _annotation, _matches, _options
from trl_grpo_ext.data.trees import SAMPLE_TREES, questions_dataset
from trl_grpo_ext.rewards import completion_text
from trl_grpo_ext.rewards.guard import excerpt, guard_reward, guard_rewards
from trl_grpo_ext.testing import cpu_test_config_kwargs, tiny_dataset

from .conftest import make_config, varied_reward

MODEL = "no/such-model"  # a path that does not exist: a trainer that got past its checks would fail to load it
BASE = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=3,
            **cpu_test_config_kwargs())  # fmt: skip
# Settings that switch each method on, valid as they are; `SWITCH_ON` names the section each one switches on, so that
# its fields are probed with the method on.
ON = {
    "prefix": dict(context_prefix_column="hint"),
    "dynamic_sampling": dict(dynamic_sampling=True),
    "curriculum": dict(budget_start=64, budget_end=16, budget_decays=1),
    "pta": dict(num_plans=2, continuations_per_plan=2),
    "segments": dict(segment_by="tags"),
    "arpo": dict(arpo=True),
    "treeopo": dict(prefix_trees=SAMPLE_TREES),
    "bicc": dict(bicc=True),
    "drafts": dict(draft_source="column"),
    "monitor": dict(monitor=True),
    "difficulty": dict(difficulty_diagnostic=True),
    "hima": dict(hima_hierarchy="toy"),
    "shared_prefix": dict(shared_prefix_forward=True),
    "tools": dict(tool_timeout=5.0),
}
SWITCH_ON = {"PrefixColumnsConfig": "prefix", "DynamicSamplingConfig": "dynamic_sampling",
             "CurriculumConfig": "curriculum", "PTAConfig": "pta", "SegmentsConfig": "segments", "ARPOConfig": "arpo",
             "TreeOPOConfigSection": "treeopo", "BiCCConfig": "bicc", "DraftConfig": "drafts",
             "MonitorConfig": "monitor", "NoRDConfigSection": "difficulty", "HiMAConfigSection": "hima",
             "SharedPrefixConfig": "shared_prefix", "ToolsConfig": "tools"}  # fmt: skip
# Values of each type that a field with a constraint beyond its type is likely to refuse.
TYPED_PROBES = {bool: [True, False], int: [-1, 0, 1, 10**6], float: [-1.0, 0.0, 0.5, 2.5, 1e6], str: ["", "?", "x y"],
                type(None): [None]}  # fmt: skip
LIST_PROBES = {str: [[], ["?"], [""]], float: [[], [-1.0], [0.5, 0.2]]}
OTHER_PROBES = [None, -1, 0, "", "?", 2.5, True, [], 10**6]  # fields whose section checks their type itself


class ModelLoaded(Exception):
    """Raised by the patched loaders: a check that should have refused the input let it reach a model load."""


@pytest.fixture
def no_model_loads(monkeypatch):
    def load(*args, **kwargs):
        raise ModelLoaded(f"a model or its config was loaded: {args[:1]}")

    for cls in (transformers.AutoConfig, transformers.AutoModelForCausalLM, transformers.PreTrainedModel):
        monkeypatch.setattr(cls, "from_pretrained", load)


def config(config_cls=GRPOExtConfig, **settings):
    return config_cls(output_dir="unused-bad-input", **{**BASE, **settings})


def assert_one_clear_error(info, name: str, shown: str | None, words=()) -> None:
    """One ValueError / TypeError raised by our code, naming `name`, showing the value, and holding `words`."""
    error, message = info.value, str(info.value)
    assert type(error) in (ValueError, TypeError), f"{type(error).__name__}: {message}"
    assert "trl_grpo_ext" in traceback.extract_tb(error.__traceback__)[-1].filename, "raised outside our checks"
    assert error.__context__ is None or error.__cause__ is not None or error.__suppress_context__, (
        "raised while handling another error, without saying so"
    )
    assert name in message, message
    if shown is not None:
        assert shown in message, message
    for word in words:
        assert word in message, message


# ---------------------------------------------------------------------------------------------------- config fields
@dataclass
class Bad:
    """A config field's bad value: the settings around it, the words of the fix, the error, how the value shows."""

    field: str
    value: object
    settings: dict = dataclasses.field(default_factory=dict)
    words: tuple = ()
    error: type = ValueError
    config: type = GRPOExtConfig
    shown: str | None = "repr"

    def __post_init__(self):
        self.shown = repr(self.value) if self.shown == "repr" else self.shown

    def build(self):
        return config(self.config, **{**self.settings, self.field: self.value})


# fmt: off
CONFIG_ROWS = [
    # generic type check (every field; one row per kind of annotation)
    Bad("arpo_alpha", "0.5", ON["arpo"], ("must be a number", "write arpo_alpha=0.5"), TypeError),
    Bad("bicc", "no", {}, ("must be True or False",), TypeError),
    Bad("num_plans", 2.5, {}, ("must be a whole number or None",), TypeError),
    Bad("monitor_stop", "any", ON["monitor"], ("must be a list of strings", "write monitor_stop=['any']"), TypeError),
    Bad("difficulty_edges", [0.3, "high"], ON["difficulty"], ("a list of numbers",), TypeError),
    Bad("plan_tag", 3, ON["pta"], ("must be a string", "e.g. plan_tag='plan'"), TypeError),
    # prefix columns
    Bad("context_prefix_column", "", {}, ("must be a dataset column name, or None",)),
    Bad("completion_prefix_column", "hint", ON["prefix"], ("set only one",), shown="'hint'"),
    # dynamic sampling
    Bad("dynamic_sampling_max_rounds", -1, ON["dynamic_sampling"], ("whole number >= 0",)),
    Bad("dynamic_sampling_max_rounds", 2, {}, ("dynamic_sampling=False", "set dynamic_sampling=True")),
    Bad("dynamic_sampling_reward", "accuracy_reward", {}, ("set dynamic_sampling=True",)),
    # curriculum
    Bad("budget_start", 0, ON["curriculum"], ("at least 1",)),
    Bad("budget_start", 10**6, {}, ("too few for budget_decays=3", "train longer or decay fewer times")),
    Bad("budget_end", 128, ON["curriculum"], ("above budget_start (64)", "swap them"), shown="128"),
    Bad("budget_decays", 0, ON["curriculum"], ("at least 1",)),
    Bad("budget_schedule", "cosine", ON["curriculum"], ("is not one of", "exponential")),
    Bad("budget_total_steps", 0, ON["curriculum"], ("whole number >= 1, or None",)),
    Bad("budget_total_steps", 1, ON["curriculum"], ("too few for budget_decays=1",), shown="spans 1 step"),
    Bad("budget_length_shape", "square", {}, ("is not one of", "triangular")),
    Bad("budget_length_count", "words", {}, ("is not one of", "think")),
    # PTA
    Bad("num_plans", 0, ON["pta"], ("whole number >= 1",)),
    Bad("continuations_per_plan", 3, ON["pta"], ("must equal num_generations (4)", "num_generations=6")),
    Bad("continuations_per_plan", None, {"num_plans": 2}, ("set both or neither",)),
    Bad("plan_tag", "</plan>", ON["pta"], ("bare tag name such as 'plan'",)),
    Bad("plan_max_tokens", 0, ON["pta"], ("whole number >= 1, or None",)),
    Bad("pta_outcome_reward", "acurracy", ON["pta"], ("not a registered reward", "accuracy", "dotted import path")),
    Bad("num_generations", 8, {"per_device_train_batch_size": 8}, ("(3*3=9) must equal num_generations (8)",),
        config=PTAGRPOConfig, shown="8"),
    # segments
    Bad("segment_by", "words", {}, ("is not one of", "paragraphs")),
    Bad("segment_by", "regex:", {}, ("empty pattern", "'regex:^Step'")),
    Bad("segment_by", "regex:(", {}, ("does not compile", "Python regular expression"), shown="'('"),
    Bad("segment_advantage", "mean", ON["segments"], ("is not one of", "soft")),
    Bad("segment_advantage", "reward", ON["segments"], ("needs segment_reward_funcs", "tool_call_validity")),
    Bad("segment_reward_funcs", ["tool_validity"], ON["segments"], ("not a registered reward",),
        shown="'tool_validity'"),
    # ARPO
    Bad("arpo_initial_rollouts", 4, ON["arpo"], ("between 1 and num_generations - 1 (3)",)),
    Bad("arpo_beam_size", 1, ON["arpo"], ("never branches", "use 2")),
    Bad("arpo_max_depth", 0, ON["arpo"], ("whole number >= 1",)),
    Bad("arpo_entropy_tokens", 0, ON["arpo"], ("whole number >= 1",)),
    Bad("arpo_entropy_top_k", 0, ON["arpo"], ("whole number >= 1",)),
    Bad("arpo_entropy_delta", "abs", ON["arpo"], ("is not one of", "reference")),
    # Tree-OPO
    Bad("prefix_trees", "", {}, ("path of a trees file",)),
    Bad("prefix_trees", "no/such/trees.jsonl", {}, ("no such file", "trl-grpo-ext trees")),
    Bad("prefix_trees", "no/such/trees.jsonl", {}, ("no such file",), config=TreeOPOConfig),
    Bad("treeopo_completions_per_prefix", 3, ON["treeopo"], ("dividing num_generations (4)", "e.g. 1")),
    Bad("treeopo_depth_mix", "deep", ON["treeopo"], ("'uniform_depth', 'uniform_node'", "'1,1,2'")),
    Bad("treeopo_depth_mix", "0,0", ON["treeopo"], ("at least one of them > 0",)),
    Bad("treeopo_max_prefix_tokens", 0, ON["treeopo"], (">= 1",)),
    Bad("treeopo_advantage", "sae", ON["treeopo"], ("use one of", "sae_soft")),
    Bad("treeopo_value", "mean", ON["treeopo"], ("use one of", "expectation")),
    Bad("treeopo_sae_delta", -0.1, ON["treeopo"], (">= 0",)),
    # BiCC
    Bad("bicc_pairing", "best", ON["bicc"], ("is not one of", "'confident'")),
    Bad("bicc_pairing", "best", {}, ("is not one of",), config=BiCCGRPOConfig),
    Bad("bicc_context_fraction", 1.5, ON["bicc"], ("must be in (0, 1]", "0.4")),
    Bad("bicc_max_pairs", 0, ON["bicc"], ("whole number >= 1, or None",)),
    Bad("bicc_max_pairs", 2, ON["bicc"], ("caps bicc_pairing='all'", "set bicc_pairing='all'")),
    Bad("bicc_context_budget", 0, ON["bicc"], ("whole number >= 1, or None",)),
    Bad("bicc_threshold", 0.7, {}, ("bicc=False", "set bicc=True")),
    Bad("bicc_separator", " | ", {}, ("bicc=False", "leave bicc_separator at its default")),
    # drafts
    Bad("draft_source", "teacher", {}, ("is not one of", "'self'")),
    Bad("draft_match", "other", ON["drafts"], ("is not one of", "'mismatched'")),
    Bad("draft_keep", "worst", ON["drafts"], ("is not one of", "'wrong'")),
    Bad("draft_mode", "sometimes", ON["drafts"], ("is not one of", "'alternate'")),
    Bad("draft_mode", "sometimes", {}, ("is not one of",), config=DraftGRPOConfig),
    Bad("draft_model", "a/model", ON["drafts"], ("only applies with draft_source in ('model',)",)),
    Bad("draft_model", None, {"draft_source": "model"}, ("needs draft_model", "path or Hub id")),
    Bad("draft_column", "", ON["drafts"], ("must name the dataset column",)),
    Bad("draft_num", 0, {"draft_source": "model", "draft_model": "a/model"}, ("whole number >= 1",)),
    Bad("draft_num", -1, {"draft_source": "self"}, ("whole number >= 0",)),
    Bad("draft_num", 2, {}, ("draft_source=None", "leave draft_num at its default")),
    Bad("draft_threshold", 0.9, {}, ("draft_source=None",)),
    Bad("drafts_per_prompt", 0, ON["drafts"], ("whole number >= 1",)),
    Bad("draft_best_of", 0, {**ON["drafts"], "draft_keep": "best"}, ("whole number >= 1",)),
    Bad("draft_best_of", 1, {**ON["drafts"], "draft_keep": "best", "drafts_per_prompt": 2}, ("raise draft_best_of",)),
    Bad("draft_store_size", 0, ON["drafts"], ("whole number >= 1",)),
    Bad("draft_store_per_problem", 0, ON["drafts"], ("whole number >= 1",)),
    Bad("draft_copy_ngram", 0, ON["drafts"], ("whole number >= 1",)),
    Bad("draft_max_new_tokens", 0, {"draft_source": "self"}, ("whole number >= 1, or None",)),
    Bad("draft_max_tokens", 0, ON["drafts"], ("whole number >= 1, or None",)),
    Bad("draft_ratio", 0.0, {**ON["drafts"], "draft_mode": "mix"}, ("in (0.0, 1.0]",)),
    Bad("draft_copy_threshold", 1.5, ON["drafts"], ("in (0.0, 1.0]",)),
    Bad("draft_top_p", 0.0, {"draft_source": "model", "draft_model": "a/model"}, ("in (0.0, 1.0]",)),
    Bad("draft_temperature", 0.0, {"draft_source": "model", "draft_model": "a/model"}, ("> 0",)),
    Bad("draft_template", "{question}", ON["drafts"], ("holding {drafts} and {question}",)),
    # monitor
    Bad("monitor_stop", ["sometimes"], ON["monitor"], ("names no detector", "'any'", "grad_explosion")),
    Bad("monitor_thresholds", ["window"], ON["monitor"], ("must read 'name=value'", "hacking_rise=0.3"),
        shown="'window'"),
    Bad("monitor_thresholds", ["hacking_rize=1"], ON["monitor"], ("not a threshold", "hacking_rise"),
        shown="'hacking_rize'"),
    Bad("monitor_thresholds", ["window=0"], ON["monitor"], (">= 1",), shown="window='0'"),
    Bad("monitor_correctness", "accuracy", {}, ("monitor=False", "set monitor=True")),
    Bad("monitor_format", ["tag_format"], {}, ("monitor=False", "set monitor=True")),
    Bad("monitor_heldout", "heldout/accuracy", {}, ("monitor=False", "set monitor=True")),
    # NoRD's difficulty diagnostic
    Bad("difficulty_edges", [0.6, 0.3], ON["difficulty"], ("increasing", "e.g. [0.33, 0.67]")),
    Bad("difficulty_edges", [], ON["difficulty"], ("one or more",)),
    Bad("difficulty_edges", [0.6, 0.3], {}, ("increasing",), config=NoRDConfig),
    Bad("difficulty_by", "kind", {}, ("difficulty_diagnostic=False", "set difficulty_diagnostic=True")),
    # HiMA
    Bad("hima_hierarchy", "no/such/hierarchy.yaml", {}, ("no such file", "'toy'")),
    Bad("hima_hierarchy", 3, {}, ("a YAML / JSON hierarchy file, 'toy'",)),
    Bad("hima_alternatives", 1, ON["hima"], ("whole number >= 2",)),
    Bad("hima_alternatives", 3, ON["hima"], ("must be a multiple of hima_alternatives=3", "num_generations=6"),
        shown="hima_alternatives=3"),
    Bad("hima_alternatives", 3, ON["hima"], ("a multiple of",), config=HiMAConfig, shown="hima_alternatives=3"),
    Bad("hima_top_k", "some", ON["hima"], ("whole number >= 1 or 'all'",)),
    Bad("hima_top_k", 2.5, ON["hima"], ("whole number >= 1 or 'all'",)),
    Bad("hima_memory_capacity", 0, ON["hima"], ("whole number >= 1",)),
    Bad("hima_memory_retrieve", -1, ON["hima"], ("whole number >= 0",)),
    Bad("hima_accuracy_reward", "acurracy", ON["hima"], ("not a registered reward", "register_reward")),
    # tool calls' time limit
    Bad("tool_timeout", 0, {}, ("must be a positive number of seconds",)),
    Bad("tool_timeout", -1.0, {}, ("must be a positive number of seconds",)),
    Bad("tool_timeout", float("nan"), {}, ("must be a positive number of seconds",), shown="nan"),
    Bad("tool_timeout", "5", {}, ("must be a number or None", "write tool_timeout=5.0"), TypeError),
    # the advantage estimator
    Bad("advantage_estimator", "grup", {}, ("not a registered estimator", "register_advantage")),
    Bad("advantage_estimator", 3, {}, ("registry name, a dotted import path or a callable",)),
]
# fmt: on


@pytest.mark.parametrize("row", [pytest.param(r, id=f"{r.field}={r.value!r}") for r in CONFIG_ROWS])
@pytest.mark.usefixtures("no_model_loads")
def test_bad_config_value_is_one_clear_error(row):
    with pytest.raises((ValueError, TypeError)) as info:
        row.build()
    assert type(info.value) is row.error, f"{type(info.value).__name__}: {info.value}"
    assert_one_clear_error(info, row.field, row.shown, row.words)


@pytest.mark.usefixtures("no_model_loads")
def test_hierarchy_file_mistakes_name_the_field(tmp_path):
    cycle = tmp_path / "cycle.yaml"
    cycle.write_text("master: router\nagents:\n  router: {role: Route., routes: [calc]}\n  calc: {role: Add.}\n"
                     "  other: {role: Unused.}\n")  # fmt: skip
    broken = tmp_path / "broken.yaml"
    broken.write_text("master: [router\n")
    for path, words in ((cycle, ("never called",)), (broken, ("hima_hierarchy",))):
        with pytest.raises(ValueError) as info:
            config(hima_hierarchy=str(path))
        assert_one_clear_error(info, "hima_hierarchy", repr(str(path)), words)


def _probes(name: str, annotation) -> list[tuple[object, bool]]:
    """(value, of the field's type?) pairs to probe a field with; a field that checks its own type gets all values."""
    if annotation is None or name in UNTYPED:
        return [(value, True) for value in OTHER_PROBES]
    typed = []
    for option in _options(annotation):
        if option in TYPED_PROBES:
            typed += TYPED_PROBES[option]
        elif getattr(option, "__origin__", None) is list:
            typed += LIST_PROBES.get(option.__args__[0], [[]])
    return [(v, True) for v in typed] + [(v, False) for v in OTHER_PROBES if not _matches(v, annotation)]


UNTYPED = {name for cls in GRPOExtConfig.__mro__ for name in vars(cls).get("_untyped_fields", ())}


@pytest.mark.usefixtures("no_model_loads")
def test_every_constrained_field_has_a_row():
    sections = {cls.__name__: cls for cls in SECTIONS}
    assert set(SWITCH_ON) == set(sections), (
        f"give each section's switch in SWITCH_ON: {set(sections) ^ set(SWITCH_ON)}"
    )
    every = {f.name for f in dataclasses.fields(GRPOExtConfig)}
    assert {row.field for row in CONFIG_ROWS} <= every
    ours = sorted(every - {f.name for f in dataclasses.fields(GRPOConfig)})
    switch = {f.name: ON[SWITCH_ON[name]] for name, cls in sections.items() for f in dataclasses.fields(cls)}
    with_rows = {row.field for row in CONFIG_ROWS} | {row.name for row in TRAINER_ROWS + COLUMN_ROWS}
    constrained = {}  # field -> the first value of its type (or any value, if it checks its own type) refused
    for name in ours:
        for off, settings in enumerate((switch.get(name, {}), {})):
            for value, typed in _probes(name, _annotation(GRPOExtConfig, name)):
                if settings.get(name, object()) == value or (off and not typed):
                    continue  # a value of another type fails the same way with the method on or off
                try:
                    config(**{**settings, name: value})
                except (ValueError, TypeError) as error:
                    message = str(error)
                    shown = [repr(value), str(value)] + ([repr(v) for v in value] if isinstance(value, list) else [])
                    assert name in message and any(text in message for text in shown), (name, value, message)
                    if not typed:  # the generic type check
                        assert isinstance(error, TypeError) and "must be" in message, (name, value, message)
                    else:
                        constrained.setdefault(name, f"{name}={value!r} with {settings}: {message}")
                else:
                    assert typed, f"{name}={value!r} with {settings} was accepted, though not of the field's type"
    missing = sorted(set(constrained) - with_rows)
    assert not missing, "fields with a constraint but no row:\n" + "\n".join(constrained[n] for n in missing)


# ---------------------------------------------------------------------------------------------------- trainer inputs
def _rollout(prompts, trainer):
    return {"prompt_ids": [], "completion_ids": [], "logprobs": []}


class _Environment:
    def reset(self, **kwargs):
        return None


@dataclass
class BadInput:
    """An input a method's `check` (or a named trainer) refuses: what the message names and shows, and the fix."""

    name: str
    shown: str | None
    build: object  # () -> the trainer, which must raise
    words: tuple = ()
    error: type = ValueError


def _trainer(settings=None, rewards=(varied_reward,), dataset=None, cls=GRPOExtTrainer, config_cls=GRPOExtConfig,
             **kwargs):  # fmt: skip
    args = config(config_cls, **(settings or {}))
    return cls(MODEL, list(rewards) if rewards is not None else None, args,
               train_dataset=tiny_dataset(8) if dataset is None else dataset, **kwargs)  # fmt: skip


ACCURACY = get_reward("accuracy")
# fmt: off
TRAINER_ROWS = [
    BadInput("dynamic_sampling_reward", "'accuracy'",
             lambda: _trainer({"dynamic_sampling": True, "dynamic_sampling_reward": "accuracy"}),
             ("not one of this trainer's rewards", "'total'")),
    BadInput("dynamic_sampling_max_rounds", "=1",
             lambda: _trainer({"dynamic_sampling": True, "dynamic_sampling_max_rounds": 1},
                              dataset=tiny_dataset(8).to_iterable_dataset()),
             ("map-style dataset", "dynamic_sampling_max_rounds=0")),
    BadInput("budget_start", "=64", lambda: _trainer(ON["curriculum"]),
             ("nothing would act on the budget", "add 'budget_length' to reward_funcs")),
    BadInput("rollout_func", None, lambda: _trainer(ON["pta"], rollout_func=_rollout), ("unset rollout_func",)),
    BadInput("advantage_estimator", "'rcc'", lambda: _trainer({**ON["segments"], "advantage_estimator": "rcc"}),
             ("unset advantage_estimator",)),
    BadInput("segment_by", "'tool_calls'", lambda: _trainer({"segment_by": "tool_calls"}), ("pass tools=[...]",)),
    BadInput("tools", None, lambda: _trainer(ON["arpo"]), ("pass tools=[...]", "or set arpo=False")),
    BadInput("environment_factory", None,
             lambda: _trainer(ON["arpo"], tools=[len], environment_factory=_Environment), ("use tools=[...]",)),
    BadInput("advantage_estimator", "'rcc'", lambda: _trainer({**ON["treeopo"], "advantage_estimator": "rcc"},
             dataset=questions_dataset(SAMPLE_TREES)), ("leave advantage_estimator='group'",)),
    BadInput("bicc_reward", "'accuracy'", lambda: _trainer({"bicc": True, "bicc_reward": "accuracy"}),
             ("not one of this trainer's rewards", "add that reward to reward_funcs")),
    BadInput("bicc_reward", "'varied_reward'", lambda: _trainer(ON["bicc"]),
             ("no reward is marked as correctness", "set bicc_reward")),
    BadInput("draft_reward", "'varied_reward'", lambda: _trainer(ON["drafts"]),
             ("no reward is marked as correctness", "set draft_reward")),
    BadInput("monitor_correctness", "'accuracy'", lambda: _trainer({"monitor": True, "monitor_correctness": "accuracy"}),
             ("not one of this trainer's rewards",)),
    BadInput("monitor_format", "'tag_format'", lambda: _trainer({"monitor": True, "monitor_format": ["tag_format"]}),
             ("not one of this trainer's rewards", "rewards/<name>/mean")),
    BadInput("hima_top_k", "'2'", lambda: _trainer({"hima_top_k": "2"}), ("set hima_hierarchy",)),
    BadInput("tools", None, lambda: _trainer(ON["hima"], tools=[len]), ("unset rollout_func, environment_factory",)),
    BadInput("beta", "beta=0.0", lambda: _trainer(callbacks=[ProRLResetCallback.v2(every_n_steps=10)]),
             ("set beta > 0", "reset='optimizer'")),
    BadInput("eval_strategy", "'no'", lambda: _trainer({"beta": 0.1}, callbacks=[ProRLResetCallback.v1(patience=2)]),
             ("set eval_strategy='steps'",)),
    # the named trainers' own requirements
    BadInput("num_plans", None, lambda: _trainer(cls=PTAGRPOTrainer), ("use PTAGRPOConfig (3 x 3)",)),
    BadInput("SegmentGRPOTrainer", None, lambda: _trainer(cls=SegmentGRPOTrainer, config_cls=GRPOConfig),
             ("needs a GRPOExtConfig",)),
    BadInput("reward_funcs", None, lambda: _trainer(cls=SegmentGRPOTrainer, rewards=None), ("the outcome reward",)),
    BadInput("prefix_trees", None, lambda: _trainer(cls=TreeOPOTrainer), ("TreeOPOConfig(prefix_trees=",)),
    BadInput("reward_funcs", None, lambda: _trainer(ON["treeopo"], cls=TreeOPOTrainer, rewards=None),
             ("e.g. ['accuracy']",)),
    BadInput("CurriculumGRPOTrainer", "got GRPOConfig", lambda: _trainer(cls=CurriculumGRPOTrainer, config_cls=GRPOConfig),
             ("needs a GRPOExtConfig",), TypeError),
    BadInput("BiCCGRPOTrainer", "got GRPOConfig", lambda: _trainer(cls=BiCCGRPOTrainer, config_cls=GRPOConfig),
             ("needs a GRPOExtConfig",), TypeError),
    BadInput("DraftGRPOTrainer", "got GRPOConfig", lambda: _trainer(cls=DraftGRPOTrainer, config_cls=GRPOConfig),
             ("needs a GRPOExtConfig",), TypeError),
    BadInput("NoRDTrainer", "got GRPOConfig", lambda: _trainer(cls=NoRDTrainer, config_cls=GRPOConfig),
             ("needs a GRPOExtConfig",), TypeError),
    BadInput("hierarchy", None, lambda: _trainer(cls=HiMATrainer), ("hima_hierarchy in the config",)),
    BadInput("hierarchy", None, lambda: _trainer(ON["hima"], cls=HiMATrainer, hierarchy="toy"), ("not both",)),
    BadInput("hima_agent_adapters", None,
             lambda: _trainer({**ON["hima"], "hima_agent_adapters": True}, cls=HiMATrainer),
             ("pass peft_config=LoraConfig(...)",)),
]
# fmt: on


@pytest.mark.parametrize("row", [pytest.param(r, id=f"{r.name}-{i}") for i, r in enumerate(TRAINER_ROWS)])
@pytest.mark.usefixtures("no_model_loads")
def test_bad_trainer_input_is_one_clear_error(row):
    with pytest.raises((ValueError, TypeError)) as info:
        row.build()
    assert type(info.value) is row.error, f"{type(info.value).__name__}: {info.value}"
    assert_one_clear_error(info, row.name, row.shown, row.words)


# ---------------------------------------------------------------------------------------------------- dataset columns
def _without(column, dataset=None):
    dataset = tiny_dataset(8) if dataset is None else dataset
    return dataset.remove_columns([column])


def _driving():
    from trl_grpo_ext.data.driving import driving_dataset

    return driving_dataset(8, images=False)


# fmt: off
COLUMN_ROWS = [  # per method, a column it needs: the message names the column (or its field), and the fix
    BadInput("prompt", "'prompt'", lambda: _trainer(dataset=_without("prompt")), ("rename your prompt column",)),
    BadInput("context_prefix_column", "'hint'", lambda: _trainer(ON["prefix"]), ("add the column or unset the field",)),
    BadInput("completion_prefix_column", "'start'", lambda: _trainer({"completion_prefix_column": "start"}),
             ("add the column or unset the field",)),
    BadInput("draft_column", "'draft'", lambda: _trainer(ON["drafts"], rewards=[ACCURACY]), ("add the column",)),
    BadInput("draft_key_column", "'problem_id'",
             lambda: _trainer({**ON["drafts"], "draft_key_column": "problem_id"}, rewards=[ACCURACY],
                              dataset=tiny_dataset(8).add_column("draft", ["4"] * 8)),
             ("add the column",)),
    BadInput("treeopo_question_column", "'question_id'",
             lambda: _trainer(ON["treeopo"], dataset=_without("question_id", questions_dataset(SAMPLE_TREES))),
             ("questions_dataset",)),
    BadInput("question id", "'other-add-", lambda: _trainer(ON["treeopo"], dataset=questions_dataset(SAMPLE_TREES).map(
        lambda row: {"question_id": "other-" + row["question_id"]})), ("add their trees or drop those rows",)),
    BadInput("difficulty_by", "'kind'", lambda: _trainer({**ON["difficulty"], "difficulty_by": "kind"}),
             ("or use 'reward'",)),
    # the columns of the methods' default rewards: NoRD's trajectory, and the correctness reward of the others
    BadInput("future", "'trajectory'", lambda: _trainer(cls=NoRDTrainer, config_cls=NoRDConfig, rewards=None,
                                                        dataset=_without("future", _driving())), ("add the column",)),
    BadInput("solution", "'accuracy_reward'", lambda: _trainer({"num_generations": 9, "per_device_train_batch_size": 9}, cls=PTAGRPOTrainer,
                                                               config_cls=PTAGRPOConfig, rewards=None,
                                                               dataset=_without("solution")), ("add the column",)),
    BadInput("solution", "'accuracy_reward'", lambda: _trainer(cls=BiCCGRPOTrainer, rewards=None,
                                                               dataset=_without("solution"))),
    BadInput("solution", "'accuracy_reward'", lambda: _trainer({**ON["drafts"], "draft_source": "self"},
                                                               cls=DraftGRPOTrainer, rewards=None,
                                                               dataset=_without("solution"))),
    BadInput("solution", "'accuracy_reward'", lambda: _trainer({"budget_decays": 2}, cls=CurriculumGRPOTrainer,
                                                               rewards=None, dataset=_without("solution"))),
    BadInput("solution", "'accuracy_reward'", lambda: _trainer({"beta": 1e-4}, cls=ProRLTrainer, rewards=None,
                                                               dataset=_without("solution"))),
    BadInput("solution", "'accuracy_reward'", lambda: _trainer({"hima_alternatives": 2}, cls=HiMATrainer,
                                                               config_cls=HiMAConfig, rewards=None, hierarchy="toy",
                                                               dataset=_without("solution"))),
    BadInput("eval_dataset", "['solution']", lambda: _trainer(rewards=[ACCURACY], eval_dataset=_without("solution"))),
]
# fmt: on


@pytest.mark.parametrize("row", [pytest.param(r, id=f"{r.name}-{i}") for i, r in enumerate(COLUMN_ROWS)])
@pytest.mark.usefixtures("no_model_loads")
def test_missing_dataset_column_is_one_clear_error(row):
    with pytest.raises(ValueError) as info:
        row.build()
    assert_one_clear_error(info, row.name, row.shown, row.words)


# ---------------------------------------------------------------------------------------------------- reward errors
def _kwargs(n=4):
    """What TRL passes a reward function for n conversational rows (row i asks i + 1 and answers it)."""
    return dict(prompts=[[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(n)],
                completions=[[{"role": "assistant", "content": str(i + 1)}] for i in range(n)],
                completion_ids=[[i] for i in range(n)], solution=[str(i + 1) for i in range(n)])  # fmt: skip


def _call(guarded, **kwargs):
    out = guarded(**kwargs)
    return asyncio.run(out) if asyncio.iscoroutine(out) else out


def test_guard_finds_the_first_failing_row_sync_async_and_registry_rewards():
    logged = []

    def picky(prompts, completions, log_metric, **kwargs):
        log_metric("picky/calls", len(completions))
        logged.append(len(completions))
        return [1.0 / (int(completion_text(c)) % 3) for c in completions]  # row 2 answers 3: divides by zero

    async def picky_async(completions, **kwargs):
        return [1.0 / (int(completion_text(c)) % 3) for c in completions]

    for reward in (picky, picky_async):
        guarded = guard_reward(reward)
        assert guarded.__name__ == reward.__name__
        assert inspect.iscoroutinefunction(guarded) == inspect.iscoroutinefunction(reward)
        with pytest.raises(RewardFunctionError) as info:
            _call(guarded, **_kwargs(), log_metric=lambda name, value: logged.append(name))
        error = info.value
        assert isinstance(error.__cause__, ZeroDivisionError)
        assert (error.reward, error.row, error.rows) == (reward.__name__, 2, 4)
        assert (excerpt(error.prompt), excerpt(error.completion)) == ("What is 2 + 1?", "3")
        assert f"reward function '{reward.__name__}' raised ZeroDivisionError" in str(error)
        assert "row 2 of the 4 rows" in str(error) and "(prompt: 'What is 2 + 1?', completion: '3')" in str(error)
    # The batch logged once; rows 0, 1 and 2 were then called alone, with log_metric silenced.
    assert logged == ["picky/calls", 4, 1, 1, 1]

    # Registry rewards: a callable object (its attributes untouched) and a factory's function.
    budget = get_reward("budget_length")
    with pytest.raises(RewardFunctionError, match="'budget_length_triangular' raised ValueError: budget_length needs"):
        _call(guard_reward(budget), **_kwargs())
    assert budget.tokenizer is None and "__wrapped__" not in vars(budget)
    with pytest.raises(
        RewardFunctionError, match="'trajectory' raised KeyError: 'future'. It fails on row 0 of the 4"
    ):
        _call(guard_reward(get_reward("trajectory")), **_kwargs())

    # A failure of the whole batch only names no row; a reward model is left alone; a reward that works is unchanged.
    def one_at_a_time(completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("one completion at a time")
        return [1.0]

    with pytest.raises(RewardFunctionError, match="passes alone, so the failure depends on the batch") as info:
        _call(guard_reward(one_at_a_time), **_kwargs())
    assert info.value.row is None and info.value.prompt is None
    model = torch.nn.Linear(1, 1)
    assert guard_rewards([model, varied_reward], ["rm", "varied"])[0] is model
    assert _call(guard_reward(ACCURACY), **_kwargs()) == ACCURACY(**_kwargs())


def test_reward_error_names_the_row_and_keeps_the_last_step(tiny_model_path, tokenizer, tmp_path):
    seen = {"calls": 0, "batch": None, "target": None}

    def flaky_reward(prompts, completions, **kwargs):
        """Fails from its 4th call on, on the rows whose completion is row 2's of that call's batch."""
        seen["calls"] += 1
        if seen["calls"] == 4:
            seen["batch"], seen["target"] = (list(prompts), list(completions)), completions[2]
        if seen["target"] is not None and seen["target"] in completions:
            raise ZeroDivisionError("cannot score this one")
        return varied_reward(completions)

    def trainer():
        args = make_config(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
        return GRPOExtTrainer(model=str(tiny_model_path), reward_funcs=flaky_reward, args=args,
                              train_dataset=tiny_dataset(16), processing_class=tokenizer)  # fmt: skip

    crashed = trainer()
    with pytest.raises(RewardFunctionError) as info:
        crashed.train()
    error, (prompts, completions) = info.value, seen["batch"]
    row = completions.index(seen["target"])  # the first row holding the failing completion
    assert isinstance(error.__cause__, ZeroDivisionError) and str(error.__cause__) == "cannot score this one"
    assert (error.reward, error.row, error.rows, error.step) == ("flaky_reward", row, 4, 3)
    assert "reward function 'flaky_reward' raised ZeroDivisionError: cannot score this one at step 3" in str(error)
    assert f"row {row} of the 4 rows" in str(error) and repr(excerpt(prompts[row])) in str(error)
    # Checkpoints: step 2's (periodic) stays; step 3, the last completed one, is written and named in the message.
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert error.checkpoint == str(out / "checkpoint-3") and error.checkpoint in str(error)
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    from safetensors.torch import load_file

    saved = load_file(out / "checkpoint-3" / "model.safetensors")
    for name, param in crashed.model.named_parameters():
        if name in saved:
            assert torch.equal(saved[name], param.detach().cpu()), name  # the weights of the last completed step
    assert set(load_file(out / "checkpoint-2" / "model.safetensors")) == set(saved)
    # Another error at the same step finds that checkpoint and names it instead of writing it again.
    again = RewardFunctionError("reward function 'r' raised.", reward="r", row=None, rows=4)
    crashed._checkpoint_after_reward_error(again, trial=None)
    assert (
        again.checkpoint == error.checkpoint
        and f"The checkpoint of the last completed step is {again.checkpoint}" in str(again)
    )
    # A fresh trainer resumes from it: step 4 generates (and scores) once, and training ends at max_steps.
    seen.update(calls=0, target=None)
    resumed = trainer()
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert resumed.state.global_step == 4 and seen["calls"] == 1
    assert os.path.isdir(out / "checkpoint-4")
