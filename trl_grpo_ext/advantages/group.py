"""GRPO's group-normalised advantage, as a pure function."""

from __future__ import annotations

import torch

from ..batch import RolloutBatch


def group_advantages(rewards: torch.Tensor, num_generations: int, scale: str = "group", eps: float = 1e-4):
    """Group-relative advantages: A_i = (r_i - mean_g r) / (std_g r + eps), GRPO (arXiv 2402.03300, eq. 3).

    Args:
        rewards: (N,) rewards, the `num_generations` completions of each prompt contiguous; NaN rows (unscorable) are
            left out of their group's mean and std and get advantage 0, as in TRL.
        num_generations: group size G; N must be a multiple of it.
        scale: `"group"` divides by the group's std (GRPO), `"batch"` by the whole batch's std, `"none"` does not
            divide (Dr. GRPO, arXiv 2503.20783: no difficulty bias).
        eps: added to the std, TRL's value.

    >>> group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, scale="none")
    tensor([ 0.7500, -0.2500, -0.2500, -0.2500])
    """
    if rewards.dim() != 1 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of num_generations={num_generations}."
        )
    grouped = rewards.view(-1, num_generations)  # (N/G, G)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    advantages = grouped - mean
    if scale == "group":
        advantages = advantages / (_nanstd(grouped, dim=1, keepdim=True) + eps)
    elif scale == "batch":
        advantages = advantages / (_nanstd(rewards) + eps)
    elif scale != "none":
        raise ValueError(f"scale={scale!r} is not one of 'group', 'batch', 'none'.")
    return torch.nan_to_num(advantages.reshape(-1), nan=0.0)


def _nanstd(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    # Sample std (Bessel-corrected), as TRL's `nanstd`.
    if dim is None:
        x, dim = x[~torch.isnan(x)], 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=keepdim)
    var = torch.nansum((x - mean) ** 2, dim=dim, keepdim=keepdim) / (count - 1).clamp(min=1)
    return var.sqrt()


def trl_group(batch: RolloutBatch) -> torch.Tensor:
    """TRL's own advantages, untouched (the default estimator, `"group"`).

    The trainer never even calls it on the default path, so GRPOExtTrainer with defaults trains bit for bit like
    GRPOTrainer (`scale_rewards`, `multi_objective_aggregation` and all).
    """
    return batch.advantages
