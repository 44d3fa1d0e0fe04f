"""PTA-GRPO's plan values and per-token advantages ("Plan Then Action", arXiv 2510.01833)."""

from __future__ import annotations

import torch

from ..batch import RolloutBatch


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
        raise ValueError(f"outcomes {tuple(outcomes.shape)} and plan_ids {tuple(plan_ids.shape)} must be equal 1-D shapes.")
    _, inverse = torch.unique(plan_ids, return_inverse=True)  # (G,) plan index per row
    scored = ~torch.isnan(outcomes)
    num_plans = int(inverse.max()) + 1 if inverse.numel() else 0
    sums = torch.zeros(num_plans, dtype=outcomes.dtype, device=outcomes.device)
    counts = torch.zeros(num_plans, dtype=outcomes.dtype, device=outcomes.device)
    sums.scatter_add_(0, inverse, torch.where(scored, outcomes, torch.zeros_like(outcomes)))
    counts.scatter_add_(0, inverse, scored.to(outcomes.dtype))
    return (sums / counts)[inverse]  # 0/0 = NaN for an all-NaN plan


def pta_token_advantages(row_advantages: torch.Tensor, plan_ids: torch.Tensor, segment_ids: torch.Tensor):
    """Per-token advantages of PTA rows: plan tokens get their plan's advantage, continuation tokens their own.

    The plan's advantage is the mean advantage of the z rows that share the plan (a shared tree edge gets the mean
    over the trajectories through it, as ARPO's "hard" rule); a continuation is a leaf and keeps its row's.

    Args:
        row_advantages: (B,) the group-normalised advantage of each row's reward.
        plan_ids: (B,) long.
        segment_ids: (B, T) long: 0 on plan tokens, 1 on continuation tokens, -1 on padding.

    >>> pta_token_advantages(torch.tensor([1.0, -1.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1]),
    ...                      torch.tensor([[0, 1, 1], [0, 1, -1], [0, 0, 1], [0, 0, 1]]))
    tensor([[ 0.0000,  1.0000,  1.0000],
            [ 0.0000, -1.0000,  0.0000],
            [ 0.5000,  0.5000,  0.5000],
            [ 0.5000,  0.5000,  0.5000]])
    """
    plan = plan_values(row_advantages, plan_ids)  # (B,)
    tokens = torch.where(segment_ids == 0, plan.unsqueeze(1), row_advantages.unsqueeze(1))  # (B, T)
    return tokens.masked_fill(segment_ids < 0, 0.0)


def pta_estimator(batch: RolloutBatch):
    """The `"pta"` estimator: `pta_token_advantages` on a PTA batch; TRL's row advantages elsewhere (evaluation)."""
    plan_ids = batch.columns.get("plan_id")
    if plan_ids is None or batch.segment_ids is None:
        return batch.advantages
    plan_ids = torch.tensor(plan_ids, device=batch.advantages.device)
    return pta_token_advantages(batch.advantages, plan_ids, batch.segment_ids)
