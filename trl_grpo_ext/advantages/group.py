"""GRPO's group-normalised advantage, as a pure function."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..batch import RolloutBatch


@dataclass(frozen=True)
class GroupStats:
    """Per-group statistics of the scored rows (NaN rows, unscorable, left out), as TRL computes its group baseline.

    `index` (N,) maps each row to its group (0..K-1); the rest are (K,): `count` scored rows, `mean` (NaN when none is
    scored), `std` the sample std (Bessel's correction, TRL's `nanstd`; NaN with fewer than two scored rows), `low`
    and `high` the smallest and largest scored value (NaN when none). `rows(x)` spreads a (K,) statistic over the rows.
    """

    index: torch.Tensor
    count: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor

    def rows(self, values: torch.Tensor) -> torch.Tensor:
        """(N,): each row's value of a (K,) per-group statistic."""
        return values[self.index]


def group_stats(values: torch.Tensor, groups: int | torch.Tensor) -> GroupStats:
    """Nan-aware statistics of each group of `values`: the one rule for every group statistic of this package.

    TRL leaves an unscorable row (every reward function returned None: its weighted `nansum` is set back to NaN) out
    of its group's mean and std (`nanmean`, `nanstd`), and gives it advantage 0 (`nan_to_num`). Here too: NaN values
    are not counted anywhere.

    Args:
        values: (N,) float; NaN for unscored rows.
        groups: the group size G (groups of G contiguous rows; N must be a multiple of it; G = N for one group over
            the whole batch), or (N,) integer labels (any values; a group's rows need not be contiguous; groups are
            numbered in sorted label order).

    >>> stats = group_stats(torch.tensor([1.0, float("nan"), 0.0, 0.0, 2.0, 4.0]), 3)
    >>> stats.count.tolist(), stats.mean.tolist(), stats.std.tolist()
    ([2.0, 3.0], [0.5, 2.0], [0.7071067690849304, 2.0])
    """
    values = values.reshape(-1)
    if not values.is_floating_point():
        values = values.float()
    if isinstance(groups, int):
        if groups < 1 or values.numel() % groups != 0:
            raise ValueError(f"{values.numel()} values cannot be split into groups of {groups} rows.")
        index = torch.arange(values.numel(), device=values.device) // groups
        size = values.numel() // groups
    else:
        if groups.shape != values.shape:
            raise ValueError(f"group labels of shape {tuple(groups.shape)} for values of shape {tuple(values.shape)}.")
        _, index = torch.unique(groups.to(values.device), return_inverse=True)
        size = int(index.max()) + 1 if index.numel() else 0
    scored = ~torch.isnan(values)
    zeros = torch.zeros(size, dtype=values.dtype, device=values.device)
    count = zeros.index_add(0, index, scored.to(values.dtype))
    mean = zeros.index_add(0, index, torch.where(scored, values, 0.0)) / count  # 0 / 0 = NaN: nothing scored
    deviation = torch.where(scored, values - mean[index], 0.0)
    var = zeros.index_add(0, index, deviation**2) / (count - 1)
    std = torch.where(count > 1, var, torch.nan).sqrt()
    inf = torch.full_like(zeros, torch.inf)
    low = inf.scatter_reduce(0, index, torch.where(scored, values, torch.inf), reduce="amin")
    high = (-inf).scatter_reduce(0, index, torch.where(scored, values, -torch.inf), reduce="amax")
    low, high = torch.where(count > 0, low, torch.nan), torch.where(count > 0, high, torch.nan)
    return GroupStats(index=index, count=count, mean=mean, std=std, low=low, high=high)


def normalise(values: torch.Tensor, groups: int | torch.Tensor, scale: str = "group", eps: float = 1e-4):
    """(N,) each value minus its group's mean, divided as `scale` says, as TRL's `scale_rewards`: `"group"` by the
    group's std, `"batch"` by the std of every scored value of `values` (centred per group, scaled over the batch),
    `"none"` not at all. NaN rows, and groups that cannot be scaled, get 0 (TRL's `nan_to_num`).

    `groups` as in `group_stats`.
    """
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is not one of {', '.join(map(repr, SCALES))}.")
    stats = group_stats(values, groups)
    out = values.reshape(-1) - stats.rows(stats.mean)
    if scale == "group":
        out = out / (stats.rows(stats.std) + eps)
    elif scale == "batch":
        out = out / (group_stats(values, max(values.numel(), 1)).std + eps)
    return torch.nan_to_num(out, nan=0.0)


SCALES = ("group", "batch", "none")


def group_advantages(rewards: torch.Tensor, num_generations: int, scale: str = "group", eps: float = 1e-4):
    """Group-relative advantages: A_i = (r_i - mean_g r) / (std_g r + eps), GRPO (arXiv 2402.03300, eq. 3).

    Args:
        rewards: (N,) rewards, the `num_generations` completions of each prompt contiguous; NaN rows (unscorable) are
            left out of their group's mean and std and get advantage 0, as in TRL (`group_stats`).
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
    return normalise(rewards, num_generations, scale, eps)


def trl_group(batch: RolloutBatch) -> torch.Tensor:
    """TRL's own advantages, untouched (the default estimator, `"group"`).

    The trainer never even calls it on the default path, so GRPOExtTrainer with defaults trains bit for bit like
    GRPOTrainer (`scale_rewards`, `multi_objective_aggregation` and all).
    """
    return batch.advantages
