"""BiCC, bilateral context conditioning (arXiv 2603.13134): learn from right and wrong answers side by side.

With a binary reward GRPO's objective contrasts the correct and the wrong completions of a group, yet each is scored
without seeing the other. BiCC adds, in every group that holds both, training rows in which a completion is
conditioned on an opposite one: a correct o+ is also trained as π(o+ | q ⊕ sep ⊕ o−), a wrong o− as
π(o− | q ⊕ sep ⊕ o+). The opposite answer is context (truncated to a fraction of the context budget; 40% worked best
in the paper), only the row's own completion is in the loss, and the row keeps its original advantage. Nothing is
sampled again: the rows are added after scoring (`trainer.add_rows`), with their log-probs under the new context
computed where TRL's loss needs them.

"Correct" is read from one named reward and a threshold (`bicc_reward`, `bicc_threshold`), never guessed: without a
name, the one reward marked as correctness (TRL's `accuracy_reward`, or any reward with `correctness = True`) is used,
and a config that names none, or a reward the trainer does not have, fails before the model loads.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import torch

from ..extension import Extension, Method, TrainerInputs, register_method
from ..rewards import get_reward, list_rewards
from .dynamic_sampling import CORRECTNESS_REWARDS

logger = logging.getLogger(__name__)

PAIRINGS = ("random", "all", "confident")
DEFAULT_SEPARATOR = "\n\nAnother answer to this question, for comparison:\n"


@dataclass
class BiCCConfig:
    """Config section: BiCC's conditioned rows (arXiv 2603.13134; `trl_grpo_ext.methods.bicc`).

    > Parameters of BiCC, bilateral context conditioning (arXiv 2603.13134; `trl_grpo_ext.methods.bicc`)

    bicc (`bool`, *optional*, defaults to `False`):
        In every group with both correct and wrong completions, add training rows where a completion follows the
        question and an opposite answer; the row's own completion alone is in the loss, with its original advantage.
        Logs `bicc/pairs`, `bicc/rows_added` and `bicc/mixed_groups`. Training only (evaluation adds no rows).
    bicc_reward (`str`, *optional*):
        The reward that says "correct": its logged name (`accuracy_reward`) or registry name (`accuracy`). Default:
        the one reward marked as correctness (TRL's `accuracy_reward` / `reasoning_accuracy_reward`, or a reward
        with `correctness = True`); with none or several, set it.
    bicc_threshold (`float`, *optional*, defaults to `0.5`):
        A completion is correct when that reward is at least this value.
    bicc_pairing (`str`, *optional*, defaults to `"random"`):
        Which opposite answer each row is conditioned on: `"random"` (one opposite drawn at random per row),
        `"all"` (every ordered (row, opposite) pair of the group, at most `bicc_max_pairs` per group, drawn at random
        when there are more) or `"confident"` (per row, the opposite answer the policy is most confident in: the
        highest mean token log-prob).
    bicc_max_pairs (`int`, *optional*):
        With `bicc_pairing="all"`, the most conditioned rows added per group. Default: `num_generations`.
    bicc_context_fraction (`float`, *optional*, defaults to `0.4`):
        The opposite answer is cut to its first floor(fraction · budget) tokens (the paper's best of 20/40/60%).
    bicc_context_budget (`int`, *optional*):
        The context budget in tokens that the fraction is taken of. Default: `max_completion_length`.
    bicc_separator (`str`, *optional*):
        The text between the question and the opposite answer (default: a blank line and "Another answer to this
        question, for comparison:").
    """

    bicc: bool = field(default=False, metadata={"help": "Add rows conditioned on an opposite answer (BiCC)."})
    bicc_reward: str | None = field(
        default=None,
        metadata={
            "help": "BiCC: the correctness reward (logged or registry name). Default: the one marked correctness."
        },
    )
    bicc_threshold: float = field(default=0.5, metadata={"help": "BiCC: correct when the reward is >= this."})
    bicc_pairing: str = field(default="random", metadata={"help": "BiCC pairing: 'random', 'all' or 'confident'."})
    bicc_max_pairs: int | None = field(
        default=None, metadata={"help": "BiCC, pairing 'all': most rows added per group (default num_generations)."}
    )
    bicc_context_fraction: float = field(
        default=0.4, metadata={"help": "BiCC: the opposite answer keeps this fraction of the context budget."}
    )
    bicc_context_budget: int | None = field(
        default=None, metadata={"help": "BiCC: the context budget in tokens (default max_completion_length)."}
    )
    bicc_separator: str = field(
        default=DEFAULT_SEPARATOR, metadata={"help": "BiCC: the text between the question and the opposite answer."}
    )

    def __post_init__(self):
        super().__post_init__()
        check_bicc_config(self)


def check_bicc_config(args) -> None:
    """Raise a ValueError naming the BiCC field, its value and the fix."""
    defaults = {"bicc_reward": None, "bicc_threshold": 0.5, "bicc_pairing": "random", "bicc_max_pairs": None,
                "bicc_context_fraction": 0.4, "bicc_context_budget": None, "bicc_separator": DEFAULT_SEPARATOR}  # fmt: skip
    if not args.bicc:
        changed = [name for name, value in defaults.items() if getattr(args, name) != value]
        if changed:
            raise ValueError(
                f"{changed[0]}={getattr(args, changed[0])!r} is set, but bicc=False; set bicc=True, or leave "
                f"{changed[0]} at its default."
            )
        return
    if args.bicc_pairing not in PAIRINGS:
        raise ValueError(f"bicc_pairing={args.bicc_pairing!r} is not one of {', '.join(map(repr, PAIRINGS))}.")
    fraction = args.bicc_context_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        raise ValueError(f"bicc_context_fraction={fraction!r} must be in (0, 1]; the paper's best is 0.4.")
    for name in ("bicc_max_pairs", "bicc_context_budget"):
        value = getattr(args, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be a whole number >= 1, or None for its default.")
    if args.bicc_max_pairs is not None and args.bicc_pairing != "all":
        raise ValueError(
            f"bicc_max_pairs={args.bicc_max_pairs} caps bicc_pairing='all', but bicc_pairing={args.bicc_pairing!r}; "
            "set bicc_pairing='all', or leave bicc_max_pairs unset."
        )
    if isinstance(args.bicc_threshold, bool) or not isinstance(args.bicc_threshold, int | float):
        raise ValueError(f"bicc_threshold={args.bicc_threshold!r} must be a number (correct: reward >= threshold).")
    args.require_whole_groups("bicc=True (it pairs completions within a group)")


def reward_names(reward_funcs) -> list[str]:
    """The names TRL logs the rewards under (`rewards/<name>/mean`): a function's `__name__`, a model's id tail."""
    names = []
    for reward in reward_funcs or []:
        if isinstance(reward, str):
            names.append(reward.split("/")[-1])
        elif hasattr(reward, "config") and hasattr(reward.config, "_name_or_path"):
            names.append(reward.config._name_or_path.split("/")[-1])
        else:
            names.append(getattr(reward, "__name__", type(reward).__name__))
    return names


def correctness_column(
    reward_funcs, name: str | None, *, option: str = "bicc_reward", switch: str = "bicc=True"
) -> int:
    """The index of the reward that says "correct": `name` (logged or registry name), else the one so marked.

    `option` and `switch` name the config field that gives `name` and the setting that needs it, in the errors.
    """
    names = reward_names(reward_funcs)
    if not reward_funcs:
        raise ValueError(f"{switch} needs reward_funcs with a correctness reward (e.g. ['accuracy']).")
    if name is not None:
        if name in names:
            return names.index(name)
        if name in list_rewards():
            function = get_reward(name) if not _is_factory(name) else None
            for i, reward in enumerate(reward_funcs):
                if reward is function:
                    return i
        raise ValueError(
            f"{option}={name!r} is not one of this trainer's rewards {names}; give the name a reward is logged "
            "under (rewards/<name>/mean) or its registry name, and add that reward to reward_funcs."
        )
    marked = [
        i for i, f in enumerate(reward_funcs) if getattr(f, "correctness", False) or names[i] in CORRECTNESS_REWARDS
    ]
    if len(marked) != 1:
        what = "no reward is" if not marked else f"{len(marked)} rewards ({[names[i] for i in marked]}) are"
        raise ValueError(
            f"{switch} reads correctness from one reward, and {what} marked as correctness among {names}; set "
            f"{option} to the one that says whether an answer is right."
        )
    return marked[0]


def _is_factory(name: str) -> bool:
    from ..rewards import REWARDS

    return REWARDS._entries[name].factory


def with_context(prompt, text: str, separator: str):
    """`prompt` with `separator + text` after the question: the last user message of a conversation, or the end of a
    plain prompt. The prompt itself is not changed.

    >>> with_context([{"role": "user", "content": "2 + 2?"}], "5", " | ")
    [{'role': 'user', 'content': '2 + 2? | 5'}]
    """
    if isinstance(prompt, str):
        return prompt + separator + text
    messages = copy.deepcopy(list(prompt))
    for message in reversed(messages):
        if message.get("role") == "user":
            if isinstance(message["content"], str):
                message["content"] = message["content"] + separator + text
            else:
                message["content"] = [*message["content"], {"type": "text", "text": separator + text}]
            return messages
    raise ValueError("BiCC puts the opposite answer after the question, but this prompt has no user message.")


def pair_rows(
    correct: list[bool], rule: str, generator: torch.Generator, confidence: list[float] | None = None, cap: int = 0
) -> list[tuple[int, int]]:
    """The (row, opposite) pairs of one group: row i is trained after the opposite answer j (`correct[i] != correct[j]`).

    `random`: one opposite per row, drawn uniformly; `confident`: per row, the opposite with the highest
    `confidence`; `all`: every ordered pair, `cap` of them drawn at random when there are more. A group without both
    kinds gives none.

    >>> pair_rows([True, False, False], "all", torch.Generator().manual_seed(0), cap=8)
    [(0, 1), (0, 2), (1, 0), (2, 0)]
    """
    rows = range(len(correct))
    if len(set(correct)) < 2:
        return []
    opposites = {i: [j for j in rows if correct[j] != correct[i]] for i in rows}
    if rule == "all":
        pairs = [(i, j) for i in rows for j in opposites[i]]
        if len(pairs) > cap:
            keep = torch.randperm(len(pairs), generator=generator)[:cap].sort().values.tolist()
            pairs = [pairs[k] for k in keep]
        return pairs
    if rule == "confident":
        return [(i, max(opposites[i], key=lambda j: (confidence[j], -j))) for i in rows]
    if rule == "random":
        return [(i, opposites[i][int(torch.randint(len(opposites[i]), (1,), generator=generator))]) for i in rows]
    raise ValueError(f"unknown pairing rule {rule!r}; use one of {PAIRINGS}.")


class BiCC(Extension):
    """Adds, after scoring, the rows of each mixed group conditioned on an opposite answer.

    Runs last (`order` 200), so that every advantage, loss weight and dropped row is final when it is copied.
    Metrics: `bicc/mixed_groups` (fraction of groups with both kinds), `bicc/pairs` (distinct (correct, wrong)
    pairs used) and `bicc/rows_added`, summed over processes.
    """

    name = "bicc"
    order = 200

    def __init__(self, reward: str | None = None, threshold: float = 0.5, pairing: str = "random",
                 max_pairs: int | None = None, context_fraction: float = 0.4, context_budget: int | None = None,
                 separator: str = DEFAULT_SEPARATOR, seed: int = 0):  # fmt: skip
        if pairing not in PAIRINGS:
            raise ValueError(f"pairing={pairing!r} is not one of {PAIRINGS}.")
        self.reward, self.threshold, self.pairing, self.max_pairs = reward, threshold, pairing, max_pairs
        self.context_fraction, self.context_budget, self.separator, self.seed = (
            context_fraction, context_budget, separator, seed,
        )  # fmt: skip
        self.column: int | None = None
        self._generator: torch.Generator | None = None

    def check(self, inputs: TrainerInputs) -> None:
        correctness_column(inputs.reward_funcs, self.reward)
        if inputs.rollout_func is not None:
            raise ValueError("bicc=True needs TRL's own prompts and completions; it does not work with rollout_func.")

    def setup(self, trainer) -> None:
        super().setup(trainer)
        self.column = correctness_column(trainer.reward_funcs, self.reward)
        # One generator, seeded alike on every process, draws for every group of the batch (see `after_scoring`).
        self._generator = torch.Generator().manual_seed(self.seed)
        logger.info(
            f"BiCC: a completion is correct when {trainer.reward_func_names[self.column]} >= {self.threshold}."
        )

    @property
    def context_tokens(self) -> int:
        budget = self.context_budget or self.trainer.args.max_completion_length
        return max(1, int(self.context_fraction * budget))

    def after_scoring(self, batch) -> None:
        if batch.mode != "train":
            return
        trainer, group = self.trainer, batch.num_generations
        scored, first = batch.num_scored, batch.process_slice.start
        # Pairs are drawn for every group of every process, in row order, and each process keeps its own groups'
        # (groups are whole on a process): the draws are those of one process holding the whole batch, and the
        # generator, whose state the main process saves in checkpoints, moves alike on every process.
        values = batch.rewards_per_func[:, self.column]  # (N,)
        dropped = batch.dropped[:scored] if batch.dropped is not None else torch.zeros(scored, dtype=torch.bool)
        usable = ~torch.isnan(values) & ~trainer.accelerator.gather(dropped.long().to(values.device)).bool()  # (N,)
        correct = (values >= self.threshold).tolist()
        confidence = None
        if self.pairing == "confident":
            confidence = trainer.accelerator.gather(torch.tensor(self._confidence(batch), device=values.device))
            confidence = confidence.tolist()
        cap = self.max_pairs or group
        pairs, mixed = [], 0
        for start in range(0, values.numel(), group):
            rows = [r for r in range(start, start + group) if bool(usable[r])]
            found = pair_rows([correct[r] for r in rows], self.pairing, self._generator,
                              None if confidence is None else [confidence[r] for r in rows], cap)  # fmt: skip
            if first <= start < first + scored:
                mixed += bool(found)
                pairs += [(rows[i] - first, rows[j] - first) for i, j in found]
        sources = [i for i, _ in pairs]
        if pairs:
            texts = [self._opposite_text(batch, j) for _, j in pairs]
            prompts = [
                with_context(batch.prompts[i], text, self.separator) for (i, _), text in zip(pairs, texts, strict=True)
            ]
            prompt_ids = self._prompt_ids(batch, sources, prompts)
            trainer.add_rows(batch, sources, prompt_ids, prompts=prompts)
        distinct = len({frozenset(p) for p in pairs})
        counts = [float(mixed), float(distinct), float(len(pairs)), float(scored // group)]
        counts = torch.tensor(counts, device=batch.completion_ids.device)
        totals = trainer.accelerator.gather(counts).view(-1, 4).sum(0)
        self.log("mixed_groups", (totals[0] / totals[3].clamp(min=1)).item(), mode="train")
        self.log("pairs", totals[1].item(), mode="train")
        self.log("rows_added", totals[2].item(), mode="train")

    def _opposite_text(self, batch, row: int) -> str:
        ids = batch.completion_ids[row][batch.completion_mask[row].bool()][: self.context_tokens]
        return self.trainer.tokenizer.decode(ids.tolist(), skip_special_tokens=True)

    def _prompt_ids(self, batch, sources: list[int], prompts: list) -> list[list[int]]:
        # The new prompt, tokenized as TRL tokenizes prompts, followed by any context ids an extension put after the
        # source's own prompt (a hint, a prefix column): the source's prompt ids minus its tokenized prompt.
        out, trainer = batch._output, self.trainer
        new = trainer.tokenize_prompts(prompts, rows=sources)
        plain = trainer.tokenize_prompts([batch.prompts[s] for s in sources], rows=sources)
        result = []
        for k, s in enumerate(sources):
            full = out["prompt_ids"][s][out["prompt_mask"][s].bool()].tolist()
            if full[: len(plain[k])] != plain[k]:
                raise RuntimeError(
                    "BiCC could not find the prompt's tokens at the start of the row's context ids (an extension "
                    "changed the prompt itself?); conditioned rows need the question first."
                )
            result.append(new[k] + full[len(plain[k]) :])
        return result

    def _confidence(self, batch) -> list[float]:
        # The policy's mean token log-prob of each completion, as it was sampled (old log-probs when TRL has them).
        out = batch._output
        scored = batch.num_scored
        logps = out.get("old_per_token_logps")
        if logps is None:
            logps = self.trainer.completion_logps(out["prompt_ids"], out["prompt_mask"], out["completion_ids"],
                                                  out["completion_mask"])  # fmt: skip
        mask = batch.loss_mask.float()
        return ((logps * mask).sum(1) / mask.sum(1).clamp(min=1))[:scored].tolist()

    def state_dict(self) -> dict:
        return {"generator": self._generator.get_state()} if self._generator is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if "generator" in state and self._generator is not None:
            self._generator.set_state(state["generator"])


def _from_config(args) -> BiCC | None:
    if not getattr(args, "bicc", False):
        return None
    return BiCC(args.bicc_reward, args.bicc_threshold, args.bicc_pairing, args.bicc_max_pairs,
                args.bicc_context_fraction, args.bicc_context_budget, args.bicc_separator, seed=args.seed)  # fmt: skip


register_method(Method(name="bicc", title="BiCC (Bilateral Context Conditioning)", arxiv="2603.13134",
                       extension=_from_config, trainer="BiCCGRPOTrainer", config="BiCCGRPOConfig"))  # fmt: skip
