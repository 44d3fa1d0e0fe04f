"""Segment-level credit (GPG, arXiv 2512.10365; ARPO, arXiv 2507.19849): segments, not tokens or answers, as actions.

A completion is cut into segments (GPG's macro-actions): tool turns, tag blocks, paragraphs, or a user's regex.
Every segmenter returns (B, T) long segment ids: 0, 1, 2, ... along each row, in order, -1 on padding. A segment is
a contiguous run of tokens; ids are consecutive within a row (a row with n segments uses 0..n-1) and restart at 0 on
every row. GPG treats a segment as one action whose log-probability is the sum of its tokens'; ∇J = E[Σ_T ∇log
π(MA_T | MS_T)·Φ_T], with Φ_T the segment's advantage (`segment_advantage`):

- `"soft"`: GRPO over the full trajectories, every token its row's advantage (ARPO's soft setting);
- `"hard"`: a token shared by several trajectories (an ARPO branch and its parent) gets the mean advantage of all of
  them, on each copy (`tree_token_advantages` over the rollout tree's node ids);
- `"reward"`: the outcome advantage plus λ times the group-normalised score of each segment (turn-level credit
  without branching), from segment rewards that return one score per trainable segment.

Tool-result tokens are never trained (TRL's tool mask). `cut_segments(segment_by, ...)` dispatches on the config
value: `"tool_calls"`, `"tags"`, `"paragraphs"` or `"regex:<pattern>"`.

Text segmenters (tags, paragraphs, regex) find character positions in the decoded completion and map them to tokens:
a new segment starts at the token that holds the boundary character. Token character spans come from the fast
tokenizer's offsets: the row's ids are decoded (special tokens kept) and re-tokenised with
`return_offsets_mapping=True`. When re-tokenising does not give back the same ids (a sampled completion need not be
the canonical tokenisation of its text), that row falls back to decoding its prefixes ids[:1], ids[:2], ... and taking
their lengths: exact, but O(T²) characters, so only the rows that need it pay for it.

What TRL 1.16 puts in `completions` when it trains with `tools=` or `environment_factory=` (`GRPOTrainer._generate`,
`_tool_call_loop`, `trl.chat_template_utils.parse_response`), as the segment reward `tool_call_validity` reads it:
each completion is a list of messages `[assistant, tool, ..., assistant, tool, ..., assistant]`.

- an assistant message is one model turn, `{"role": "assistant", "content": str}`, with `"tool_calls": [{"type":
  "function", "function": {"name": str, "arguments": dict}}, ...]` when its tool calls parsed. A malformed call
  (bad JSON, missing fields) fails `parse_response`, which falls back to the decoded text: the message has no
  `tool_calls`, its content still holds the call markup (`<tool_call>...`), no tool runs and the loop stops.
- after a turn with tool calls come its tool messages, `{"role": "tool", "name": name, "content": str(result)}`, one
  per call: sync tools in call order, then async ones. A failed call gives the content `str({"error": message})`, i.e.
  `"{'error': '...'}"`: an unknown name (`"Tool {name} not found."`), an exception raised by the tool (bad
  arguments...), or a call type other than "function".
- a turn's calls get no tool messages when the loop stops first: `max_tool_calling_iterations` reached, or the results
  would overflow `max_completion_length` (TRL rolls them back).

In the token sequence, assistant message j is the j-th run of model tokens (`tool_mask == 1`), i.e. segment 2j of
`segments_from_tool_mask`; tool messages are the runs of `tool_mask == 0` between them.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..advantages import segment_reward_advantages, tree_token_advantages
from ..extension import Extension, Method, TrainerInputs, register_method
from ..rewards import get_reward, register_reward
from ..rewards.guard import check_reward_name

SEGMENT_BY_CHOICES = ("tool_calls", "tags", "paragraphs", "regex:<pattern>")
_TAG_NAME = re.compile(r"^[A-Za-z_][\w-]*$")
# A blank line: a newline, optional horizontal space, another newline, and any white space after it. The new
# paragraph starts where the match ends, so the blank line closes the paragraph before it.
_BLANK_LINES = re.compile(r"\n[ \t\r]*\n\s*")


def segments_from_tool_mask(tool_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """A new segment at every switch between model tokens and tool-result tokens.

    TRL's `tool_mask` is 1 on tokens the model generated and 0 on tool-result (environment) tokens. A completion
    model → tool → model → tool → model gets segments 0, 1, 2, 3, 4: tool results get their own ids (they are never
    trained, but they are edges of the rollout path). TRL's completions start with generated tokens, so model turn j
    is segment 2j and the result of its tool calls is segment 2j + 1.

    Args:
        tool_mask: (B, T) 1 on model tokens, 0 on tool-result tokens (TRL's `out["tool_mask"]`).
        completion_mask: (B, T) 1 on real tokens, 0 on padding.

    Returns:
        (B, T) long segment ids, -1 where `completion_mask` is 0.

    >>> segments_from_tool_mask(torch.tensor([[1, 1, 0, 0, 1, 1]]), torch.tensor([[1, 1, 1, 1, 1, 0]]))
    tensor([[ 0,  0,  1,  1,  2, -1]])
    """
    if tool_mask.dim() != 2 or tool_mask.shape != completion_mask.shape:
        raise ValueError(
            f"tool_mask and completion_mask must both have shape (B, T), got {tuple(tool_mask.shape)} and "
            f"{tuple(completion_mask.shape)}."
        )
    valid = completion_mask.bool()  # (B, T)
    kind = tool_mask.bool()  # (B, T)
    switch = torch.zeros_like(valid)
    switch[:, 1:] = kind[:, 1:] != kind[:, :-1]  # (B, T): True where a new segment starts
    return _ids_from_starts(switch, valid)


def segments_from_regex(
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    tokenizer,
    pattern: str | re.Pattern,
    require_match: bool = True,
) -> torch.Tensor:
    """A new segment starts at every match of `pattern` in the decoded completion.

    The boundary is the match's start (a zero-width pattern such as `(?=Step \\d)` works). A match at position 0 or
    inside the token that already starts a segment adds no segment. Rows without a match are one segment.

    Args:
        completion_ids: (B, T) token ids.
        completion_mask: (B, T) 1 on real tokens, 0 on padding.
        tokenizer: the policy's tokenizer (a fast tokenizer for the quick path; any tokenizer works).
        pattern: a Python regular expression (string or compiled).
        require_match: when True (default), a batch where the pattern matches no completion at all raises
            `ValueError`: almost always a wrong pattern, which would otherwise silently train one segment per
            completion (plain GRPO). Pass False to let such batches through as one segment per completion.

    Returns:
        (B, T) long segment ids, -1 on padding.
    """
    regex = _compile(pattern)
    what = f"segment_by='regex:{regex.pattern}': the pattern {regex.pattern!r} matches no completion"
    return _segments_from_text(completion_ids, completion_mask, tokenizer, regex, require_match, what)


def segments_from_tags(
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    tokenizer,
    tags: Sequence[str] | str = ("think", "answer"),
    require_match: bool = True,
) -> torch.Tensor:
    """A new segment starts at every opening tag `<tag>` of the given tags.

    `<think>a</think>\\n<answer>7</answer>` gives two segments, `<think>a</think>\\n` and `<answer>7</answer>`: text
    after a closing tag stays with the block it closes; text before the first tag is a segment of its own.

    Args:
        completion_ids, completion_mask, tokenizer: as in `segments_from_regex`.
        tags: tag names, e.g. `("plan", "think", "answer")` or `"plan,think,answer"`.
        require_match: as in `segments_from_regex`: a batch with none of the tags in any completion raises.

    Returns:
        (B, T) long segment ids, -1 on padding.
    """
    if isinstance(tags, str):
        tags = [t.strip() for t in tags.split(",")]
    tags = list(tags)
    bad = [t for t in tags if not isinstance(t, str) or not _TAG_NAME.match(t)]
    if not tags or bad:
        raise ValueError(
            f"segments_from_tags: tags={tags!r} must be non-empty bare tag names like 'think' (no angle brackets)."
        )
    regex = re.compile("<(?:" + "|".join(re.escape(t) for t in tags) + ")>")
    what = f"segment_by='tags': none of the opening tags {', '.join(f'<{t}>' for t in tags)} is in any completion"
    return _segments_from_text(completion_ids, completion_mask, tokenizer, regex, require_match, what)


def segments_from_paragraphs(
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    tokenizer,
    require_match: bool = True,
) -> torch.Tensor:
    """A new segment starts after every blank line (a line holding only white space).

    The blank line itself closes the paragraph before it: `"a\\n\\nb"` gives `"a\\n\\n"` and `"b"`.

    Args:
        completion_ids, completion_mask, tokenizer: as in `segments_from_regex`.
        require_match: as in `segments_from_regex`: a batch with no blank line in any completion raises.

    Returns:
        (B, T) long segment ids, -1 on padding.
    """
    what = "segment_by='paragraphs': not one blank line in any completion"
    return _segments_from_text(
        completion_ids, completion_mask, tokenizer, _BLANK_LINES, require_match, what, at_match_end=True
    )


def parse_segment_by(segment_by: str) -> tuple[str, str | None]:
    """Validate a `segment_by` value; returns (kind, regex pattern or None). Config validation calls this early.

    >>> parse_segment_by("regex:^Step")
    ('regex', '^Step')
    """
    if not isinstance(segment_by, str):
        raise ValueError(f"segment_by={segment_by!r} must be a string, one of {', '.join(SEGMENT_BY_CHOICES)}.")
    if segment_by.startswith("regex:"):
        pattern = segment_by[len("regex:") :]
        if not pattern:
            raise ValueError(
                "segment_by='regex:' has an empty pattern; write the regex after the colon, e.g. 'regex:^Step'."
            )
        _compile(pattern)
        return "regex", pattern
    if segment_by in ("tool_calls", "tags", "paragraphs"):
        return segment_by, None
    raise ValueError(f"segment_by={segment_by!r} is not one of {', '.join(SEGMENT_BY_CHOICES)}.")


def cut_segments(
    segment_by: str,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    tool_mask: torch.Tensor | None = None,
    tokenizer=None,
    tags: Sequence[str] | str = ("think", "answer"),
    require_match: bool = True,
) -> torch.Tensor:
    """Segment ids (B, T) for the config's `segment_by`: `"tool_calls"`, `"tags"`, `"paragraphs"` or
    `"regex:<pattern>"`.

    `"tool_calls"` needs `tool_mask` (TRL returns one whenever it trains with `tools=` or `environment_factory=`;
    a completion without tool calls is then one segment). The text segmenters need `tokenizer`; `tags` applies to
    `"tags"`, `require_match` to the text segmenters.
    """
    kind, pattern = parse_segment_by(segment_by)
    if kind == "tool_calls":
        if tool_mask is None:
            raise ValueError(
                "segment_by='tool_calls' needs TRL's tool_mask, and this batch has none: train with tools= or "
                "environment_factory=, or pick a text segmenter ('tags', 'paragraphs', 'regex:<pattern>')."
            )
        return segments_from_tool_mask(tool_mask, completion_mask)
    if tokenizer is None:
        raise ValueError(
            f"segment_by={segment_by!r} reads the completion text and needs tokenizer=the policy's tokenizer."
        )
    if kind == "tags":
        return segments_from_tags(completion_ids, completion_mask, tokenizer, tags, require_match)
    if kind == "paragraphs":
        return segments_from_paragraphs(completion_ids, completion_mask, tokenizer, require_match)
    return segments_from_regex(completion_ids, completion_mask, tokenizer, pattern, require_match)


def token_char_ends(rows: list[list[int]], tokenizer) -> tuple[list[str], list[list[int]]]:
    """For each row of token ids: its decoded text (special tokens kept) and the character offset where each token
    ends.

    Fast path (one batched call): re-tokenise the texts with offsets, used for every row that gets back exactly its
    ids. Other rows: the length of each decoded prefix ids[: t + 1] (O(T²) characters). Ends never decrease: a token
    that holds only part of a multi-byte character ends where the previous one did.
    """
    texts = tokenizer.batch_decode(rows, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    ends: list[list[int] | None] = [None] * len(rows)
    if getattr(tokenizer, "is_fast", False) and rows:
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        for row, (ids, again, offsets) in enumerate(
            zip(rows, encoded["input_ids"], encoded["offset_mapping"], strict=False)
        ):
            if list(again) == list(ids):
                ends[row] = _running_max([end for _, end in offsets])
    for row, ids in enumerate(rows):
        if ends[row] is None:
            prefixes = tokenizer.batch_decode(
                [ids[: t + 1] for t in range(len(ids))], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            ends[row] = _running_max([min(len(p), len(texts[row])) for p in prefixes])
    return texts, ends


def _segments_from_text(
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    tokenizer,
    regex: re.Pattern,
    require_match: bool,
    what: str,
    at_match_end: bool = False,
) -> torch.Tensor:
    # A new segment starts at every match's start (or end, with at_match_end).
    if completion_ids.dim() != 2 or completion_mask.shape != completion_ids.shape:
        raise ValueError(
            f"completion_ids and completion_mask must both have shape (B, T), got {tuple(completion_ids.shape)} and "
            f"{tuple(completion_mask.shape)}."
        )
    valid = completion_mask.bool()  # (B, T)
    starts = torch.zeros_like(valid)  # (B, T): True where a new segment starts
    positions = [valid[row].nonzero().squeeze(1) for row in range(valid.size(0))]  # B tensors of (L_b,)
    texts, ends = token_char_ends([completion_ids[row, p].tolist() for row, p in enumerate(positions)], tokenizer)
    matched = False
    # Text work, one regex search per row; the token maths of each row is vectorised.
    for row, (text, row_ends, row_positions) in enumerate(zip(texts, ends, positions, strict=False)):
        boundaries = [m.end() if at_match_end else m.start() for m in regex.finditer(text)]
        matched = matched or bool(boundaries)
        boundaries = torch.tensor([b for b in boundaries if 0 < b < len(text)], dtype=torch.long)  # (n,)
        if boundaries.numel() == 0:
            continue
        # Token t holds boundary b when end_{t-1} <= b < end_t: its index is the count of tokens ending at or before b.
        holders = torch.searchsorted(torch.tensor(row_ends, dtype=torch.long), boundaries, right=True)  # (n,)
        starts[row, row_positions[holders[holders < row_positions.numel()]]] = True
    if require_match and not matched and bool(valid.any()):
        raise ValueError(
            f"{what} of this batch of {completion_ids.size(0)}, so nothing would be cut into segments. Check it "
            "against your completions' text (special tokens included), or pass require_match=False to train such "
            "batches as one segment per completion."
        )
    return _ids_from_starts(starts, valid)


def _ids_from_starts(starts: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    # starts, valid: (B, T) bool. Padding never starts a segment, so ids stay consecutive over real tokens.
    ids = (starts & valid).long().cumsum(1)  # (B, T)
    first = torch.where(valid.any(1), valid.long().argmax(1), 0)  # (B,) first real token of each row
    ids = ids - ids.gather(1, first.unsqueeze(1))  # the first real token is segment 0
    return torch.where(valid, ids, torch.full_like(ids, -1))


def _running_max(values: list[int]) -> list[int]:
    if not values:
        return []
    return torch.cummax(torch.tensor(values, dtype=torch.long), 0).values.tolist()


def _compile(pattern: str | re.Pattern) -> re.Pattern:
    if isinstance(pattern, re.Pattern):
        return pattern
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(
            f"segment_by regex {pattern!r} does not compile: {exc}. Write a Python regular expression."
        ) from exc


# ---------------------------------------------------------------------------------------------------- segment rewards
def tool_call_scores(
    completion, known_tools: Iterable[str] | None = None, call_marker: str = "<tool_call>"
) -> list[float | None]:
    """Tool-call validity of each model turn (assistant message) of one completion: a list, one entry per turn.

    Rule, per tool call of a turn (each check as TRL ran it):
    1. parsed: the turn has the call in `tool_calls`, of type "function", with a string name and dict arguments;
    2. known tool: with `known_tools`, its name is one of them; without, TRL's "Tool ... not found." error catches it;
    3. ran without error: its tool message (the first unused one with that name among the tool messages right after
       the turn) is not an error result, `"{'error': ...}"`. A tool that itself returns `{"error": ...}` counts as
       failed too: it reported an error.
    A call scores 1.0 when all three hold and 0.0 when one fails. A call that parsed and is known but has no tool
    message never ran (the loop stopped first) and is not scored. A turn scores the mean of its scored calls (1.0 or
    0.0 for a single call); a turn without `tool_calls` scores 0.0 when its text holds `call_marker` (a call that did
    not parse) and None otherwise (no call: the final answer, or plain reasoning). None means "no segment reward".

    Args:
        completion: a conversational completion (list of messages), or a string (one turn, never executed by TRL).
        known_tools: the names of the tools the model may call; None trusts TRL's not-found error.
        call_marker: the text that opens a tool call in the model's format (`<tool_call>` for Qwen / Hermes).

    >>> tool_call_scores([
    ...     {"role": "assistant", "content": "", "tool_calls": [
    ...         {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
    ...     {"role": "tool", "name": "add", "content": "3"},
    ...     {"role": "assistant", "content": "The sum is 3."},
    ... ])
    [1.0, None]
    """
    if isinstance(completion, str):
        return [0.0 if call_marker and call_marker in completion else None]
    known = None if known_tools is None else set(known_tools)
    scores: list[float | None] = []
    for index, message in enumerate(completion):
        if message.get("role", "assistant") != "assistant":
            continue
        calls = message.get("tool_calls") or []
        if not calls:
            content = message.get("content")
            attempted = isinstance(content, str) and bool(call_marker) and call_marker in content
            scores.append(0.0 if attempted else None)
            continue
        results = _following_tool_messages(completion, index)
        call_scores = [score for score in (_call_score(call, results, known) for call in calls) if score is not None]
        scores.append(sum(call_scores) / len(call_scores) if call_scores else None)
    return scores


def get_tool_call_validity_reward(
    known_tools: Iterable[str] | None = None, call_marker: str = "<tool_call>"
) -> Callable:
    """Build the tool-call validity segment reward: for each completion, one score per model turn (`tool_call_scores`).

    A segment reward (METHODS.md §4, ARPO arXiv 2507.19849: tool-use steps get their own credit): it returns
    `list[list[float | None]]`, one list per completion and one entry per assistant message, so the j-th entry scores
    segment 2j of `segments_from_tool_mask`. It is not a TRL scalar reward: use it where segment rewards are wired.

    Args:
        known_tools: names of the tools the model may call (e.g. `[f.__name__ for f in tools]`); None relies on TRL's
            "Tool ... not found." error result.
        call_marker: the text that opens a tool call in the model's chat format; `""` never counts an unparsed call.

    >>> reward = get_tool_call_validity_reward(known_tools=["add"])
    >>> reward(prompts=[[]], completions=[[{"role": "assistant", "content": "<tool_call>{bad json</tool_call>"}]],
    ...        completion_ids=[[1, 2]])
    [[0.0]]
    """
    if known_tools is not None:
        if isinstance(known_tools, str):
            raise ValueError(
                f"known_tools={known_tools!r} must be a list of tool names, e.g. [{known_tools!r}], not a string."
            )
        known_tools = [getattr(t, "__name__", t) for t in known_tools]
        bad = [t for t in known_tools if not isinstance(t, str) or not t]
        if bad:
            raise ValueError(f"known_tools holds {bad!r}; give tool names (strings) or the tool functions themselves.")
    if not isinstance(call_marker, str):
        raise ValueError(f"call_marker={call_marker!r} must be a string such as '<tool_call>' (or '' for none).")

    def tool_call_validity(prompts=None, completions=None, completion_ids=None, **kwargs) -> list[list[float | None]]:
        return [tool_call_scores(c, known_tools, call_marker) for c in completions]

    tool_call_validity.__name__ = "tool_call_validity"
    tool_call_validity.__qualname__ = "tool_call_validity"
    tool_call_validity.segment_reward = True  # one score per segment: not for TRL's scalar reward_funcs
    return tool_call_validity


tool_call_validity_reward = get_tool_call_validity_reward()


def _following_tool_messages(completion: list, index: int) -> list[dict]:
    results = []
    for message in completion[index + 1 :]:
        if message.get("role") != "tool":
            break
        results.append(message)
    return results


def _call_score(call, results: list[dict], known: set[str] | None) -> float | None:
    if not isinstance(call, dict):
        return 0.0
    function = call.get("function")
    name = function.get("name") if isinstance(function, dict) else call.get("name", "unknown")
    # Every call, even a malformed one, consumes its tool message, so that later calls find their own.
    result = _take_result(results, name)
    parsed = (
        call.get("type", "function") == "function"
        and isinstance(function, dict)
        and isinstance(name, str)
        and isinstance(function.get("arguments", {}), dict)
    )
    if not parsed or (known is not None and name not in known):
        return 0.0
    if result is None:
        return None
    return 0.0 if _is_error(result.get("content")) else 1.0


def _take_result(results: list[dict], name) -> dict | None:
    for position, message in enumerate(results):
        if message.get("name") == name:
            return results.pop(position)
    return None


def _is_error(content) -> bool:
    # TRL writes a failed call's result as str({"error": str(exception)}).
    if not isinstance(content, str) or not content.lstrip().startswith("{"):
        return False
    try:
        value = ast.literal_eval(content.strip())
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # deep nesting: the parser's own limits
        return False
    return isinstance(value, dict) and "error" in value


register_reward("tool_call_validity", get_tool_call_validity_reward, factory=True)


# ---------------------------------------------------------------------------------------------------- the method
SEGMENT_ADVANTAGES = ("soft", "hard", "reward")


@dataclass
class SegmentsConfig:
    """Config section: segment-level advantages (GPG, arXiv 2512.10365; ARPO, arXiv 2507.19849).

    > Parameters of segment-level advantages (GPG, arXiv 2512.10365; `trl_grpo_ext.methods.segments`)

    segment_by (`str`, *optional*):
        How completions are cut into segments: `"tool_calls"` (at TRL's tool-result boundaries), `"tags"`,
        `"paragraphs"` or `"regex:<pattern>"`. Setting it switches segment credit on.
    segment_advantage (`str`, *optional*, defaults to `"soft"`):
        `"soft"`: GRPO over full trajectories; `"hard"`: every copy of a token shared by several trajectories
        (ARPO branches) gets the mean advantage of all of them; `"reward"`: outcome advantage + λ · normalised
        segment reward.
    segment_reward_funcs (`list[str]`, *optional*):
        Segment rewards (registry names or import paths) for `"reward"`: each returns, per completion, one score
        per trainable segment (e.g. `"tool_call_validity"`).
    segment_reward_lambda (`float`, *optional*, defaults to `1.0`):
        λ, the weight of the normalised segment reward.
    """

    segment_by: str | None = field(
        default=None, metadata={"help": "Segments: 'tool_calls', 'tags', 'paragraphs' or 'regex:<pattern>'."}
    )
    segment_advantage: str = field(
        default="soft", metadata={"help": "Segment advantage mode.", "choices": list(SEGMENT_ADVANTAGES)}
    )
    segment_reward_funcs: list[str] = field(
        default_factory=list, metadata={"help": "Segment rewards (one score per trainable segment) for 'reward'."}
    )
    segment_reward_lambda: float = field(default=1.0, metadata={"help": "λ, the weight of the segment reward."})

    def __post_init__(self):
        super().__post_init__()
        if self.segment_by is not None:
            parse_segment_by(self.segment_by)
        if self.segment_advantage not in SEGMENT_ADVANTAGES:
            raise ValueError(f"segment_advantage={self.segment_advantage!r} is not one of {SEGMENT_ADVANTAGES}.")
        for index, name in enumerate(self.segment_reward_funcs):
            check_reward_name(f"segment_reward_funcs[{index}]", name)
        if self.segment_advantage == "reward":
            if not self.segment_reward_funcs:
                raise ValueError(
                    "segment_advantage='reward' needs segment_reward_funcs, e.g. ['tool_call_validity']; or use 'soft'."
                )
            self.require_whole_groups("segment rewards (normalised within a group)")


class Segments(Extension):
    """Cuts each completion into segments and credits them by `segment_advantage` (see the module docstring).

    Metrics: `segments/per_completion`.
    """

    name = "segments"
    order = 10  # after an owning rollout's own credit rule (order 0)

    def __init__(self, segment_by: str, mode: str = "soft", reward_funcs: Sequence[str] = (), lam: float = 1.0):
        self.segment_by, self.mode, self.lam = segment_by, mode, lam
        self.segment_rewards = [get_reward(name) for name in reward_funcs]

    def check(self, inputs: TrainerInputs) -> None:
        estimator = getattr(inputs.args, "advantage_estimator", "group")
        if estimator != "group":
            raise ValueError(
                f"segment_by={self.segment_by!r} credits the segments itself (segment_advantage={self.mode!r}); unset "
                f"advantage_estimator={estimator!r}, or unset segment_by."
            )
        if self.segment_by == "tool_calls" and not inputs.tools and inputs.environment_factory is None:
            raise ValueError(
                "segment_by='tool_calls' cuts completions at tool results, and this trainer has no tools: pass "
                "tools=[...] (or environment_factory=...), or pick 'tags', 'paragraphs' or 'regex:<pattern>'."
            )

    def after_scoring(self, batch) -> None:
        segments = cut_segments(self.segment_by, batch.completion_ids, batch.completion_mask,
                                tool_mask=batch.tool_mask, tokenizer=self.trainer.tokenizer)  # fmt: skip
        self.log("per_completion", (segments.amax(dim=1) + 1).float().mean().item())
        if self.mode == "hard":
            batch.set_advantages(
                tree_token_advantages(batch.advantages, batch.node_ids), source="segment_advantage='hard'"
            )
        elif self.mode == "reward":
            scores = self._segment_scores(batch, segments)
            advantages = segment_reward_advantages(batch.current_advantages, scores, segments, batch.num_generations,
                                                   lam=self.lam)  # fmt: skip
            batch.set_advantages(advantages, source="segment_advantage='reward'")

    def _segment_scores(self, batch, segments: torch.Tensor) -> torch.Tensor:
        """(B, S) summed segment-reward scores on each row's trainable segments, NaN elsewhere."""
        model_tokens = batch.loss_mask.bool()
        width = int(segments.max().item()) + 1
        scores = torch.full((segments.size(0), width), float("nan"))
        completion_ids = [
            ids[mask.bool()].tolist() for ids, mask in zip(batch.completion_ids, batch.completion_mask, strict=False)
        ]
        for reward in self.segment_rewards:
            name = getattr(reward, "__name__", repr(reward))
            out = reward(prompts=batch.prompts, completions=batch.completions, completion_ids=completion_ids,
                         **batch.columns)  # fmt: skip
            if len(out) != segments.size(0):
                raise ValueError(
                    f"segment reward {name!r} returned {len(out)} lists for {segments.size(0)} completions."
                )
            for row, row_scores in enumerate(out):
                trainable = torch.unique(segments[row][model_tokens[row]]).tolist()
                if row_scores is None:
                    continue
                if len(row_scores) != len(trainable):
                    raise ValueError(
                        f"segment reward {name!r} returned {len(row_scores)} score(s) for completion {row}, which has "
                        f"{len(trainable)} trainable segment(s) under segment_by={self.segment_by!r}; return one "
                        "score (or None) per segment."
                    )
                for segment, score in zip(trainable, row_scores, strict=True):
                    if score is not None:
                        current = scores[row, segment]
                        scores[row, segment] = score if torch.isnan(current) else current + score
        return scores


def _from_config(args) -> Segments | None:
    if getattr(args, "segment_by", None) is None:
        return None
    return Segments(args.segment_by, args.segment_advantage, args.segment_reward_funcs, args.segment_reward_lambda)


register_method(Method(name="segments", title="GPG segment-level advantages", arxiv="2512.10365",
                       extension=_from_config, trainer="SegmentGRPOTrainer", cli_name="segment"))  # fmt: skip
