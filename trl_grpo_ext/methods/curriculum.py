"""Curriculum GRPO: a token budget that shrinks over training ("Train Long, Think Short", arXiv 2508.08940).

The budget B(t) starts at `start`, drops `num_decays` times at equal intervals, and ends at `end`. It is written
into the prompt (`{budget}`), scores the completion's length (triangular reward, the paper's best; band reward, its
weaker alternative) and, optionally, caps generation. A budget that nothing reads is an error before the model
loads: it would be logged while training exactly like plain GRPO.

>>> [budget_at(s, start=256, end=87, num_decays=3, total_steps=600) for s in (0, 150, 300, 450)]
[256, 179, 125, 87]
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

from transformers import TrainerCallback

from ..extension import Extension, Method, TrainerInputs, register_method
from ..rewards import completion_text, register_reward
from ..rollout import RolloutPlan

SCHEDULES = ("exponential", "linear")
SHAPES = ("triangular", "band")
COUNTS = ("completion", "think")
FIELD = "{budget}"


def think_span(text: str) -> str | None:
    """The text between the first `<think>` and the first `</think>` after it, or None (what the regex
    `<think>(.*?)</think>` finds, in linear time: the regex retries from every `<think>` of an unclosed text).

    >>> think_span("<think>a</think> b <think>c</think>"), think_span("<think>" * 3)
    ('a', None)
    """
    start = text.find("<think>")
    end = text.find("</think>", start + len("<think>")) if start >= 0 else -1
    return None if end < 0 else text[start + len("<think>") : end]


def check_schedule(
    *, start: int, end: int, num_decays: int, total_steps: int | None = None, schedule: str = "exponential"
):
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
            f"the budget schedule from budget_start={start} spans {total_steps} step(s) (budget_total_steps, or "
            f"max_steps), too few for budget_decays={num_decays}: each of the {num_decays + 1} budget stages needs at "
            "least one step; train longer or decay fewer times."
        )


def budget_at(
    step: int, *, start: int, end: int, num_decays: int, total_steps: int, schedule: str = "exponential"
) -> int:
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
            span = think_span(completion_text(completion))
            if span is not None:
                if self.tokenizer is None:
                    raise ValueError(
                        "budget_length(count='think') needs the policy's tokenizer: pass tokenizer=..., or use it "
                        "in a trl_grpo_ext trainer, which hands its own over."
                    )
                span = span.encode("utf-8", "replace").decode("utf-8")  # a lone surrogate would stop the tokenizer
                return len(self.tokenizer(span, add_special_tokens=False)["input_ids"])
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


register_reward("budget_length", BudgetLengthReward, factory=True)


@dataclass
class CurriculumConfig:
    """Config section: Curriculum GRPO's token budget ("Train Long, Think Short", arXiv 2508.08940).

    > Parameters of Curriculum GRPO (token budget; arXiv 2508.08940; `trl_grpo_ext.methods.curriculum`)

    budget_start (`int`, *optional*):
        Token budget at the start of training. Setting it switches the curriculum on (`TokenBudgetCurriculum`):
        `{budget}` in prompts is replaced by the current budget, reward functions get a `budget` column, and
        `curriculum/budget` is logged. Something must act on it (a reward that reads `budget`, `{budget}` in the
        prompts, or `budget_caps_generation`), or the trainer raises before the model loads. The paper: 256.
    budget_end (`int`, *optional*, defaults to `87`):
        Token budget after the last decay. The paper: 87.
    budget_decays (`int`, *optional*, defaults to `3`):
        Number of drops, at equal intervals of `total_steps / (budget_decays + 1)`. The paper: 3.
    budget_schedule (`str`, *optional*, defaults to `"exponential"`):
        `"exponential"` (B = start · d^k, the paper's) or `"linear"` (equal drops).
    budget_total_steps (`int`, *optional*):
        Steps the schedule spans; default: the run's `max_steps`.
    budget_caps_generation (`bool`, *optional*, defaults to `False`):
        Also cap generation at the budget (`max_completion_length` for transformers and vLLM).
    budget_length_shape (`str`, *optional*, defaults to `"triangular"`):
        Length reward of `CurriculumGRPOTrainer`: `"triangular"` (the paper's best) or `"band"`.
    budget_length_count (`str`, *optional*, defaults to `"completion"`):
        What the length reward counts: the whole completion, or only the `<think>` span (the paper is ambiguous).
    """

    budget_start: int | None = field(
        default=None,
        metadata={"help": "Token budget at the start (switches the Curriculum GRPO token budget on). Paper: 256."},
    )
    budget_end: int = field(default=87, metadata={"help": "Token budget after the last decay. Paper: 87."})
    budget_decays: int = field(default=3, metadata={"help": "Number of budget drops, at equal intervals. Paper: 3."})
    budget_schedule: str = field(
        default="exponential", metadata={"help": "Budget schedule.", "choices": list(SCHEDULES)}
    )
    budget_total_steps: int | None = field(
        default=None, metadata={"help": "Steps the budget schedule spans (default: max_steps)."}
    )
    budget_caps_generation: bool = field(
        default=False, metadata={"help": "Also cap generation (max_completion_length) at the current budget."}
    )
    budget_length_shape: str = field(
        default="triangular",
        metadata={"help": "Length reward of CurriculumGRPOTrainer.", "choices": list(SHAPES)},
    )
    budget_length_count: str = field(
        default="completion", metadata={"help": "What the length reward counts.", "choices": list(COUNTS)}
    )

    def __post_init__(self):
        super().__post_init__()
        for name, choices in (("budget_length_shape", SHAPES), ("budget_length_count", COUNTS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {choices}.")
        total = self.budget_total_steps
        if total is not None and total < 1:
            raise ValueError(
                f"budget_total_steps={total!r} must be a whole number >= 1, or None for the run's max_steps."
            )
        if self.budget_start is not None:
            total = total or (self.max_steps if self.max_steps > 0 else None)
            check_schedule(start=self.budget_start, end=self.budget_end, num_decays=self.budget_decays,
                           total_steps=total, schedule=self.budget_schedule)  # fmt: skip


class TokenBudgetCurriculum(Extension, TrainerCallback):
    """The shrinking token budget, as an extension of any of our trainers (and a callback for its step events).

    At every step it computes B(t) from the trainer's global step (so a resumed run continues the schedule). Each
    batch's rows get it: `{budget}` in their prompts is replaced by it, and reward functions receive it as the
    `budget` column (the `budget_length` reward scores against it). It logs `curriculum/budget` and, with
    `cap_generation=True`, caps generation (`max_completion_length` everywhere TRL keeps it) at B(t).

    Switch it on with the `budget_*` config fields, or pass it in `callbacks=[...]` (not both). Before the model
    loads it checks that something acts on the budget (the cap, a reward that reads `budget`, or `{budget}` in the
    prompts); otherwise it raises.

    Args:
        budget_start, budget_end, budget_decays, schedule: the schedule (see `budget_at`); the paper: 256 → 87, 3.
        total_steps: steps the schedule spans; default: the run's `max_steps`.
        cap_generation: also cap generation at the budget.
    """

    name = "curriculum"
    columns = ("budget",)  # added to every row: reward functions may require it

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
        self.budget = budget_start
        self._in_prompts: bool | None = None  # unknown until a dataset is seen

    def check(self, inputs: TrainerInputs) -> None:
        if self.cap_generation or any(_reads_budget(f) for f in inputs.reward_funcs or []):
            return
        dataset = inputs.train_dataset
        if (
            hasattr(dataset, "__len__")
            and hasattr(dataset, "__getitem__")
            and "prompt" in getattr(dataset, "column_names", [])
        ):
            self._in_prompts = any(FIELD in _text(dataset[i]["prompt"]) for i in range(min(len(dataset), 64)))
            if not self._in_prompts:
                raise ValueError(_NOTHING_USES_IT.format(start=self.budget_start))

    def budget_at_step(self, step: int, max_steps: int) -> int:
        total = self.total_steps or max_steps
        return budget_at(step, start=self.budget_start, end=self.budget_end, num_decays=self.budget_decays,
                         total_steps=total, schedule=self.schedule)  # fmt: skip

    def on_train_begin(self, args, state, control, **kwargs):
        check_schedule(start=self.budget_start, end=self.budget_end, num_decays=self.budget_decays,
                       total_steps=self.total_steps or state.max_steps, schedule=self.schedule)  # fmt: skip
        self._update(state)

    def on_step_begin(self, args, state, control, **kwargs):
        self._update(state)

    def _update(self, state) -> None:
        self.budget = self.budget_at_step(state.global_step, state.max_steps)
        if self.cap_generation:
            self.trainer.set_generation_cap(self.budget)
        self.log("budget", self.budget, mode="train")

    def prepare(self, plan: RolloutPlan) -> None:
        if self._in_prompts is None and not self.cap_generation:
            rewards = self.trainer.reward_funcs
            self._in_prompts = any(FIELD in _text(row.get("prompt")) for row in plan.rows)
            if not self._in_prompts and not any(_reads_budget(f) for f in rewards):
                raise ValueError(_NOTHING_USES_IT.format(start=self.budget_start))
        value = str(self.budget)
        plan.rows[:] = [{**row, "budget": self.budget, "prompt": _fill(row.get("prompt"), value)} for row in plan.rows]


_NOTHING_USES_IT = (
    "budget_start={start} switches the token-budget curriculum on, but nothing would act on the budget: no reward "
    "reads the `budget` column (add 'budget_length' to reward_funcs, or give your reward a `budget` parameter), the "
    "prompts hold no {{budget}} field, and budget_caps_generation=False. Do one of these, or unset budget_start."
)


def _reads_budget(reward) -> bool:
    if isinstance(reward, BudgetLengthReward):
        return True
    try:
        return "budget" in inspect.signature(reward).parameters
    except (TypeError, ValueError):
        return False


def _text(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(_text(m.get("content")) for m in prompt if isinstance(m, dict))
    return ""


def _fill(prompt, value: str):
    if isinstance(prompt, str):
        return prompt.replace(FIELD, value)
    if isinstance(prompt, list):
        return [_fill_message(m, value) for m in prompt]
    return prompt


def _fill_message(message: dict, value: str) -> dict:
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": content.replace(FIELD, value)}
    if isinstance(content, list):
        parts = [
            {**p, "text": p["text"].replace(FIELD, value)} if isinstance(p.get("text"), str) else p for p in content
        ]
        return {**message, "content": parts}
    return message


def _from_config(args) -> TokenBudgetCurriculum | None:
    if getattr(args, "budget_start", None) is None:
        return None
    return TokenBudgetCurriculum(args.budget_start, args.budget_end, args.budget_decays, args.budget_schedule,
                                 args.budget_total_steps, args.budget_caps_generation)  # fmt: skip


register_method(Method(name="curriculum", title="Curriculum GRPO (Train Long, Think Short)", arxiv="2508.08940",
                       extension=_from_config, trainer="CurriculumGRPOTrainer"))  # fmt: skip
