"""Named trainers: `GRPOExtTrainer` subclasses that only set a method's defaults."""

from __future__ import annotations

from .callbacks import ProRLResetCallback
from .config import GRPOExtConfig, ProRLConfig, PTAGRPOConfig
from .curriculum import check_schedule
from .rewards import get_reward
from .rewards.plan import PlanValueReward
from .rollouts import truncate_at_tag
from .trainer import GRPOExtTrainer


class CurriculumGRPOTrainer(GRPOExtTrainer):
    """Curriculum GRPO ("Train Long, Think Short", arXiv 2508.08940): a shrinking token budget.

    Defaults from the paper: budget 256 → 87 in 3 exponential decays (`budget_*` fields of `GRPOExtConfig`), and,
    when `reward_funcs` is not given, r = 0.6·correct + 0.3·length + 0.1·format with the triangular length reward
    (`accuracy`, `budget_length`, `tag_format` for `<think>`/`<answer>`). Your own `reward_funcs` replace those three;
    add `"budget_length"` to them to keep the length term. Put `{budget}` in your prompts to tell the model its budget.
    """

    PAPER_REWARD_WEIGHTS = [0.6, 0.3, 0.1]

    def __init__(self, model, reward_funcs=None, args: GRPOExtConfig | None = None, *pos, **kwargs):
        if args is None:
            args = GRPOExtConfig(output_dir="Curriculum-GRPO")
        if not isinstance(args, GRPOExtConfig):
            raise TypeError(f"CurriculumGRPOTrainer needs a GRPOExtConfig for its budget fields, got {type(args).__name__}.")
        if args.budget_start is None:
            args.budget_start = 256
            check_schedule(start=args.budget_start, end=args.budget_end, num_decays=args.budget_decays,
                           total_steps=args.budget_total_steps, schedule=args.budget_schedule)  # fmt: skip
        if reward_funcs is None:
            reward_funcs = [
                get_reward("accuracy"),
                get_reward("budget_length", shape=args.budget_length_shape, count=args.budget_length_count),
                get_reward("tag_format", tags=["think", "answer"]),
            ]
            if args.reward_weights is None:
                args.reward_weights = list(self.PAPER_REWARD_WEIGHTS)
        super().__init__(model, reward_funcs, args, *pos, **kwargs)


class ProRLTrainer(GRPOExtTrainer):
    """ProRL ("Prolonged Reinforcement Learning Expands Reasoning Boundaries", arXiv 2505.24864).

    The recipe comes from `ProRLConfig`'s defaults (decoupled clip 0.2 / 0.4, small KL, temperature 1.2, 16
    rollouts, constant lr 2e-6, dapo loss, dynamic sampling); every one can be overridden there. Unless `callbacks`
    already hold a `ProRLResetCallback`, the v2 reset schedule is added (reference reset every 300 steps); pass
    `prorl_resets=False` to train without resets. Without `reward_funcs`: `accuracy` plus the stop-properly penalty.
    """

    def __init__(self, model, reward_funcs=None, args: GRPOExtConfig | None = None, *pos, prorl_resets: bool = True,
                 **kwargs):  # fmt: skip
        if args is None:
            args = ProRLConfig(output_dir="ProRL")
        if reward_funcs is None:
            reward_funcs = [get_reward("accuracy"), get_reward("stop_penalty")]
        super().__init__(model, reward_funcs, args, *pos, **kwargs)
        has_resets = any(isinstance(cb, ProRLResetCallback) for cb in self.callback_handler.callbacks)
        if prorl_resets and not has_resets:
            self.add_callback(ProRLResetCallback.v2())


