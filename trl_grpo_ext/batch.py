"""`RolloutBatch`: one scored generation batch, as advantage estimators and extensions see it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .rollout import Rollout


@dataclass
class RolloutBatch:
    """One scored generation batch.

    Rewards are gathered over all processes (N rows, the groups whole, in TRL's order: the `num_generations`
    completions of a prompt are contiguous), because group maths needs every member of a group. Token tensors hold
    this process's rows only (B rows); `process_slice` picks them out of N. On one process N == B.

    Shapes: N = rows on all processes, B = rows on this process, T = padded completion length, F = reward functions.
    Rows added after scoring (`trainer.add_rows`, BiCC's conditioned rows) follow the B scored rows in the token
    tensors and per-row lists; rewards and `local(...)` cover the scored rows only.

    `advantages` is TRL's own result and stays as it is. What the loss will use is written with `set_advantages`,
    `scale_loss_weights` and `drop_rows` (by the advantage estimator, then by each extension's `after_scoring`).
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
    segment_ids: torch.Tensor | None = None  # (B, T) long: 0 on a given completion prefix, 1 after, -1 on padding
    owners: torch.Tensor | None = None  # (B, T) long: the row that generated each token (see `rollout.py`), -1 pad
    prompts: list = field(default_factory=list)  # (B,) prompts, as the reward functions saw them
    completions: list = field(default_factory=list)  # (B,) decoded completions
    columns: dict[str, list] = field(default_factory=dict)  # dataset columns of this process's rows
    old_per_token_logps: torch.Tensor | None = None  # (B, T) when TRL computed them
    ref_per_token_logps: torch.Tensor | None = None  # (B, T) when beta != 0
    mode: str = "train"
    step: int = 0
    rollout: Rollout | None = None  # the generation record these rows came from
    extra: dict[str, Any] = field(default_factory=dict)  # what an extension hands later hooks or its estimator
    notes: dict[str, list] = field(default_factory=dict)  # (B,) per-row values from `RolloutPlan.note`, row for row
    loss_advantages: torch.Tensor | None = None  # (B,) or (B, T) once set; None: TRL's `advantages`
    loss_weights: torch.Tensor | None = None  # (B, T) float, multiplied into the loss mask
    dropped: torch.Tensor | None = None  # (B,) bool: rows taken out of the loss
    seq_log_ratio: torch.Tensor | None = None  # (N,) log pi_theta(o|q) - log pi_ref(o|q), when the estimator asks
    added_from: list[int] = field(default_factory=list)  # per row added after scoring, the scored row it repeats
    metrics: dict[str, float] = field(default_factory=dict)  # scalars the estimator logs (once the batch is scored)
    _output: dict | None = field(default=None, repr=False)  # TRL's output dict (trainer.py reads and writes it)

    @property
    def num_scored(self) -> int:
        """This process's scored rows: the first `num_scored` rows; rows added after scoring (`add_rows`) follow."""
        return self.completion_ids.size(0) - len(self.added_from)

    @property
    def group_ids(self) -> torch.Tensor:
        """(N,) long: the group (prompt) index of every row on all processes."""
        n = self.rewards.numel()
        return torch.arange(n, device=self.rewards.device) // self.num_generations

    @property
    def loss_mask(self) -> torch.Tensor:
        """(B, T): the tokens the loss sees (completion mask times tool mask)."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask

    @property
    def node_ids(self) -> torch.Tensor:
        """(B, T) long: the rollout-tree node of every token, -1 on padding (owner row · T + position).

        Rows that share tokens (a PTA plan, an ARPO branch's prefix) carry the same ids on them; with no tree every
        row's tokens are its own. Ids are unique over this process's batch; trees never span processes.
        """
        rows, length = self.completion_ids.shape
        owners = self.owners
        if owners is None:
            owners = torch.arange(rows, device=self.completion_ids.device).unsqueeze(1).expand(rows, length)
        positions = torch.arange(length, device=owners.device).unsqueeze(0)
        nodes = owners.to(positions.device) * length + positions
        return torch.where((owners >= 0) & self.completion_mask.bool(), nodes, torch.full_like(nodes, -1))

    @property
    def current_advantages(self) -> torch.Tensor:
        """What the loss would use now: the last `set_advantages`, else TRL's."""
        return self.advantages if self.loss_advantages is None else self.loss_advantages

    def local(self, values: torch.Tensor) -> torch.Tensor:
        """This process's rows of a tensor over all N rows."""
        return values[self.process_slice]

    def set_advantages(self, advantages: torch.Tensor, source: str = "an extension") -> None:
        """Set the advantages the loss uses: (B,) one per row, or (B, T) one per token. NaN becomes 0."""
        rows, length = self.completion_ids.shape
        if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) not in ((rows,), (rows, length)):
            shape = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
            raise ValueError(
                f"{source} returned advantages of shape {shape}; expected a tensor of shape ({rows},) or "
                f"({rows}, {length}) for this process's rows (use `batch.local(...)` on values computed over all rows)."
            )
        self.loss_advantages = torch.nan_to_num(advantages.to(self.completion_mask.device).float(), nan=0.0)

    def scale_loss_weights(self, weights: torch.Tensor, source: str = "an extension") -> None:
        """Multiply (B, T) per-token weights into the loss mask (0 takes a token out of the loss and its count)."""
        if tuple(weights.shape) != tuple(self.completion_ids.shape):
            raise ValueError(
                f"{source} returned loss weights of shape {tuple(weights.shape)}; expected "
                f"{tuple(self.completion_ids.shape)}."
            )
        weights = weights.to(self.completion_mask.device).float()
        self.loss_weights = weights if self.loss_weights is None else self.loss_weights * weights

    def drop_rows(self, rows: torch.Tensor) -> None:
        """Take the rows where `rows` (B,) is True out of the loss; the loss is then normalised over the others."""
        rows = rows.to(self.completion_mask.device).bool()
        self.dropped = rows if self.dropped is None else self.dropped | rows
