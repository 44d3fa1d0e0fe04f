"""Named trainers: `GRPOExtTrainer` subclasses that only set a method's defaults; the methods are in `methods/`."""

from __future__ import annotations

from .config import BiCCGRPOConfig, DraftGRPOConfig, GRPOExtConfig, HiMAConfig, NoRDConfig, ProRLConfig, PTAGRPOConfig
from .methods.bicc import check_bicc_config
from .methods.curriculum import check_schedule
from .methods.drafts import check_draft_config
from .methods.hima import check_hima_config, load_hierarchy
from .methods.prorl import ProRLResetCallback
from .methods.pta import PlanValueReward
from .rewards import get_reward
from .trainer import GRPOExtTrainer


class CurriculumGRPOTrainer(GRPOExtTrainer):
    """Curriculum GRPO ("Train Long, Think Short", arXiv 2508.08940): a shrinking token budget.

    Defaults from the paper: budget 256 → 87 in 3 exponential decays (the `budget_*` fields), and, when
    `reward_funcs` is not given, r = 0.6·correct + 0.3·length + 0.1·format with the triangular length reward
    (`accuracy`, `budget_length`, `tag_format` for `<think>`/`<answer>`). Your own `reward_funcs` replace those three;
    add `"budget_length"` to them to keep the length term. Put `{budget}` in your prompts to tell the model its budget.
    """

    PAPER_REWARD_WEIGHTS = [0.6, 0.3, 0.1]

    def __init__(self, model, reward_funcs=None, args: GRPOExtConfig | None = None, *pos, **kwargs):
        args = args if args is not None else GRPOExtConfig(output_dir="Curriculum-GRPO")
        if not isinstance(args, GRPOExtConfig):
            raise TypeError(
                f"CurriculumGRPOTrainer needs a GRPOExtConfig for its budget fields, got {type(args).__name__}."
            )
        if args.budget_start is None:
            args.budget_start = 256
            total = args.budget_total_steps or (args.max_steps if args.max_steps > 0 else None)
            check_schedule(start=args.budget_start, end=args.budget_end, num_decays=args.budget_decays,
                           total_steps=total, schedule=args.budget_schedule)  # fmt: skip
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
        args = args if args is not None else ProRLConfig(output_dir="ProRL")
        if reward_funcs is None:
            reward_funcs = [get_reward("accuracy"), get_reward("stop_penalty")]
        callbacks = list(kwargs.pop("callbacks", None) or [])
        if prorl_resets and not any(isinstance(cb, ProRLResetCallback) for cb in callbacks):
            callbacks.append(ProRLResetCallback.v2())
        super().__init__(model, reward_funcs, args, *pos, callbacks=callbacks or None, **kwargs)


class PTAGRPOTrainer(GRPOExtTrainer):
    """PTA-GRPO ("Plan Then Action", arXiv 2510.01833): each prompt gets m plans, each plan z continuations.

    The rollout, the plan-sharing credit and the metrics are `trl_grpo_ext.methods.pta.PTA`'s. This trainer sets the
    paper's defaults: `PTAGRPOConfig` (m = z = 3), and without `reward_funcs` r = r_outcome + r_plan + r_format
    (`pta_outcome_reward`, default `accuracy`; `PlanValueReward`, the success rate of the plan's own continuations;
    `tag_format` for `<plan>`, `<think>`, `<answer>`), weighted by `reward_weights`.
    """

    def __init__(self, model, reward_funcs=None, args: GRPOExtConfig | None = None, *pos, **kwargs):
        args = args if args is not None else PTAGRPOConfig(output_dir="PTA-GRPO")
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
        super().__init__(model, reward_funcs, args, *pos, **kwargs)


