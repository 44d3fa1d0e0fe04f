"""The extension pipeline's pieces that methods build on: the `Extension` hooks and the method record.

Every method is an `Extension` on `GRPOExtTrainer`'s pipeline; methods compose because they only meet there. Per
generation batch the trainer runs, in order:

1. `before_batch(mode)`: once per batch, before anything is generated (ProRL applies a pending reset here);
2. `prepare(plan)`: add context or completion prefixes to the rows (`RolloutPlan`), or fill fields into them;
3. `rollout(plan, prompts)`: the one extension that owns the rollout generates it (PTA's plans, ARPO's branches);
   without one, or when it returns None, TRL generates as usual from the plan's prefixes;
4. TRL scores the rows (reward functions see whole trajectories), then the advantage estimator runs;
5. `after_scoring(batch)`: advantages, loss weights, dropped rows, metrics, in `order`.

Steps 2-5 also run for the extra batches an extension asks for (`trainer.score_rows`, dynamic-sampling refills).
A method module defines its config section, its extension and its rewards, and registers a `Method` record;
`trl_grpo_ext/trainer.py` imports no method module. docs/extending.md walks through writing one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .batch import RolloutBatch
    from .rollout import Rollout, RolloutPlan

__all__ = ["Extension", "TrainerInputs", "Method", "register_method", "list_methods", "get_method"]


@dataclass
class TrainerInputs:
    """What a trainer was given, for `Extension.check` (before any model loads)."""

    args: object
    reward_funcs: list | None
    train_dataset: object
    eval_dataset: object
    tools: list | None
    environment_factory: object
    rollout_func: object


class Extension:
    """One method's hooks on the pipeline. Subclass it, override the hooks you need, and register a `Method`.

    Class attributes:
        name: the method's name and metric prefix (`trainer.log_metric(f"{name}/...")`, or `self.log(...)`).
        owns_rollout: whether `rollout` generates the batch; at most one extension of a trainer may.
        order: `after_scoring` runs in increasing order (estimators 0, filters that drop rows 100).

    An extension that is also a `transformers.TrainerCallback` is registered as a callback too (step events). After
    `setup`, `self.trainer` is the trainer; hooks use its public methods only (`generate_stage`,
    `generate_rollouts`, `continue_rollouts`, `score_rows`, `log_metric`, ...), never TRL's private ones.
    """

    name: str = ""
    owns_rollout: bool = False
    order: int = 0

    trainer = None

    def check(self, inputs: TrainerInputs) -> None:
        """Raise a ValueError naming the field, the value and the fix, before any model loads."""

    def setup(self, trainer) -> None:
        """Called once, after TRL's trainer is built."""
        self.trainer = trainer

    def before_batch(self, mode: str) -> None:
        """Called once per generation batch, before it is generated (not for extra batches)."""

    def prepare(self, plan: RolloutPlan) -> None:
        """Add context / completion prefixes to the plan's rows, or fill fields into the rows."""

    def rollout(self, plan: RolloutPlan, prompts: list) -> Rollout | None:
        """Generate the batch (only if `owns_rollout`). `prompts` are TRL's, one per row; None: generate as usual."""
        return None

    def after_scoring(self, batch: RolloutBatch) -> None:
        """Read the scored batch; write advantages, loss weights or dropped rows; log metrics."""

    def state_dict(self) -> dict:
        """State saved in every checkpoint (tensors allowed) and given back to `load_state_dict` on resume."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""

    def log(self, key: str, value: float, mode: str | None = None) -> None:
        """Log `name/key` with TRL's metrics (averaged over each logging interval); `mode` defaults to the model's."""
        if self.trainer is None:
            raise RuntimeError(
                f"{type(self).__name__} has no trainer: it is an extension of trl_grpo_ext trainers; pass it in "
                "`callbacks=[...]` or `extensions=[...]` of one (plain TRL trainers do not run extensions)."
            )
        mode = mode or ("train" if self.trainer.model.training else "eval")
        self.trainer.log_metric(f"{self.name}/{key}", value, mode=mode)


@dataclass(frozen=True)
class Method:
    """A method of the package: what the CLI's `--trainer`, the model card and the docs index are built from.

    Attributes:
        name: the key (`pta`), also its extension's metric prefix.
        title: the method as the model card names it.
        arxiv: its paper's arXiv id, or None for a piece of the engine.
        extension: builds the extension from the config, or returns None when the config does not switch it on.
        trainer: the named trainer that switches it on (`PTAGRPOTrainer`), exported by `trl_grpo_ext`, or None.
        config: that trainer's config class name (`PTAGRPOConfig`), or None for `GRPOExtConfig`.
        cli_name: the `--trainer` name, when it differs from `name`.
    """

    name: str
    title: str
    arxiv: str | None
    extension: Callable[[object], Extension | None] | None = None
    trainer: str | None = None
    config: str | None = None
    cli_name: str | None = None


METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    """Register a method record; a name taken by another record raises."""
    known = METHODS.get(method.name)
    if known is not None and known != method:
        raise ValueError(f"method {method.name!r} is already registered ({known.title}); pick another name.")
    METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
    if name not in METHODS:
        _load_builtins()
    if name not in METHODS:
        raise KeyError(f"unknown method {name!r}. Known methods: {', '.join(METHODS)}.")
    return METHODS[name]


def list_methods() -> list[Method]:
    """The registered methods, in registration order."""
    _load_builtins()
    return list(METHODS.values())


def _load_builtins() -> None:
    import trl_grpo_ext  # the package imports its methods lazily: they register on first use

    trl_grpo_ext.load_builtins()
