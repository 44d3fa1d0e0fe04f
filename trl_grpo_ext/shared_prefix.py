"""Shared-prefix forward: a token that several rows of a micro-batch share runs through the model once.

TRL's loss runs the model over `prompt_ids + completion_ids` of every row, so the G rows of a group repeat their
prompt, and tree rows repeat more: a PTA plan shared by z continuations, an ARPO branch's parent trajectory up to the
branch point. The idea of PrefixGrouper (arXiv 2506.05433) is to lay a group out as one sequence, the shared prefix
once and every suffix after it, with an attention mask that lets each suffix see the prefix and itself. Here the same
idea is taken one step further, to any tree: the rows of a micro-batch become a trie of tokens, laid out in pre-order
(a node, then its subtree), so that each token attends to exactly the tokens its row had before it:

- rows that share the whole prompt go into one packed row, the others into rows of their own (a dense mask over
  rows that only share a system prompt would cost more attention than the shared tokens save);
- two rows share the node of column c when they agree on columns 0..c+1: the label too, so that every node predicts
  one next token. A branch point's last token is therefore repeated once per branch (one token per row at most);
- a node's subtree is contiguous in pre-order, so token q may attend to token k exactly when
  `k <= q < subtree_end[k]`: an index-based mask function that transformers turns into the mask its attention
  implementation wants (`ALL_MASK_ATTENTION_FUNCTIONS`: boolean for sdpa, additive for eager);
- each token keeps the position it has in TRL's padded batch (its column), so rotary embeddings see what they see on
  the plain path, and the gradient of a shared token's log-prob is the sum over the rows that read it, as autograd
  sums it on the plain path.

The maths here is pure tensors; `GRPOExtTrainer._get_per_token_logps_and_entropies` runs the model on the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = [
    "SharedPrefixConfig",
    "PrefixTree",
    "prefix_tree",
    "tree_mask_function",
    "group_order",
    "check_shared_prefix_model",
    "ATTENTION",
]

# Attention implementations that take a custom 4D mask: transformers' `create_causal_mask` returns a 4D mask as it is.
ATTENTION = ("sdpa", "eager")


@dataclass
class SharedPrefixConfig:
    """Config section: the loss's forward pass over rows that share prefixes.

    > Parameters that control the loss's forward pass (`trl_grpo_ext.shared_prefix`)

    shared_prefix_forward (`bool`, *optional*, defaults to `False`):
        Run each token that several rows of a micro-batch share (the group's prompt, a PTA plan, an ARPO branch's
        parent prefix) through the model once, in the loss and in the old / reference log-probs, with a tree
        attention mask (the idea of PrefixGrouper, arXiv 2506.05433). Rows are then put into micro-batches by
        prompt (groups in random order) instead of TRL's row shuffle. The log-probs and gradients are the plain
        path's up to float rounding. Needs `attn_implementation` "sdpa" or "eager" and a model with full attention
        in every layer; see docs/benchmarks.md for when it pays.
    """

    shared_prefix_forward: bool = field(
        default=False,
        metadata={
            "help": "Run tokens that rows of a micro-batch share (prompt, PTA plan, ARPO prefix) through the model "
            "once, with a tree attention mask (PrefixGrouper's idea); rows are grouped into micro-batches by prompt."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if not self.shared_prefix_forward:
            return
        kwargs = self.model_init_kwargs if isinstance(self.model_init_kwargs, dict) else {}  # TRL parsed JSON by now
        implementation = kwargs.get("attn_implementation")
        if implementation is not None and implementation not in ATTENTION:
            raise ValueError(
                f"shared_prefix_forward=True needs a custom 4D attention mask, which attn_implementation="
                f"{implementation!r} does not take; set model_init_kwargs['attn_implementation'] to one of "
                f"{list(ATTENTION)}, or shared_prefix_forward=False."
            )


@dataclass
class PrefixTree:
    """The packed layout of a micro-batch: P packed rows of N tokens, and where each row's log-probs are in it.

    `input_ids`, `position_ids`, `subtree_end` and `shift_labels` are (P, N); padding (after each packed row's
    `lengths` real tokens) attends to itself only and has label -100. `source` (B, K) is, for each row and completion
    column, the flat index into a (P, N) output of the token that predicts it, or -1 where the plain path's log-prob
    is 0 (padding). `tokens` is the number of real tokens (`lengths.sum()`), `row_tokens` the non-padding tokens of
    the B rows, as TRL's forward sees them.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    subtree_end: torch.Tensor
    shift_labels: torch.Tensor
    source: torch.Tensor
    lengths: torch.Tensor
    row_tokens: int

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """(P, N) per-token values of the packed rows -> (B, K), 0 where `source` is -1 (as TRL's are on padding)."""
        picked = values.reshape(-1)[self.source.clamp(min=0)]
        return torch.where(self.source >= 0, picked, torch.zeros((), dtype=values.dtype, device=values.device))


