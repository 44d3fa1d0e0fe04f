"""Segment-level advantages (GPG / ARPO): the three ways to credit the segments of a completion.

- `soft_advantages`: GRPO over whole trajectories, every token gets its row's advantage (ARPO's "soft" setting).
- `hard_advantages`: a token shared by several trajectories gets the mean advantage of all of them (ARPO's "hard").
- `segment_reward_advantages`: outcome advantage plus λ times a group-normalised per-segment reward (turn-level
  credit without branching, METHODS.md §4).

Pure functions of tensors; rows are in TRL's order (the `num_generations` completions of a prompt contiguous) and a
group's rows must all be present (tree and group maths need whole groups).
"""

from __future__ import annotations

import math

import torch

from .group import _nanstd, group_advantages
from .tree import tree_token_advantages

SEGMENT_NORMALIZATIONS = ("group", "position", "none")


def soft_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    token_mask: torch.Tensor | None = None,
    scale: str = "group",
) -> torch.Tensor:
    """ARPO's "soft" advantage: GRPO over the full trajectories, A_{i,t} = (r_i - mean R) / std R for every token.

    ARPO (arXiv 2507.19849, "Advantage Attribution Estimation", soft setting) keeps the branched trajectories as
    independent group members: identical to GRPO's group advantage (arXiv 2402.03300, eq. 3), broadcast to the
    row's tokens.

    Args:
        rewards: (N,) rewards, groups of `num_generations` contiguous; NaN rows get 0 (`group_advantages`).
        num_generations: group size G.
        token_mask: optional (N, T); with it the result is (N, T), the row advantage on tokens where the mask is
            non-zero and 0 elsewhere. Without it the result is (N,), which TRL's loss broadcasts itself.
        scale: `"group"`, `"batch"` or `"none"`, as in `group_advantages`.

    >>> soft_advantages(torch.tensor([1.0, 0.0]), 2, token_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]), scale="none")
    tensor([[ 0.5000,  0.5000,  0.0000],
            [-0.5000, -0.5000, -0.5000]])
    """
    rows = group_advantages(rewards, num_generations, scale=scale)  # (N,)
    if token_mask is None:
        return rows
    if token_mask.dim() != 2 or token_mask.size(0) != rows.numel():
        raise ValueError(
            f"token_mask must have shape (N, T) with N = {rows.numel()} rows like rewards, got "
            f"{tuple(token_mask.shape)}."
        )
    return rows.unsqueeze(1) * (token_mask != 0).to(rows.dtype)  # (N, T)


def hard_advantages(
    rewards: torch.Tensor, num_generations: int, node_ids: torch.Tensor, scale: str = "group"
) -> torch.Tensor:
    """ARPO's "hard" advantage: tokens unique to a branch get (r_i - mean R) / std R, shared tokens the mean of all
    trajectories that share them.

    Leaf advantages a_i = (r_i - mean_g R) / std_g R (`group_advantages`), then A_{i,t} = mean of a_j over the rows j
    whose `node_ids` contain node_ids[i, t] (`tree_token_advantages`). ARPO, arXiv 2507.19849 ("Advantage
    Attribution Estimation", hard setting); GPG, arXiv 2512.10365.

    Args:
        rewards: (N,) rewards, groups of `num_generations` contiguous. A NaN row (unscored) has no leaf advantage: it
            is left out of the means of the nodes it shares, and its own tokens get 0 (as TRL gives it).
        num_generations: group size G.
        node_ids: (N, T) long node ids, -1 on padding (`shared_prefix_node_ids`, or the rollout engine's own). Rows of
            different groups never share an id.
        scale: how leaf advantages are scaled, as in `group_advantages` (`"group"` is ARPO's std R).

    Returns:
        (N, T) token advantages, 0 on padding.

    >>> # rows 0 and 1 share their first token; rewards 1, 0 -> leaf advantages 0.5, -0.5 (scale="none")
    >>> hard_advantages(torch.tensor([1.0, 0.0]), 2, torch.tensor([[0, 1], [0, 3]]), scale="none")
    tensor([[ 0.0000,  0.5000],
            [ 0.0000, -0.5000]])
    """
    if node_ids.dim() != 2 or node_ids.size(0) != rewards.numel():
        raise ValueError(
            f"node_ids has shape {tuple(node_ids.shape)} but rewards has {rewards.numel()} rows: the tree needs the "
            "node ids of every row of every group (gather them over processes, or keep whole groups per process)."
        )
    leaf = group_advantages(rewards, num_generations, scale=scale)  # (N,)
    leaf = torch.where(torch.isnan(rewards), torch.full_like(leaf, math.nan), leaf)
    return tree_token_advantages(leaf, node_ids)


