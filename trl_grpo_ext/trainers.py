"""Named trainers: `GRPOExtTrainer` subclasses that only set a method's defaults."""

from __future__ import annotations

from .callbacks import ProRLResetCallback
import torch

from .config import GRPOExtConfig, ProRLConfig, PTAGRPOConfig
from .curriculum import check_schedule
from .rewards import get_reward
from .rewards.plan import PlanValueReward
from .advantages import segment_reward_advantages
from .rollouts import branch_probability, branch_token_advantages, choose_branches, resume_points, truncate_at_tag
from .segments import cut_segments
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
        args.require_whole_groups("PTA-GRPO (plans are shared within a process)")
        super().__init__(model, reward_funcs, args, *pos, **kwargs)

    def _score_batch(self, inputs):
        if not self.model.training:
            return super()._score_batch(inputs)
        m, z = self.args.num_plans, self.args.continuations_per_plan
        group = m * z
        if len(inputs) % group:
            raise ValueError(f"a PTA generation batch holds whole groups of {group} rows; got {len(inputs)} rows.")
        # Stage 1: one plan per block of z rows (rows of a group are its m plans x z continuations, in order).
        plan_rows = inputs[::z]
        close = f"</{self.args.plan_tag}>"
        close_ids = self._tokenizer(close, add_special_tokens=False)["input_ids"]
        raw = self.generate_stage([row["prompt"] for row in plan_rows], num_generations=m,
                                  max_new_tokens=self.args.plan_max_tokens,
                                  stop_token_ids=close_ids if len(close_ids) == 1 else ())  # fmt: skip
        plans, closed = zip(*(truncate_at_tag(ids, self._tokenizer, close) for ids in raw))
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