def prefix_tree(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> PrefixTree:
    """Lay the rows of TRL's `prompt_ids + completion_ids` batch out as a token trie in pre-order (see module doc).

    Args:
        input_ids: (B, L) prompt (left-padded) and completion (right-padded) ids, as TRL's loss builds them.
        attention_mask: (B, L) 1 on real tokens.
        logits_to_keep: K, the completion columns (the last K), whose tokens get log-probs.

    Rows are compared by their padded content, so rows share a token only at the same column (position). Below,
    the first two rows share the prompt `5 6` and the first completion token 7, which predicts 8 in one and 9 in the
    other, so 7 is laid out twice; the third row has another prompt and a packed row of its own:

    >>> ids = torch.tensor([[0, 5, 6, 7, 8], [0, 5, 6, 7, 9], [3, 5, 6, 7, 8]])
    >>> tree = prefix_tree(ids, torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]), logits_to_keep=2)
    >>> tree.input_ids.tolist()  # 0 pads the second packed row
    [[5, 6, 7, 8, 7, 9], [3, 5, 6, 7, 8, 0]]
    >>> tree.subtree_end.tolist()  # the second 7 (q = 4) sees 5 6 (k <= q < end[k]) and itself, not 7 8
    [[6, 6, 4, 4, 6, 6], [5, 5, 5, 5, 5, 6]]
    >>> tree.source.tolist()  # per row and completion column, the flat index in (P, N) of the token predicting it
    [[1, 2], [1, 4], [8, 9]]
    """
    width = input_ids.size(1)
    prompt_width = width - logits_to_keep
    if prompt_width < 1:
        raise ValueError(f"logits_to_keep ({logits_to_keep}) leaves no prompt column of the {width} columns.")
    device = input_ids.device
    valid = attention_mask.bool()
    key = input_ids.masked_fill(~valid, -1)
    unique, row_of = torch.unique(key, dim=0, return_inverse=True)  # (U, L) in lexicographic order: a trie's DFS
    count_rows = unique.size(0)
    real = unique >= 0
    cols = torch.arange(width, device=device)

    # lcp[i]: columns row i shares with row i - 1 (padding included, so a shared token is at the same column).
    same = torch.zeros_like(real)
    same[1:] = unique[1:] == unique[:-1]
    lcp = same.long().cumprod(1).sum(1)  # (U,)
    starts_packed_row = lcp < prompt_width  # another prompt: another packed row
    starts_packed_row[0] = True
    # Row i's own nodes start at column lcp - 1: the node of column c is shared only if column c + 1 is too.
    start = torch.where(starts_packed_row, 0, (lcp - 1).clamp(min=0))  # (U,)
    own = real & (cols >= start[:, None])  # (U, L) the nodes row i adds to the trie
    first = torch.cumsum(own.sum(1), 0) - own.sum(1)  # (U,) pre-order index of each row's first own node
    ends_at = torch.cat([first, own.sum().view(1)])  # (U + 1,) with the total at the end
    index = first[:, None] + own.long().cumsum(1) - 1  # (U, L) pre-order index of own nodes

    # The row that owns the node of (i, c): the last row j <= i whose own nodes reach back to column c.
    introduces = start[:, None] <= cols  # (U, L)
    row_ids = torch.arange(count_rows, device=device)[:, None].expand(count_rows, width)
    owner = torch.where(introduces, row_ids, -1).cummax(0).values  # (U, L)
    node = index.gather(0, owner.clamp(min=0))  # (U, L) pre-order index of every real token's node
    # A node's subtree ends where the next row that introduces its column (or a new packed row) begins.
    after = torch.where(introduces, row_ids, count_rows).flip(0).cummin(0).values.flip(0)  # first k >= i
    after = torch.cat([after[1:], torch.full((1, width), count_rows, device=device)])  # first k > i
    end = ends_at[after]  # (U, L)

    next_token = torch.cat([unique[:, 1:], torch.full((count_rows, 1), -1, device=device)], dim=1)
    label = torch.where((cols + 1 >= prompt_width) & (next_token >= 0), next_token, -100)

    packed_row_of_row = starts_packed_row.long().cumsum(0) - 1  # (U,)
    packed = packed_row_of_row[:, None].expand(count_rows, width)[own]  # (T,) packed row of each node
    offset = first[starts_packed_row][packed]  # (T,) pre-order index of its packed row's first node
    local = torch.arange(packed.numel(), device=device) - offset
    lengths = torch.bincount(packed, minlength=int(starts_packed_row.sum()))
    count_packed, size = lengths.numel(), int(lengths.max())

    def layout(values: torch.Tensor, padding: int | torch.Tensor) -> torch.Tensor:  # (T,) -> (P, N)
        out = torch.empty((count_packed, size), dtype=values.dtype, device=device)
        out[:] = padding
        out[packed, local] = values
        return out

    pad_positions = torch.arange(size, device=device).expand(count_packed, size)
    input_ids_packed = layout(unique[own], 0)
    positions = layout(cols.expand(count_rows, width)[own], 0)
    subtree_end = layout(end[own] - offset, pad_positions + 1)  # padding attends to itself only
    shift_labels = layout(label[own], -100)

    flat = packed * size + local  # (T,) flat index of each node in a (P, N) output
    predicted = real[:, prompt_width - 1 : -1] & real[:, prompt_width:]  # (U, K) token and its predecessor real
    source = torch.where(predicted, flat[node[:, prompt_width - 1 : -1].clamp(min=0)], -1)
    return PrefixTree(input_ids_packed, positions, subtree_end, shift_labels, source[row_of], lengths,
                      int(valid.sum()))  # fmt: skip


def check_shared_prefix_model(config) -> None:
    """Raise unless a model with this config takes the tree mask as it is, in every layer.

    The mask goes to every layer unchanged (transformers' `create_causal_mask` returns a 4D mask as it is), so
    sliding-window or chunked layers would see more than their window; flash attention takes no 4D mask at all.
    """
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ATTENTION:
        raise ValueError(
            f"shared_prefix_forward=True needs a custom 4D attention mask, which the model's attn_implementation="
            f"{implementation!r} does not take; load the model with attn_implementation in {list(ATTENTION)} "
            "(model_init_kwargs={'attn_implementation': 'sdpa'}), or set shared_prefix_forward=False."
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = sorted(set(getattr(text, "layer_types", None) or []) - {"full_attention"})
    window = getattr(text, "sliding_window", None) if getattr(text, "use_sliding_window", True) else None
    if layers or (not getattr(text, "layer_types", None) and window is not None):
        raise ValueError(
            f"shared_prefix_forward=True needs full attention in every layer, but the model ({text.model_type}) has "
            f"{', '.join(layers) or f'sliding_window={window}'} layers, whose own masks a tree mask would replace; "
            "set shared_prefix_forward=False for this model."
        )


def tree_mask_function(subtree_end: torch.Tensor) -> Callable:
    """transformers' mask function of a pre-order token tree: query q sees key k when `k <= q < subtree_end[b, k]`.

    Index-based, so `sdpa_mask` broadcasts it without vmap; `ALL_MASK_ATTENTION_FUNCTIONS[implementation]` builds
    the (P, 1, N, N) mask in the form the attention implementation takes.
    """

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < subtree_end[batch_idx, kv_idx])

    return inner_mask


def group_order(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                completion_mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """A row order that keeps rows with the same prompt together, groups in their order of first appearance.

    TRL shuffles the rows of a generation batch before it cuts it into micro-batches; applied to the shuffled rows,
    this order keeps the groups' random order and puts each group's rows next to each other, sorted by completion
    so that rows sharing a completion prefix (a plan) fall into the same micro-batch when a group spans two.

    >>> prompts = torch.tensor([[1, 2], [3, 4], [1, 2], [3, 4]])
    >>> group_order(prompts, torch.ones(4, 2), torch.tensor([[9], [8], [7], [6]]), torch.ones(4, 1)).tolist()
    [2, 0, 3, 1]
    """
    prompt = prompt_ids.masked_fill(prompt_mask == 0, -1)
    whole = torch.cat([prompt, completion_ids.masked_fill(completion_mask == 0, -1)], dim=1)
    _, group = torch.unique(prompt, dim=0, return_inverse=True)
    rows = torch.arange(group.numel(), device=group.device)
    first_seen = torch.full_like(group, group.numel()).scatter_reduce(0, group, rows, reduce="amin")
    _, content = torch.unique(whole, dim=0, return_inverse=True)  # lexicographic rank of each row
    return torch.argsort(first_seen[group] * group.numel() + content, stable=True)
