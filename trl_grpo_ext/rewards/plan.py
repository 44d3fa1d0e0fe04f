"""PTA-GRPO's plan-value reward ("Plan Then Action", arXiv 2510.01833, §3.2)."""

from __future__ import annotations

import torch

from ..advantages.plan import plan_values


class PlanValueReward:
    """r_plan: the success rate of the continuations of a row's plan, (1/z)·Σ_k outcome_{j,k}.

    It scores the whole local batch at once: rows carry a `plan_id` column (and `plan_group`, the prompt they belong
    to), set by `PTAGRPOTrainer`, and every row of a plan must be on the same process (the trainer checks). With
    `normalize=True` the values are standardised across the m plans of each prompt, (v_j − mean v) / (std v + 1e-4);
    the paper does not say whether it normalises, so it is an option (off by default).

    `outcome` is the correctness reward (TRL signature), called once more here: its per-row scores are averaged.
    """

    def __init__(self, outcome, normalize: bool = False):
        self.outcome = outcome
        self.normalize = normalize
        self.__name__ = "plan_value"

    def __call__(self, completions, plan_id=None, plan_group=None, **kwargs) -> list[float | None]:
        if plan_id is None:
            raise ValueError("plan_value needs `plan_id` on every row: it is set by PTAGRPOTrainer's staged rollout.")
        # The outcome reward already logged its extra columns when TRL called it; do not log them twice.
        kwargs = {k: v for k, v in kwargs.items() if k not in ("log_extra", "log_metric")}
        scores = self.outcome(completions=completions, **kwargs)
        outcomes = torch.tensor([float("nan") if s is None else float(s) for s in scores])
        values = plan_values(outcomes, torch.tensor(plan_id))  # (B,)
        if self.normalize:
            values = _normalise_across_plans(values, torch.tensor(plan_id), torch.tensor(plan_group))
        return [None if torch.isnan(v) else float(v) for v in values]


def _normalise_across_plans(values, plan_ids, groups):
    # One value per plan, standardised among the plans of the same prompt (sample std), then back to the rows.
    _, inverse = torch.unique(plan_ids, return_inverse=True)  # (B,) plan index
    first = torch.full((int(inverse.max()) + 1,), values.numel()).scatter_reduce_(
        0, inverse, torch.arange(values.numel()), reduce="amin"
    )  # (P,) a row of each plan
    per_plan, per_plan_group = values[first], groups[first]  # (P,)
    _, group = torch.unique(per_plan_group, return_inverse=True)  # (P,)
    count = torch.zeros(int(group.max()) + 1).scatter_add_(0, group, torch.ones_like(per_plan))
    mean = torch.zeros_like(count).scatter_add_(0, group, per_plan) / count
    var = torch.zeros_like(count).scatter_add_(0, group, (per_plan - mean[group]) ** 2) / (count - 1).clamp(min=1)
    return ((per_plan - mean[group]) / (var.sqrt()[group] + 1e-4))[inverse]
