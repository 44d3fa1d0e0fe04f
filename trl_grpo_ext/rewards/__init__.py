"""Reward registry and built-in rewards.

Every reward keeps TRL's signature `f(prompts, completions, completion_ids, **columns) -> list[float | None]`, so a
TRL reward works here and ours work in plain TRL. Parameterised rewards come from factories that validate their
arguments and set `__name__` (TRL logs each reward under that name).

>>> from trl_grpo_ext import get_reward, list_rewards
>>> fmt = get_reward("tag_format", tags=["think", "answer"])
>>> fmt(completions=["<think>2+2</think><answer>4</answer>", "4"])
[1.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Callable

from trl.rewards import (
    accuracy_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    reasoning_accuracy_reward,
    think_format_reward,
)

from ..registry import Registry
from .format import completion_text, contains_solution_reward, tag_format_reward
from .length import BudgetLengthReward
from .plan import PlanValueReward
from .stop import StopPenalty
from .tools import get_tool_call_validity_reward

REWARDS = Registry("reward")


def register_reward(name: str, fn: Callable | None = None, *, factory: bool = False):
    """Register a reward (or, with `factory=True`, a reward factory) under `name`. Usable as a decorator."""
    return REWARDS.register(name, fn, factory=factory)


def get_reward(name: str | Callable, **params) -> Callable:
    """The reward registered as `name`, built with `params` if it is a factory; dotted import paths work too."""
    return REWARDS.get(name, **params)


def list_rewards() -> list[str]:
    """The registered reward names, sorted."""
    return REWARDS.names()


# TRL's own rewards, by short names.
register_reward("accuracy", accuracy_reward)
register_reward("reasoning_accuracy", reasoning_accuracy_reward)
register_reward("think_format", think_format_reward)
register_reward("soft_overlong", get_soft_overlong_punishment, factory=True)
register_reward("repetition_penalty", get_repetition_penalty_reward, factory=True)
# Ours.
register_reward("tag_format", tag_format_reward, factory=True)
register_reward("contains_solution", contains_solution_reward)
register_reward("budget_length", BudgetLengthReward, factory=True)
register_reward("stop_penalty", StopPenalty, factory=True)
# A segment reward (one score per model turn): for SegmentGRPOTrainer's segment_reward_funcs, not reward_funcs.
register_reward("tool_call_validity", get_tool_call_validity_reward, factory=True)

__all__ = ["REWARDS", "register_reward", "get_reward", "list_rewards", "completion_text", "contains_solution_reward", "tag_format_reward", "BudgetLengthReward", "StopPenalty", "PlanValueReward"]