def segment_reward_advantages(
    outcome_advantages: torch.Tensor,
    segment_rewards: torch.Tensor,
    segment_ids: torch.Tensor,
    num_generations: int,
    lam: float = 1.0,
    normalize: str = "group",
    eps: float = 1e-4,
) -> torch.Tensor:
    """Outcome advantage plus λ times the normalised segment reward: A_{i,k} = A_outcome,i + λ · ŝ_{i,k}.

    Per-segment rewards without branching (turn-level credit, METHODS.md §4; GPG, arXiv 2512.10365: a segment is a
    macro-action with its own advantage Φ_T). Every token of segment k of row i gets A_{i,k}.

    ŝ_{i,k} normalises s_{i,k}, leaving NaN (missing) segments out of every statistic:
    - `"group"` (default): over all segment rewards of the group, pooled, ŝ = (s - mean) / (std + eps). Segment k of
      one row and segment k of another need not be the same kind of step (a tool call in one, the answer in the
      other), so the pooled statistics are the reading that holds for any completion structure.
    - `"position"`: over the group's k-th segments only (row-aligned structures, where turn k of every row is
      comparable, e.g. a fixed plan / act / answer layout).
    - `"none"`: ŝ = s (rewards already centred, e.g. ±1).
    A missing segment (NaN) adds nothing: its tokens get the outcome advantage alone. std is the sample std (TRL's);
    a group with one scored segment has std 0 and so ŝ = 0.

    Args:
        outcome_advantages: (N,) per-row outcome advantage (e.g. `group_advantages` of the outcome reward).
        segment_rewards: (N, S) float, s_{i,k}; NaN for missing segments (tool-result segments, segments a reward did
            not score, rows with fewer segments). S must cover every segment id in `segment_ids` (pad with NaN).
        segment_ids: (N, T) long segment index of every token (`trl_grpo_ext.segments`), -1 on padding.
        num_generations: group size G; groups contiguous.
        lam: λ, the weight of the segment reward.
        normalize: `"group"`, `"position"` or `"none"` (above).
        eps: added to the std, TRL's value.

    Returns:
        (N, T) token advantages, 0 where `segment_ids` is -1.

    >>> segment_reward_advantages(  # group of 2 rows, 2 segments each; segment rewards 1, 0 | 0, NaN
    ...     torch.tensor([0.5, -0.5]), torch.tensor([[1.0, 0.0], [0.0, float("nan")]]),
    ...     torch.tensor([[0, 1, -1], [0, 1, 1]]), num_generations=2, lam=1.0, normalize="none")
    tensor([[ 1.5000,  0.5000,  0.0000],
            [-0.5000, -0.5000, -0.5000]])
    """
    if normalize not in SEGMENT_NORMALIZATIONS:
        raise ValueError(f"normalize={normalize!r} is not one of {', '.join(map(repr, SEGMENT_NORMALIZATIONS))}.")
    if not isinstance(lam, (int, float)) or not math.isfinite(lam):
        raise ValueError(f"lam={lam!r} must be a finite number (the weight of the segment reward), e.g. 1.0.")
    rows = outcome_advantages.numel()
    if outcome_advantages.dim() != 1:
        raise ValueError(f"outcome_advantages must have shape (N,), got {tuple(outcome_advantages.shape)}.")
    if segment_rewards.dim() != 2 or segment_rewards.size(0) != rows:
        raise ValueError(
            f"segment_rewards must have shape (N, S) with N = {rows} rows, got {tuple(segment_rewards.shape)}."
        )
    if segment_ids.dim() != 2 or segment_ids.size(0) != rows:
        raise ValueError(f"segment_ids must have shape (N, T) with N = {rows} rows, got {tuple(segment_ids.shape)}.")
    if num_generations < 1 or rows % num_generations != 0:
        raise ValueError(
            f"{rows} rows cannot be split into groups of num_generations={num_generations}; segment rewards are "
            "normalised within whole groups."
        )
    num_segments = segment_rewards.size(1)
    if segment_ids.numel() and int(segment_ids.max()) >= num_segments:
        raise ValueError(
            f"segment_ids holds segment {int(segment_ids.max())} but segment_rewards has only S={num_segments} "
            f"columns; pad segment_rewards with NaN up to {int(segment_ids.max()) + 1} columns for unscored segments."
        )

    scores = segment_rewards.to(outcome_advantages.dtype)  # (N, S)
    if normalize == "group":
        pooled = scores.view(rows // num_generations, num_generations * num_segments)  # (N/G, G·S)
        mean = torch.nanmean(pooled, dim=1, keepdim=True)
        std = _nanstd(pooled, dim=1, keepdim=True)
        normalised = ((pooled - mean) / (std + eps)).view(rows, num_segments)
    elif normalize == "position":
        grouped = scores.view(rows // num_generations, num_generations, num_segments)  # (N/G, G, S)
        mean = torch.nanmean(grouped, dim=1, keepdim=True)
        std = _nanstd(grouped, dim=1, keepdim=True)
        normalised = ((grouped - mean) / (std + eps)).view(rows, num_segments)
    else:
        normalised = scores
    normalised = torch.nan_to_num(normalised, nan=0.0)  # (N, S): missing segments add nothing
    if num_segments == 0:  # no segment is scored: every token is padding or gets its outcome advantage alone
        normalised = normalised.new_zeros(rows, 1)

    valid = segment_ids >= 0  # (N, T)
    bonus = normalised.gather(1, segment_ids.long().clamp(min=0))  # (N, T)
    advantages = outcome_advantages.unsqueeze(1) + lam * bonus  # (N, T)
    return torch.where(valid, advantages, torch.zeros_like(advantages))
