"""`RolloutBatch`: what advantage estimators see after a generation batch has been scored."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RolloutBatch:
    """One scored generation batch, as an advantage estimator sees it.

    Rewards are gathered over all processes (N rows, the groups whole, in TRL's order: the `num_generations`
    completions of a prompt are contiguous), because group maths needs every member of a group. Token tensors hold
    this process's rows only (B rows); `process_slice` picks them out of N. On one process N == B.

    Shapes: N = rows on all processes, B = rows on this process, T = padded completion length, F = reward functions.
    """

    rewards: torch.Tensor  # (N,) weighted sum of the reward functions; NaN where every function returned None
    rewards_per_func: torch.Tensor  # (N, F) raw scores, NaN where a function returned None
    reward_func_names: list[str]
    reward_weights: torch.Tensor  # (F,)
    num_generations: int
    process_slice: slice
    advantages: torch.Tensor  # (B,) TRL's own group advantages for this process's rows
    completion_ids: torch.Tensor  # (B, T)
    completion_mask: torch.Tensor  # (B, T) 1 on real tokens, 0 on padding
    tool_mask: torch.Tensor | None = None  # (B, T) 1 on model tokens, 0 on tool / environment tokens
    segment_ids: torch.Tensor | None = None  # (B, T) long, -1 on padding
    prompts: list = field(default_factory=list)  # (B,) prompts, as the reward functions saw them
    completions: list = field(default_factory=list)  # (B,) decoded completions
    columns: dict[str, list] = field(default_factory=dict)  # dataset columns of this process's rows
    old_per_token_logps: torch.Tensor | None = None  # (B, T) when TRL computed them
    ref_per_token_logps: torch.Tensor | None = None  # (B, T) when beta != 0
    mode: str = "train"
    step: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # what an extension hands its estimator

    @property
    def group_ids(self) -> torch.Tensor:
        """(N,) long: the group (prompt) index of every row on all processes."""
        n = self.rewards.numel()
        return torch.arange(n, device=self.rewards.device) // self.num_generations

    @property
    def loss_mask(self) -> torch.Tensor:
        """(B, T): the tokens the loss sees (completion mask times tool mask)."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask

    def local(self, values: torch.Tensor) -> torch.Tensor:
        """This process's rows of a tensor over all N rows."""
        return values[self.process_slice]