class SegmentGRPOTrainer(GRPOExtTrainer):
    """Segment-level credit (GPG, arXiv 2512.10365) and ARPO's branching rollouts (arXiv 2507.19849).

    The segmenters and credit rules are `trl_grpo_ext.methods.segments`'s, the branching `trl_grpo_ext.methods.arpo`'s.
    This trainer sets their defaults: `segment_by="tool_calls"` when unset (segments end at tool results), and
    requires an outcome reward (segment rewards, if any, go on top of it in `segment_reward_funcs`).
    """

    def __init__(self, model, reward_funcs=None, args: GRPOExtConfig | None = None, *pos, **kwargs):
        if not isinstance(args, GRPOExtConfig):
            raise ValueError("SegmentGRPOTrainer needs a GRPOExtConfig (segment_by, segment_advantage, arpo, ...).")
        if args.segment_by is None:
            args.segment_by = "tool_calls"
        if not reward_funcs and not kwargs.get("environment_factory"):
            raise ValueError(
                "SegmentGRPOTrainer needs reward_funcs (the outcome reward, e.g. ['accuracy']); segment rewards go in "
                "segment_reward_funcs on top of it."
            )
        super().__init__(model, reward_funcs, args, *pos, **kwargs)


class TreeOPOTrainer(GRPOExtTrainer):
    """Tree-OPO (arXiv 2509.09284): each group completes K prefixes of one question's teacher tree, at mixed depths.

    The prefix sampling, the staged / SAE advantages and the metrics are `trl_grpo_ext.methods.tree_opo.TreeOPO`'s.
    This trainer sets the defaults: `TreeOPOConfig`, and without `train_dataset` one row per tree of `prefix_trees`
    (`trl_grpo_ext.data.trees.questions_dataset`: prompt, question_id and the trees' other fields).
    """

    def __init__(self, model, reward_funcs=None, args: GRPOExtConfig | None = None, *pos, **kwargs):
        if not isinstance(args, GRPOExtConfig) or args.prefix_trees is None:
            raise ValueError(
                "TreeOPOTrainer needs prefix_trees, the path of a trees file: TreeOPOConfig(prefix_trees='trees.jsonl') "
                "(build one with trl_grpo_ext.data.build_prefix_trees or `trl-grpo-ext trees`)."
            )
        if not reward_funcs:
            raise ValueError("TreeOPOTrainer needs reward_funcs: the outcome reward, e.g. ['accuracy'] (binary).")
        if not pos and kwargs.get("train_dataset") is None:
            from .data.trees import questions_dataset

            kwargs["train_dataset"] = questions_dataset(args.prefix_trees)
        super().__init__(model, reward_funcs, args, *pos, **kwargs)


class BiCCGRPOTrainer(GRPOExtTrainer):
    """BiCC (arXiv 2603.13134): groups with both right and wrong answers also train each answer after an opposite one.

    The pairing, the context and the metrics are `trl_grpo_ext.methods.bicc.BiCC`'s. This trainer switches it on
    (`BiCCGRPOConfig`, or `bicc=True` on your `GRPOExtConfig`); combine it with `advantage_estimator="rcc"` for the
    paper's reward-confidence-corrected baseline. Without `reward_funcs`: `accuracy` (the correctness it reads).
    """

    def __init__(self, model, reward_funcs=None, args: GRPOExtConfig | None = None, *pos, **kwargs):
        args = args if args is not None else BiCCGRPOConfig(output_dir="BiCC-GRPO")
        if not isinstance(args, GRPOExtConfig):
            raise TypeError(f"BiCCGRPOTrainer needs a GRPOExtConfig for its bicc fields, got {type(args).__name__}.")
        if not args.bicc:
            args.bicc = True
            check_bicc_config(args)
        if reward_funcs is None:
            reward_funcs = [get_reward("accuracy")]
        super().__init__(model, reward_funcs, args, *pos, **kwargs)


class DraftGRPOTrainer(GRPOExtTrainer):
    """Draft-conditioned RL: groups answer a problem with drafts shown before it (the policy's own, a second model's,
    or a dataset column's), matched or mismatched, and learn to improve on them; evaluation shows none.

    The sources, the selection and the metrics are `trl_grpo_ext.methods.drafts.Drafts`'s. This trainer switches it
    on (`DraftGRPOConfig`: self-refinement, alternating solve and refine batches; or `draft_source` on your
    `GRPOExtConfig`). Without `reward_funcs`: `accuracy` (which also scores the drafts).
    """

    def __init__(self, model, reward_funcs=None, args: GRPOExtConfig | None = None, *pos, **kwargs):
        args = args if args is not None else DraftGRPOConfig(output_dir="Draft-GRPO")
        if not isinstance(args, GRPOExtConfig):
            raise TypeError(f"DraftGRPOTrainer needs a GRPOExtConfig for its draft fields, got {type(args).__name__}.")
        if args.draft_source is None:
            args.draft_source, args.draft_mode = "self", "alternate"
            check_draft_config(args)
        if reward_funcs is None:
            reward_funcs = [get_reward("accuracy")]
        super().__init__(model, reward_funcs, args, *pos, **kwargs)


