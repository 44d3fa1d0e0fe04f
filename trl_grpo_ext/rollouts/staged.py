"""Staged rollouts: a first stage generates a prefix (a PTA plan) that later stages continue."""

from __future__ import annotations


def truncate_at_tag(ids: list[int], tokenizer, tag: str) -> tuple[list[int], bool]:
    """Cut generated token ids right after the first occurrence of `tag` in their text.

    Returns `(ids, closed)`: the shortest prefix of `ids` whose decoded text contains `tag`, and True; or all of `ids`
    and False when `tag` never appears (for PTA: a plan that never closes; the whole stage is then the plan).
    Works whether the tag is one token (as in the tiny test tokenizer) or several (most real vocabularies).

    >>> class Chars:  # a toy tokenizer: one character per token
    ...     def decode(self, ids, skip_special_tokens=False): return "".join(chr(i) for i in ids)
    >>> truncate_at_tag([ord(c) for c in "ab</p>cd"], Chars(), "</p>")
    ([97, 98, 60, 47, 112, 62], True)
    """
    text = tokenizer.decode(ids, skip_special_tokens=False)
    end = text.find(tag)
    if end < 0:
        return list(ids), False
    end += len(tag)
    low, high = 1, len(ids)  # the shortest k with tag inside decode(ids[:k]): binary search, decode is monotone
    while low < high:
        mid = (low + high) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=False)) >= end:
            high = mid
        else:
            low = mid + 1
    return list(ids[:low]), True
