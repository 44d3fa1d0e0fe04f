"""PTA-GRPO: plan, then act ("Plan Then Action", arXiv 2510.01833, ICML 2026).

Output format `<plan>…</plan><think>…</think><answer>…</answer>`. Each prompt gets m plans and each plan z
continuations: one group of m·z trajectories, a tree whose plan edges are shared. A plan is generated once, up to its
closing tag, and every one of its z rows holds it (rows are whole trajectories): its tokens are one tree node, and
each copy is trained with the mean advantage of the z rows through it. r = r_outcome + r_plan + r_format, with
r_plan(plan_j) = (1/z)·Σ_k 1[answer_{j,k} correct], the success rate of the plan's own continuations.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..advantages import group_stats, plan_values, tree_token_advantages, trl_group
from ..extension import Extension, Method, TrainerInputs, register_method
from ..rewards.guard import check_reward_name
from ..rollout import Rollout, RolloutPlan


@dataclass
class PTAConfig:
    """Config section: PTA-GRPO's rollout tree (arXiv 2510.01833, §4: m = 3 plans, z = 3 continuations).

    > Parameters of PTA-GRPO (plan, then act; arXiv 2510.01833; `trl_grpo_ext.methods.pta`)

    num_plans (`int`, *optional*):
        m, plans generated per prompt (the paper: 3). Setting it (with `continuations_per_plan`) switches the
        plan -> continuation rollout on; m · z must equal `num_generations`.
    continuations_per_plan (`int`, *optional*):
        z, continuations generated from each plan (the paper: 3). Each plan is generated once and held, token for
        token, by its z rows.
    plan_tag (`str`, *optional*, defaults to `"plan"`):
        The plan is generated up to the closing `</plan_tag>`, whatever its number of tokens.
    plan_max_tokens (`int`, *optional*):
        Token cap of the plan stage (default: `max_completion_length`); plan and continuation together stay
        within `max_completion_length`. A plan that does not close within it is kept whole as the plan, and
        fails the format reward.
    plan_value_normalize (`bool`, *optional*, defaults to `False`):
        Standardise plan values across the m plans of a prompt (the paper does not say; off keeps r_plan in
        [0, 1]).
    pta_outcome_reward (`str`, *optional*, defaults to `"accuracy"`):
        Registry name or import path of the correctness reward behind r_outcome and r_plan.
    """

    num_plans: int | None = field(default=None, metadata={"help": "PTA-GRPO: plans per prompt (m). Paper: 3."})
    continuations_per_plan: int | None = field(
        default=None, metadata={"help": "PTA-GRPO: continuations per plan (z); m * z = num_generations. Paper: 3."}
    )
    plan_tag: str = field(default="plan", metadata={"help": "PTA-GRPO: the plan is generated up to </plan_tag>."})
    plan_max_tokens: int | None = field(
        default=None,
        metadata={"help": "PTA-GRPO: token cap of the plan stage (default: max_completion_length); plan and "
                  "continuation together stay within max_completion_length."},
    )  # fmt: skip
    plan_value_normalize: bool = field(
        default=False, metadata={"help": "PTA-GRPO: standardise plan values across the m plans of a prompt."}
    )
    pta_outcome_reward: str = field(
        default="accuracy", metadata={"help": "PTA-GRPO: correctness reward (registry name or import path)."}
    )

    def __post_init__(self):
        super().__post_init__()
        m, z = self.num_plans, self.continuations_per_plan
        if m is None and z is None:
            return
        for (name, value), (other, given) in ((("num_plans", m), ("continuations_per_plan", z)),
                                              (("continuations_per_plan", z), ("num_plans", m))):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{name}={value!r} must be a whole number >= 1 (the paper uses 3), with {other}={given!r}; set "
                    "both or neither."
                )
        if m * z != self.num_generations:
            raise ValueError(
                f"num_plans * continuations_per_plan ({m}*{z}={m * z}) must equal num_generations "
                f"({self.num_generations}); e.g. set num_generations={m * z}."
            )
        if self.plan_max_tokens is not None and (isinstance(self.plan_max_tokens, bool) or self.plan_max_tokens < 1):
            raise ValueError(
                f"plan_max_tokens={self.plan_max_tokens!r} must be a whole number >= 1, or None for "
                "max_completion_length (plan and continuation share that cap)."
            )
        if not self.plan_tag or not self.plan_tag.replace("_", "").isalnum():
            raise ValueError(f"plan_tag={self.plan_tag!r} must be a bare tag name such as 'plan'.")
        check_reward_name("pta_outcome_reward", self.pta_outcome_reward)
        self.require_whole_groups("PTA-GRPO (a prompt's plans are shared within a process)")


def truncate_at_tag(ids: list[int], tokenizer, tag: str) -> tuple[list[int], bool]:
    """Cut generated token ids right after the first occurrence of `tag` in their text.

    Returns `(ids, closed)`: the shortest prefix of `ids` whose decoded text contains `tag`, and True; or all of `ids`
    and False when `tag` never appears (for PTA: a plan that never closes; the whole stage is then the plan).
    Works whether the tag is one token (as in the tiny test tokenizer) or several (most real vocabularies).

    >>> class Chars:  # a toy tokenizer: one character per token
    ...     def decode(self, ids, skip_special_tokens=False): return "".join(chr(i) for i in ids)
    >>> truncate_at_tag([ord(c) for c in "ab</p>cd"], Chars(), "</p>")
    ([97, 98, 60, 47, 112, 62], True)
    """
    text = tokenizer.decode(ids, skip_special_tokens=False)
    end = text.find(tag)
    if end < 0:
        return list(ids), False
    end += len(tag)
    low, high = 1, len(ids)  # the shortest k with tag inside decode(ids[:k]): binary search, decode is monotone
    while low < high:
        mid = (low + high) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=False)) >= end:
            high = mid
        else:
            low = mid + 1
    return list(ids[:low]), True


class PlanValueReward:
    """r_plan: the success rate of the continuations of a row's plan, (1/z)·Σ_k outcome_{j,k}.

    It reads the plans from the rollout being scored (`trainer.current_rollout`: rows with one root share a plan),
    never from dataset columns; the trainer hands itself over (the `trainer` attribute). Outside a PTA rollout each
    row is its own plan. With `normalize=True` the values are standardised across the m plans of each prompt,
    (v_j − mean v) / (std v + 1e-4); the paper does not say whether it normalises, so it is an option (off).

    `outcome` is the correctness reward (TRL signature), called once more here: its per-row scores are averaged.
    """

    def __init__(self, outcome, normalize: bool = False):
        self.outcome = outcome
        self.normalize = normalize
        self.trainer = None
        self.__name__ = "plan_value"

    def __call__(self, completions, **kwargs) -> list[float | None]:
        rollout = self.trainer.current_rollout if self.trainer is not None else None
        if rollout is None or len(rollout) != len(completions):
            raise ValueError(
                "plan_value scores the plans of the rollout being scored: use it in a trl_grpo_ext trainer."
            )
        # The outcome reward already logged its extra columns when TRL called it; do not log them twice.
        kwargs = {k: v for k, v in kwargs.items() if k not in ("log_extra", "log_metric")}
        scores = self.outcome(completions=completions, **kwargs)
        outcomes = torch.tensor([float("nan") if s is None else float(s) for s in scores])
        roots = torch.tensor(rollout.roots())
        values = plan_values(outcomes, roots)  # (B,)
        if self.normalize:
            group = self.trainer.num_generations if self.trainer.model.training else self.trainer.num_generations_eval
            values = _normalise_across_plans(values, roots, torch.arange(len(roots)) // group)
        return [None if torch.isnan(v) else float(v) for v in values]


def _normalise_across_plans(values, plan_ids, groups):
    # One value per plan, standardised among the plans of the same prompt (sample std), then back to the rows. A plan
    # with no scored row (value NaN) is left out of its prompt's mean and std, and stays NaN (unscored).
    _, inverse = torch.unique(plan_ids, return_inverse=True)  # (B,) plan index
    first = torch.full((int(inverse.max()) + 1,), values.numel()).scatter_reduce_(
        0, inverse, torch.arange(values.numel()), reduce="amin"
    )  # (P,) a row of each plan
    per_plan, per_plan_group = values[first], groups[first]  # (P,)
    stats = group_stats(per_plan, per_plan_group)
    std = torch.nan_to_num(stats.rows(stats.std), nan=0.0)  # one scored plan: centred to 0, as before
    return ((per_plan - stats.rows(stats.mean)) / (std + 1e-4))[inverse]


class PTA(Extension):
    """Owns the training rollout: m plans per prompt, then z continuations of each; plan tokens get the plan's mean.

    Stage 1 generates one plan per block of z rows (blocks of m rows per prompt for the backend), after each row's
    context and completion prefix, and stops at `</plan_tag>` whatever its token count (stop strings on transformers
    and vLLM), at EOS, or at `plan_max_tokens`. Stage 2 continues each plan in its z rows (blocks of z); a plan that
    ended with EOS ends its rows there. Plan and continuation together stay within `max_completion_length`.
    Evaluation generates in one stage (the model writes its own plan).

    With the default estimator, tokens get `tree_token_advantages` of TRL's row advantages: a plan's tokens the mean
    over its z rows, continuation tokens their own row's. Metrics: `pta/plans_closed`, `pta/plans_ended` (EOS inside
    the plan), `pta/generated_tokens` (plans once, plus continuations), `pta/independent_tokens` (the same rows
    sampled independently), `pta/tokens_saved_fraction`.
    """

    name = "pta"
    owns_rollout = True

    def __init__(self, num_plans: int, continuations_per_plan: int, plan_tag: str = "plan",
                 plan_max_tokens: int | None = None):  # fmt: skip
        self.m, self.z = num_plans, continuations_per_plan
        self.close = f"</{plan_tag}>"
        self.plan_max_tokens = plan_max_tokens

    def check(self, inputs: TrainerInputs) -> None:
        if inputs.rollout_func is not None:
            raise ValueError("PTA-GRPO generates its plan -> continuation tree itself; unset rollout_func.")

    def rollout(self, plan: RolloutPlan, prompts: list) -> Rollout | None:
        if plan.mode != "train":
            return None
        trainer, z = self.trainer, self.z
        rows = len(plan.rows)
        if rows % (self.m * z):
            raise ValueError(f"a PTA generation batch holds whole groups of {self.m * z} rows; got {rows} rows.")
        # Stage 1: one plan per block of z rows (rows of a group are its m plans x z continuations, in order).
        starts = list(range(0, rows, z))
        stage = plan.select(starts)
        raw, raw_logprobs = trainer.generate_stage(
            [prompts[i] for i in starts], stage, num_generations=self.m, max_new_tokens=self.plan_max_tokens,
            stop=[self.close], rows=starts,
        )  # fmt: skip
        plans, closed, ended, plan_logprobs = [], [], [], []
        eos = set(trainer.eos_token_ids)
        for k, (ids, given) in enumerate(zip(raw, stage.prefix_ids, strict=True)):
            cut, done = truncate_at_tag(ids[len(given) :], trainer.tokenizer, self.close)
            plans.append(list(given) + cut)
            closed.append(done)
            ended.append(not done and bool(cut) and cut[-1] in eos)
            if raw_logprobs is not None:
                plan_logprobs.append(list(raw_logprobs[k][: len(plans[-1])]))
        # Stage 2: each plan starts the completion of its z rows, generated in blocks of z.
        block = [i // z for i in range(rows)]
        rollout = trainer.generate_rollouts(
            prompts, replace(plan, prefix_ids=[plans[b] for b in block]), num_generations=z,
            finished=[ended[b] for b in block], prefix_logprobs=[plan_logprobs[b] for b in block] if plan_logprobs else None,
        )  # fmt: skip
        rollout.parents = [-1 if i % z == 0 else i - i % z for i in range(rows)]
        rollout.shared = [0 if i % z == 0 else len(plans[b]) for i, b in enumerate(block)]
        rollout.prefix_lengths = [len(p) for p in plan.prefix_ids]

        plan_tokens = sum(len(p) - len(g) for p, g in zip(plans, stage.prefix_ids, strict=True))
        continuation = sum(len(c) - len(plans[b]) for c, b in zip(rollout.completion_ids, block, strict=True))
        independent = z * plan_tokens + continuation
        self.log("plans_closed", sum(closed) / len(closed))
        self.log("plans_ended", sum(ended) / len(ended))
        self.log("generated_tokens", plan_tokens + continuation)
        self.log("independent_tokens", independent)
        self.log("tokens_saved_fraction", 1 - (plan_tokens + continuation) / max(independent, 1))
        return rollout

    def after_scoring(self, batch) -> None:
        if batch.owners is None or self.trainer.advantage_estimator is not trl_group:
            return  # no shared plans (evaluation), or the user's estimator decides the credit
        batch.set_advantages(tree_token_advantages(batch.advantages, batch.node_ids), source="PTA-GRPO")


def _from_config(args) -> PTA | None:
    if getattr(args, "num_plans", None) is None:
        return None
    return PTA(args.num_plans, args.continuations_per_plan, args.plan_tag, args.plan_max_tokens)


register_method(Method(name="pta", title="PTA-GRPO (Plan Then Action)", arxiv="2510.01833", extension=_from_config,
                       trainer="PTAGRPOTrainer", config="PTAGRPOConfig"))  # fmt: skip
