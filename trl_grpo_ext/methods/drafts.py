"""Draft-conditioned RL: the policy answers a problem with one or more drafts shown before it, and learns to improve on
them without copying them.

Two published recipes are this one extension with different settings:

- **Mismatched wrong drafts** (arXiv 2605.17314): wrong drafts from a smaller model, each shown with a *different*
  problem (`draft_source="model"`, `draft_match="mismatched"`, `draft_keep="wrong"`, `loss_type="dr_grpo"`); no
  drafts at test time.
- **Self-refinement** (ThinkTwice, arXiv 2604.01591; Parallel-Distill-Refine, arXiv 2510.01123): the policy's own
  drafts, refined (`draft_source="self"`), in steps that alternate solving and refining (`draft_mode="alternate"`).

Per training batch, the extension (1) collects drafts for the batch's problems from its source (a dataset column, a
second model, or the policy: fresh drafts and its earlier completions) into a bounded store, scored for correctness on
their own problem with the trainer's correctness reward; (2) picks, for each group chosen to refine, the drafts it is
shown (matched or mismatched; any, wrong-only, correct-only or best-of-k); (3) rewrites the group's prompt with the
template (the drafts before the question). All rows of a group see the same drafts, so the group's advantages compare
answers to one prompt. Reward functions see the drafts a row was shown in its `drafts` column (empty for a solve row):
`draft_improvement` and `draft_copy_penalty` read it. Evaluation batches are never shown drafts.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass, field

import torch
from accelerate.utils import gather_object

from ..extension import Extension, Method, TrainerInputs, register_method
from ..rewards import completion_text, get_reward, register_reward
from .bicc import correctness_column

logger = logging.getLogger(__name__)

SOURCES = ("column", "model", "self")
MATCHES = ("matched", "mismatched")
KEEPS = ("any", "wrong", "correct", "best")
MODES = ("refine", "alternate", "mix")
DEFAULT_TEMPLATE = (
    "Below is a draft answer to a problem. It may be wrong: check it, then solve the problem yourself.\n\n{drafts}\n\n"
    "Problem: {question}"
)
DRAFTS_COLUMN = "drafts"  # what reward functions read: the drafts a row was shown ([] for a solve row)


@dataclass
class DraftConfig:
    """Config section: draft-conditioned RL (`trl_grpo_ext.methods.drafts`).

    > Parameters of draft-conditioned RL (arXiv 2605.17314, 2604.01591; `trl_grpo_ext.methods.drafts`)

    draft_source (`str`, *optional*):
        Where drafts come from: `"column"` (the dataset column `draft_column`), `"model"` (a second model,
        `draft_model`, generating `draft_num` drafts per problem of each group that refines) or `"self"` (the
        policy: its earlier completions of the problem, kept in the store, and `draft_num` fresh drafts per problem
        of each group that refines). None switches drafts off.
    draft_column (`str`, *optional*, defaults to `"draft"`):
        With `draft_source="column"`: the dataset column holding each problem's draft (a string, or a list of them).
    draft_model (`str`, *optional*):
        With `draft_source="model"`: the draft model's path or Hub id. It must share the policy's tokenizer (drafts
        are generated from the policy's prompt token ids); it is frozen and never trained.
    draft_num (`int`, *optional*, defaults to `1`):
        Drafts generated per problem of each group that refines (`model`: at least 1; `self`: 0 uses the store
        only).
    draft_max_new_tokens (`int`, *optional*):
        The most tokens a generated draft has. Default: `max_completion_length`.
    draft_temperature (`float`, *optional*, defaults to `1.0`), draft_top_p (`float`, *optional*, defaults to `1.0`):
        The draft model's sampling settings (`self` drafts use the policy's own).
    draft_match (`str`, *optional*, defaults to `"matched"`):
        `"matched"`: a problem is shown drafts of itself; `"mismatched"`: drafts of other problems only (never its
        own, nor those of a duplicate of it: problems are told apart by `draft_key_column`, else by their prompt).
    draft_keep (`str`, *optional*, defaults to `"any"`):
        Which drafts may be shown: `"any"`, `"wrong"` (wrong for their own problem, and for the problem shown with
        them), `"correct"` (correct for their own problem), `"best"` (the highest-scoring of `draft_best_of` drawn).
    drafts_per_prompt (`int`, *optional*, defaults to `1`):
        Drafts shown with a problem.
    draft_best_of (`int`, *optional*, defaults to `4`):
        With `draft_keep="best"`: how many drafts are drawn before the best are kept.
    draft_reward (`str`, *optional*):
        The reward that scores a draft (and says "correct"): its logged or registry name. Default: the one reward
        marked as correctness (as `bicc_reward`).
    draft_threshold (`float`, *optional*, defaults to `0.5`):
        A draft (or a completion) is correct when that reward is at least this value.
    draft_mode (`str`, *optional*, defaults to `"refine"`):
        `"refine"`: every training group is shown drafts; `"alternate"`: generation batches alternate solve (no
        drafts) and refine, starting with solve (ThinkTwice); `"mix"`: each group refines with probability
        `draft_ratio`.
    draft_ratio (`float`, *optional*, defaults to `0.5`):
        With `draft_mode="mix"`: the share of groups shown drafts.
    draft_template (`str`, *optional*):
        The prompt of a refine row, with `{drafts}` and `{question}` (write `{{`, `}}` for literal braces). In a
        conversation it replaces the last user message's text.
    draft_max_tokens (`int`, *optional*):
        Each draft is cut to this many tokens before it is stored. Default: `max_completion_length`.
    draft_store_size (`int`, *optional*, defaults to `1024`), draft_store_per_problem (`int`, *optional*, defaults
    to `8`):
        The store keeps the drafts of this many problems (the least recently seen go first), and at most this many
        per problem (the newest). It is saved in checkpoints.
    draft_key_column (`str`, *optional*):
        A dataset column that names each problem (an id). Default: the prompt itself.
    draft_copy_ngram (`int`, *optional*, defaults to `4`), draft_copy_threshold (`float`, *optional*, defaults to
    `0.8`):
        A refined answer is counted a copy (`drafts/copy_rate`) when at least this share of its word n-grams is in a
        draft it was shown.
    """

    draft_source: str | None = field(
        default=None, metadata={"help": "Drafts from 'column', 'model' or 'self' (None: off)."}
    )
    draft_column: str = field(default="draft", metadata={"help": "draft_source='column': the drafts' column."})
    draft_model: str | None = field(default=None, metadata={"help": "draft_source='model': the draft model."})
    draft_num: int = field(default=1, metadata={"help": "Drafts generated per problem of each refining group."})
    draft_max_new_tokens: int | None = field(
        default=None, metadata={"help": "The most tokens of a generated draft (default max_completion_length)."}
    )
    draft_temperature: float = field(default=1.0, metadata={"help": "The draft model's sampling temperature."})
    draft_top_p: float = field(default=1.0, metadata={"help": "The draft model's top-p."})
    draft_match: str = field(default="matched", metadata={"help": "'matched' or 'mismatched' drafts."})
    draft_keep: str = field(default="any", metadata={"help": "Drafts kept: 'any', 'wrong', 'correct' or 'best'."})
    drafts_per_prompt: int = field(default=1, metadata={"help": "Drafts shown with a problem."})
    draft_best_of: int = field(default=4, metadata={"help": "draft_keep='best': drafts drawn before the best kept."})
    draft_reward: str | None = field(
        default=None, metadata={"help": "The reward that scores drafts (default: the one marked correctness)."}
    )
    draft_threshold: float = field(default=0.5, metadata={"help": "Correct when the reward is >= this."})
    draft_mode: str = field(default="refine", metadata={"help": "'refine', 'alternate' (solve/refine) or 'mix'."})
    draft_ratio: float = field(default=0.5, metadata={"help": "draft_mode='mix': the share of groups refining."})
    draft_template: str = field(
        default=DEFAULT_TEMPLATE, metadata={"help": "A refine row's prompt, with {drafts} and {question}."}
    )
    draft_max_tokens: int | None = field(
        default=None, metadata={"help": "Drafts are cut to this many tokens (default max_completion_length)."}
    )
    draft_store_size: int = field(default=1024, metadata={"help": "Problems whose drafts the store keeps."})
    draft_store_per_problem: int = field(default=8, metadata={"help": "Drafts kept per problem."})
    draft_key_column: str | None = field(
        default=None, metadata={"help": "A column naming each problem (default: its prompt)."}
    )
    draft_copy_ngram: int = field(default=4, metadata={"help": "n of the n-gram overlap that counts a copy."})
    draft_copy_threshold: float = field(default=0.8, metadata={"help": "Overlap from which an answer is a copy."})

    def __post_init__(self):
        super().__post_init__()
        check_draft_config(self)


_DEFAULTS = {name: f.default for name, f in DraftConfig.__dataclass_fields__.items() if name != "draft_source"}
_ONLY_FOR = {
    "draft_column": ("draft_source", ("column",)),
    "draft_model": ("draft_source", ("model",)),
    "draft_temperature": ("draft_source", ("model",)),
    "draft_top_p": ("draft_source", ("model",)),
    "draft_num": ("draft_source", ("model", "self")),
    "draft_max_new_tokens": ("draft_source", ("model", "self")),
    "draft_best_of": ("draft_keep", ("best",)),
    "draft_ratio": ("draft_mode", ("mix",)),
}


def check_draft_config(args) -> None:
    """Raise a ValueError naming the draft field, its value and the fix."""
    source = args.draft_source
    if source is None:
        changed = [name for name, value in _DEFAULTS.items() if getattr(args, name) != value]
        if changed:
            raise ValueError(
                f"{changed[0]}={getattr(args, changed[0])!r} is set, but draft_source=None (drafts off); set "
                f"draft_source to one of {SOURCES}, or leave {changed[0]} at its default."
            )
        return
    for name, allowed in (("draft_source", SOURCES), ("draft_match", MATCHES), ("draft_keep", KEEPS),
                          ("draft_mode", MODES)):  # fmt: skip
        if getattr(args, name) not in allowed:
            raise ValueError(f"{name}={getattr(args, name)!r} is not one of {', '.join(map(repr, allowed))}.")
    for name, (switch, values) in _ONLY_FOR.items():
        if getattr(args, name) != _DEFAULTS[name] and getattr(args, switch) not in values:
            raise ValueError(
                f"{name}={getattr(args, name)!r} only applies with {switch} in {values}, but {switch}="
                f"{getattr(args, switch)!r}; leave {name} at its default, or change {switch}."
            )
    if source == "model" and not args.draft_model:
        raise ValueError(f"draft_source='model' needs draft_model (it is {args.draft_model!r}): the path or Hub id of "
                         "the model that writes drafts.")  # fmt: skip
    if source == "column" and (not isinstance(args.draft_column, str) or not args.draft_column):
        raise ValueError(f"draft_column={args.draft_column!r} must name the dataset column that holds the drafts.")
    minimum = {"draft_num": 1 if source == "model" else 0, "drafts_per_prompt": 1, "draft_best_of": 1,
               "draft_store_size": 1, "draft_store_per_problem": 1, "draft_copy_ngram": 1}  # fmt: skip
    for name, low in minimum.items():
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be a whole number >= {low}.")
    for name in ("draft_max_new_tokens", "draft_max_tokens"):
        value = getattr(args, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be a whole number >= 1, or None for max_completion_length.")
    if args.draft_keep == "best" and args.draft_best_of < args.drafts_per_prompt:
        raise ValueError(
            f"draft_best_of={args.draft_best_of} is below drafts_per_prompt={args.drafts_per_prompt}: the best "
            "drafts are kept out of draft_best_of drawn; raise draft_best_of."
        )
    for name, low, high in (("draft_ratio", 0.0, 1.0), ("draft_copy_threshold", 0.0, 1.0), ("draft_top_p", 0.0, 1.0)):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not low < value <= high:
            raise ValueError(f"{name}={value!r} must be a number in ({low}, {high}].")
    if (
        isinstance(args.draft_temperature, bool)
        or not isinstance(args.draft_temperature, int | float)
        or (args.draft_temperature <= 0)
    ):
        raise ValueError(f"draft_temperature={args.draft_temperature!r} must be a number > 0.")
    if isinstance(args.draft_threshold, bool) or not isinstance(args.draft_threshold, int | float):
        raise ValueError(f"draft_threshold={args.draft_threshold!r} must be a number (correct: reward >= threshold).")
    template = args.draft_template
    try:
        ok = isinstance(template, str) and "{drafts}" in template and "{question}" in template
        ok = ok and bool(template.format(drafts="", question=""))
    except (KeyError, IndexError, ValueError):
        ok = False
    if not ok:
        raise ValueError(
            f"draft_template={template!r} must be a text holding {{drafts}} and {{question}} and no other field "
            "(write {{ and }} for literal braces)."
        )
    args.require_whole_groups(f"draft_source={source!r} (all rows of a group are shown the same drafts)")


# ---------------------------------------------------------------------------------------------------- pure pieces
@dataclass(frozen=True)
class Draft:
    """A draft answer to the problem `key`; `score` is the correctness reward on that problem (None: unscored)."""

    key: str
    text: str
    score: float | None = None
    correct: bool | None = None


def choose_drafts(keys: list[str], pool: list[Draft], *, match: str = "matched", keep: str = "any", per_row: int = 1,
                  best_of: int = 4, generator: torch.Generator | None = None, accept=None) -> list[list[int]]:  # fmt: skip
    """For each problem key, the indices of the pool drafts it is shown (at most `per_row`; [] when none qualifies).

    Candidates are the pool's drafts of the same problem (`matched`) or of any other one (`mismatched`: never a draft
    whose key is the row's), filtered by `keep` (`wrong` / `correct`: by the draft's `correct` on its own problem,
    unscored drafts left out; `best`: `best_of` drawn at random, the highest `score` first, unscored ones (score None
    or NaN) after every scored one); they are tried in random order and kept when `accept(row, index)` (default:
    always) is true.

    >>> pool = [Draft("a", "1", 0.0, False), Draft("b", "2", 1.0, True), Draft("b", "3", 0.0, False)]
    >>> choose_drafts(["a", "b"], pool, match="mismatched", keep="wrong")
    [[2], [0]]
    """
    if match not in MATCHES or keep not in KEEPS:
        raise ValueError(f"match={match!r} must be one of {MATCHES} and keep={keep!r} one of {KEEPS}.")
    generator = generator or torch.Generator().manual_seed(0)
    chosen = []
    for row, key in enumerate(keys):
        candidates = [i for i, d in enumerate(pool) if (d.key == key) == (match == "matched")]
        if keep == "wrong":
            candidates = [i for i in candidates if pool[i].correct is False]
        elif keep == "correct":
            candidates = [i for i in candidates if pool[i].correct is True]
        order = [candidates[k] for k in torch.randperm(len(candidates), generator=generator).tolist()]
        if keep == "best":  # the highest score first; unscored drafts (None or NaN) after every scored one
            order = sorted(order[:best_of], key=lambda i: (1, 0.0) if _unscored(pool[i]) else (0, -pool[i].score))
        picked = []
        for i in order:
            if accept is None or accept(row, i):
                picked.append(i)
                if len(picked) == per_row:
                    break
        chosen.append(picked)
    return chosen


def _unscored(draft: Draft) -> bool:
    return draft.score is None or math.isnan(draft.score)


def ngram_overlap(text: str, reference: str, n: int = 4) -> float:
    """The share of `text`'s word n-grams that are also in `reference` (counts clipped, as BLEU's precision).

    A text shorter than n words is compared on n-grams of its own length; an empty text overlaps 0.

    >>> ngram_overlap("a b c d e", "a b c x", n=2)  # ab, bc of ab bc cd de
    0.5
    """
    words, ref = text.split(), reference.split()
    if not words:
        return 0.0
    k = min(n, len(words))
    grams = Counter(tuple(words[i : i + k]) for i in range(len(words) - k + 1))
    ref_grams = Counter(tuple(ref[i : i + k]) for i in range(len(ref) - k + 1))
    return sum(min(count, ref_grams[g]) for g, count in grams.items()) / sum(grams.values())


def format_drafts(drafts: list[str]) -> str:
    """The `{drafts}` block: `Draft:` and the text for one draft, `Draft 1:`, `Draft 2:` ... for several."""
    if len(drafts) == 1:
        return f"Draft:\n{drafts[0]}"
    return "\n\n".join(f"Draft {i}:\n{text}" for i, text in enumerate(drafts, 1))


def with_drafts(prompt, drafts: list[str], template: str = DEFAULT_TEMPLATE):
    """`prompt` with `drafts` placed by `template` around the question (the last user message of a conversation, or
    the whole plain prompt). The prompt itself is not changed.

    >>> with_drafts([{"role": "user", "content": "2 + 2?"}], ["5"], "{drafts} | {question}")
    [{'role': 'user', 'content': 'Draft:\\n5 | 2 + 2?'}]
    """
    block = format_drafts(drafts)
    if isinstance(prompt, str):
        return template.format(drafts=block, question=prompt)
    messages = copy.deepcopy(list(prompt))
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message["content"]
            if isinstance(content, str):
                message["content"] = template.format(drafts=block, question=content)
            else:  # a list of parts (text, images): the template's text goes around them
                before, _, after = template.partition("{question}")
                before, after = before.format(drafts=block), after.format(drafts=block)
                message["content"] = [*([{"type": "text", "text": before}] if before else []), *content,
                                      *([{"type": "text", "text": after}] if after else [])]  # fmt: skip
            return messages
    raise ValueError("drafts are placed around the question, but this prompt has no user message.")


def problem_key(row: dict, key_column: str | None = None) -> str:
    """What tells problems apart: the `key_column` value, else the prompt (so duplicates of a problem share a key)."""
    value = row[key_column] if key_column is not None else row["prompt"]
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


class DraftStore:
    """Drafts per problem, bounded: `problems` problems (least recently added first out), `per_problem` each (newest
    kept). An identical text is stored once per problem (its newest score kept)."""

    def __init__(self, problems: int = 1024, per_problem: int = 8):
        self.problems, self.per_problem = problems, per_problem
        self._drafts: OrderedDict[str, list[Draft]] = OrderedDict()

    def add(self, draft: Draft) -> None:
        drafts = [d for d in self._drafts.pop(draft.key, []) if d.text != draft.text]
        self._drafts[draft.key] = [*drafts, draft][-self.per_problem :]
        while len(self._drafts) > self.problems:
            self._drafts.popitem(last=False)

    def pool(self) -> list[Draft]:
        return [d for drafts in self._drafts.values() for d in drafts]

    def __len__(self) -> int:
        return len(self._drafts)

    def state_dict(self) -> dict:
        return {"drafts": [asdict(d) for d in self.pool()]}

    def load_state_dict(self, state: dict) -> None:
        self._drafts.clear()
        for item in state.get("drafts", []):
            self.add(Draft(**item))


# ---------------------------------------------------------------------------------------------------- rewards
def _repeat_columns(kwargs: dict, counts: list[int], n: int) -> dict:
    # Per-row columns (lists of n values) repeated `counts[i]` times; everything else (trainer_state, ...) as it is.
    out = {}
    for key, value in kwargs.items():
        if isinstance(value, list) and len(value) == n:
            out[key] = [v for v, c in zip(value, counts, strict=True) for _ in range(c)]
        else:
            out[key] = value
    return out


def _as_completion(like, text: str):
    return [{"role": "assistant", "content": text}] if isinstance(like, list) else text


def draft_improvement_reward(reward: str = "accuracy"):
    """Build a reward for beating the drafts: score(answer) − max score(draft) over the drafts the row was shown
    (its `drafts` column), both scored by the registry reward `reward`; None for a row shown no drafts."""
    base = get_reward(reward)

    def draft_improvement(prompts, completions, completion_ids=None, **kwargs) -> list[float | None]:
        drafts = kwargs.pop(DRAFTS_COLUMN, None)
        if drafts is None:
            raise ValueError(
                "draft_improvement reads the `drafts` column (the drafts each row was shown); train with draft_source "
                "set (DraftGRPOTrainer fills it), or give the dataset a `drafts` column of lists of texts."
            )
        n = len(completions)
        own = base(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        counts = [len(d) for d in drafts]
        flat = [_as_completion(c, text) for c, d in zip(completions, drafts, strict=True) for text in d]
        scores = []
        if flat:
            rep = _repeat_columns({"prompts": prompts, **kwargs}, counts, n)
            scores = base(completions=flat, completion_ids=None, **rep)
        out, k = [], 0
        for i in range(n):
            row = [s for s in scores[k : k + counts[i]] if s is not None]
            k += counts[i]
            out.append(None if not counts[i] or own[i] is None or not row else float(own[i]) - max(row))
        return out

    draft_improvement.__name__ = "draft_improvement"
    return draft_improvement


def draft_copy_penalty_reward(n: int = 4):
    """Build a penalty on copying a draft: −(the largest word n-gram overlap of the answer with a draft it was shown),
    in [−1, 0]; 0 for a row shown no drafts."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"draft_copy_penalty: n={n!r} must be a whole number >= 1.")

    def draft_copy_penalty(completions, **kwargs) -> list[float]:
        drafts = kwargs.get(DRAFTS_COLUMN)
        if drafts is None:
            raise ValueError(
                "draft_copy_penalty reads the `drafts` column (the drafts each row was shown); train with "
                "draft_source set, or give the dataset a `drafts` column of lists of texts."
            )
        texts = [completion_text(c) for c in completions]
        return [-max((ngram_overlap(t, d, n) for d in ds), default=0.0) for t, ds in zip(texts, drafts, strict=True)]

    draft_copy_penalty.__name__ = "draft_copy_penalty"
    return draft_copy_penalty


