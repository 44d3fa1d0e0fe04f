"""Named trainers: `GRPOExtTrainer` subclasses that only set a method's defaults."""

from __future__ import annotations

from .callbacks import ProRLResetCallback
from .config import GRPOExtConfig, ProRLConfig
from .curriculum import check_schedule
from .rewards import get_reward
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
