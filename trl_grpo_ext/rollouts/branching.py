"""ARPO's entropy-guided branching after tool results ("Agentic Reinforced Policy Optimization", arXiv 2507.19849).

Of a group of M rollouts, N are full rollouts. After each tool result, the entropy of the next k generated tokens is
compared with that of the first k tokens of the response: a rise in uncertainty is where exploring pays. With
probability clip(α + β·ΔH, 0, 1) the trajectory branches there: Z new rollouts continue it from that point. Unused
slots get fresh rollouts. A branch shares its parent's tokens up to the branch point; those tokens are generated
once.
"""

from __future__ import annotations

import torch

from ..advantages.tree import tree_token_advantages


def resume_points(tool_mask: list[int]) -> list[int]:
    """Completion positions where the model resumes generating after a tool result (TRL's tool_mask goes 0 → 1).

    >>> resume_points([1, 1, 0, 0, 1, 1, 0, 1])
    [4, 7]
    """
    return [t for t in range(1, len(tool_mask)) if tool_mask[t] == 1 and tool_mask[t - 1] == 0]


def branch_probability(entropies: torch.Tensor, point: int, k: int, alpha: float, beta: float) -> float:
    """clip(α + β·ΔH, 0, 1), ΔH = (H_t − H_initial) / H_initial (arXiv 2507.19849, eq. 2).

    H_t is the mean entropy of the k tokens generated from `point`, H_initial that of the first k tokens of the
    response. The paper normalises ΔH without saying how; we take the relative change, so that β reads the same
    whatever the vocabulary's entropy scale.

    >>> branch_probability(torch.tensor([1.0, 1.0, 2.0, 2.0]), point=2, k=2, alpha=0.5, beta=0.2)
    0.7
    """
    initial = entropies[:k].mean().item()
    after = entropies[point : point + k].mean().item()
    delta = (after - initial) / max(initial, 1e-6)
    return min(1.0, max(0.0, alpha + beta * delta))


def choose_branches(
    candidates: list[list[tuple[int, float]]], slots: int, z: int, generator: torch.Generator
) -> list[tuple[int, int]]:
    """Which (parent, point) pairs branch, in the order rollouts reach them.

    `candidates[i]` lists `(point, probability)` for initial rollout i. Points are visited breadth first (every
    rollout's first tool result, then every second one...), as parallel rollouts reach them; each accepted point
    takes Z slots, until fewer than Z are left. Returns one (parent, point) per accepted point.
    """
    chosen = []
    depth = 0
    while slots >= z and any(depth < len(c) for c in candidates):
        for parent, points in enumerate(candidates):
            if depth < len(points) and slots >= z:
                point, probability = points[depth]
                if torch.rand((), generator=generator).item() < probability:
                    chosen.append((parent, point))
                    slots -= z
        depth += 1
    return chosen


def branch_token_advantages(
    leaf_advantages: torch.Tensor, completion_mask: torch.Tensor, parents: list[int], points: list[int]
) -> torch.Tensor:
    """ARPO's "hard" advantage for a batch whose branch rows continue a parent row.

    A branch row b continues row `parents[b]` from completion position `points[b]`: the parent's tokens before that
    point are shared by both (they sit once in the batch, in the parent row; the branch has them as context). Each
    parent token gets the mean leaf advantage of the parent and of every branch that shares it; other tokens keep
    their row's leaf advantage. Rows that are not branches have `parents[b] = -1`.

    Args:
        leaf_advantages: (B,) the rows' own (group-normalised) advantages.
        completion_mask: (B, T).
        parents, points: per row, the parent row and branch point, or -1.

    >>> branch_token_advantages(torch.tensor([1.0, -1.0]), torch.ones(2, 3), parents=[-1, 0], points=[-1, 2])
    tensor([[ 0.,  0.,  1.],
            [-1., -1., -1.]])
    """
    rows, length = completion_mask.shape
    branch_points: dict[int, list[int]] = {}
    for row, (parent, point) in enumerate(zip(parents, points, strict=True)):
        if parent >= 0:
            branch_points.setdefault(parent, []).append(point)
    stride = length + 1
    positions = torch.arange(length)
    own = (torch.arange(rows) * stride + length).unsqueeze(1).expand(rows, length)  # (B, T) a node per leaf
    nodes = torch.where(completion_mask.bool(), own, torch.full_like(own, -1))
    width = max([length] + [len(set(p)) + 1 for p in branch_points.values()])
    virtual = torch.full((rows, width), -1, dtype=torch.long)
    virtual[:, :length] = nodes
    for parent, ps in branch_points.items():
        cuts = torch.tensor(sorted(set(ps)))
        interval = torch.searchsorted(cuts, positions, right=True)  # (T,) cuts at or before each token
        virtual[parent, :length] = torch.where(completion_mask[parent].bool(), parent * stride + interval, -1)
    for row, (parent, point) in enumerate(zip(parents, points, strict=True)):
        if parent >= 0:
            cuts = sorted(set(branch_points[parent]))
            shared = cuts.index(point) + 1  # the parent's intervals before this branch's point
            virtual[row] = -1
            virtual[row, :shared] = parent * stride + torch.arange(shared)
            virtual[row, shared] = row * stride + length
    result = tree_token_advantages(leaf_advantages, virtual)[:, :length]
    leaves = leaf_advantages.unsqueeze(1) * completion_mask.to(leaf_advantages.dtype)
    is_branch = torch.tensor([p >= 0 for p in parents]).unsqueeze(1)
    return torch.where(is_branch, leaves, result)
