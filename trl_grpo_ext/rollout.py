"""The rollout record: what one generation batch holds, per row, and the tree its rows form.

A rollout is a path through a tree (docs/index.md). GRPO's G completions of a prompt are G leaves under one root;
PTA-GRPO's continuations share their plan; an ARPO branch repeats its parent's trajectory up to a tool result and
then goes its own way. Every row here is a **whole trajectory** (reward functions see it as an unbranched rollout
would be seen); the tree says which leading completion tokens of a row are the same tokens as another row's:

- `parents[b]`: the row whose first `shared[b]` completion tokens row b repeats, or -1 for a root;
- `owners` (B, T): for every completion token, the row that generated it (a root for its own tokens, the parent's
  owner for the shared ones). Tokens with the same owner and position are one tree node, and
  `tree_token_advantages` gives each of them the mean advantage of the rows that share it.

Only `trl_grpo_ext/trainer.py` converts a `Rollout` to and from TRL's tuples; extensions build and read this record.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

__all__ = ["RolloutPlan", "Rollout", "token_owners", "turn_messages"]


@dataclass
class RolloutPlan:
    """The rows of the next generation batch and what each row is generated from.

    Extensions add to the per-row lists in their `prepare` hook, in pipeline order; several may add context to one
    row (a draft, then a hint): their token ids are concatenated.

    Attributes:
        rows: the dataset rows (dicts) of this process, in TRL's order: the `num_generations` rows of a prompt
            contiguous. Reward functions receive their columns. An extension may replace a row (a curriculum fills
            `{budget}` into the prompt); it never adds tree structure to it.
        mode: `"train"` or `"eval"`.
        num_generations: the group size G of this mode.
        context_ids: per row, token ids appended to the tokenised prompt: generated after, never trained.
        prefix_ids: per row, token ids that start the completion: the policy continues them and they are trained.
        notes: per-row values an extension keeps for its later hooks, `{key: [one value per row]}` (the tree node a
            Tree-OPO row starts from). Reward functions never see them; the scored batch carries them as
            `RolloutBatch.notes`, row for row.
    """

    rows: list[dict]
    mode: str
    num_generations: int
    context_ids: list[list[int]] = field(default_factory=list)
    prefix_ids: list[list[int]] = field(default_factory=list)
    notes: dict[str, list] = field(default_factory=dict)

    def __post_init__(self):
        self.context_ids = self.context_ids or [[] for _ in self.rows]
        self.prefix_ids = self.prefix_ids or [[] for _ in self.rows]

    def add_context(self, ids: list[list[int]]) -> None:
        """Append `ids[i]` to the context of row i (after what earlier extensions added)."""
        self._extend(self.context_ids, ids, "context")

    def add_prefix(self, ids: list[list[int]]) -> None:
        """Append `ids[i]` to the completion prefix of row i."""
        self._extend(self.prefix_ids, ids, "completion prefix")

    def select(self, rows: list[int]) -> RolloutPlan:
        """The plan of a subset of rows (in the given order), for a generation call over them."""
        return replace(
            self,
            rows=[self.rows[i] for i in rows],
            context_ids=[self.context_ids[i] for i in rows],
            prefix_ids=[self.prefix_ids[i] for i in rows],
            notes={key: [values[i] for i in rows] for key, values in self.notes.items()},
        )

    def note(self, key: str, values: list) -> None:
        """Keep one value per row under `key` for this batch's later hooks (`RolloutBatch.notes[key]`)."""
        if len(values) != len(self.rows):
            raise ValueError(f"note {key!r}: {len(values)} values for {len(self.rows)} rows; give one value per row.")
        self.notes[key] = list(values)

    def _extend(self, target: list[list[int]], ids: list[list[int]], what: str) -> None:
        if len(ids) != len(self.rows):
            raise ValueError(f"{len(ids)} {what} lists for {len(self.rows)} rows: give one list of token ids per row.")
        for row, extra in zip(target, ids, strict=True):
            row.extend(int(i) for i in extra)


