"""Segment-reward advantages (GPG): outcome advantage plus λ times a group-normalised per-segment reward.

Turn-level credit without branching (METHODS.md §4). ARPO's "soft" credit is TRL's own row advantage, and its
"hard" credit is `tree_token_advantages` on the rollout tree; this is the third way to credit segments.

Pure functions of tensors; rows are in TRL's order (the `num_generations` completions of a prompt contiguous) and a
group's rows must all be present (tree and group maths need whole groups).
"""

from __future__ import annotations

import math

import torch

from .group import normalise

SEGMENT_NORMALIZATIONS = ("group", "position", "none")


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
    A missing segment (NaN) adds nothing: its tokens get the outcome advantage alone. std is the sample std (TRL's,
    `group_stats`); a group with one scored segment has ŝ = 0.

    Args:
        outcome_advantages: (N,) per-row outcome advantage (e.g. `group_advantages` of the outcome reward), or (N, T)
            per-token advantages that an earlier credit rule wrote.
        segment_rewards: (N, S) float, s_{i,k}; NaN for missing segments (tool-result segments, segments a reward did
            not score, rows with fewer segments). S must cover every segment id in `segment_ids` (pad with NaN).
        segment_ids: (N, T) long segment index of every token (`trl_grpo_ext.methods.segments`), -1 on padding.
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
    rows = outcome_advantages.size(0) if outcome_advantages.dim() else 0
    if outcome_advantages.dim() not in (1, 2):
        raise ValueError(f"outcome_advantages must have shape (N,) or (N, T), got {tuple(outcome_advantages.shape)}.")
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
    if normalize in ("group", "position"):
        group = (torch.arange(rows, device=scores.device) // num_generations).unsqueeze(1).expand(rows, num_segments)
        if normalize == "position":  # the group's k-th segments only
            group = group * num_segments + torch.arange(num_segments, device=scores.device)
        normalised = normalise(scores.reshape(-1), group.reshape(-1), "group", eps).view(rows, num_segments)
    else:
        normalised = scores
    normalised = torch.nan_to_num(normalised, nan=0.0)  # (N, S): missing segments add nothing
    if num_segments == 0:  # no segment is scored: every token is padding or gets its outcome advantage alone
        normalised = normalised.new_zeros(rows, 1)

    valid = segment_ids >= 0  # (N, T)
    bonus = normalised.gather(1, segment_ids.long().clamp(min=0))  # (N, T)
    outcome = outcome_advantages.unsqueeze(1) if outcome_advantages.dim() == 1 else outcome_advantages
    advantages = outcome + lam * bonus  # (N, T)
    return torch.where(valid, advantages, torch.zeros_like(advantages))
