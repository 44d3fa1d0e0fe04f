"""Cut completions into segments (GPG's macro-actions): tool turns, tag blocks, paragraphs, or a user's regex.

Every segmenter returns (B, T) long segment ids: 0, 1, 2, ... along each row, in order, -1 on padding. A segment is
a contiguous run of tokens; ids are consecutive within a row (a row with n segments uses 0..n-1) and restart at 0 on
every row. GPG (arXiv 2512.10365) treats a segment as one action whose log-probability is the sum of its tokens'; the
advantage estimators in `trl_grpo_ext.advantages` give each segment one advantage.

`cut_segments(segment_by, ...)` dispatches on the config value: `"tool_calls"`, `"tags"`, `"paragraphs"` or
`"regex:<pattern>"`.

Text segmenters (tags, paragraphs, regex) find character positions in the decoded completion and map them to tokens:
a new segment starts at the token that holds the boundary character. Token character spans come from the fast
tokenizer's offsets: the row's ids are decoded (special tokens kept) and re-tokenised with
`return_offsets_mapping=True`. When re-tokenising does not give back the same ids (a sampled completion need not be
the canonical tokenisation of its text), that row falls back to decoding its prefixes ids[:1], ids[:2], ... and taking
their lengths: exact, but O(T²) characters, so only the rows that need it pay for it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

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
        for row, (ids, again, offsets) in enumerate(zip(rows, encoded["input_ids"], encoded["offset_mapping"])):
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
    for row, (text, row_ends, row_positions) in enumerate(zip(texts, ends, positions)):
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
