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
def heldout_accuracy(model, tokenizer, problems: list[tuple[int, int]] | None = None, max_new_tokens: int = 24,
                     batch_size: int = 64, system: str | None = None) -> float:  # fmt: skip
    """Greedy accuracy on the held-out problems: the share whose reply's last integer is the sum (prompts as in
    `addition_dataset`, with the same optional system message)."""
    problems = problems or addition_problems("heldout")
    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    right = 0
    try:
        for start in range(0, len(problems), batch_size):
            chunk = problems[start : start + batch_size]
            head = [{"role": "system", "content": system}] if system else []
            texts = [tokenizer.apply_chat_template([*head, {"role": "user", "content": QUESTION.format(a=a, b=b)}],
                                                   tokenize=False, add_generation_prompt=True) for a, b in chunk]  # fmt: skip
            inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
            replies = tokenizer.batch_decode(out[:, inputs["input_ids"].size(1) :], skip_special_tokens=True)
            right += sum(last_integer(r) == a + b for r, (a, b) in zip(replies, chunk, strict=True))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return right / len(problems)


class HeldoutAccuracy(TrainerCallback):
    """Logs `heldout/accuracy` (greedy, on the held-out problems) at the start, every `every` steps and at the end."""

    key = "heldout/accuracy"
    label = f"held-out accuracy (greedy, {HELDOUT_SIZE} problems)"

    def __init__(self, every: int | None = None, max_new_tokens: int = 24, system: str | None = None):
        self.every, self.max_new_tokens, self.system = every, max_new_tokens, system
        self.trainer = None
        self.history: list[tuple[int, float]] = []  # (step, accuracy)

    def attach(self, trainer) -> HeldoutAccuracy:
        self.trainer = trainer
        return self

    def evaluate(self, model, tokenizer) -> float:
        return heldout_accuracy(model, tokenizer, max_new_tokens=self.max_new_tokens, system=self.system)

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
        value = self.evaluate(model, self.trainer.processing_class)
        if say:
            tqdm.write(f"The {self.label} {when}: {value:.3f} ({time.perf_counter() - start:.0f} s)")
        self.history.append((step, value))
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
    label = f"held-out driving score (greedy, {DRIVING_HELDOUT_SIZE} scenes)"

    def __init__(self, every: int | None = None, max_new_tokens: int = 48, rows=None):
        super().__init__(every=every, max_new_tokens=max_new_tokens)
        self.rows = rows

    def evaluate(self, model, tokenizer) -> float:
        return heldout_driving_score(model, tokenizer, self.rows, max_new_tokens=self.max_new_tokens)