@dataclass
class Rollout:
    """One generated batch of this process's rows, before scoring.

    Attributes:
        prompt_ids: per row, the prompt token ids the completion was generated after (context prefixes included).
        completion_ids: per row, the whole trajectory's token ids (completion prefix, generated and tool tokens).
        completions: per row, the decoded completion as reward functions see it (text, or a list of messages).
        tool_mask: per row and token, 1 on model tokens and 0 on tool-result tokens; None without tools.
        logprobs: per row and token, the backend's sampling log-prob (None where it has none); None if not kept.
        parents: per row, the row whose first `shared[b]` completion tokens it repeats, or -1. None: no sharing.
        shared: per row, how many leading completion tokens it shares with its parent (0 for a root).
        prefix_lengths: per row, leading completion tokens that were given, not generated (a completion prefix).
        adapters: per row, the LoRA adapter that generated it and that its loss trains (None: the policy's own);
            names from `trainer.add_adapters`. None: every row is the policy's.
        images, tool_images, extra_fields: TRL's, passed through.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    completions: list
    tool_mask: list[list[int]] | None = None
    logprobs: list[list[float | None]] | None = None
    parents: list[int] | None = None
    shared: list[int] | None = None
    prefix_lengths: list[int] | None = None
    adapters: list[str | None] | None = None
    images: list | None = None
    tool_images: list | None = None
    extra_fields: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.completion_ids)

    def check_tree(self) -> None:
        """Raise ValueError unless every row's shared tokens are its parent's, token for token."""
        if self.parents is None:
            return
        shared = self.shared or [0] * len(self)
        for row, (parent, n) in enumerate(zip(self.parents, shared, strict=True)):
            if parent < 0:
                if n:
                    raise ValueError(f"row {row} has no parent but shares {n} token(s) with it.")
                continue
            if parent == row or not 0 <= parent < len(self):
                raise ValueError(f"row {row} has parent {parent}, which is not another row of this batch.")
            if self.completion_ids[row][:n] != self.completion_ids[parent][:n] or n > len(self.completion_ids[parent]):
                raise ValueError(f"row {row} is said to share {n} token(s) with row {parent}, but they differ.")

    def roots(self) -> list[int]:
        """Per row, the root of its tree (itself for a root): the rows that share a PTA plan have one root."""
        parents = self.parents or [-1] * len(self)
        roots = []
        for row in range(len(self)):
            while parents[row] >= 0:
                row = parents[row]
            roots.append(row)
        return roots

    def owners(self, length: int) -> torch.Tensor:
        """(B, `length`) long: the row that generated each completion token (`token_owners`), -1 past the end."""
        lengths = [len(ids) for ids in self.completion_ids]
        return token_owners(self.parents or [-1] * len(self), self.shared or [0] * len(self), lengths, length)

    def take(self, rows: list[int]) -> Rollout:
        """The given rows, in that order; the tree is kept where both a row and its parent are taken."""
        position = {row: i for i, row in enumerate(rows)}
        parents = shared = None
        if self.parents is not None:
            parents, shared = [], []
            for row in rows:
                parent = self.parents[row]
                kept = parent in position
                parents.append(position[parent] if kept else -1)
                shared.append(self.shared[row] if kept else 0)

        def pick(values):
            return None if values is None else [values[i] for i in rows]

        return Rollout(
            prompt_ids=pick(self.prompt_ids),
            completion_ids=pick(self.completion_ids),
            completions=pick(self.completions),
            tool_mask=pick(self.tool_mask),
            logprobs=pick(self.logprobs),
            parents=parents,
            shared=shared,
            prefix_lengths=pick(self.prefix_lengths),
            adapters=pick(self.adapters),
            images=pick(self.images),
            tool_images=pick(self.tool_images),
            extra_fields={},
        )

    @staticmethod
    def concat(parts: list[Rollout]) -> Rollout:
        """The rows of `parts`, one after the other; parent indices are shifted with their part."""
        parts = [p for p in parts if len(p)]
        if not parts:
            raise ValueError("Rollout.concat needs at least one non-empty rollout.")

        def join(name):
            values = [getattr(p, name) for p in parts]
            if all(v is None for v in values):
                return None
            return [x for p, v in zip(parts, values, strict=True) for x in (v if v is not None else _blank(p, name))]

        parents, shared, offset = [], [], 0
        for part in parts:
            parents += [p + offset if p >= 0 else -1 for p in (part.parents or [-1] * len(part))]
            shared += part.shared or [0] * len(part)
            offset += len(part)
        tree = any(p >= 0 for p in parents)
        return Rollout(
            prompt_ids=join("prompt_ids"),
            completion_ids=join("completion_ids"),
            completions=join("completions"),
            tool_mask=join("tool_mask"),
            logprobs=join("logprobs"),
            parents=parents if tree else None,
            shared=shared if tree else None,
            prefix_lengths=join("prefix_lengths"),
            adapters=join("adapters"),
            images=join("images"),
            tool_images=join("tool_images"),
            extra_fields={},
        )


def _blank(part: Rollout, name: str) -> list:
    # What a part without this field contributes, so that rows stay aligned.
    if name == "tool_mask":
        return [[1] * len(ids) for ids in part.completion_ids]
    if name == "logprobs":
        return [[None] * len(ids) for ids in part.completion_ids]
    if name == "prefix_lengths":
        return [0] * len(part)
    return [None] * len(part)


def token_owners(parents: list[int], shared: list[int], lengths: list[int], width: int) -> torch.Tensor:
    """(B, width) long: for every completion token, the row that generated it; -1 past each row's length.

    Row b's first `shared[b]` tokens are its parent's tokens, so they have the parent's owner; its other tokens are
    its own. Tokens of two rows with the same owner at the same position are one node of the rollout tree.

    >>> token_owners(parents=[-1, 0, 1], shared=[0, 2, 3], lengths=[3, 4, 4], width=4)
    tensor([[ 0,  0,  0, -1],
            [ 0,  0,  1,  1],
            [ 0,  0,  1,  2]])
    """
    rows = len(lengths)
    positions = torch.arange(width).unsqueeze(0)  # (1, T)
    valid = positions < torch.tensor(lengths, dtype=torch.long).unsqueeze(1)  # (B, T)
    owners = torch.arange(rows).unsqueeze(1).expand(rows, width).clone()  # (B, T)
    parent = torch.tensor(parents, dtype=torch.long)  # (B,)
    inherits = (parent.unsqueeze(1) >= 0) & (positions < torch.tensor(shared, dtype=torch.long).unsqueeze(1))
    # A token's owner is its parent's owner at that position; one pass per tree level settles every chain.
    for _ in range(rows):
        updated = torch.where(inherits, owners[parent.clamp(min=0)], owners)
        if torch.equal(updated, owners):
            break
        owners = updated
    return torch.where(valid, owners, torch.full_like(owners, -1))


def turn_messages(completion: list, turns: int) -> list:
    """The messages of a conversational completion before its assistant turn number `turns` (0-based).

    A tool-calling completion is [assistant, tool, ..., assistant, tool, ..., assistant]: the trajectory up to the
    start of turn k is every message before the k-th assistant message.

    >>> turn_messages([{"role": "assistant"}, {"role": "tool"}, {"role": "assistant"}], 1)
    [{'role': 'assistant'}, {'role': 'tool'}]
    """
    seen = 0
    for index, message in enumerate(completion):
        if message.get("role", "assistant") == "assistant":
            if seen == turns:
                return list(completion[:index])
            seen += 1
    return list(completion)
