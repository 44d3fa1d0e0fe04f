"""Advantage estimators and their registry.

An estimator maps a scored batch to advantages: `fn(batch: RolloutBatch) -> Tensor` of shape (B,) (one advantage
per completion, as in GRPO) or (B, T) (one per completion token), for this process's rows. It may instead return
`(advantages, loss_weights)` where `loss_weights` is a (B, T) float tensor multiplied into the loss mask (0 removes
a token from the loss, and from the token count that normalises it). An estimator with `needs_log_ratio = True`
(RCC) gets `batch.seq_log_ratio`, the sequence log-ratio to the reference, computed by the trainer; scalars it puts
in `batch.metrics` are logged.

>>> from trl_grpo_ext import register_advantage
>>> @register_advantage("centred")  # doctest: +SKIP
... def centred(batch):
...     return batch.local(group_advantages(batch.rewards, batch.num_generations, scale="none"))
"""

from __future__ import annotations

from collections.abc import Callable

from ..registry import Registry
from .group import GroupStats, group_advantages, group_stats, trl_group
from .plan import plan_values
from .rcc import rcc, rcc_advantages
from .segment import segment_reward_advantages
from .staged import constraint_satisfaction, sae_project, staged_advantages, tree_order_pairs
from .tree import tree_estimator, tree_token_advantages

ADVANTAGES = Registry("advantage")


def register_advantage(name: str, fn: Callable | None = None, *, factory: bool = False):
    """Register an advantage estimator under `name`. Usable as a decorator."""
    return ADVANTAGES.register(name, fn, factory=factory)


def get_advantage(name: str | Callable, **params) -> Callable:
    """The estimator registered as `name`; dotted import paths work too."""
    return ADVANTAGES.get(name, **params)


def list_advantages() -> list[str]:
    """The registered estimator names, sorted."""
    return ADVANTAGES.names()


register_advantage("group", trl_group)
register_advantage("tree", tree_estimator)
register_advantage("rcc", rcc)

__all__ = [
    "ADVANTAGES",
    "register_advantage",
    "get_advantage",
    "list_advantages",
    "group_advantages",
    "group_stats",
    "GroupStats",
    "trl_group",
    "tree_token_advantages",
    "tree_estimator",
    "segment_reward_advantages",
    "plan_values",
    "rcc_advantages",
    "staged_advantages",
    "sae_project",
    "tree_order_pairs",
    "constraint_satisfaction",
]
