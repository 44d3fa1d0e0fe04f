"""PTA-GRPO's plan values and per-token advantages ("Plan Then Action", arXiv 2510.01833)."""

from __future__ import annotations

import torch


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
    _, inverse = torch.unique(plan_ids, return_inverse=True)  # (G,) plan index per row
    scored = ~torch.isnan(outcomes)
    num_plans = int(inverse.max()) + 1 if inverse.numel() else 0
    sums = torch.zeros(num_plans, dtype=outcomes.dtype, device=outcomes.device)
    counts = torch.zeros(num_plans, dtype=outcomes.dtype, device=outcomes.device)
    sums.scatter_add_(0, inverse, torch.where(scored, outcomes, torch.zeros_like(outcomes)))
    counts.scatter_add_(0, inverse, scored.to(outcomes.dtype))
    return (sums / counts)[inverse]  # 0/0 = NaN for an all-NaN plan
