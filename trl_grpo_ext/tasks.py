"""The built-in tasks: single-digit addition (and, for NoRD, driving), their rewards and held-out evaluations.

"What is 7 + 5? Answer with just the number." A small real model (SmolLM2-135M-Instruct) answers some of these right
before training and learns the rest within a few minutes of GRPO on a CPU, so the main job (`trl-grpo-ext train`),
the real-model tests and `benchmarks/learning.py` can show learning, not just running. The 100 problems a + b with
a, b in 0..9 are split once, by a fixed seed, into 60 held-out problems (never trained on) and 40 training problems.

>>> [row["solution"] for row in addition_dataset("heldout")][:3]
['5', '8', '2']
>>> last_integer_reward(completions=["7 + 5 = 12", "It is 13."], solution=["12", "12"])
[1.0, 0.0]
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import random
import re
import sys
import time

import torch
from datasets import Dataset
from transformers import TrainerCallback

from .rewards import completion_text, register_reward

QUESTION = "What is {a} + {b}? Answer with just the number."
HELDOUT_SIZE = 60
_INTEGER = re.compile(r"-?\d+")


def addition_problems(split: str) -> list[tuple[int, int]]:
    """The (a, b) pairs of a split: `"heldout"` (60 fixed problems) or `"train"` (the other 40)."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(0).shuffle(pairs)
    if split == "heldout":
        return pairs[:HELDOUT_SIZE]
    if split == "train":
        return pairs[HELDOUT_SIZE:]
    raise ValueError(f"split={split!r} is not 'train' or 'heldout'.")


def addition_dataset(split: str = "train", repeats: int = 1, system: str | None = None) -> Dataset:
    """TRL's conversational prompt format: `prompt` (one user message) and `solution` (the sum, as text)."""
    prompts, solutions = [], []
    for _ in range(repeats):
        for a, b in addition_problems(split):
            messages = [{"role": "user", "content": QUESTION.format(a=a, b=b)}]
            prompts.append(([{"role": "system", "content": system}] if system else []) + messages)
            solutions.append(str(a + b))
    return Dataset.from_dict({"prompt": prompts, "solution": solutions})


def addition_trees(split: str = "train") -> list[dict]:
    """The task's prefix trees from a scripted teacher (the rows of `trl_grpo_ext.data.trees.SAMPLE_TREES`).

    Per problem A + B (id `add-A-B`): the teacher answers directly ("S", right), or writes "We add A and B." and then
    either the right sum, after which both of its two endings are right, or a sum one too high, which it follows to
    the wrong answer. So a prefix's value is what a competent teacher's Monte Carlo estimate would be: the bare
    question 3/4, "We add" 2/3, the right sum 1, the wrong sum 0.
    """
    trees = []
    for a, b in addition_problems(split):
        s, wrong = a + b, a + b + 1
        steps = [("0", None, "", None), ("1", "0", f"We add {a} and {b}.", None), ("2", "1", f"{a} + {b} = {s}.", None),
                 ("3", "2", f"The answer is {s}.", True), ("4", "2", f"So {a} + {b} is {s}.", True),
                 ("5", "1", f"{a} + {b} = {wrong}.", None), ("6", "5", f"The answer is {wrong}.", False),
                 ("7", "0", str(s), True)]  # fmt: skip
        nodes = [{"id": i, "parent": p, "text": t, **({} if c is None else {"correct": c})} for i, p, t, c in steps]
        prompt = [{"role": "user", "content": QUESTION.format(a=a, b=b)}]
        trees.append({"question_id": f"add-{a}-{b}", "prompt": prompt, "delimiter": "\n\n", "solution": str(s),
                      "nodes": nodes})  # fmt: skip
    return trees


def last_integer(text: str) -> int | None:
    """The last integer in a text, or None; None too when it has more digits than Python converts to an int
    (`sys.get_int_max_str_digits()`, 4300 by default), which no answer of the task has.

    >>> last_integer("7 + 5 = 12."), last_integer("-007"), last_integer("no number"), last_integer("9" * 5000)
    (12, -7, None, None)
    """
    found = _INTEGER.findall(text)
    if not found:
        return None
    digits = found[-1].lstrip("-").lstrip("0") or "0"  # int() counts leading zeros towards its limit too
    limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0
    if limit and len(digits) > limit:
        return None
    return -int(digits) if found[-1].startswith("-") else int(digits)


