"""Tree-OPO's advantages (arXiv 2509.09284): the staged heuristic and staged advantage estimation (SAE).

A Tree-OPO group mixes completions of one question started from a teacher's prefixes at different depths. A deep
prefix is easy (most of the solution is given), so a success from it deserves less credit than one from the bare
question, and a failure from it more blame. Both estimators encode that.

- Staged heuristic: a'_i = r_i - alpha * V(p_i), then minus its mean within the group; no std division (paper
  section 4, alpha = 0.5, V = the expectation value by default).
- SAE: the advantages closest to the mean-centred rewards r0 that respect the tree's ordering:
  minimise 1/2 ||a - r0||^2 subject to sum(a) = 0, ||a||^2 <= N ("soft") or = N ("hard"), and a_i + delta <= a_j
  for every ordered pair (i, j). `tree_order_pairs` builds the pairs from the tree (documented there).

`sae_project` is exact: the projection onto the ordering polyhedron is a least-distance program, solved by
Lawson and Hanson's reduction to non-negative least squares (scipy.optimize.nnls, a finite active-set method); the
norm constraint is met by a scalar search on the scale of r0 (the KKT multiplier of the norm constraint).
"""

from __future__ import annotations

import numpy as np
import torch

from .group import normalise

__all__ = ["staged_advantages", "sae_project", "tree_order_pairs", "constraint_satisfaction"]


def staged_advantages(
    rewards: torch.Tensor, values: torch.Tensor, group_ids: torch.Tensor, alpha: float = 0.5
) -> torch.Tensor:
    """(r - alpha * V) minus its mean within each group id; no division by the std.

    Args:
        rewards: (N,) the completions' rewards; NaN rows (unscorable) are left out of their group's mean and get 0, as
            in TRL (`group_stats`).
        values: (N,) V(p) of the prefix each completion started from (in [0, 1] for a binary reward).
        group_ids: (N,) integer group of each row (any labels; rows of a group need not be contiguous).
        alpha: weight of the prefix value (the paper's 0.5; 0 gives plain mean-centred rewards, Dr. GRPO's).

    >>> staged_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([0.2, 0.8, 0.2, 0.8]),
    ...                   torch.tensor([0, 0, 0, 0]))
    tensor([ 0.6500,  0.3500, -0.3500, -0.6500])
    """
    rewards, values, group_ids = _as_rows(rewards, "rewards"), _as_rows(values, "values"), group_ids.reshape(-1)
    if not (rewards.numel() == values.numel() == group_ids.numel()):
        raise ValueError(
            f"rewards, values and group_ids must all have N entries; got {rewards.numel()}, {values.numel()} and "
            f"{group_ids.numel()}."
        )
    return normalise(rewards - alpha * values.to(rewards), group_ids, scale="none")