class SegmentGRPOTrainer(GRPOExtTrainer):
    """Segment-level credit (GPG, arXiv 2512.10365; ARPO, arXiv 2507.19849): segments, not tokens or answers.

    Completions are cut into segments (`segment_by`: tool-call turns, tags, paragraphs or a regex). Advantages
    (`segment_advantage`): `"soft"` is GRPO over the full trajectories; `"hard"` gives a token shared by several
    trajectories (an ARPO branch and its parent) the mean advantage of all of them; `"reward"` adds λ times the
    group-normalised score of each segment (`segment_reward_funcs`, one score per trainable segment) to the row's
    outcome advantage. Tool-result tokens are never trained (TRL's tool mask).

    With `arpo=True` (and `tools=`), rollouts branch after tool results where the entropy rises (see
    `trl_grpo_ext.rollouts.branching`). A branch row holds only its continuation; the shared prefix stays in the
    parent row, trained once, and is the branch's context.

    Metrics: `segments/per_completion`; with ARPO `tree/branches` (branch rows) and `tree/generated_tokens_saved`
    (prefix tokens the branches did not generate again).
    """

    def __init__(self, model, reward_funcs=None, args: GRPOExtConfig | None = None, *pos, **kwargs):
        if not isinstance(args, GRPOExtConfig) or args.segment_by is None:
            raise ValueError("SegmentGRPOTrainer needs a GRPOExtConfig with segment_by ('tool_calls', 'tags', ...).")
        if args.advantage_estimator != "group":
            raise ValueError(
                f"SegmentGRPOTrainer computes its own advantages (segment_advantage={args.segment_advantage!r}); "
                f"unset advantage_estimator={args.advantage_estimator!r}."
            )
        if args.arpo or args.segment_advantage == "reward":
            args.require_whole_groups("ARPO branching and segment rewards")
        if not reward_funcs and not kwargs.get("environment_factory"):
            raise ValueError(
                "SegmentGRPOTrainer needs reward_funcs (the outcome reward, e.g. ['accuracy']); segment rewards go in "
                "segment_reward_funcs on top of it."
            )
        self.segment_rewards = [get_reward(name) for name in args.segment_reward_funcs]
        super().__init__(model, reward_funcs, args, *pos, **kwargs)
        if args.arpo and not self.tools:
            raise ValueError("arpo=True branches after tool results: pass tools=[...] to the trainer, or set arpo=False.")
        self.advantage_estimator = self.segment_advantages
        self._rewrites_advantages = True
        self._branch_generator = torch.Generator().manual_seed(args.seed)

    # ---- advantages
    def segment_advantages(self, batch):
        segments = cut_segments(self.args.segment_by, batch.completion_ids, batch.completion_mask,
                                tool_mask=batch.tool_mask, tokenizer=self._tokenizer)  # fmt: skip
        self.log_metric("segments/per_completion", (segments.amax(dim=1) + 1).float().mean().item())
        mode = self.args.segment_advantage
        parents = batch.columns.get("arpo_parent")
        if mode == "hard" and parents is not None:
            return branch_token_advantages(batch.advantages, batch.completion_mask, parents,
                                           batch.columns["arpo_point"])  # fmt: skip
        if mode == "reward":
            scores = self._segment_scores(batch, segments)
            return segment_reward_advantages(batch.advantages, scores, segments, batch.num_generations,
                                             lam=self.args.segment_reward_lambda)  # fmt: skip
        return batch.advantages

    def _segment_scores(self, batch, segments: torch.Tensor) -> torch.Tensor:
        """(B, S) summed segment-reward scores on each row's trainable segments, NaN elsewhere."""
        model_tokens = batch.loss_mask.bool() if batch.tool_mask is not None else batch.completion_mask.bool()
        width = int(segments.max().item()) + 1
        scores = torch.full((segments.size(0), width), float("nan"))
        for reward in self.segment_rewards:
            name = getattr(reward, "__name__", repr(reward))
            out = reward(prompts=batch.prompts, completions=batch.completions,
                         completion_ids=self.last_scoring["completion_ids"], **batch.columns)  # fmt: skip
            if len(out) != segments.size(0):
                raise ValueError(f"segment reward {name!r} returned {len(out)} lists for {segments.size(0)} completions.")
            for row, row_scores in enumerate(out):
                trainable = torch.unique(segments[row][model_tokens[row]]).tolist()
                if row_scores is None:
                    continue
                if len(row_scores) != len(trainable):
                    raise ValueError(
                        f"segment reward {name!r} returned {len(row_scores)} score(s) for completion {row}, which has "
                        f"{len(trainable)} trainable segment(s) under segment_by={self.args.segment_by!r}; return one "
                        f"score (or None) per segment."
                    )
                for segment, score in zip(trainable, row_scores, strict=True):
                    if score is not None:
                        current = scores[row, segment]
                        scores[row, segment] = score if torch.isnan(current) else current + score
        return scores

    # ---- ARPO rollouts
    def _score_batch(self, inputs):
        if not (self.args.arpo and self.model.training):
            return super()._score_batch(inputs)
        m, n, z = self.num_generations, self.args.arpo_initial_rollouts, self.args.arpo_branches
        k, alpha, beta = self.args.arpo_entropy_tokens, self.args.arpo_alpha, self.args.arpo_beta
        groups = len(inputs) // m
        first_rows = [g * m + j for g in range(groups) for j in range(n)]
        first = self.generate_rollouts([inputs[i]["prompt"] for i in first_rows], num_generations=n)
        entropies = self.completion_entropies(first[0], first[1])
        layout, second_prompts, contexts = [], [], []  # layout: per final row, ("first", i) or ("second", j)
        parents, points = [], []
        for g in range(groups):
            members = range(g * n, (g + 1) * n)
            candidates = [
                [(p, branch_probability(entropies[i], p, k, alpha, beta)) for p in resume_points(first[2][i])]
                for i in members
            ]
            chosen = choose_branches(candidates, m - n, z, self._branch_generator)
            layout += [("first", i) for i in members]
            parents += [-1] * n
            points += [-1] * n
            for parent, point in chosen:
                for _ in range(z):
                    layout.append(("second", len(second_prompts)))
                    second_prompts.append(inputs[g * m]["prompt"])
                    contexts.append(first[1][g * n + parent][:point])
                    parents.append(g * m + parent)
                    points.append(point)
            while len(layout) < (g + 1) * m:  # fresh rollouts fill the unused slots
                layout.append(("second", len(second_prompts)))
                second_prompts.append(inputs[g * m]["prompt"])
                contexts.append([])
                parents.append(-1)
                points.append(-1)
        second = self.generate_rollouts(second_prompts, num_generations=1, context_ids=contexts) if second_prompts else None
        self.pregenerated = _merge_rollouts(first, second, layout)
        inputs = [dict(row, arpo_parent=parents[i], arpo_point=points[i]) for i, row in enumerate(inputs)]
        out = super()._score_batch(inputs)
        branches = [p for p in points if p >= 0]
        self.log_metric("tree/branches", len(branches))
        self.log_metric("tree/generated_tokens_saved", sum(branches))
        return out


def _merge_rollouts(first: tuple, second: tuple | None, layout: list[tuple[str, int]]) -> tuple:
    """TRL `_generate` tuples of two generation calls, as one tuple in `layout` order."""
    sources = {"first": first, "second": second}

    def pick(field: int):
        values = [sources[name][field] if sources[name] is not None else None for name, _ in layout]
        if all(v is None for v in values):
            return None
        return [source[index] for source, (_, index) in zip(values, layout, strict=True)]

    prompt_ids, completion_ids, tool_mask, completions, logprobs = (pick(i) for i in range(5))
    tool_images = pick(7)
    return prompt_ids, completion_ids, tool_mask, completions, logprobs, {}, None, tool_images
