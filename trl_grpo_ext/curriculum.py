"""Curriculum GRPO: a token budget that shrinks over training ("Train Long, Think Short", arXiv 2508.08940).

The budget B(t) starts at `start`, drops `num_decays` times at equal intervals, and ends at `end`. It is written
into the prompt (`{budget}`), scores the completion's length (triangular reward, the paper's best; band reward, its
weaker alternative) and, optionally, caps generation.

>>> [budget_at(s, start=256, end=87, num_decays=3, total_steps=600) for s in (0, 150, 300, 450)]
[256, 179, 125, 87]
"""

from __future__ import annotations

import math

from transformers import TrainerCallback

SCHEDULES = ("exponential", "linear")


def check_schedule(*, start: int, end: int, num_decays: int, total_steps: int | None = None, schedule: str = "exponential"):
    """Raise a ValueError naming the field, the value and the fix if the schedule is not usable."""
    if schedule not in SCHEDULES:
        raise ValueError(f"budget_schedule={schedule!r} is not one of {SCHEDULES}.")
    for name, value in (("budget_start", start), ("budget_end", end)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a whole number of tokens, at least 1.")
    if end > start:
        raise ValueError(
            f"budget_end ({end}) is above budget_start ({start}): the budget shrinks over training; swap them, or set "
            "them equal for a fixed budget."
        )
    if isinstance(num_decays, bool) or not isinstance(num_decays, int) or num_decays < 1:
        raise ValueError(f"budget_decays={num_decays!r} must be at least 1 (the paper uses 3).")
    if total_steps is not None and total_steps < num_decays + 1:
        raise ValueError(
            f"total_steps={total_steps} is too short for budget_decays={num_decays}: each of the {num_decays + 1} "
            f"budget stages needs at least one step; train longer or decay fewer times."
        )


def budget_at(step: int, *, start: int, end: int, num_decays: int, total_steps: int, schedule: str = "exponential") -> int:
    """The token budget at `step`: B = round(start · d^k), k = min(floor(step / I), num_decays).

    I = total_steps / (num_decays + 1) and d = (end / start)^(1 / num_decays) (arXiv 2508.08940, §3: B(t) =
    max(1, B0 · d^floor(t/I))). The linear schedule drops by equal steps (start - end) / num_decays at the same
    points. The budget is `end` from the last drop to the end of training, and never below 1.
    """
    check_schedule(start=start, end=end, num_decays=num_decays, total_steps=total_steps, schedule=schedule)
    interval = total_steps / (num_decays + 1)
    k = min(math.floor(step / interval), num_decays)
    if schedule == "exponential":
        budget = start * (end / start) ** (k / num_decays)
    else:
        budget = start - k * (start - end) / num_decays
    return max(1, round(budget))


def triangular_length_score(length: int, budget: int, r_max: float = 1.0) -> float:
    """Triangular length reward (arXiv 2508.08940, eq. 4): r_max·l/L if l ≤ L; r_max·(1 − (l−L)/L) if L < l ≤ 2L; 0.

    >>> triangular_length_score(50, 100), triangular_length_score(100, 100), triangular_length_score(150, 100)
    (0.5, 1.0, 0.5)
    """
    if budget < 1:
        raise ValueError(f"budget={budget} must be at least 1 token.")
    if length <= budget:
        return r_max * length / budget
    if length <= 2 * budget:
        return r_max * (1 - (length - budget) / budget)
    return 0.0


def band_length_score(length: int, budget: int, r_max: float = 1.0, width: float = 0.5) -> float:
    """Band length reward, the paper's weaker alternative: r_max when (1 − width)·L ≤ l ≤ L, else 0.

    The paper does not give the band's exact edges; we read it as "use most of the budget without exceeding it",
    with `width` the fraction of the budget below L that still scores.

    >>> band_length_score(60, 100), band_length_score(40, 100), band_length_score(101, 100)
    (1.0, 0.0, 0.0)
    """
    if budget < 1:
        raise ValueError(f"budget={budget} must be at least 1 token.")
    if not 0 < width <= 1:
        raise ValueError(f"width={width} must be in (0, 1].")
    return r_max if (1 - width) * budget <= length <= budget else 0.0


class TokenBudgetCurriculum(TrainerCallback):
    """The shrinking token budget, as a callback for any of our trainers.

    At every step it computes B(t) from the trainer's global step (so a resumed run continues the schedule) and sets
    the trainer's `budget` prompt field: `{budget}` in prompts is replaced by it, and reward functions receive it as
    the `budget` column (the `budget_length` reward scores against it). It logs `curriculum/budget` and, with
    `cap_generation=True`, caps generation (`max_completion_length` everywhere TRL keeps it) at B(t).

    Args:
        budget_start, budget_end, budget_decays, schedule: the schedule (see `budget_at`); the paper: 256 → 87, 3.
        total_steps: steps the schedule spans; default: the run's `max_steps`.
        cap_generation: also cap generation at the budget.
    """

    def __init__(
        self,
        budget_start: int = 256,
        budget_end: int = 87,
        budget_decays: int = 3,
        schedule: str = "exponential",
        total_steps: int | None = None,
        cap_generation: bool = False,
    ):
        check_schedule(start=budget_start, end=budget_end, num_decays=budget_decays, total_steps=total_steps,
                       schedule=schedule)  # fmt: skip
        self.budget_start, self.budget_end, self.budget_decays = budget_start, budget_end, budget_decays
        self.schedule, self.total_steps, self.cap_generation = schedule, total_steps, cap_generation
        self.trainer = None
        self.budget = budget_start

    def attach(self, trainer) -> TokenBudgetCurriculum:
        """Hand over the trainer (callbacks get the model, not the trainer); our trainers call this for you."""
        self.trainer = trainer
        return self

    def budget_at_step(self, step: int, max_steps: int) -> int:
        total = self.total_steps or max_steps
        return budget_at(step, start=self.budget_start, end=self.budget_end, num_decays=self.budget_decays,
                         total_steps=total, schedule=self.schedule)  # fmt: skip

    def on_train_begin(self, args, state, control, **kwargs):
        self._update(state)

    def on_step_begin(self, args, state, control, **kwargs):
        self._update(state)

    def _update(self, state):
        if self.trainer is None:
            raise RuntimeError(
                "TokenBudgetCurriculum has no trainer: pass it in `callbacks=[...]` or `add_callback` of a trl_grpo_ext "
                "trainer (they hand themselves over), or call `curriculum.attach(trainer)`."
            )
        self.budget = self.budget_at_step(state.global_step, state.max_steps)
        self.trainer.prompt_fields["budget"] = self.budget
        if self.cap_generation:
            self.trainer.set_generation_cap(self.budget)
        self.trainer.log_metric("curriculum/budget", self.budget)