def last_integer_reward(completions, solution, **kwargs) -> list[float]:
    """1.0 when the last integer of the completion is the `solution`, else 0.0 (the task's correctness reward)."""
    return [
        1.0 if last_integer(completion_text(c)) == int(s) else 0.0 for c, s in zip(completions, solution, strict=True)
    ]


last_integer_reward.correctness = True  # dynamic sampling filters on it


def brevity_reward(max_tokens: int = 24):
    """Build a reward for short answers: 1 − min(l, max_tokens) / max_tokens, l the completion's length in tokens."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"brevity: max_tokens={max_tokens!r} must be a whole number >= 1.")

    def brevity(completion_ids, **kwargs) -> list[float]:
        return [1.0 - min(len(ids), max_tokens) / max_tokens for ids in completion_ids]

    brevity.__name__ = "brevity"
    return brevity


register_reward("last_integer", last_integer_reward)
register_reward("brevity", brevity_reward, factory=True)
TASK_REWARDS = ["last_integer", "brevity"]
TASK_REWARD_WEIGHTS = [1.0, 0.5]


@torch.no_grad()
def greedy_replies(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int = 24, batch_size: int = 64,
                   ) -> list[str]:  # fmt: skip
    """The model's greedy reply to each conversational prompt (left-padded batches, the model's mode restored)."""
    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    replies = []
    try:
        for start in range(0, len(prompts), batch_size):
            texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                     for p in prompts[start : start + batch_size]]  # fmt: skip
            inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
            replies += tokenizer.batch_decode(out[:, inputs["input_ids"].size(1) :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return replies


def heldout_correct(model, tokenizer, problems: list[tuple[int, int]] | None = None, max_new_tokens: int = 24,
                    batch_size: int = 64, system: str | None = None) -> list[bool]:  # fmt: skip
    """Per held-out problem, whether the greedy reply's last integer is the sum (prompts as in `addition_dataset`,
    with the same optional system message)."""
    problems = problems or addition_problems("heldout")
    head = [{"role": "system", "content": system}] if system else []
    prompts = [[*head, {"role": "user", "content": QUESTION.format(a=a, b=b)}] for a, b in problems]
    replies = greedy_replies(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    return [last_integer(r) == a + b for r, (a, b) in zip(replies, problems, strict=True)]


def heldout_accuracy(model, tokenizer, problems: list[tuple[int, int]] | None = None, max_new_tokens: int = 24,
                     batch_size: int = 64, system: str | None = None) -> float:  # fmt: skip
    """Greedy accuracy on the held-out problems: the share whose reply's last integer is the sum (prompts as in
    `addition_dataset`, with the same optional system message)."""
    correct = heldout_correct(model, tokenizer, problems, max_new_tokens, batch_size, system)
    return sum(correct) / len(correct)


class HeldoutAccuracy(TrainerCallback):
    """Logs `heldout/accuracy` (greedy, on the held-out problems) at the start, every `every` steps and at the end.

    `history` holds (step, accuracy) per evaluation, `correct` the per-problem correctness (0 / 1, in the held-out
    set's order) of each, what a paired comparison of two runs resamples."""

    key = "heldout/accuracy"

    def __init__(self, every: int | None = None, max_new_tokens: int = 24, system: str | None = None,
                 size: int | None = None):  # fmt: skip
        """`size`: the first `size` of the 60 held-out problems (default all)."""
        if size is not None and not 1 <= size <= HELDOUT_SIZE:
            raise ValueError(f"heldout_size={size!r}: the addition task has {HELDOUT_SIZE} held-out problems; "
                             f"choose 1 to {HELDOUT_SIZE}")  # fmt: skip
        self.every, self.max_new_tokens, self.system = every, max_new_tokens, system
        self.problems = addition_problems("heldout")[:size]
        self.label = f"held-out accuracy (greedy, {len(self.problems)} problems)"
        self.trainer = None
        self.history: list[tuple[int, float]] = []  # (step, accuracy)
        self.correct: list[list[int] | None] = []  # per evaluation: per problem 1 (right) or 0
        self._correct = None

    def attach(self, trainer) -> HeldoutAccuracy:
        self.trainer = trainer
        return self

    def correctness(self, model, tokenizer) -> list[bool]:
        """Per held-out problem, whether the greedy reply is right."""
        return heldout_correct(model, tokenizer, self.problems, max_new_tokens=self.max_new_tokens, system=self.system)

    def evaluate(self, model, tokenizer) -> float:
        self._correct = [int(c) for c in self.correctness(model, tokenizer)]
        return sum(self._correct) / len(self._correct)

    def measure(self, step: int) -> float:
        """Evaluate now, log the value, and say on the main process what runs and what it gave (the evaluation takes
        a minute on a CPU: a silent pause under a progress bar reads as a hang)."""
        from tqdm.auto import tqdm  # writes above an open progress bar without breaking it

        say = self.trainer.is_world_process_zero() if hasattr(self.trainer, "is_world_process_zero") else True
        when = "before training" if not self.history else f"after step {step}"
        if say:
            tqdm.write(f"Evaluating the {self.label} {when}...")
        start = time.perf_counter()
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        self._correct = None
        value = self.evaluate(model, self.trainer.processing_class)
        if say:
            tqdm.write(f"The {self.label} {when}: {value:.3f} ({time.perf_counter() - start:.0f} s)")
        self.history.append((step, value))
        self.correct.append(self._correct)
        if hasattr(self.trainer, "log_metric"):  # ours: joins TRL's metrics (reporters); TRL's own trainer: history
            self.trainer.log_metric(self.key, value)
        return value

    def on_train_begin(self, args, state, control, **kwargs):
        if not self.history:
            self.measure(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self.every and state.global_step % self.every == 0 and state.global_step < state.max_steps:
            self.measure(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.measure(state.global_step)


# ------------------------------------------------------------------------------------------------ driving (NoRD)
DRIVING_TRAIN_SEED, DRIVING_HELDOUT_SEED = 0, 1000
DRIVING_HELDOUT_SIZE = 48


def driving_task_dataset(split: str = "train", n: int | None = None):
    """The text-only driving task (`trl_grpo_ext.data.driving`, `images=False`): 256 training scenes (seed 0) or the
    48 held-out scenes (seed 1000, never trained on)."""
    from .data.driving import driving_dataset

    if split == "train":
        return driving_dataset(n or 256, images=False, seed=DRIVING_TRAIN_SEED)
    if split == "heldout":
        return driving_dataset(n or DRIVING_HELDOUT_SIZE, images=False, seed=DRIVING_HELDOUT_SEED)
    raise ValueError(f"split={split!r} is not 'train' or 'heldout'.")


@torch.no_grad()
def heldout_driving_score(model, tokenizer, rows=None, max_new_tokens: int = 48, batch_size: int = 48) -> float:
    """Mean driving score of greedy trajectories on the held-out scenes (`trajectory` reward: malformed or a wrong
    number of waypoints scores 0)."""
    from .rewards import get_reward

    rows = rows if rows is not None else driving_task_dataset("heldout")
    reward = get_reward("trajectory")
    template, tokenizer = tokenizer, getattr(tokenizer, "tokenizer", tokenizer)  # a VLM's processor: text prompts
    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    total = 0.0
    try:
        for start in range(0, len(rows), batch_size):
            chunk = rows.select(range(start, min(start + batch_size, len(rows))))
            texts = [
                template.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in chunk["prompt"]
            ]
            inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
            replies = tokenizer.batch_decode(out[:, inputs["input_ids"].size(1) :], skip_special_tokens=True)
            total += sum(reward(completions=replies, future=chunk["future"], scene=chunk["scene"]))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return total / len(rows)


class HeldoutDrivingScore(HeldoutAccuracy):
    """Logs `heldout/driving_score` (greedy, on the 48 held-out text scenes) at the start, every `every` steps and
    at the end."""

    key = "heldout/driving_score"

    def __init__(self, every: int | None = None, max_new_tokens: int = 48, rows=None, size: int | None = None):
        """`rows`: the held-out scenes (default: `size` scenes of the held-out seed, 48 unless given)."""
        super().__init__(every=every, max_new_tokens=max_new_tokens)
        if size is not None and (rows is not None or size < 1):
            raise ValueError(f"heldout_size={size!r} must be a whole number >= 1, and is not given with rows")
        self.rows = rows if rows is not None else driving_task_dataset("heldout", n=size)
        self.label = f"held-out driving score (greedy, {len(self.rows)} scenes)"

    def evaluate(self, model, tokenizer) -> float:
        return heldout_driving_score(model, tokenizer, self.rows, max_new_tokens=self.max_new_tokens)


# ------------------------------------------------------------------------------------------------ reasoning-gym
# Any reasoning-gym dataset (`pip install "trl-grpo-ext[tasks]"`) as a task: `--task rg:chain_sum`, its config from
# `--task_args`, its verifier (`score_answer`) as the reward `rg_score`, a held-out set of another seed.
RG_PREFIX = "rg:"
RG_INSTALL = 'pip install "trl-grpo-ext[tasks]"'
RG_INSTRUCTION = "Answer with just the final answer."
RG_TRAIN_SEED, RG_HELDOUT_SEED = 0, 1_000_000
RG_TRAIN_SIZE, RG_HELDOUT_SIZE = 1000, 200
RG_HELDOUT_DRAWS = 20  # the held-out set draws up to this many times its size to find as many distinct questions
_NUMBER = re.compile(r"[-+]?\d(?:[\d,]*\d)?(?:\.\d+)?")
_LEAD_IN = re.compile(r"^(?:the\s+)?(?:final\s+)?answer(?:\s+is)?\s*[:=]?\s*", re.IGNORECASE)


def import_reasoning_gym():
    """The `reasoning_gym` module, or an ImportError whose message is the one line that names the install."""
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ImportError(f"the reasoning-gym tasks need the reasoning-gym package: {RG_INSTALL}") from exc
    return reasoning_gym


def rg_dataset_names() -> list[str]:
    """The names of reasoning-gym's datasets (`chain_sum`, `gcd`, ...), sorted."""
    import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _is_number(text) -> bool:
    try:
        float(str(text).replace(",", ""))
    except ValueError:
        return False
    return True


def last_answer_tag(text: str) -> str | None:
    """The content of the last `<answer>...</answer>` pair, or None: what `re.findall(r"<answer>\s?(.*?)\s?</answer>",
    text, re.DOTALL)[-1]` gives (reasoning_gym.utils.extract_answer's rule), in linear time (the regex rescans the
    text from every `<answer>` of one that is never closed).

    >>> last_answer_tag("<answer> 7 </answer> then <answer>8</answer>"), last_answer_tag("<answer>" * 3)
    ('8', None)
    """
    found, at = None, 0
    while (start := text.find("<answer>", at)) >= 0:
        end = text.find("</answer>", start + len("<answer>"))
        if end < 0:
            break
        found, at = text[start + len("<answer>") : end], end + len("</answer>")
    if found is None:
        return None
    found = found[1:] if found[:1].isspace() else found
    return found[:-1] if found[-1:].isspace() else found


def final_answer(text: str, numeric: bool = False) -> str | None:
    """The answer a completion gives, by one rule (docs/cli.md, "reasoning-gym tasks").

    The content of the last `<answer>...</answer>` pair when there is one (reasoning-gym's own `extract_answer`),
    else the whole completion. From that, for a task whose reference answer is a number (`numeric`), its last number
    (as `last_integer` reads the built-in task's replies, decimals and thousands commas kept); for any other task,
    its last non-empty line, without an "Answer:" / "The final answer is" lead-in, `**` bold markers and a trailing
    period. None when nothing is left.

    >>> final_answer("2 + 3 = 5, so the answer is 5.", numeric=True)
    '5'
    >>> final_answer("Let me think.\\n**Answer: blue.**")
    'blue'
    >>> final_answer("<answer>7</answer> or maybe 8", numeric=True)
    '7'
    """
    tagged = last_answer_tag(text)
    text = text if tagged is None else tagged
    if numeric:
        numbers = _NUMBER.findall(text)
        return numbers[-1] if numbers else None
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return None
    answer = lines[-1].replace("**", "").strip()
    answer = _LEAD_IN.sub("", answer).strip()
    answer = answer[:-1].rstrip() if answer.endswith(".") else answer
    return answer or None


@functools.lru_cache(maxsize=64)
def _rg_dataset(key: str):
    """The reasoning-gym dataset that a row's `rg_task` (JSON: name, args, seed, size) names, built once."""
    spec = json.loads(key)
    return import_reasoning_gym().create_dataset(spec["name"], **spec["args"], seed=spec["seed"], size=spec["size"])


@functools.lru_cache(maxsize=65536)
def _rg_entry(key: str, index: int) -> dict:
    return _rg_dataset(key)[index]


def rg_score(text: str, task: str, index: int) -> float:
    """The verifier's score (`score_answer(answer, entry)`, 0 to 1) of a completion's `final_answer` to row `index` of
    the reasoning-gym dataset `task` (the row's `rg_task`). A verifier that raises on an answer scores it 0."""
    dataset, entry = _rg_dataset(task), _rg_entry(task, index)
    answer = final_answer(text, numeric=_is_number(entry["answer"]))
    try:
        return float(dataset.score_answer(answer, entry))
    except Exception:  # the verifier chokes on what the model wrote: not a right answer
        return 0.0


def rg_score_reward(completions, rg_task, rg_index, **kwargs) -> list[float]:
    """The reasoning-gym task's correctness reward: its verifier's score of the completion's final answer (1.0 right,
    0.0 wrong; some verifiers give partial credit in between). Rows carry `rg_task` and `rg_index` (`RGTask.dataset`)."""
    return [rg_score(completion_text(c), t, i) for c, t, i in zip(completions, rg_task, rg_index, strict=True)]


rg_score_reward.correctness = True  # dynamic sampling filters on it
register_reward("rg_score", rg_score_reward)


class RGTask:
    """A reasoning-gym dataset as a task: `name` (`chain_sum`), `args` (its config's fields, as `--task_args`).

    Training problems: `args["size"]` (default 1000) items of seed `args["seed"]` (default 0), less any whose question
    is a held-out one. Held-out problems: the first `heldout_size` distinct questions of seed 1000000. The prompt is
    one user message, the question and "Answer with just the final answer." (the built-in task's format).
    Construction checks the name and the config; a bad one is a ValueError whose message is one line.
    """

    def __init__(self, name: str, args: dict | None = None, heldout_size: int = RG_HELDOUT_SIZE):
        reasoning_gym = import_reasoning_gym()
        from reasoning_gym.factory import DATASETS

        if name not in DATASETS:
            close = difflib.get_close_matches(name, DATASETS, n=5, cutoff=0.5)
            names = ", ".join(close or sorted(DATASETS))
            hint = f"close names: {names}" if close else f"the {len(DATASETS)} names: {names}"
            raise ValueError(f"{RG_PREFIX}{name} is not a reasoning-gym dataset; {hint}")
        args = dict(args or {})
        config_cls = DATASETS[name][1]
        fields = [f.name for f in dataclasses.fields(config_cls)]
        unknown = [key for key in args if key not in fields]
        if unknown:
            raise ValueError(f"task_args {', '.join(map(repr, unknown))} of {RG_PREFIX}{name}: no such field of "
                             f"{config_cls.__name__}; its fields: {', '.join(fields)}")  # fmt: skip
        if not isinstance(heldout_size, int) or heldout_size < 1:
            raise ValueError(f"heldout_size={heldout_size!r} must be a whole number >= 1")
        self.name, self.heldout_size = name, heldout_size
        self.train_seed, self.train_size = args.pop("seed", RG_TRAIN_SEED), args.pop("size", RG_TRAIN_SIZE)
        if self.train_seed == RG_HELDOUT_SEED:
            raise ValueError(f"task_args seed {RG_HELDOUT_SEED} is the held-out set's; choose another training seed")
        self.args = args
        try:
            reasoning_gym.create_dataset(name, **args, seed=self.train_seed, size=self.train_size)
        except Exception as exc:  # the config's own checks (asserts) and type errors
            what = " ".join(str(exc).split()) or type(exc).__name__
            raise ValueError(f"task_args {json.dumps(args)} of {RG_PREFIX}{name}: {what}") from exc
        self._splits = None

    @property
    def task(self) -> str:
        return f"{RG_PREFIX}{self.name}"

    def key(self, split: str) -> str:
        """The split's dataset as the rows' `rg_task` column holds it (JSON: name, args, seed, size)."""
        seed, size = ((self.train_seed, self.train_size) if split == "train"
                      else (RG_HELDOUT_SEED, RG_HELDOUT_DRAWS * self.heldout_size))  # fmt: skip
        return json.dumps({"name": self.name, "args": self.args, "seed": seed, "size": size}, sort_keys=True)

    def indices(self) -> dict[str, list[int]]:
        """The items of each split: held-out first (distinct questions), then training (none a held-out question)."""
        if self._splits is None:
            heldout, questions = [], set()
            source = _rg_dataset(self.key("heldout"))
            for index in range(len(source)):
                question = source[index]["question"]
                if question not in questions:
                    heldout.append(index)
                    questions.add(question)
                    if len(heldout) == self.heldout_size:
                        break
            source = _rg_dataset(self.key("train"))
            train = [index for index in range(self.train_size) if source[index]["question"] not in questions]
            if not train:
                raise ValueError(f"{self.task} {json.dumps(self.args)}: every training problem is a held-out one "
                                 f"({len(heldout)} held-out problems); lower --heldout_size or widen --task_args")  # fmt: skip
            self._splits = {"train": train, "heldout": heldout}
        return self._splits

    def dataset(self, split: str = "train", system: str | None = None) -> Dataset:
        """TRL's conversational format: `prompt`, and what the verifier needs: `answer` (the reference), `rg_task`,
        `rg_index` (the item, regenerated from its seed when scored)."""
        if split not in ("train", "heldout"):
            raise ValueError(f"split={split!r} is not 'train' or 'heldout'.")
        key, source = self.key(split), _rg_dataset(self.key(split))
        head = [{"role": "system", "content": system}] if system else []
        rows = {"prompt": [], "answer": [], "rg_task": [], "rg_index": []}
        for index in self.indices()[split]:
            entry = source[index]
            rows["prompt"].append([*head, {"role": "user", "content": f"{entry['question']}\n\n{RG_INSTRUCTION}"}])
            rows["answer"].append(str(entry["answer"]))
            rows["rg_task"].append(key)
            rows["rg_index"].append(index)
        return Dataset.from_dict(rows)


class RGHeldoutAccuracy(HeldoutAccuracy):
    """`heldout/accuracy` on a reasoning-gym task's held-out problems: the share of greedy replies that its verifier
    scores 1 (`rg_score`)."""

    def __init__(self, task: RGTask, every: int | None = None, max_new_tokens: int = 24, system: str | None = None):
        super().__init__(every=every, max_new_tokens=max_new_tokens, system=system)
        self.rows = task.dataset("heldout", system=system)
        self.label = f"held-out accuracy (greedy, {len(self.rows)} {task.task} problems)"

    def correctness(self, model, tokenizer) -> list[bool]:
        replies = greedy_replies(model, tokenizer, self.rows["prompt"], max_new_tokens=self.max_new_tokens)
        return [rg_score(r, t, i) >= 1.0 for r, t, i in zip(replies, self.rows["rg_task"], self.rows["rg_index"],
                                                            strict=True)]  # fmt: skip
