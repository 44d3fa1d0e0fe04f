"""Advantages on a rollout tree: a token gets the mean advantage of every trajectory that passes through it.

A group's completions form a tree: rows that branched from a common prefix (ARPO's branches after a tool result,
PTA-GRPO's continuations of one plan) share their leading tokens, and a leaf is a whole trajectory. A *node* is one
edge of that tree: a span of tokens that a set of rows has in common. `node_ids` (B, T) names the node of every token;
rows that share a span carry the same id on it.

ARPO's "hard" advantage (arXiv 2507.19849, "Advantage Attribution Estimation") gives a token unique to one
trajectory that trajectory's advantage, and a token of a shared prefix the mean advantage of all trajectories that
share it. GPG (arXiv 2512.10365, Generalized Policy Gradient theorem) is the view behind it: a segment (macro-action)
is an action, and its advantage Φ_T is estimated by the returns of every rollout that took it.
"""

from __future__ import annotations

import torch


def tree_token_advantages(leaf_advantages: torch.Tensor, node_ids: torch.Tensor) -> torch.Tensor:
    """Each token gets the mean of `leaf_advantages` over all rows whose `node_ids` contain that token's node id.

    A_{i,t} = mean_{j : n(i,t) ∈ node_ids[j]} a_j, the "hard" advantage of ARPO (arXiv 2507.19849, "Advantage
    Attribution Estimation") and the segment advantage Φ_T of GPG (arXiv 2512.10365), estimated by every rollout
    through the node. A row counts once per node however many of its tokens carry that node id. A token that only its
    own row has gets the row's advantage, so with no shared node this is GRPO's advantage broadcast to tokens.

    Caller's contract: rows of different groups never share a node id (node ids are global over the batch; make them
    so, e.g. with `shared_prefix_node_ids`, which builds them from a row index). The function cannot check it.

    Args:
        leaf_advantages: (B,) float, one advantage per row (trajectory). A NaN row (unscored) is left out of every
            mean; a token that only NaN rows reach gets 0, as TRL gives unscored rows 0.
        node_ids: (B, T) integer node id of every token, -1 on padding (and on any token that is not on the tree).
            Ids are any non-negative integers (hashes work): only equality matters.

    Returns:
        (B, T) tensor of `leaf_advantages`' dtype: the token advantages, 0 where `node_ids` is -1.

    Cost: one sort of the B·T (node, row) keys (`torch.unique`; ids above 2**62 / B take a second one) plus scatter /
    gather passes: O(B·T log(B·T)) time, O(B·T) memory; no (B, number of nodes) matrix is built.

    >>> # rows 0 and 1 share node 5 (a common prefix), then branch into nodes 6 and 7; row 2 (node 8) is alone.
    >>> node_ids = torch.tensor([[5, 5, 6, -1], [5, 7, 7, 7], [8, 8, -1, -1]])
    >>> tree_token_advantages(torch.tensor([1.0, -1.0, 3.0]), node_ids)
    tensor([[ 0.,  0.,  1.,  0.],
            [ 0., -1., -1., -1.],
            [ 3.,  3.,  0.,  0.]])
    """
    if leaf_advantages.dim() != 1:
        raise ValueError(
            f"leaf_advantages must have shape (B,) (one advantage per row), got {tuple(leaf_advantages.shape)}."
        )
    if node_ids.dim() != 2 or node_ids.size(0) != leaf_advantages.size(0):
        raise ValueError(
            f"node_ids must have shape (B, T) with B = {leaf_advantages.size(0)} rows like leaf_advantages, got "
            f"{tuple(node_ids.shape)}."
        )
    if node_ids.dtype.is_floating_point or node_ids.dtype == torch.bool:
        raise TypeError(f"node_ids must be an integer tensor (torch.long), got dtype {node_ids.dtype}.")
    if not leaf_advantages.dtype.is_floating_point:
        raise TypeError(f"leaf_advantages must be a float tensor, got dtype {leaf_advantages.dtype}.")
    if node_ids.numel() and int(node_ids.min()) < -1:
        raise ValueError(
            f"node_ids holds {int(node_ids.min())}; node ids are >= 0, and -1 marks padding (no other negatives)."
        )

    num_rows = node_ids.size(0)
    if node_ids.numel() == 0:
        return torch.zeros(node_ids.shape, dtype=leaf_advantages.dtype, device=leaf_advantages.device)
    node_ids = node_ids.long()
    valid = node_ids >= 0  # (B, T)
    if int(node_ids.max()) > (2**62) // num_rows:
        # Ids too large to pack with a row index (hashes): make them dense first, at the cost of one more sort.
        node_ids = torch.where(valid, torch.unique(node_ids, return_inverse=True)[1], -1)
    rows = torch.arange(num_rows, device=node_ids.device).unsqueeze(1)  # (B, 1)
    # One (node, row) pair per row that visits a node, however many tokens it has there, sorted by node then row;
    # every padding token maps to the single key -1, a pair of its own.
    keys = torch.where(valid, node_ids * num_rows + rows, -1)  # (B, T)
    pairs, token_pair = torch.unique(keys.view(-1), return_inverse=True)  # (P,), (B·T,)
    pair_row = pairs.remainder(num_rows)  # (P,)
    pair_node = pairs.div(num_rows, rounding_mode="floor")  # (P,) sorted: number the distinct nodes in one pass
    first = torch.ones_like(pair_node, dtype=torch.bool)
    first[1:] = pair_node[1:] != pair_node[:-1]
    pair_node = first.cumsum(0) - 1  # (P,) dense node index 0..K-1
    num_nodes = int(pair_node[-1]) + 1

    leaf = leaf_advantages.detach()
    scored = ~torch.isnan(leaf)  # (B,)
    sums = torch.zeros(num_nodes, dtype=leaf.dtype, device=leaf.device)  # (K,)
    sums.scatter_add_(0, pair_node, torch.nan_to_num(leaf, nan=0.0)[pair_row])
    counts = torch.zeros(num_nodes, dtype=leaf.dtype, device=leaf.device)  # (K,)
    counts.scatter_add_(0, pair_node, scored[pair_row].to(leaf.dtype))
    means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))  # (K,)
    tokens = means[pair_node[token_pair]].view(node_ids.shape)  # (B, T)
    return torch.where(valid, tokens, torch.zeros_like(tokens))