class NoRDTrainer(GRPOExtTrainer):
    """NoRD (arXiv 2602.21172): a driving policy writes its future waypoints directly, scored by a driving metric.

    This trainer sets the recipe: `NoRDConfig` (Dr. GRPO: `loss_type="dr_grpo"`, `scale_rewards="none"`; short
    completions; `DifficultyBiasDiagnostic` on), and without `reward_funcs` the `trajectory` reward (the toy
    PDMS-like driving score of `trl_grpo_ext.methods.nord`, reading the `future` and `scene` columns). Prompts may
    carry images (a vision-language model and its processor): TRL's VLM path feeds them. The synthetic scenes of
    `trl_grpo_ext.data.driving` are in that format.
    """

    def __init__(self, model, reward_funcs=None, args: GRPOExtConfig | None = None, *pos, **kwargs):
        args = args if args is not None else NoRDConfig(output_dir="NoRD")
        if not isinstance(args, GRPOExtConfig):
            raise TypeError(f"NoRDTrainer needs a GRPOExtConfig (or NoRDConfig), got {type(args).__name__}.")
        if reward_funcs is None:
            reward_funcs = [get_reward("trajectory")]
        super().__init__(model, reward_funcs, args, *pos, **kwargs)


class HiMATrainer(GRPOExtTrainer):
    """HiMA-R1 (JoyAgents-R1, arXiv 2506.19846): a hierarchy of agents on one model, trained together by VR-GRPO.

    The rollout, the node groups, the top-K filter and the memory stores are `trl_grpo_ext.methods.hima.HiMA`'s. Give
    the hierarchy as `hierarchy=` (a `Hierarchy`, a mapping, a file path or `"toy"`) or as `hima_hierarchy` in the
    config (`HiMAConfig`). Without `reward_funcs`: R = R_accuracy + R_format − R_efficiency, i.e.
    `hima_accuracy_reward` (default `accuracy`), `hima_format` and `hima_efficiency` (which returns −cost).
    """

    def __init__(self, model, reward_funcs=None, args: GRPOExtConfig | None = None, *pos, hierarchy=None, **kwargs):
        args = args if args is not None else HiMAConfig(output_dir="HiMA")
        if not isinstance(args, GRPOExtConfig):
            raise TypeError(f"HiMATrainer needs a GRPOExtConfig (or HiMAConfig), got {type(args).__name__}.")
        if hierarchy is None and args.hima_hierarchy is None:
            raise ValueError("HiMATrainer needs a hierarchy: hierarchy=Hierarchy(...) (or a YAML file, or 'toy'), or "
                             "hima_hierarchy in the config.")  # fmt: skip
        if hierarchy is not None:
            if args.hima_hierarchy is not None:
                raise ValueError("give the hierarchy once: hierarchy= or hima_hierarchy, not both.")
            args.hima_hierarchy = hierarchy  # a Hierarchy, a mapping, a file or "toy": the extension loads it
            check_hima_config(args)
        adapters = args.hima_agent_adapters or any(a.adapter for a in load_hierarchy(args.hima_hierarchy).agents)
        if adapters and kwargs.get("peft_config") is None and not hasattr(model, "peft_config"):
            raise ValueError("the hierarchy gives agents their own LoRA adapters (hima_agent_adapters, or `adapter:` "
                             "of an agent), which need a LoRA policy: pass peft_config=LoraConfig(...) (CLI: "
                             "--use_peft), or drop the adapters so that the agents share the model.")  # fmt: skip
        if reward_funcs is None:
            reward_funcs = [get_reward(args.hima_accuracy_reward), get_reward("hima_format"),
                            get_reward("hima_efficiency")]  # fmt: skip
        super().__init__(model, reward_funcs, args, *pos, **kwargs)
