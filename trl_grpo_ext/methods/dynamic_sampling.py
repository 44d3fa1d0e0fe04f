"""Dynamic sampling (DAPO, arXiv 2503.14476, §3.2; ProRL's recipe): keep only groups whose outcomes vary.

A group whose G completions are all right, or all wrong, has zero advantage for every member: it costs a forward and
backward pass, teaches nothing, and dilutes the batch. Such groups are dropped from the loss (which is then
normalised over the kept rows, for every `loss_type`), after up to `dynamic_sampling_max_rounds` rounds that refill
them with groups of fresh prompts.

DAPO and ProRL filter on accuracy (all right or all wrong), not on the total reward: a shaping term such as a brevity
bonus gives almost every group some variance and would keep groups that carry no correctness signal. So the filter
reads one reward function: `dynamic_sampling_reward` names it; by default it is the correctness reward when one is
present (TRL's `accuracy_reward` / `reasoning_accuracy_reward`, or any reward with `correctness = True`), else the
weighted total.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..advantages.group import group_stats
from ..extension import Extension, Method, TrainerInputs, register_method

logger = logging.getLogger(__name__)

CORRECTNESS_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward")


def varied_groups(values: torch.Tensor, num_generations: int, tol: float = 1e-6) -> torch.Tensor:
    """(N / G,) bool: True for the groups whose scored values are not all equal (NaN rows, unscorable, are left out:
    a group whose scored rows agree is flat, as is one with fewer than two scored rows).

    >>> varied_groups(torch.tensor([1.0, 1.0, 0.0, 0.5, 0.5, 0.5]), 3).tolist()
    [True, False]
    """
    stats = group_stats(values, num_generations)
    return (stats.high - stats.low) > tol  # a group with fewer than two scored rows: 0 or NaN, flat


@dataclass
class DynamicSamplingConfig:
    """Config section: DAPO's dynamic sampling (arXiv 2503.14476; used by ProRL).

    > Parameters of dynamic sampling (DAPO, arXiv 2503.14476; `trl_grpo_ext.methods.dynamic_sampling`)

    dynamic_sampling (`bool`, *optional*, defaults to `False`):
        Drop from the loss the groups whose outcomes all agree (zero variance: zero advantage, no signal); the loss
        is then normalised over the kept rows, for every `loss_type`. Logs `dynamic_sampling/kept_fraction`. TRL
        has no such option (huggingface/trl#3708).
    dynamic_sampling_max_rounds (`int`, *optional*, defaults to `0`):
        Before dropping, refill the batch: up to this many extra generation rounds on fresh prompts drawn from
        the training set, replacing zero-variance groups with varied ones. 0 only drops. When the rounds run out,
        the rest is dropped with a warning. Needs whole groups on each process.
    dynamic_sampling_reward (`str`, *optional*):
        The reward whose values must vary within a group: its logged name (`accuracy_reward`), or `"total"` for
        the weighted sum. Default: the correctness reward when one is present (as DAPO and ProRL filter on
        accuracy), else the total.
    """

    dynamic_sampling: bool = field(
        default=False, metadata={"help": "Drop groups whose outcomes all agree from the loss (DAPO dynamic sampling)."}
    )
    dynamic_sampling_max_rounds: int = field(
        default=0,
        metadata={"help": "Extra generation rounds that refill dropped groups with fresh prompts (0: only drop)."},
    )
    dynamic_sampling_reward: str | None = field(
        default=None,
        metadata={
            "help": "The reward function whose values must vary within a group (its logged name, e.g. "
            "'accuracy_reward'), or 'total' for the weighted sum. Default: the correctness reward if present, else "
            "the total."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        rounds = self.dynamic_sampling_max_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"dynamic_sampling_max_rounds={rounds!r} must be a whole number >= 0 (0: drop only).")
        if not self.dynamic_sampling and (rounds > 0 or self.dynamic_sampling_reward is not None):
            what = (f"dynamic_sampling_max_rounds={rounds}" if rounds
                    else f"dynamic_sampling_reward={self.dynamic_sampling_reward!r}")  # fmt: skip
            raise ValueError(
                f"{what} is set, but dynamic_sampling=False; set dynamic_sampling=True, or leave {what.split('=')[0]} "
                "at its default."
            )
        if rounds > 0:
            self.require_whole_groups(f"dynamic_sampling_max_rounds={rounds} (or set it to 0)")


class DynamicSampling(Extension):
    """Drops zero-variance groups from the loss, after bounded refills.

    Metrics: `dynamic_sampling/kept_fraction` (of groups, before refills), `dynamic_sampling/refill_rounds`,
    `dynamic_sampling/final_kept_fraction`, `dynamic_sampling/generated_tokens` (the step's completion tokens on all
    processes, refills included: TRL's `completions/mean_length` averages the batches, it does not add them).
    """

    name = "dynamic_sampling"
    order = 100  # after the advantages are written: it only removes rows

    def __init__(self, max_rounds: int = 0, reward: str | None = None, seed: int = 0):
        self.max_rounds, self.reward, self.seed = max_rounds, reward, seed
        self.column: int | None = None  # the reward function filtered on; None: the weighted total
        self._generator: torch.Generator | None = None

    def check(self, inputs: TrainerInputs) -> None:
        dataset = inputs.train_dataset
        if self.max_rounds > 0 and not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ValueError(
                f"dynamic_sampling_max_rounds={self.max_rounds} draws fresh prompts from train_dataset, which must then "
                "be a map-style dataset (an IterableDataset cannot be indexed); set dynamic_sampling_max_rounds=0 to "
                "only drop groups."
            )
        if self.reward not in (None, "total"):
            from .bicc import reward_names  # bicc imports this module's CORRECTNESS_REWARDS

            self._reward_column(reward_names(inputs.reward_funcs))  # before the model loads; `setup` reads TRL's names

    def _reward_column(self, names: list[str]) -> int:
        if self.reward not in names:
            raise ValueError(
                f"dynamic_sampling_reward={self.reward!r} is not one of this trainer's rewards {names}; give the name "
                "a reward is logged under (rewards/<name>/mean), or 'total'."
            )
        return names.index(self.reward)

    def setup(self, trainer) -> None:
        super().setup(trainer)
        names = list(trainer.reward_func_names)
        if self.reward == "total":
            self.column = None
        elif self.reward is not None:
            self.column = self._reward_column(names)
        else:
            marked = [i for i, f in enumerate(trainer.reward_funcs) if getattr(f, "correctness", False)]
            named = [i for i, n in enumerate(names) if n in CORRECTNESS_REWARDS]
            self.column = (marked or named or [None])[0]
        what = "the weighted total reward" if self.column is None else f"the reward {names[self.column]!r}"
        logger.info(f"dynamic sampling keeps the groups whose {what} varies.")
        # Its own generator: refills must not shift the global RNG that generation and shuffling draw from. Seeded
        # alike on every process, it draws every process's refills (`_draw`), so its state, which the main process
        # saves in checkpoints, is every process's.
        self._generator = torch.Generator().manual_seed(self.seed)

    def after_scoring(self, batch) -> None:
        if batch.mode != "train":
            return
        trainer, group = self.trainer, batch.num_generations
        keep = self._varied_rows(batch)  # (B,)
        kept_groups = trainer.accelerator.gather(keep.float().sum().reshape(1)).sum().item() / group
        total_groups = trainer.accelerator.gather(torch.tensor([float(keep.numel())], device=keep.device)).sum().item()
        total_groups /= group
        self.log("kept_fraction", kept_groups / total_groups)
        generated = self._tokens(batch)
        rounds = 0
        while rounds < self.max_rounds:
            # Every process runs the same number of rounds: generation and scoring gather across processes.
            need = int(trainer.accelerator.gather(((~keep).sum() // group).reshape(1)).max().item())
            if need == 0:
                break
            rounds += 1
            extra = trainer.score_rows(self._draw(need, group), until=self)
            generated += self._tokens(extra)
            fresh = self._varied_rows(extra)
            dropped = [g for g in range(keep.numel() // group) if not keep[g * group]]
            usable = [g for g in range(need) if fresh[g * group]]
            replace = {
                d * group + j: u * group + j for d, u in zip(dropped, usable, strict=False) for j in range(group)
            }
            batch = trainer.splice_rows(batch, extra, replace)
            keep[list(replace)] = True
        self.log("generated_tokens", generated)
        remaining = int(trainer.accelerator.gather((~keep).sum().reshape(1)).sum().item()) // group
        if self.max_rounds > 0:
            self.log("refill_rounds", rounds)
            if remaining:
                logger.warning(
                    f"dynamic sampling: {remaining} group(s) still have zero variance after "
                    f"dynamic_sampling_max_rounds={self.max_rounds} refill round(s); they are dropped from this step's "
                    "loss. Raise dynamic_sampling_max_rounds, or check that the rewards can vary within a group."
                )
        self.log("final_kept_fraction", 1.0 - remaining / total_groups)
        if not bool(keep.all()):
            batch.drop_rows(~keep)

    def _tokens(self, batch) -> float:
        """The completion tokens of `batch` on every process."""
        return self.trainer.accelerator.gather(batch.completion_mask.sum().float().reshape(1)).sum().item()

    def _varied_rows(self, batch) -> torch.Tensor:
        """(B,) bool: this process's rows whose group (over all processes) has filter values that vary."""
        values = batch.rewards if self.column is None else batch.rewards_per_func[:, self.column]  # (N,)
        rows = varied_groups(values, batch.num_generations).repeat_interleave(batch.num_generations)  # (N,)
        return batch.local(rows).clone().to(batch.completion_mask.device)

    def _draw(self, num_groups: int, group: int) -> list[dict]:
        """`num_groups` prompts drawn at random from the training set, each repeated for a whole group: this process's
        share of a draw for every process (each process draws as many)."""
        dataset, accelerator = self.trainer.train_dataset, self.trainer.accelerator
        drawn = torch.randint(len(dataset), (accelerator.num_processes, num_groups), generator=self._generator)
        indices = drawn[accelerator.process_index].tolist()
        return [dict(dataset[i]) for i in indices for _ in range(group)]

    def state_dict(self) -> dict:
        # Refills draw their prompts from this generator: a resumed run draws the ones the uninterrupted run draws.
        return {"generator": self._generator.get_state()} if self._generator is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if "generator" in state and self._generator is not None:
            self._generator.set_state(state["generator"])


def _from_config(args) -> DynamicSampling | None:
    if not getattr(args, "dynamic_sampling", False):
        return None
    return DynamicSampling(args.dynamic_sampling_max_rounds, args.dynamic_sampling_reward, seed=args.seed)


register_method(Method(name="dynamic_sampling", title="Dynamic sampling (DAPO)", arxiv="2503.14476",
                       extension=_from_config))  # fmt: skip
