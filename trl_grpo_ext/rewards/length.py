"""Length rewards against a token budget (Curriculum GRPO, arXiv 2508.08940)."""

from __future__ import annotations

import re

from ..curriculum import band_length_score, triangular_length_score
from .format import completion_text

SHAPES = ("triangular", "band")
COUNTS = ("completion", "think")
_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


class BudgetLengthReward:
    """Scores each completion's length against the row's `budget` column, in the policy's tokens.

    The `budget` column comes from the dataset, or from `TokenBudgetCurriculum`, which sets it on every row to the
    current B(t). A picklable callable class, like TRL's own parameterised rewards.
    """

    def __init__(self, shape: str = "triangular", count: str = "completion", r_max: float = 1.0, width: float = 0.5,
                 tokenizer=None):  # fmt: skip
        if shape not in SHAPES:
            raise ValueError(f"budget_length: shape={shape!r} is not one of {SHAPES}.")
        if count not in COUNTS:
            raise ValueError(f"budget_length: count={count!r} is not one of {COUNTS}.")
        if not 0 < float(width) <= 1:
            raise ValueError(f"budget_length: width={width!r} must be in (0, 1].")
        self.shape, self.count, self.r_max, self.width = shape, count, float(r_max), float(width)
        # With count="think" the think span is re-tokenised; our trainers fill this in with their tokenizer.
        self.tokenizer = tokenizer
        self.__name__ = f"budget_length_{shape}" + ("_think" if count == "think" else "")

    def length(self, completion, ids) -> int:
        if self.count == "think":
            match = _THINK.search(completion_text(completion))
            if match is not None:
                if self.tokenizer is None:
                    raise ValueError(
                        "budget_length(count='think') needs the policy's tokenizer: pass tokenizer=..., or use it "
                        "in a trl_grpo_ext trainer, which hands its own over."
                    )
                return len(self.tokenizer(match.group(1), add_special_tokens=False)["input_ids"])
        return len(ids)

    def __call__(self, completions, completion_ids, budget=None, **kwargs) -> list[float]:
        if budget is None:
            raise ValueError(
                "budget_length needs a `budget` column: add TokenBudgetCurriculum (or use CurriculumGRPOTrainer), or "
                "give the dataset a `budget` column."
            )
        scores = []
        for completion, ids, b in zip(completions, completion_ids, budget, strict=True):
            n = self.length(completion, ids)
            if self.shape == "triangular":
                scores.append(triangular_length_score(n, int(b), self.r_max))
            else:
                scores.append(band_length_score(n, int(b), self.r_max, self.width))
        return scores
