"""`GRPOExtConfig`: TRL's `GRPOConfig` plus one section of fields per extension."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig


@dataclass
class GRPOExtConfig(GRPOConfig):
    r"""Configuration for [`GRPOExtTrainer`]: every field of TRL's `GRPOConfig`, plus the extensions' own.

    With every extension left at its default, training is bit for bit that of `GRPOTrainer` with the same
    `GRPOConfig` fields. All defaults inherited from `GRPOConfig` are unchanged (note TRL's `bf16=True` and
    `gradient_checkpointing=True`: turn both off to train on a CPU).

    Parameters:
        > Parameters that control the advantage

        advantage_estimator (`str` or callable, *optional*, defaults to `"group"`):
            Registry name or dotted import path of the advantage estimator, or the callable itself. `"group"` keeps
            TRL's own group-normalised advantages (and its `scale_rewards`, `multi_objective_aggregation`). An
            estimator returns (B,) or (B, T) advantages; see `trl_grpo_ext.advantages`.

        > Parameters that control generation from per-row prefixes

        context_prefix_column (`str`, *optional*):
            Dataset column holding text appended to each prompt before generation as context: the policy generates
            after it, and it is not trained (Tree-OPO's teacher prefixes, a draft to refine).
        completion_prefix_column (`str`, *optional*):
            Dataset column holding text that starts each completion: the policy continues it, and it is trained as
            part of the completion (segment 0; the generated continuation is segment 1).

        > Parameters of Curriculum GRPO (token budget; "Train Long, Think Short", arXiv 2508.08940)

        budget_start (`int`, *optional*):
            Token budget at the start of training. Setting it switches the curriculum on (`TokenBudgetCurriculum`):
            `{budget}` in prompts is replaced by the current budget, reward functions get a `budget` column, and
            `curriculum/budget` is logged. The paper: 256.
        budget_end (`int`, *optional*, defaults to `87`):
            Token budget after the last decay. The paper: 87.
        budget_decays (`int`, *optional*, defaults to `3`):
            Number of drops, at equal intervals of `total_steps / (budget_decays + 1)`. The paper: 3.
        budget_schedule (`str`, *optional*, defaults to `"exponential"`):
            `"exponential"` (B = start · d^k, the paper's) or `"linear"` (equal drops).
        budget_total_steps (`int`, *optional*):
            Steps the schedule spans; default: the run's `max_steps`.
        budget_caps_generation (`bool`, *optional*, defaults to `False`):
            Also cap generation at the budget (`max_completion_length` for transformers and vLLM generation).
        budget_length_shape (`str`, *optional*, defaults to `"triangular"`):
            Length reward of `CurriculumGRPOTrainer`: `"triangular"` (the paper's best) or `"band"`.
        budget_length_count (`str`, *optional*, defaults to `"completion"`):
            What the length reward counts: the whole completion, or only the `<think>` span (the paper is ambiguous).

        > Parameters of dynamic sampling (DAPO, arXiv 2503.14476; used by ProRL)

        dynamic_sampling (`bool`, *optional*, defaults to `False`):
            Drop from the loss the groups whose rewards all agree (zero variance: zero advantage, no signal). Logs
            `dynamic_sampling/kept_fraction`. TRL has no such option (huggingface/trl#3708).
        dynamic_sampling_max_rounds (`int`, *optional*, defaults to `0`):
            Before dropping, refill the batch: up to this many extra generation rounds on fresh prompts drawn from
            the training set, replacing zero-variance groups with varied ones. 0 only drops. When the rounds run out,
            the rest is dropped with a warning. Needs whole groups on each process.

        > Parameters of PTA-GRPO (plan, then act; arXiv 2510.01833)

        num_plans (`int`, *optional*):
            m, plans generated per prompt (the paper: 3). Setting it (with `continuations_per_plan`) describes the
            rollout tree of `PTAGRPOTrainer`; m · z must equal `num_generations`.
        continuations_per_plan (`int`, *optional*):
            z, continuations generated from each plan (the paper: 3). Each plan is generated once and shared, token
            for token, by its z rows.
        plan_tag (`str`, *optional*, defaults to `"plan"`):
            The plan is generated up to the closing `</plan_tag>`.
        plan_max_tokens (`int`, *optional*):
            Generation cap of the plan stage (default: `max_completion_length`). A plan that does not close within
            it is kept whole as the plan, and fails the format reward.
        plan_value_normalize (`bool`, *optional*, defaults to `False`):
            Standardise plan values across the m plans of a prompt (the paper does not say; off keeps r_plan in
            [0, 1]).
        pta_outcome_reward (`str`, *optional*, defaults to `"accuracy"`):
            Registry name or import path of the correctness reward behind r_outcome and r_plan.

        > Parameters of segment-level advantages (GPG, arXiv 2512.10365; ARPO, arXiv 2507.19849)

        segment_by (`str`, *optional*):
            How `SegmentGRPOTrainer` cuts completions into segments: `"tool_calls"` (at TRL's tool-result
            boundaries), `"tags"`, `"paragraphs"` or `"regex:<pattern>"`.
        segment_advantage (`str`, *optional*, defaults to `"soft"`):
            `"soft"`: GRPO over full trajectories; `"hard"`: a token shared by several trajectories (ARPO branches)
            gets the mean advantage of all of them; `"reward"`: outcome advantage + λ · normalised segment reward.
        segment_reward_funcs (`list[str]`, *optional*):
            Segment rewards (registry names or import paths) for `"reward"`: each returns, per completion, one score
            per trainable segment (e.g. `"tool_call_validity"`).
        segment_reward_lambda (`float`, *optional*, defaults to `1.0`):
            λ, the weight of the normalised segment reward.
        arpo (`bool`, *optional*, defaults to `False`):
            ARPO rollouts: of each group of M = `num_generations`, start `arpo_initial_rollouts` full rollouts, then
            branch `arpo_branches` continuations after tool results where the entropy rises, with probability
            clip(α + β·ΔH, 0, 1); unused slots get fresh rollouts. Needs `tools=`.
        arpo_initial_rollouts (`int`, *optional*):
            N; default M / 2 (the paper: 8 of 16).
        arpo_branches (`int`, *optional*, defaults to `2`):
            Z, continuations branched at an accepted point.
        arpo_entropy_tokens (`int`, *optional*, defaults to `10`):
            k, generated tokens whose mean entropy is compared with the first k tokens of the response.
        arpo_alpha (`float`, *optional*, defaults to `0.5`) and arpo_beta (`float`, *optional*, defaults to `0.2`):
            The paper's branching probability, clip(α + β·ΔH, 0, 1).
    """

    advantage_estimator: str = field(
        default="group",
        metadata={
            "help": "Registry name or dotted import path of the advantage estimator. 'group' keeps TRL's own "
            "group-normalised advantages; see `trl_grpo_ext.list_advantages()`."
        },
    )
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

    budget_start: int | None = field(
        default=None,
        metadata={"help": "Token budget at the start (switches the Curriculum GRPO token budget on). Paper: 256."},
    )
    budget_end: int = field(default=87, metadata={"help": "Token budget after the last decay. Paper: 87."})
    budget_decays: int = field(default=3, metadata={"help": "Number of budget drops, at equal intervals. Paper: 3."})
    budget_schedule: str = field(
        default="exponential",
        metadata={"help": "Budget schedule.", "choices": ["exponential", "linear"]},
    )
    budget_total_steps: int | None = field(
        default=None, metadata={"help": "Steps the budget schedule spans (default: max_steps)."}
    )
    budget_caps_generation: bool = field(
        default=False, metadata={"help": "Also cap generation (max_completion_length) at the current budget."}
    )

    budget_length_shape: str = field(
        default="triangular",
        metadata={"help": "Length reward of CurriculumGRPOTrainer.", "choices": ["triangular", "band"]},
    )
    budget_length_count: str = field(
        default="completion",
        metadata={"help": "What the length reward counts.", "choices": ["completion", "think"]},
    )

    dynamic_sampling: bool = field(
        default=False, metadata={"help": "Drop zero-reward-variance groups from the loss (DAPO dynamic sampling)."}
    )
    dynamic_sampling_max_rounds: int = field(
        default=0,
        metadata={"help": "Extra generation rounds that refill dropped groups with fresh prompts (0: only drop)."},
    )

    num_plans: int | None = field(default=None, metadata={"help": "PTA-GRPO: plans per prompt (m). Paper: 3."})
    continuations_per_plan: int | None = field(
        default=None, metadata={"help": "PTA-GRPO: continuations per plan (z); m * z = num_generations. Paper: 3."}
    )
    plan_tag: str = field(default="plan", metadata={"help": "PTA-GRPO: the plan is generated up to </plan_tag>."})
    plan_max_tokens: int | None = field(
        default=None, metadata={"help": "PTA-GRPO: generation cap of the plan stage (default: max_completion_length)."}
    )
    plan_value_normalize: bool = field(
        default=False, metadata={"help": "PTA-GRPO: standardise plan values across the m plans of a prompt."}
    )
    pta_outcome_reward: str = field(
        default="accuracy", metadata={"help": "PTA-GRPO: correctness reward (registry name or import path)."}
    )

    segment_by: str | None = field(
        default=None, metadata={"help": "Segments: 'tool_calls', 'tags', 'paragraphs' or 'regex:<pattern>'."}
    )
    segment_advantage: str = field(
        default="soft", metadata={"help": "Segment advantage mode.", "choices": ["soft", "hard", "reward"]}
    )
    segment_reward_funcs: list[str] = field(
        default_factory=list, metadata={"help": "Segment rewards (one score per trainable segment) for 'reward'."}
    )
    segment_reward_lambda: float = field(default=1.0, metadata={"help": "λ, the weight of the segment reward."})
    arpo: bool = field(default=False, metadata={"help": "ARPO entropy-guided branching after tool results."})
    arpo_initial_rollouts: int | None = field(
        default=None, metadata={"help": "ARPO: N full rollouts per group (default num_generations / 2)."}
    )
    arpo_branches: int = field(default=2, metadata={"help": "ARPO: Z continuations per accepted branch point."})
    arpo_entropy_tokens: int = field(default=10, metadata={"help": "ARPO: k tokens whose entropy is measured."})
    arpo_alpha: float = field(default=0.5, metadata={"help": "ARPO: α in clip(α + β·ΔH, 0, 1). Paper: 0.5."})
    arpo_beta: float = field(default=0.2, metadata={"help": "ARPO: β in clip(α + β·ΔH, 0, 1). Paper: 0.2."})

    def __post_init__(self):
        super().__post_init__()
        self._check_pta()
        self._check_segments()
        self._check_advantage_estimator()
        self._check_dynamic_sampling()
        if self.budget_start is not None:
            from .curriculum import check_schedule

            total = self.budget_total_steps or (self.max_steps if self.max_steps > 0 else None)
            check_schedule(start=self.budget_start, end=self.budget_end, num_decays=self.budget_decays,
                           total_steps=total, schedule=self.budget_schedule)  # fmt: skip
        for name, choices in (("budget_length_shape", ("triangular", "band")),
                              ("budget_length_count", ("completion", "think"))):  # fmt: skip
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {choices}.")
        for name in ("context_prefix_column", "completion_prefix_column"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name}={value!r} must be a dataset column name, or None to switch it off.")
        if self.context_prefix_column is not None and self.context_prefix_column == self.completion_prefix_column:
            raise ValueError(
                f"context_prefix_column and completion_prefix_column are both {self.context_prefix_column!r}; a prefix "
                "is either context (not trained) or part of the completion (trained): set only one."
            )

    def _check_advantage_estimator(self):
        from .advantages import list_advantages

        value = self.advantage_estimator
        if callable(value):
            return
        if not isinstance(value, str) or not value:
            raise ValueError(
                f"advantage_estimator={value!r} must be a registry name, a dotted import path or a callable; "
                f"known names: {', '.join(list_advantages())}."
            )
        if value not in list_advantages() and "." not in value:
            raise ValueError(
                f"advantage_estimator={value!r} is not a registered estimator. Known: {', '.join(list_advantages())}; "
                "register yours with `trl_grpo_ext.register_advantage` before building the config, or give its dotted "
                "import path (e.g. 'my_package.my_estimator')."
            )

    def _check_pta(self):
        m, z = self.num_plans, self.continuations_per_plan
        if m is None and z is None:
            return
        for name, value in (("num_plans", m), ("continuations_per_plan", z)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a whole number >= 1 (the paper uses 3); set both or neither.")
        if m * z != self.num_generations:
            raise ValueError(
                f"num_plans * continuations_per_plan ({m}*{z}={m * z}) must equal num_generations "
                f"({self.num_generations}); e.g. set num_generations={m * z}."
            )
        if self.plan_max_tokens is not None and self.plan_max_tokens < 1:
            raise ValueError(f"plan_max_tokens={self.plan_max_tokens} must be >= 1, or None for max_completion_length.")
        if not self.plan_tag or not self.plan_tag.replace("_", "").isalnum():
            raise ValueError(f"plan_tag={self.plan_tag!r} must be a bare tag name such as 'plan'.")

    def _check_segments(self):
        if self.segment_by is not None:
            from .segments import parse_segment_by

            parse_segment_by(self.segment_by)
        if self.segment_advantage not in ("soft", "hard", "reward"):
            raise ValueError(f"segment_advantage={self.segment_advantage!r} is not one of 'soft', 'hard', 'reward'.")
        if self.segment_advantage == "reward" and not self.segment_reward_funcs:
            raise ValueError(
                "segment_advantage='reward' needs segment_reward_funcs, e.g. ['tool_call_validity']; or use 'soft'."
            )
        if not self.arpo:
            return
        m = self.num_generations
        if self.arpo_initial_rollouts is None:
            self.arpo_initial_rollouts = max(1, m // 2)
        n, z = self.arpo_initial_rollouts, self.arpo_branches
        if not 1 <= n <= m:
            raise ValueError(f"arpo_initial_rollouts={n} must be between 1 and num_generations={m}.")
        if z < 1 or (n < m and z > m - n):
            raise ValueError(
                f"arpo_branches={z} cannot fit: after arpo_initial_rollouts={n} full rollouts, a group of "
                f"num_generations={m} has {m - n} slot(s) left for branches; use arpo_branches between 1 and {max(m - n, 1)}."
            )
        if self.arpo_entropy_tokens < 1:
            raise ValueError(f"arpo_entropy_tokens={self.arpo_entropy_tokens} must be >= 1.")

    def _check_dynamic_sampling(self):
        rounds = self.dynamic_sampling_max_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"dynamic_sampling_max_rounds={rounds!r} must be a whole number >= 0 (0: drop only).")
        if rounds > 0 and not self.dynamic_sampling:
            raise ValueError(
                f"dynamic_sampling_max_rounds={rounds} refills dropped groups, but dynamic_sampling=False; set "
                "dynamic_sampling=True, or dynamic_sampling_max_rounds=0."
            )
        if rounds > 0:
            self.require_whole_groups(f"dynamic_sampling_max_rounds={rounds} (or set it to 0)")

    def require_whole_groups(self, what: str) -> None:
        """Raise unless each process holds whole groups (every row of a prompt's group on one process)."""
        rows = self.per_device_train_batch_size * (self.steps_per_generation or 1)
        if rows % self.num_generations:
            raise ValueError(
                f"{what} works on whole groups per process: per_device_train_batch_size * steps_per_generation "
                f"({rows}) must be a multiple of num_generations ({self.num_generations})."
            )


@dataclass
class ProRLConfig(GRPOExtConfig):
    r"""`GRPOExtConfig` with ProRL's recipe as defaults (arXiv 2505.24864, §3; NVIDIA's DeepSeek-R1-Distill-Qwen-1.5B
    run). Every field can still be set.

    Defaults that differ from `GRPOExtConfig`:
        epsilon (0.2) and epsilon_high (0.4): decoupled clipping ("clip-higher", from DAPO).
        beta (1e-4): a small KL penalty, kept so that reference resets have something to reset.
        temperature (1.2): high rollout temperature, for diverse samples over a long run.
        num_generations (16) and per_device_train_batch_size (16): 16 rollouts a prompt.
        learning_rate (2e-6) with lr_scheduler_type ("constant").
        loss_type ("dapo"): token-level normalisation.
        dynamic_sampling (True): groups whose rollouts all succeed or all fail are dropped.
    """

    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping bound. ProRL: 0.2."})
    epsilon_high: float | None = field(default=0.4, metadata={"help": "Upper clipping bound. ProRL: 0.4."})
    beta: float = field(default=1e-4, metadata={"help": "KL coefficient: small, as in ProRL."})
    temperature: float = field(default=1.2, metadata={"help": "Rollout temperature. ProRL: 1.2."})
    num_generations: int | None = field(default=16, metadata={"help": "Rollouts per prompt. ProRL: 16."})
    per_device_train_batch_size: int = field(default=16, metadata={"help": "Rows per device and step."})
    learning_rate: float = field(default=2e-6, metadata={"help": "Constant learning rate. ProRL: 2e-6."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "ProRL keeps the learning rate constant."})
    loss_type: str = field(default="dapo", metadata={"help": "Loss normalisation. ProRL: token-level (dapo)."})
    dynamic_sampling: bool = field(default=True, metadata={"help": "Drop zero-variance groups. ProRL: on."})


@dataclass
class PTAGRPOConfig(GRPOExtConfig):
    r"""`GRPOExtConfig` with PTA-GRPO's rollout tree as defaults (arXiv 2510.01833, §4: m = 3 plans, z = 3
    continuations each, one group of 9). Every field can still be set."""

    num_plans: int | None = field(default=3, metadata={"help": "Plans per prompt (m). Paper: 3."})
    continuations_per_plan: int | None = field(default=3, metadata={"help": "Continuations per plan (z). Paper: 3."})
    num_generations: int | None = field(default=9, metadata={"help": "m * z rows per prompt."})
    per_device_train_batch_size: int = field(default=9, metadata={"help": "Rows per device and step (whole groups)."})
