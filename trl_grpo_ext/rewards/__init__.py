"""Reward registry, generic built-in rewards, and the one resolver the trainer and the command line share.

Every reward keeps TRL's signature `f(prompts, completions, completion_ids, **columns) -> list[float | None]`, so a
TRL reward works here and ours work in plain TRL. Parameterised rewards come from factories that validate their
arguments and set `__name__` (TRL logs each reward under that name). A method's own rewards live in its module
(`budget_length` in `trl_grpo_ext.methods.curriculum`) and register there.

>>> from trl_grpo_ext import get_reward, list_rewards
>>> fmt = get_reward("tag_format", tags=["think", "answer"])
>>> fmt(completions=["<think>2+2</think><answer>4</answer>", "4"])
[1.0, 0.0]
"""

from __future__ import annotations

import os
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


def parse_reward_spec(spec: str) -> tuple[str, dict]:
    """Split a `name:key=value,key=value` reward entry into a name and its parameters.

    A comma-separated item without `=` continues the previous value as a list. Values become ints, floats, booleans
    (true/false) or None (none/null) where they read as such, else strings.

    >>> parse_reward_spec("tag_format:tags=plan,think,answer")
    ('tag_format', {'tags': ['plan', 'think', 'answer']})
    >>> parse_reward_spec("budget_length:shape=band,width=0.3")
    ('budget_length', {'shape': 'band', 'width': 0.3})
    """
    name, _, rest = spec.partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"reward {spec!r} has no name before ':'; write 'name:key=value'.")
    params: dict[str, list] = {}
    key = None
    for item in rest.split(",") if rest.strip() else []:
        head, eq, value = item.partition("=")
        if eq:
            key = head.strip()
            if not key or key in params:
                problem = "an empty parameter name" if not key else f"parameter {key!r} twice"
                raise ValueError(f"reward {spec!r} has {problem}; write 'name:key=value,key2=value2'.")
            params[key] = [_parse_value(value)]
        elif key is None:
            raise ValueError(f"reward {spec!r}: {item!r} is not key=value; write 'name:key=value,key2=value2'.")
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


def resolve_reward(item):
    """One reward entry as TRL takes it: a callable, or a reward-model id (a string with '/', or a folder).

    Entries: a callable (kept), a registry name or dotted import path (`"accuracy"`), a name with parameters
    (`"tag_format:tags=plan,answer"`), a YAML mapping `{name: {key: value}}`, or a reward-model id. A segment reward
    (one score per segment) is refused here: it belongs in `segment_reward_funcs`.
    """
    if isinstance(item, dict):
        if len(item) != 1:
            raise ValueError(f"reward {item!r}: a mapping names one reward, {{name: {{parameter: value}}}}.")
        ((name, params),) = item.items()
        item = get_reward(name, **(params or {}))
    elif isinstance(item, str) and ":" in item and not os.path.isdir(item):
        name, params = parse_reward_spec(item)
        item = get_reward(name, **params)
    elif isinstance(item, str) and (item in REWARDS.names() or ("." in item and "/" not in item)):
        item = get_reward(item)
    elif isinstance(item, str) and "/" not in item and not os.path.isdir(item):
        get_reward(item)  # neither a registered name nor a reward model: raises with the known names
    if getattr(item, "segment_reward", False):
        raise ValueError(
            f"{getattr(item, '__name__', repr(item))!r} is a segment reward (one score per segment), not a scalar "
            "reward: give it in segment_reward_funcs, not in reward_funcs."
        )
    return item


def resolve_rewards(reward_funcs) -> list | None:
    """`resolve_reward` on each entry of `reward_funcs` (one entry or a list); None stays None."""
    if reward_funcs is None:
        return None
    items = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    return [resolve_reward(item) for item in items]


# TRL's own rewards, by short names.
register_reward("accuracy", accuracy_reward)
register_reward("reasoning_accuracy", reasoning_accuracy_reward)
register_reward("think_format", think_format_reward)
register_reward("soft_overlong", get_soft_overlong_punishment, factory=True)
register_reward("repetition_penalty", get_repetition_penalty_reward, factory=True)
# Ours.
register_reward("tag_format", tag_format_reward, factory=True)
register_reward("contains_solution", contains_solution_reward)

__all__ = [
    "REWARDS",
    "register_reward",
    "get_reward",
    "list_rewards",
    "parse_reward_spec",
    "resolve_reward",
    "resolve_rewards",
    "completion_text",
    "contains_solution_reward",
    "tag_format_reward",
]
