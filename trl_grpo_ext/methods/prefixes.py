"""Per-row prefixes from dataset columns: text that joins the prompt as context, or starts the completion.

`context_prefix_column` names a column whose text is appended to the tokenised prompt (after the chat template's
assistant header): the policy generates after it and it is not trained. `completion_prefix_column` names a column
whose text starts the completion: the policy continues it, it is trained, and reward functions see it as the start
of the completion. Both are a `PrefixColumns` extension, so they compose with every other method: a PTA plan is
generated after the context, an ARPO rollout continues the completion prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..extension import Extension, Method, TrainerInputs, register_method
from ..rollout import RolloutPlan


@dataclass
class PrefixColumnsConfig:
    """Config section: generation from per-row prefixes held in dataset columns.

    > Parameters that control generation from per-row prefixes (`trl_grpo_ext.methods.prefixes`)

    context_prefix_column (`str`, *optional*):
        Dataset column holding text appended to each prompt before generation as context: the policy generates
        after it, and it is not trained (a teacher's prefix, a draft to refine).
    completion_prefix_column (`str`, *optional*):
        Dataset column holding text that starts each completion: the policy continues it, and it is trained as
        part of the completion (segment 0; the generated continuation is segment 1).
    """

    context_prefix_column: str | None = field(
        default=None,
        metadata={
            "help": "Dataset column with text appended to each prompt as context before generation (not trained)."
        },
    )
    completion_prefix_column: str | None = field(
        default=None,
        metadata={
            "help": "Dataset column with text that starts each completion; the policy continues it and it is trained."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        for name in ("context_prefix_column", "completion_prefix_column"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name}={value!r} must be a dataset column name, or None to switch it off.")
        if self.context_prefix_column is not None and self.context_prefix_column == self.completion_prefix_column:
            raise ValueError(
                f"context_prefix_column and completion_prefix_column are both {self.context_prefix_column!r}; a prefix "
                "is either context (not trained) or part of the completion (trained): set only one."
            )


class PrefixColumns(Extension):
    """Tokenises each row's prefix columns (`add_special_tokens=False`; None or "" means no prefix) into the plan."""

    name = "prefix_columns"

    def __init__(self, context_column: str | None, completion_column: str | None):
        self.columns = {"context_prefix_column": context_column, "completion_prefix_column": completion_column}

    def check(self, inputs: TrainerInputs) -> None:
        names = getattr(inputs.train_dataset, "column_names", None)
        for option, column in self.columns.items():
            if column is not None and names is not None and column not in names:
                raise ValueError(
                    f"{option}={column!r}, but the training dataset has no such column (columns: {names}); add the "
                    "column or unset the field."
                )

    def prepare(self, plan: RolloutPlan) -> None:
        for option, column in self.columns.items():
            if column is None:
                continue
            if column not in plan.rows[0]:
                raise KeyError(
                    f"{option}={column!r}, but the dataset has no such column (columns: {sorted(plan.rows[0])}); add "
                    "the column or unset the field."
                )
            texts = [row[column] or "" for row in plan.rows]
            ids = [self.trainer.tokenizer(t, add_special_tokens=False)["input_ids"] if t else [] for t in texts]
            (plan.add_context if option == "context_prefix_column" else plan.add_prefix)(ids)


def _from_config(args) -> PrefixColumns | None:
    context = getattr(args, "context_prefix_column", None)
    completion = getattr(args, "completion_prefix_column", None)
    if context is None and completion is None:
        return None
    return PrefixColumns(context, completion)


register_method(Method(name="prefix_columns", title="Generation from per-row prefixes", arxiv=None,
                       extension=_from_config))  # fmt: skip
