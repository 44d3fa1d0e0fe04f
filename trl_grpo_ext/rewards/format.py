"""Format rewards: are the configured tags present, once each, in order?"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

_TAG_NAME = re.compile(r"^[A-Za-z_][\w-]*$")


def completion_text(completion) -> str:
    """The text of one completion, standard (`str`) or conversational (a list of messages).

    For conversational completions the assistant messages are joined, so multi-turn tool-calling completions are
    read whole; TRL's own rewards read only `completion[0]["content"]`.
    """
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion if m.get("role", "assistant") == "assistant")


def tag_format_reward(tags: Sequence[str] | str = ("think", "answer"), partial: bool = False) -> Callable:
    """Build a reward that checks that a completion is made of the given tag blocks, in order.

    With `partial=False` (default) a completion scores 1.0 when it is exactly `<t1>…</t1> <t2>…</t2> …` (white space
    between blocks and at the ends allowed) with every tag opened and closed once, else 0.0. With `partial=True` it
    scores the fraction of tags that are opened once and closed once after their opening.

    Args:
        tags: tag names in the order they must appear, e.g. `["plan", "think", "answer"]` (PTA-GRPO's format) or a
            comma-separated string `"plan,think,answer"`.
        partial: give partial credit instead of all-or-nothing.

    >>> reward = tag_format_reward(["think", "answer"])
    >>> reward(completions=["<think>3+4</think>\\n<answer>7</answer>", "<answer>7</answer><think>x</think>"])
    [1.0, 0.0]
    >>> tag_format_reward("think,answer", partial=True)(completions=["<think>x</think> 7"])
    [0.5]
    """
    if isinstance(tags, str):
        tags = [t.strip() for t in tags.split(",")]
    tags = list(tags)
    if not tags:
        raise ValueError("tag_format: tags=[] is empty; give at least one tag name, e.g. tags=['think', 'answer'].")
    bad = [t for t in tags if not isinstance(t, str) or not _TAG_NAME.match(t)]
    if bad:
        raise ValueError(
            f"tag_format: tags={tags!r} contains invalid names {bad!r}; use bare names like 'think' (no angle brackets)."
        )
    if len(set(tags)) != len(tags):
        raise ValueError(f"tag_format: tags={tags!r} repeats a tag; list each tag once.")
    if not isinstance(partial, bool):
        raise ValueError(f"tag_format: partial={partial!r} must be true or false.")

    blocks = [rf"<{re.escape(t)}>.*?</{re.escape(t)}>" for t in tags]
    whole = re.compile(r"^\s*" + r"\s*".join(blocks) + r"\s*$", re.DOTALL)

    def score(text: str) -> float:
        once = [text.count(f"<{t}>") == 1 and text.count(f"</{t}>") == 1 for t in tags]
        if partial:
            ok = [o and text.index(f"<{t}>") < text.index(f"</{t}>") for o, t in zip(once, tags, strict=False)]
            return sum(ok) / len(tags)
        return 1.0 if all(once) and whole.match(text) else 0.0

    def reward(completions, **kwargs) -> list[float]:
        return [score(completion_text(c)) for c in completions]

    reward.__name__ = "tag_format_" + "_".join(tags)
    reward.__qualname__ = reward.__name__
    return reward


def contains_solution_reward(completions, solution, **kwargs) -> list[float]:
    """1.0 when the row's `solution` appears in the completion as a whole word or number, else 0.0.

    A lenient correctness check (the answer anywhere in the text), useful as a dense early signal next to the
    strict `accuracy` (math-verify on the final answer). Rows with an empty solution score None (skipped).

    >>> contains_solution_reward(["so it is 12.", "it is 123"], solution=["12", "12"])
    [1.0, 0.0]
    """
    scores = []
    for completion, sol in zip(completions, solution, strict=True):
        sol = str(sol).strip()
        if not sol:
            scores.append(None)
            continue
        pattern = rf"(?<![\w.]){re.escape(sol)}(?![\w]|\.\d)"
        scores.append(1.0 if re.search(pattern, completion_text(completion)) else 0.0)
    return scores
