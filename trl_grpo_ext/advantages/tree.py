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
    so, e.g. owner row · T + position, as `RolloutBatch.node_ids` builds them). The function cannot check it.

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


def tree_estimator(batch) -> torch.Tensor:
    """The `"tree"` estimator: every token gets the mean of TRL's row advantages over the rows that share its node.

    On a batch whose rows share no tokens this is TRL's advantage on every token; on a PTA or ARPO rollout it is the
    "hard" credit of a shared edge, given to each copy of it.
    """
    return tree_token_advantages(batch.advantages, batch.node_ids)
