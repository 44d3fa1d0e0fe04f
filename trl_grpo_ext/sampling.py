"""Dynamic sampling (DAPO, arXiv 2503.14476, §3.2): keep only groups whose rewards vary.

A group whose G completions all scored the same has zero advantage for every member: it costs a forward and
backward pass and teaches nothing, and it dilutes the batch. These pure functions find such groups and splice
replacement rows into a padded batch.
"""

from __future__ import annotations

import torch


def varied_groups(rewards: torch.Tensor, num_generations: int, tol: float = 1e-6) -> torch.Tensor:
    """(N / G,) bool: True for the groups whose rewards are not all equal (NaN rows, unscorable, are ignored).

    >>> varied_groups(torch.tensor([1.0, 1.0, 0.0, 0.5, 0.5, 0.5]), 3).tolist()
    [True, False]
    """
    grouped = rewards.view(-1, num_generations)  # (N/G, G)
    scored = ~torch.isnan(grouped)
    high = torch.where(scored, grouped, torch.full_like(grouped, -torch.inf)).amax(dim=1)
    low = torch.where(scored, grouped, torch.full_like(grouped, torch.inf)).amin(dim=1)
    return (high - low) > tol  # a group with fewer than two scored rows has high - low <= 0 or NaN: dropped


def splice_rows(
    base: dict,
    extra: dict,
    replace: dict[int, int],
    pad_values: dict[str, float],
    left_padded: set[str],
) -> dict:
    """`base` with row `i` replaced by row `replace[i]` of `extra`, for tensors padded to different lengths.

    Tensors of shape (B, ...) are spliced row-wise; (B, T) tensors are first padded to a common T (on the left for
    the keys in `left_padded`, on the right otherwise) with `pad_values[key]` (default 0). Scalars are taken from
    `base`. A key present in only one of the two dicts, or a non-tensor value, is an error: silently keeping one
    side would mix rows of different batches.
    """
    if base.keys() != extra.keys():
        raise ValueError(f"cannot splice batches with different keys: {sorted(base.keys() ^ extra.keys())}")
    rows = torch.tensor(list(replace), dtype=torch.long)
    sources = torch.tensor(list(replace.values()), dtype=torch.long)
    out = {}
    for key, value in base.items():
        other = extra[key]
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            out[key] = value
            continue
        if not isinstance(value, torch.Tensor) or not isinstance(other, torch.Tensor):
            raise NotImplementedError(f"dynamic sampling cannot refill batches carrying {key!r} ({type(value).__name__})")
        if value.dim() >= 2 and value.size(1) != other.size(1) and value.size(1) > 1 and other.size(1) > 1:
            width = max(value.size(1), other.size(1))
            value, other = (_pad(t, width, pad_values.get(key, 0), key in left_padded) for t in (value, other))
        value = value.clone()
        value[rows.to(value.device)] = other[sources.to(other.device)].to(value.dtype)
        out[key] = value
    return out


def _pad(tensor: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
    missing = width - tensor.size(1)
    if missing == 0:
        return tensor
    fill = tensor.new_full((tensor.size(0), missing, *tensor.shape[2:]), value)
    return torch.cat([fill, tensor] if left else [tensor, fill], dim=1)