register_reward("draft_improvement", draft_improvement_reward, factory=True)
register_reward("draft_copy_penalty", draft_copy_penalty_reward, factory=True)


# ---------------------------------------------------------------------------------------------------- extension
def _no_op(*args, **kwargs):
    return None


class Drafts(Extension):
    """Collects drafts into a store, shows the groups chosen to refine their drafts, logs what the policy did with them.

    Metrics (train batches, summed over processes): `drafts/refine_fraction` (rows shown drafts),
    `drafts/solve_accuracy` and `drafts/refine_accuracy` (correctness per mode), `drafts/draft_accuracy` (drafts
    shown that were correct for the row's problem), `drafts/improvement_rate` (refined rows scoring above every draft
    they were shown), `drafts/copy_rate` (refined rows that copy a draft), `drafts/missing` (groups chosen to refine
    that no draft qualified for: they solve instead), `drafts/store_problems`, `drafts/generated_tokens` (draft tokens
    generated for the batch, by the policy or the draft model: only for the groups that refine).
    """

    name = "drafts"
    columns = (DRAFTS_COLUMN,)  # added to every row: reward functions may require it
    order = 50

    def __init__(self, args):
        self.source, self.column, self.model_name = args.draft_source, args.draft_column, args.draft_model
        self.num, self.max_new_tokens = args.draft_num, args.draft_max_new_tokens
        self.temperature, self.top_p = args.draft_temperature, args.draft_top_p
        self.match, self.keep, self.per_row, self.best_of = (
            args.draft_match, args.draft_keep, args.drafts_per_prompt, args.draft_best_of,
        )  # fmt: skip
        self.reward, self.threshold = args.draft_reward, args.draft_threshold
        self.mode, self.ratio, self.template = args.draft_mode, args.draft_ratio, args.draft_template
        self.max_tokens, self.key_column = args.draft_max_tokens, args.draft_key_column
        self.copy_n, self.copy_threshold = args.draft_copy_ngram, args.draft_copy_threshold
        self.seed = args.seed
        self.store = DraftStore(args.draft_store_size, args.draft_store_per_problem)
        self.batches = 0  # training generation batches begun
        self.column_index: int | None = None
        self.score_fn = None
        self.draft_model = None
        self._generator: torch.Generator | None = None

    # -------------------------------------------------------------- before training
    def check(self, inputs: TrainerInputs) -> None:
        correctness_column(inputs.reward_funcs, self.reward, option="draft_reward",
                           switch=f"draft_source={self.source!r}")  # fmt: skip
        names = getattr(inputs.train_dataset, "column_names", None)
        needed = {
            "draft_column": self.column if self.source == "column" else None,
            "draft_key_column": self.key_column,
        }
        for option, column in needed.items():
            if column is not None and names is not None and column not in names:
                raise ValueError(
                    f"{option}={column!r}, but the training dataset has no such column (columns: {names}); add the "
                    f"column, or set {option} to one of those."
                )

    def setup(self, trainer) -> None:
        super().setup(trainer)
        self.column_index = correctness_column(trainer.reward_funcs, self.reward, option="draft_reward",
                                               switch=f"draft_source={self.source!r}")  # fmt: skip
        fn = trainer.reward_funcs[self.column_index]
        if isinstance(fn, torch.nn.Module) or not callable(fn):
            raise ValueError(
                f"draft_reward: {trainer.reward_func_names[self.column_index]} is a reward model; drafts are scored "
                "by a reward function (e.g. 'accuracy'); set draft_reward to one."
            )
        self.score_fn = fn
        # One generator, seeded alike on every process, draws for every group of the batch (see `prepare`).
        self._generator = torch.Generator().manual_seed(self.seed)
        if self.source == "model":
            self.draft_model = self._load_draft_model()
        logger.info(
            f"drafts: source {self.source!r}, {self.match} / {self.keep}, mode {self.mode!r}; a draft is correct when "
            f"{trainer.reward_func_names[self.column_index]} >= {self.threshold}."
        )

    def _load_draft_model(self):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            theirs = AutoTokenizer.from_pretrained(self.model_name)
        except Exception as error:
            raise ValueError(
                f"draft_model={self.model_name!r}: its tokenizer could not be loaded ({type(error).__name__}: {error}); "
                "give a folder or Hub id holding a model and its tokenizer."
            ) from error
        ours = self.trainer.tokenizer
        if theirs.get_vocab() != ours.get_vocab():
            raise ValueError(
                f"draft_model={self.model_name!r} has another tokenizer than the policy ({len(theirs)} tokens against "
                f"{len(ours)}, or the same size with other ids): drafts are generated from the policy's prompt token "
                "ids and read back with its tokenizer. Use a draft model of the policy's family (one tokenizer), or "
                "write its drafts into a dataset column and use draft_source='column'."
            )
        model = AutoModelForCausalLM.from_pretrained(self.model_name, dtype="auto")
        model.to(self.trainer.accelerator.device).eval().requires_grad_(False)
        return model

    # -------------------------------------------------------------- per batch
    def before_batch(self, mode: str) -> None:
        if mode == "train":
            self.batches += 1

    def _refining(self, groups: int) -> list[bool]:
        """Per group of every process (`groups` each), whether it refines."""
        total = groups * self.trainer.accelerator.num_processes
        if self.mode == "refine":
            return [True] * total
        if self.mode == "alternate":
            return [self.batches % 2 == 0] * total  # batch 1 solves, batch 2 refines, ...
        return (torch.rand(total, generator=self._generator) < self.ratio).tolist()

    def prepare(self, plan) -> None:
        plan.rows[:] = [{**row, DRAFTS_COLUMN: []} for row in plan.rows]
        phases = ["eval" if plan.mode != "train" else "solve"] * len(plan.rows)
        if plan.mode != "train":
            plan.note("draft_phase", phases)
            plan.note("draft_scores", [[] for _ in plan.rows])
            return
        g = plan.num_generations
        self._generated = 0
        starts = list(range(0, len(plan.rows), g))
        keys = [problem_key(plan.rows[s], self.key_column) for s in starts]
        refining = self._refining(len(starts))  # every process's groups, drawn alike on every process
        first = self.trainer.accelerator.process_index * len(starts)
        self._collect(plan, starts, keys, refining)
        pool = self.store.pool()
        # Drafts are chosen for the groups of every process, in row order, from the store every process shares and
        # with one generator, and each process keeps its own groups' (groups are whole on a process): the choice of
        # one process holding the whole batch, and a generator state that is every process's.
        all_keys, all_rows = gather_object(keys), gather_object([plan.rows[s] for s in starts])
        targets = [k for k, r in enumerate(refining) if r]
        verdicts = {}

        def accept(t: int, i: int) -> bool:
            # `wrong`: a draft wrong for its own problem must also be wrong for the one it is shown with.
            if self.keep != "wrong" or self.match == "matched":
                return True
            if (t, i) not in verdicts:
                (score,) = self._score([all_rows[targets[t]]], [pool[i].text])
                verdicts[t, i] = score is not None and score < self.threshold
            return verdicts[t, i]

        chosen = choose_drafts([all_keys[k] for k in targets], pool, match=self.match, keep=self.keep,
                               per_row=self.per_row, best_of=self.best_of, generator=self._generator,
                               accept=accept)  # fmt: skip
        shown = [[] for _ in all_keys]
        for k, picked in zip(targets, chosen, strict=True):
            shown[k] = [pool[i].text for i in picked]
        shown = shown[first : first + len(starts)]
        missing = sum(1 for k in targets if first <= k < first + len(starts) and not shown[k - first])
        flat_rows = [plan.rows[starts[k]] for k in range(len(starts)) for _ in shown[k]]
        flat_scores = self._score(flat_rows, [t for texts in shown for t in texts]) if flat_rows else []
        scores, cursor = [], 0
        for texts in shown:
            scores.append(flat_scores[cursor : cursor + len(texts)])
            cursor += len(texts)
        row_scores = [[] for _ in plan.rows]
        for k, start in enumerate(starts):
            if not shown[k]:
                continue
            for r in range(start, start + g):
                row = plan.rows[r]
                plan.rows[r] = {**row, "prompt": with_drafts(row["prompt"], shown[k], self.template),
                                DRAFTS_COLUMN: list(shown[k])}  # fmt: skip
                phases[r], row_scores[r] = "refine", scores[k]
        plan.note("draft_phase", phases)
        plan.note("draft_scores", row_scores)
        plan.note("draft_key", [keys[r // g] for r in range(len(plan.rows))])
        self._missing = (missing, len(starts))

    def _collect(self, plan, starts: list[int], keys: list[str], refining: list[bool]) -> None:
        """Put this batch's drafts into the store: the column's, or `draft_num` generated per problem of each group
        that refines (`refining`: every process's groups), and none when no group does.

        Generation is collective (vLLM server mode, sharded parameters: see `GRPOExtTrainer._generate_single_turn`),
        and `refining` is every process's: each process knows whether any group refines, so all of them generate, or
        none does; a process with fewer refining groups than another pads its call with groups whose drafts are
        thrown away (and not counted in `drafts/generated_tokens`)."""
        if self.source == "column":
            rows = [plan.rows[s] for s in starts]
            texts = []
            for row in rows:
                value = row.get(self.column)
                if self.column not in row:
                    raise KeyError(
                        f"draft_column={self.column!r}, but the rows have no such column (columns: {sorted(row)}); "
                        "add the column or set draft_column."
                    )
                value = [] if value is None else [value] if isinstance(value, str) else list(value)
                texts.append([t for t in value if isinstance(t, str) and t.strip()])
            self._add(rows, keys, texts)
            return
        if self.num == 0 or not any(refining):
            return
        first = self.trainer.accelerator.process_index * len(starts)
        mine = [k for k in range(len(starts)) if refining[first + k]]
        most = max(sum(refining[p : p + len(starts)]) for p in range(0, len(refining), len(starts)))
        pad = most - len(mine) if self.draft_model is None and self.trainer.accelerator.num_processes > 1 else 0
        texts = self._write_drafts(plan, [starts[k] for k in mine], pad=pad)
        self._add([plan.rows[starts[k]] for k in mine], [keys[k] for k in mine], texts)

    def _add(self, rows: list[dict], keys: list[str], texts: list[list[str]]) -> None:
        texts = [[self._cut(t) for t in group] for group in texts]
        flat_rows = [row for row, group in zip(rows, texts, strict=True) for _ in group]
        scores = self._score(flat_rows, [t for group in texts for t in group]) if flat_rows else []
        k, drafts = 0, []
        for key, group in zip(keys, texts, strict=True):
            for text in group:
                score = scores[k]
                k += 1
                drafts.append(Draft(key, text, score, None if score is None else score >= self.threshold))
        for draft in gather_object(drafts):  # every process's, in row order: one store on every process
            self.store.add(draft)

    def _cut(self, text: str) -> str:
        limit = self.max_tokens or self.trainer.args.max_completion_length
        ids = self.trainer.tokenizer(text, add_special_tokens=False)["input_ids"]
        return text if len(ids) <= limit else self.trainer.tokenizer.decode(ids[:limit], skip_special_tokens=True)

    def _write_drafts(self, plan, starts: list[int], pad: int = 0) -> list[list[str]]:
        """`draft_num` drafts per problem (the groups starting at `starts`), by the draft model or the policy (TRL's
        generation, vLLM included); `pad` more groups of the batch's first row take part in the policy's call, their
        drafts thrown away."""
        trainer, n = self.trainer, self.num
        cap = self.max_new_tokens or trainer.args.max_completion_length
        rows = [s for s in [*starts, *[0] * pad] for _ in range(n)]
        prompts = [plan.rows[s]["prompt"] for s in rows]
        if self.draft_model is None:
            ids, _ = trainer.generate_stage(prompts, plan.select(rows), num_generations=n, max_new_tokens=cap,
                                            rows=rows)  # fmt: skip
        else:
            ids = self._model_generate(trainer.tokenize_prompts(prompts, rows=rows), cap) if rows else []
        ids = ids[: len(starts) * n]
        self._generated += sum(len(row) for row in ids)
        texts = trainer.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return [[t for t in texts[k * n : (k + 1) * n] if t.strip()] for k in range(len(starts))]

    @torch.no_grad()
    def _model_generate(self, prompt_ids: list[list[int]], max_new_tokens: int, chunk: int = 16) -> list[list[int]]:
        tokenizer, model = self.trainer.tokenizer, self.draft_model
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = set(self.trainer.eos_token_ids)
        out = []
        for start in range(0, len(prompt_ids), chunk):
            batch = prompt_ids[start : start + chunk]
            width = max(map(len, batch))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=model.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
            generated = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=max_new_tokens,
                                       temperature=self.temperature, top_p=self.top_p, pad_token_id=pad,
                                       eos_token_id=sorted(eos))  # fmt: skip
            for row in generated[:, width:].tolist():
                end = next((i for i, t in enumerate(row) if t in eos), len(row))
                out.append(row[:end])
        return out

    def _score(self, rows: list[dict], texts: list[str]) -> list[float | None]:
        """The correctness reward of `texts[i]` as an answer to `rows[i]` (TRL's reward arguments, logging off)."""
        keys = [k for k in rows[0] if k not in ("prompt", "completion", "completion_ids")]
        columns = {k: [row.get(k) for row in rows] for k in keys}
        completions = [_as_completion(row["prompt"], t) for row, t in zip(rows, texts, strict=True)]
        ids = [self.trainer.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        values = self.score_fn(prompts=[row["prompt"] for row in rows], completions=completions, completion_ids=ids,
                               trainer_state=self.trainer.state, log_extra=_no_op, log_metric=_no_op, **columns)  # fmt: skip
        return [None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v) for v in values]

    # -------------------------------------------------------------- after scoring
    def after_scoring(self, batch) -> None:
        if batch.mode != "train":
            return
        scored = batch.num_scored
        values = batch.local(batch.rewards_per_func[:, self.column_index])[:scored].tolist()
        phases = batch.notes["draft_phase"][:scored]
        drafts = batch.columns.get(DRAFTS_COLUMN, [[]] * scored)[:scored]
        scores = batch.notes["draft_scores"][:scored]
        texts = [completion_text(c) for c in batch.completions[:scored]]
        sums = dict.fromkeys(("solve", "solve_ok", "refine", "refine_ok", "copies", "improved", "drafts",
                              "drafts_ok"), 0.0)  # fmt: skip
        for value, phase, shown, draft_scores, text in zip(values, phases, drafts, scores, texts, strict=True):
            ok = not math.isnan(value) and value >= self.threshold
            sums[phase] += 1
            sums[f"{phase}_ok"] += ok
            if phase == "refine":
                sums["copies"] += max((ngram_overlap(text, d, self.copy_n) for d in shown), default=0.0) >= (
                    self.copy_threshold
                )
                known = [s for s in draft_scores if s is not None]
                sums["improved"] += bool(known) and not math.isnan(value) and value > max(known)
                sums["drafts"] += len(draft_scores)
                sums["drafts_ok"] += sum(s is not None and s >= self.threshold for s in draft_scores)
        missing, groups = getattr(self, "_missing", (0, 0))
        counts = [*sums.values(), missing, groups, scored, getattr(self, "_generated", 0)]
        counts = torch.tensor(counts, dtype=torch.float, device=batch.completion_ids.device)
        totals = dict(zip([*sums, "missing", "groups", "rows", "generated"], self.trainer.accelerator.gather(counts).view(-1,
                      len(counts)).sum(0).tolist(), strict=True))  # fmt: skip
        self.log("refine_fraction", totals["refine"] / max(totals["rows"], 1), mode="train")
        self.log("missing", totals["missing"] / max(totals["groups"], 1), mode="train")
        self.log("store_problems", float(len(self.store)), mode="train")
        self.log("generated_tokens", totals["generated"], mode="train")
        for phase in ("solve", "refine"):
            if totals[phase]:
                self.log(f"{phase}_accuracy", totals[f"{phase}_ok"] / totals[phase], mode="train")
        if totals["refine"]:
            self.log("copy_rate", totals["copies"] / totals["refine"], mode="train")
            self.log("improvement_rate", totals["improved"] / totals["refine"], mode="train")
        if totals["drafts"]:
            self.log("draft_accuracy", totals["drafts_ok"] / totals["drafts"], mode="train")
        if self.source == "self":  # the policy's answers are drafts for later batches
            keys = batch.notes["draft_key"][:scored]
            drafts = []
            for key, text, value in zip(keys, texts, values, strict=True):
                if text.strip():
                    score = None if math.isnan(value) else value
                    drafts.append(
                        Draft(key, self._cut(text), score, None if score is None else score >= self.threshold)
                    )
            for draft in gather_object(drafts):  # every process's, in row order: one store on every process
                self.store.add(draft)

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        state = {"store": self.store.state_dict(), "batches": self.batches}
        if self._generator is not None:
            state["generator"] = self._generator.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.store.load_state_dict(state.get("store", {}))
        self.batches = state.get("batches", 0)
        if "generator" in state and self._generator is not None:
            self._generator.set_state(state["generator"])


def _from_config(args) -> Drafts | None:
    return Drafts(args) if getattr(args, "draft_source", None) is not None else None


register_method(Method(name="drafts", title="Draft-conditioned RL (mismatched drafts, self-refinement)",
                       arxiv="2605.17314", extension=_from_config, trainer="DraftGRPOTrainer",
                       config="DraftGRPOConfig"))  # fmt: skip