def shared_prefix_node_ids(
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    num_generations: int,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Node ids of the group's prefix tree: tokens of rows that share an identical prefix share a node.

    Within a group (the `num_generations` contiguous rows of one prompt), the node of token t of row i is the set of
    rows whose completions agree with row i, token for token, from position 0 through the end of the segment that
    holds t, and that cut that prefix into the same segments (same segment ids, and a segment ending there too). With
    `segment_ids=None` every token is its own segment: the node is the token's exact prefix (a trie of the group's
    completions).

    So rows that branched from a common prefix (ARPO's branches after a tool result, a plan shared by PTA-GRPO's
    continuations) share the nodes of the shared segments and nothing after the first segment where they differ. Rows
    sampled independently that happen to start alike share those tokens too: they are the same prefix, and the mean
    of all rollouts through a prefix is the Monte-Carlo estimate of its value (GPG, arXiv 2512.10365).

    The node id is `r * T + e`, with r the lowest row index (in the batch) of the sharing rows and e the position at
    which the segment ends: unique over the batch, so rows of different groups never share an id, as
    `tree_token_advantages` requires.

    Args:
        completion_ids: (B, T) token ids, right-padded (TRL's completion layout: position 0 is the first generated
            token of every row).
        completion_mask: (B, T) 1 on real tokens, 0 on padding (right padding only).
        num_generations: group size G; B must be a multiple of it and the groups contiguous (TRL's order). Tree maths
            needs whole groups: gather the rows over processes first, or keep whole groups on each process.
        segment_ids: optional (B, T) long segment index of every token (`trl_grpo_ext.segments`), -1 on padding.
            Without it the nodes are single tokens.

    Returns:
        (B, T) long node ids, -1 on padding (and where `segment_ids` is -1).

    Cost: compares every pair of rows of a group at every position, exactly (no hashing, so no collisions):
    O(B·G·T) time and about 4·B·G·T bytes at the peak (34 MB for B=64, G=8, T=16k; 8 times that at G=64).

    >>> ids = torch.tensor([[1, 2, 3], [1, 2, 4], [1, 5, 6], [7, 8, 9]])
    >>> shared_prefix_node_ids(ids, torch.ones_like(ids), num_generations=4)
    tensor([[ 0,  1,  2],
            [ 0,  1,  5],
            [ 0,  7,  8],
            [ 9, 10, 11]])
    """
    if completion_ids.dim() != 2 or completion_mask.shape != completion_ids.shape:
        raise ValueError(
            f"completion_ids and completion_mask must both have shape (B, T), got {tuple(completion_ids.shape)} and "
            f"{tuple(completion_mask.shape)}."
        )
    num_rows, length = completion_ids.shape
    if num_generations < 1 or num_rows % num_generations != 0:
        raise ValueError(
            f"{num_rows} rows cannot be split into groups of num_generations={num_generations}: tree maths needs "
            "whole groups (gather the rows over processes, or make the per-process batch a multiple of "
            "num_generations)."
        )
    mask = completion_mask.bool()  # (B, T)
    if length > 1 and bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError(
            "completion_mask must be right-padded (ones, then zeros), as TRL pads completions; a row has a real token "
            "after padding. Left-aligned completions are needed so that position t means the same in every row."
        )
    if segment_ids is None:
        segment_ids = torch.arange(length, device=completion_ids.device).expand(num_rows, length)
    elif segment_ids.shape != completion_ids.shape:
        raise ValueError(
            f"segment_ids must have shape {tuple(completion_ids.shape)} like completion_ids, got "
            f"{tuple(segment_ids.shape)}."
        )
    segment_ids = torch.where(mask, segment_ids.long(), torch.full_like(segment_ids, -1, dtype=torch.long))  # (B, T)
    valid = segment_ids >= 0  # (B, T)
    if num_rows == 0 or not bool(valid.any()):
        return torch.full((num_rows, length), -1, dtype=torch.long, device=completion_ids.device)
    if int(segment_ids.max()) >= length:
        raise ValueError(
            f"segment_ids holds {int(segment_ids.max())}, but a row of length T={length} has at most T segments: "
            "segment ids must be per-row indices 0, 1, 2, ... (as trl_grpo_ext.segments returns them)."
        )

    positions = torch.arange(length, device=completion_ids.device)  # (T,)
    # Last position of every segment of every row: (B, S) with S = T slots, -1 for segments a row does not have.
    segment_end = torch.full((num_rows, length), -1, dtype=torch.long, device=completion_ids.device)
    segment_end.scatter_reduce_(
        1, segment_ids.clamp(min=0), torch.where(valid, positions, -1), reduce="amax"
    )

    # A segment ends at t when the next position holds another segment (or padding): rows that share a node must
    # end it at the same place, not only agree on its tokens.
    following = torch.cat([segment_ids[:, 1:], segment_ids.new_full((num_rows, 1), -1)], dim=1)  # (B, T)
    ends_here = valid & (segment_ids != following)  # (B, T)

    groups = num_rows // num_generations
    g = num_generations
    ids = completion_ids.reshape(groups, g, length)
    seg = segment_ids.reshape(groups, g, length)
    end = ends_here.reshape(groups, g, length)
    # First position where rows i and j of a group differ (token, segmentation or length): (groups, G, G).
    differs = (ids.unsqueeze(2) != ids.unsqueeze(1)) | (seg.unsqueeze(2) != seg.unsqueeze(1))  # (groups, G, G, T)
    differs |= end.unsqueeze(2) != end.unsqueeze(1)
    first_difference = torch.where(differs.any(-1), differs.to(torch.uint8).argmax(-1), length)  # (groups, G, G)
    del differs
    # Row j shares segment k of row i when they agree through its last position.
    ends = segment_end.view(groups, g, 1, length)  # (groups, G, 1, S)
    shares = first_difference.unsqueeze(-1) > ends  # (groups, G_i, G_j, S)
    representative = shares.to(torch.uint8).argmax(2)  # (groups, G_i, S): lowest sharing j (i itself shares)
    representative = representative + (torch.arange(groups, device=ids.device) * g).view(groups, 1, 1)
    representative = representative.view(num_rows, length)  # (B, S) batch row index
    nodes = representative * length + segment_end  # (B, S)
    token_nodes = nodes.gather(1, segment_ids.clamp(min=0))  # (B, T)
    return torch.where(valid, token_nodes, torch.full_like(token_nodes, -1))
