"""PTA-GRPO's plan values and per-token advantages ("Plan Then Action", arXiv 2510.01833)."""

from __future__ import annotations

import torch

from .group import group_stats


def plan_values(outcomes: torch.Tensor, plan_ids: torch.Tensor) -> torch.Tensor:
    """For each row, the mean outcome of the rows that share its plan: r_plan(j) = (1/z)·Σ_k 1[answer_{j,k} correct].

    Args:
        outcomes: (G,) float, e.g. 1.0 for a correct answer; NaN rows (unscorable) are left out of the mean.
        plan_ids: (G,) long, the plan each row continues.

    Returns (G,): the plan's value on each of its rows (NaN for a plan whose rows are all NaN).

    >>> plan_values(torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 0, 1, 1, 1]))
    tensor([0.6667, 0.6667, 0.6667, 0.0000, 0.0000, 0.0000])
    """
    if outcomes.shape != plan_ids.shape or outcomes.dim() != 1:
        raise ValueError(
            f"outcomes {tuple(outcomes.shape)} and plan_ids {tuple(plan_ids.shape)} must be equal 1-D shapes."
        )
    stats = group_stats(outcomes, plan_ids)
    return stats.rows(stats.mean)  # NaN for an all-NaN plan