def sae_project(r0: torch.Tensor, order_pairs, delta: float = 0.0, mode: str = "soft") -> torch.Tensor:
    """The advantages a closest to `r0` with sum(a) = 0, ||a||^2 <= N (soft) or = N (hard), a_i + delta <= a_j.

    Args:
        r0: (N,) the mean-centred rewards of one group (it is centred again here; the sum constraint needs it). NaN
            rows (unscorable) are left out of the projection, of the sum and of N, and get 0; no pair may name them.
        order_pairs: (M, 2) pairs (i, j) of row indices, meaning a_i + delta <= a_j (a list of pairs, an array or a
            long tensor; empty for none).
        delta: the margin of every ordering constraint (>= 0).
        mode: "soft" (||a||^2 <= N: a feasible r0 is returned unchanged) or "hard" (||a||^2 = N: the advantages are
            rescaled onto the sphere, as std normalisation would).

    Returns:
        (N,) tensor of r0's dtype and device. With delta > 0 and a cycle in the pairs there is no solution and a
        ValueError names it. An all-zero r0 (a group whose rewards agree) gives the closest point that meets the
        margins, rescaled onto the sphere in hard mode; with no margin to meet it stays zero in both modes.

    Only differences a_j - a_i are constrained, so the projection keeps the mean of r0 (0); the norm constraint is
    met by projecting s * r0 and searching the scale s (bisection to 1e-10): for soft, s = 1 when the projection of
    r0 already has ||a||^2 <= N.

    >>> sae_project(torch.tensor([0.5, -0.5]), [(1, 0)], delta=0.0)  # feasible: unchanged
    tensor([ 0.5000, -0.5000])
    >>> sae_project(torch.tensor([0.5, -0.5]), [(0, 1)], delta=0.2)  # a_0 + 0.2 <= a_1: the closest such point
    tensor([-0.1000,  0.1000])
    """
    if mode not in ("soft", "hard"):
        raise ValueError(f"mode={mode!r}; use 'soft' (||a||^2 <= N) or 'hard' (||a||^2 = N).")
    if delta < 0:
        raise ValueError(f"delta={delta!r} must be >= 0 (the margin in a_i + delta <= a_j).")
    r0_t = _as_rows(r0, "r0")
    scored = ~torch.isnan(r0_t)
    if not bool(scored.all()):  # project the scored rows alone
        keep = scored.nonzero().flatten().tolist()
        where = {row: k for k, row in enumerate(keep)}
        pairs = np.asarray(order_pairs.cpu() if isinstance(order_pairs, torch.Tensor) else order_pairs, dtype=np.int64)
        unscored = sorted({int(i) for i in pairs.reshape(-1) if int(i) not in where})
        if unscored:
            raise ValueError(
                f"order_pairs name rows {unscored}, whose r0 is NaN (unscored): leave them out of the pairs (an "
                "unscored row is ordered against nothing)."
            )
        out = torch.zeros_like(r0_t)
        if keep:
            sub = [(where[int(i)], where[int(j)]) for i, j in pairs.reshape(-1, 2)]
            out[keep] = sae_project(r0_t[keep], sub, delta=delta, mode=mode)
        return out
    y = r0_t.detach().double().cpu().numpy()
    n = y.size
    if n == 0:
        return r0_t.clone()
    y = y - y.mean()
    pairs = np.asarray(order_pairs.cpu() if isinstance(order_pairs, torch.Tensor) else order_pairs, dtype=np.int64)
    pairs = pairs.reshape(-1, 2)
    if pairs.size and (pairs.min() < 0 or pairs.max() >= n or np.any(pairs[:, 0] == pairs[:, 1])):
        raise ValueError(
            f"order_pairs must hold pairs (i, j) of distinct row indices in [0, {n}); got {pairs.tolist()}."
        )
    budget = float(n)

    def project(scale: float) -> np.ndarray:
        return _ldp_project(scale * y, pairs, delta)

    def result(a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(a, dtype=r0_t.dtype, device=r0_t.device)

    a = project(1.0)
    norm = float(a @ a)
    if (mode == "soft" and norm <= budget) or not np.any(np.abs(a) > 0):
        return result(a)
    base = project(0.0)  # what the margins alone need (r0 scaled to nothing)
    if float(base @ base) > budget:
        raise ValueError(
            f"the ordering constraints with delta={delta} need ||a||^2 = {float(base @ base):.3g} > N = {n}; lower "
            "delta or use fewer pairs."
        )
    if not np.any(np.abs(y) > 0):  # r0 = 0 (a zero-variance group): only the margins order the rows
        return result(base if mode == "soft" else base * np.sqrt(budget / float(base @ base)))

    def excess(scale: float) -> float:  # ||P(s r0)||^2 - N: increasing in s
        a = project(scale)
        return float(a @ a) - budget

    if mode == "soft" or norm > budget:  # shrink: the largest s <= 1 with ||P(s r0)||^2 <= N
        low, high = 0.0, 1.0
    else:  # hard and below the sphere: grow s until ||P(s r0)||^2 = N
        low, high = 1.0, 2.0
        while excess(high) < 0:
            low, high = high, high * 2
            if high > 1e12:
                raise ValueError("sae_project(mode='hard') cannot reach ||a||^2 = N: r0 is (numerically) zero.")
    low, high = _root_bracket(excess, low, high, tol=1e-10)
    a = project(low)
    if mode == "hard":  # land exactly on the sphere; scaling up by ~1 keeps every margin (a_j - a_i >= delta)
        a = a * np.sqrt(budget / float(a @ a))
    return torch.as_tensor(a, dtype=r0_t.dtype, device=r0_t.device)


def tree_order_pairs(rewards, values, related) -> list[tuple[int, int]]:
    """The ordering pairs (i, j), meaning a_i + delta <= a_j, of one group's rows, from the tree.

    Rows i and j are completions started from prefix nodes p_i and p_j of one question's tree:

    1. outcome pairs: r_i < r_j gives (i, j): a failure never gets more credit than a success;
    2. parent/child pairs (p_i and p_j on one path from the root) and sibling triplets (a node and two of its
       children p_i, p_j): with r_i == r_j and V(p_i) > V(p_j), (i, j): the same outcome from the easier start
       (the higher success rate below it) earns less credit for a success and more blame for a failure.

    The second rule orders related starts by their value, not by depth: a deeper prefix is usually easier, but a
    teacher's wrong step makes it harder, and its value says so. The staged heuristic r - alpha V satisfies every
    such pair with delta = 0; SAE enforces them with a margin.

    Args:
        rewards: (n,) the rows' rewards (a sequence or tensor).
        values: (n,) V of each row's prefix node.
        related: `related(i, j) -> bool`: the rows' prefix nodes are distinct and parent/child (one an ancestor of the
            other) or siblings (children of one node).
    """
    r = [float(x) for x in (rewards.tolist() if isinstance(rewards, torch.Tensor) else rewards)]
    v = [float(x) for x in (values.tolist() if isinstance(values, torch.Tensor) else values)]
    pairs = []
    for i in range(len(r)):
        for j in range(len(r)):
            if i != j and (r[i] < r[j] or (r[i] == r[j] and v[i] > v[j] and related(i, j))):
                pairs.append((i, j))
    return pairs


def constraint_satisfaction(advantages: torch.Tensor, order_pairs, delta: float = 0.0, tol: float = 1e-6) -> float:
    """The fraction of pairs (i, j) with a_i + delta <= a_j (within `tol`); 1.0 when there are no pairs."""
    pairs = torch.as_tensor(np.asarray(list(order_pairs), dtype=np.int64).reshape(-1, 2))
    if pairs.numel() == 0:
        return 1.0
    a = advantages.detach().double().cpu().reshape(-1)
    return float((a[pairs[:, 0]] + delta <= a[pairs[:, 1]] + tol).double().mean())


def _root_bracket(f, low: float, high: float, tol: float) -> tuple[float, float]:
    """Shrink [low, high] with f(low) <= 0 < f(high) around f's root (f increasing): regula falsi with the Illinois
    step, which keeps the bracket and converges superlinearly (a handful of projections, where bisection needs ~35)."""
    f_low, f_high, side = f(low), f(high), 0
    for _ in range(200):
        if high - low < tol * max(1.0, high):
            break
        mid = high - f_high * (high - low) / (f_high - f_low) if f_high != f_low else (low + high) / 2
        if not low < mid < high:
            mid = (low + high) / 2
        f_mid = f(mid)
        if f_mid > 0:
            high, f_high = mid, f_mid
            if side == 1:
                f_low /= 2
            side = 1
        else:
            low, f_low = mid, f_mid
            if side == -1:
                f_high /= 2
            side = -1
            if -f_mid < 1e-9 * max(1.0, abs(f_high)):
                break  # on the sphere to 1e-9, from the feasible side
    return low, high


def _ldp_project(y: np.ndarray, pairs: np.ndarray, delta: float) -> np.ndarray:
    # Least-distance programming (Lawson & Hanson, "Solving Least Squares Problems", ch. 23): with u = a - y the
    # problem is min ||u|| s.t. E u >= f, E's row k = e_j - e_i and f_k = delta - (y_j - y_i). NNLS on
    # [E^T; f^T] w ~ [0; 1] gives the residual r, and u = -r[:n] / r[n]; r[n] == 0 means no feasible point.
    from scipy.optimize import nnls

    if pairs.size == 0:
        return y.copy()
    i, j = pairs[:, 0], pairs[:, 1]
    f = delta - (y[j] - y[i])
    if np.all(f <= 0):
        return y.copy()
    n, m = y.size, len(pairs)
    matrix = np.zeros((n + 1, m))
    matrix[j, np.arange(m)] = 1.0
    matrix[i, np.arange(m)] -= 1.0
    matrix[n] = f
    target = np.zeros(n + 1)
    target[n] = 1.0
    weights, _ = nnls(matrix, target, maxiter=max(50 * m, 1000))
    residual = matrix @ weights - target
    if abs(residual[n]) < 1e-12:
        raise ValueError(
            f"the ordering pairs have no solution with delta={delta}: they contain a cycle (a_i + delta <= ... <= a_i)."
        )
    return y - residual[:n] / residual[n]


def _as_rows(values: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(values, torch.Tensor):
        values = torch.as_tensor(values, dtype=torch.float32)
    if values.dim() > 1 and values.numel() != values.size(0):
        raise ValueError(f"{name} must have shape (N,), got {tuple(values.shape)}.")
    return values.reshape(-1).float() if not values.is_floating_point() else values.reshape(-1)