class PTAGRPOTrainer(GRPOExtTrainer):
    """PTA-GRPO ("Plan Then Action", arXiv 2510.01833): each prompt gets m plans, each plan z continuations.

    Rollout (training): the m plans of a prompt are generated first, up to `</plan>` (`generate_stage`); each plan
    is then the completion prefix of its z rows, which continue it (one tree, m·z = `num_generations` leaves). A
    plan is generated once and shared token for token, so PTA costs m plan generations instead of m·z.
    Evaluation generates plainly (the model writes its own plan).

    Rewards (without `reward_funcs`): r = r_outcome + r_plan + r_format, the paper's sum (weights via
    `reward_weights`): `pta_outcome_reward` (default `accuracy`), `PlanValueReward` (the success rate of the plan's
    own continuations), and `tag_format` for `<plan>`, `<think>`, `<answer>`.

    Advantages (`advantage_estimator="pta"`, set unless you chose another): continuation tokens get their row's
    group-normalised advantage; plan tokens the mean advantage of the plan's z rows.

    A plan that never closes its tag within `plan_max_tokens` is kept whole as the plan: its rows continue it, all
    of it is trained with the plan's advantage, and it scores 0 on the format reward.

    Metrics: `pta/plans_closed`, `pta/generated_tokens` (plans once + continuations), `pta/independent_tokens` (what
    m·z independent samples of the same completions would have generated), `pta/tokens_saved_fraction`.
    """

    def __init__(self, model, reward_funcs=None, args: GRPOExtConfig | None = None, *pos, **kwargs):
        if args is None:
            args = PTAGRPOConfig(output_dir="PTA-GRPO")
        if not isinstance(args, GRPOExtConfig) or args.num_plans is None:
            raise ValueError(
                "PTAGRPOTrainer needs num_plans and continuations_per_plan: use PTAGRPOConfig (3 x 3) or set them on "
                "your GRPOExtConfig."
            )
        if reward_funcs is None:
            outcome = get_reward(args.pta_outcome_reward)
            reward_funcs = [
                outcome,
                PlanValueReward(outcome, normalize=args.plan_value_normalize),
                get_reward("tag_format", tags=[args.plan_tag, "think", "answer"]),
            ]
        if args.advantage_estimator == "group":
            args.advantage_estimator = "pta"
        local_rows = args.per_device_train_batch_size * args.steps_per_generation
        if local_rows % args.num_generations:
            raise ValueError(
                f"PTA-GRPO shares plans within a process: per_device_train_batch_size * steps_per_generation "
                f"({local_rows}) must be a multiple of num_generations ({args.num_generations})."
            )
        super().__init__(model, reward_funcs, args, *pos, **kwargs)

    def _score_batch(self, inputs):
        if not self.model.training:
            return super()._score_batch(inputs)
        m, z = self.args.num_plans, self.args.continuations_per_plan
        group = m * z
        if len(inputs) % group:
            raise ValueError(f"a PTA generation batch holds whole groups of {group} rows; got {len(inputs)} rows.")
        if self.prompt_fields:
            inputs = [self._fill_prompt_fields(row) for row in inputs]
        # Stage 1: one plan per block of z rows (rows of a group are its m plans x z continuations, in order).
        plan_rows = inputs[::z]
        raw = self.generate_stage([row["prompt"] for row in plan_rows], num_generations=m,
                                  max_new_tokens=self.args.plan_max_tokens)  # fmt: skip
        plans, closed = zip(*(truncate_at_tag(ids, self._tokenizer, f"</{self.args.plan_tag}>") for ids in raw))
        inputs = [dict(row, plan_id=i // z, plan_group=i // group) for i, row in enumerate(inputs)]
        # Stage 2: each plan starts the completion of its z rows, generated in blocks of z.
        self.set_row_prefixes(completion_ids=[plans[i // z] for i in range(len(inputs))], num_generations=z)
        out = super()._score_batch(inputs)

        plan_tokens = sum(len(p) for p in plans)
        continuation_tokens = int(out["completion_mask"].sum().item()) - z * plan_tokens
        generated = sum(len(r) for r in raw) + continuation_tokens
        independent = z * plan_tokens + continuation_tokens
        self.log_metric("pta/plans_closed", sum(closed) / len(closed))
        self.log_metric("pta/generated_tokens", generated)
        self.log_metric("pta/independent_tokens", independent)
        self.log_metric("pta/tokens_saved_fraction", 1 - generated / max(independent, 1))
        return out
