"""Segmenters (tool turns, tags, paragraphs, regex), the `segment_by` dispatcher and the tool-call validity reward."""

import re

import pytest
import torch

from trl_grpo_ext.methods.segments import (
    cut_segments,
    get_tool_call_validity_reward,
    parse_segment_by,
    segments_from_paragraphs,
    segments_from_regex,
    segments_from_tags,
    segments_from_tool_mask,
    token_char_ends,
    tool_call_scores,
    tool_call_validity_reward,
)


def _batch(tokenizer, texts, pad_to=None):
    """Right-padded (B, T) ids and mask, as TRL lays completions out."""
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return _pad(rows, pad_to)


def _pad(rows, pad_to=None):
    length = pad_to or max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (length - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows])
    return ids, mask


def _pieces(tokenizer, ids, segments):
    """The decoded text of each segment of each row."""
    out = []
    for row_ids, row_segments in zip(ids.tolist(), segments.tolist(), strict=False):
        count = max(row_segments) + 1
        out.append(
            [
                tokenizer.decode([i for i, s in zip(row_ids, row_segments, strict=False) if s == k])
                for k in range(count)
            ]
        )
    return out


# ---------------------------------------------------------------- tool turns


def test_segments_from_tool_mask():
    tool_mask = torch.tensor(
        [
            [1, 1, 0, 0, 1, 0, 1, 1],  # model, tool, model, tool, model
            [1, 1, 1, 1, 1, 1, 1, 1],  # no tool call: one segment, padded after 3 tokens
            [1, 0, 0, 1, 1, 1, 1, 1],  # TRL pads tool_mask with 1: padding must not open a segment
        ]
    )
    mask = torch.tensor([[1] * 8, [1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]])
    expected = torch.tensor(
        [
            [0, 0, 1, 1, 2, 3, 4, 4],
            [0, 0, 0, -1, -1, -1, -1, -1],
            [0, 1, 1, 2, -1, -1, -1, -1],
        ]
    )
    assert torch.equal(segments_from_tool_mask(tool_mask, mask), expected)


# ---------------------------------------------------------------- text segmenters


def test_segments_from_tags(tokenizer):
    texts = ["ok <think>the sum</think> <answer>7</answer>", "<think>the</think><|im_end|>", "the answer is 7"]
    ids, mask = _batch(tokenizer, texts)
    segments = segments_from_tags(ids, mask, tokenizer)
    # text before the first tag is a segment; text after a closing tag stays with its block
    assert _pieces(tokenizer, ids, segments) == [
        ["ok ", "<think>the sum</think> ", "<answer>7</answer>"],
        ["<think>the</think><|im_end|>"],  # the tag at position 0 opens no new segment
        ["the answer is 7"],  # no tag: one segment
    ]
    # ok, ' ' | <think> the ' s' um </think> ' ' | <answer> 7 </answer>: 11 tokens; row 2 is 5 tokens then padding
    assert segments[0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2]
    assert segments[1].tolist() == [0, 0, 0, 0, -1, -1, -1, -1, -1, -1, -1]
    assert segments[2].tolist() == [0, 0, 0, 0, -1, -1, -1, -1, -1, -1, -1]
    custom = segments_from_tags(ids, mask, tokenizer, tags="answer")
    assert _pieces(tokenizer, ids, custom)[0] == ["ok <think>the sum</think> ", "<answer>7</answer>"]


def test_segments_from_paragraphs(tokenizer):
    ids, mask = _batch(tokenizer, ["the sum\n\nis 7\n\n\nanswer", "the sum is 7"])
    segments = segments_from_paragraphs(ids, mask, tokenizer)
    # a blank line (and any run of them) closes the paragraph before it
    assert _pieces(tokenizer, ids, segments) == [["the sum\n\n", "is 7\n\n\n", "answer"], ["the sum is 7"]]


def test_segments_from_regex_boundary_inside_a_token(tokenizer):
    ids, mask = _batch(tokenizer, ["Step one. Step two", "add the sum"])
    steps = segments_from_regex(ids, mask, tokenizer, r"(?=Step)")  # zero-width: before each "Step"
    assert _pieces(tokenizer, ids, steps) == [["Step one. ", "Step two"], ["add the sum"]]
    # "m" is the second character of the token "um": the segment starts at the token that holds it
    inside = segments_from_regex(ids, mask, tokenizer, "m")
    assert _pieces(tokenizer, ids, inside)[1] == ["add the s", "um"]


def test_regex_that_matches_nothing_is_an_error(tokenizer):
    ids, mask = _batch(tokenizer, ["the sum is 7", "the answer is 7"])
    message = re.escape("the pattern 'Step [0-9]' matches no completion of this batch of 2") + ".*require_match=False"
    with pytest.raises(ValueError, match=message):
        segments_from_regex(ids, mask, tokenizer, "Step [0-9]")
    with pytest.raises(ValueError, match=r"none of the opening tags <plan> is in any completion of this batch of 2"):
        segments_from_tags(ids, mask, tokenizer, tags=["plan"])
    with pytest.raises(ValueError, match="not one blank line in any completion of this batch of 2"):
        segments_from_paragraphs(ids, mask, tokenizer)
    # Opting out trains such a batch as one segment per completion.
    lenient = segments_from_regex(ids, mask, tokenizer, "Step [0-9]", require_match=False)
    assert torch.equal(lenient, torch.where(mask.bool(), 0, -1))


def test_non_canonical_tokens_fall_back_to_prefix_decoding(tokenizer):
    # "the" sampled as t + h + e (the tokenizer itself would give one token "the"), then " s", "um".
    t, h, e = tokenizer.convert_tokens_to_ids(["t", "h", "e"])
    rest = tokenizer(" sum", add_special_tokens=False)["input_ids"]
    rows = [[t, h, e] + rest]
    texts, ends = token_char_ends(rows, tokenizer)
    assert texts == ["the sum"]
    assert ends == [[1, 2, 3, 5, 7]]  # t | h | e | " s" | "um"
    ids, mask = _pad(rows)
    segments = segments_from_regex(ids, mask, tokenizer, "h")
    assert segments.tolist() == [[0, 1, 1, 1, 1]]


def test_multibyte_characters_map_to_the_first_token_that_holds_them(tokenizer):
    ids, mask = _batch(tokenizer, ["héllo"])
    texts, ends = token_char_ends([ids[0].tolist()], tokenizer)
    # "é" is two byte tokens: the first ends at 2 (it holds the character), the second adds nothing
    assert texts == ["héllo"] and ends[0][:3] == [1, 2, 2]
    assert _pieces(tokenizer, ids, segments_from_regex(ids, mask, tokenizer, "é")) == [["h", "éllo"]]


# ---------------------------------------------------------------- segment_by


def test_cut_segments_dispatches_every_choice(tokenizer):
    ids, mask = _batch(tokenizer, ["<think>the sum</think>\n\n<answer>7</answer>"])
    tool_mask = torch.ones_like(mask)
    tool_mask[0, 2:4] = 0
    assert cut_segments("tool_calls", ids, mask, tool_mask=tool_mask)[0, :5].tolist() == [0, 0, 1, 1, 2]
    assert cut_segments("tags", ids, mask, tokenizer=tokenizer).max() == 1  # <think> block | <answer> block
    assert cut_segments("paragraphs", ids, mask, tokenizer=tokenizer).max() == 1  # split after "\n\n"
    assert cut_segments("regex:<answer>|um", ids, mask, tokenizer=tokenizer).max() == 2
    assert parse_segment_by("regex:a:b") == ("regex", "a:b")  # only the first colon separates


def test_bad_segment_by_values():
    ids, mask = torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"segment_by='turns' is not one of tool_calls, tags, paragraphs, regex:"):
        cut_segments("turns", ids, mask)
    with pytest.raises(ValueError, match="empty pattern"):
        parse_segment_by("regex:")
    with pytest.raises(ValueError, match=r"segment_by regex '\(' does not compile"):
        parse_segment_by("regex:(")
    with pytest.raises(ValueError, match="needs TRL's tool_mask.*tools= or environment_factory="):
        cut_segments("tool_calls", ids, mask)
    with pytest.raises(ValueError, match="needs tokenizer="):
        cut_segments("paragraphs", ids, mask)


# ---------------------------------------------------------------- tool-call validity (TRL's completion format)


def _call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _error(message):
    # TRL's _tool_call_loop writes a failed call's result as str({"error": str(e)})
    return str({"error": message})


def test_tool_call_validity_on_trl_style_completions():
    ok_then_answer = [
        {"role": "assistant", "content": "", "tool_calls": [_call("add", a=1, b=2)]},
        {"role": "tool", "name": "add", "content": "3"},
        {"role": "assistant", "content": "<answer>3</answer>"},
    ]
    unknown_tool = [
        {"role": "assistant", "content": "", "tool_calls": [_call("mul", a=1, b=2)]},
        {"role": "tool", "name": "mul", "content": _error("Tool mul not found.")},
        {"role": "assistant", "content": "<answer>?</answer>"},
    ]
    tool_raised = [
        {"role": "assistant", "content": "", "tool_calls": [_call("add", a=1, c=2)]},
        {"role": "tool", "name": "add", "content": _error("add() got an unexpected keyword argument 'c'")},
    ]
    # parse_response failed: TRL kept the decoded text, no tool_calls, and stopped the loop
    unparsed = [{"role": "assistant", "content": '<tool_call>\n{"name": "add", "arguments": {"a": 1\n</tool_call>'}]
    completions = [ok_then_answer, unknown_tool, tool_raised, unparsed]
    scores = tool_call_validity_reward(prompts=[[]] * 4, completions=completions, completion_ids=[[1]] * 4)
    # one entry per assistant turn: 1.0 / 0.0 for a turn with a call, None for a turn without one
    assert scores == [[1.0, None], [0.0, None], [0.0], [0.0]]
    assert tool_call_validity_reward.__name__ == "tool_call_validity"


def test_tool_call_validity_multi_turn_several_calls_and_unrun_calls():
    completion = [
        # two calls in one turn; results come back async-last, so they are matched by name: add ok, search failed
        {"role": "assistant", "content": "", "tool_calls": [_call("search", q="x"), _call("add", a=1, b=2)]},
        {"role": "tool", "name": "add", "content": "3"},
        {"role": "tool", "name": "search", "content": _error("timeout")},
        {"role": "assistant", "content": "", "tool_calls": [_call("add", a=3, b=4)]},
        {"role": "tool", "name": "add", "content": "7"},
        # the loop hit max_tool_calling_iterations: this call never ran
        {"role": "assistant", "content": "", "tool_calls": [_call("add", a=7, b=1)]},
    ]
    # turn 1: (0 + 1) / 2 = 0.5; turn 2: 1.0; turn 3: no result -> not scored
    assert tool_call_scores(completion) == [0.5, 1.0, None]
    # With the known tools named, an unknown name scores 0, even in the call that never ran.
    # turn 1: search failed (0), add unknown (0) -> 0; turns 2 and 3: add unknown -> 0
    assert tool_call_scores(completion, known_tools=["search"]) == [0.0, 0.0, 0.0]
    assert tool_call_scores(completion, known_tools=["search", "add"]) == [0.5, 1.0, None]


def test_tool_call_validity_edge_cases():
    assert tool_call_scores([]) == []
    assert tool_call_scores("plain text") == [None]
    assert tool_call_scores("<tool_call>{}</tool_call>") == [0.0]  # a call TRL never executes
    bad_type = [{"role": "assistant", "tool_calls": [{"type": "code", "name": "x"}]}, {"role": "tool", "name": "x"}]
    assert tool_call_scores(bad_type) == [0.0]
    # A tool that returns a plain dict with other keys succeeded.
    fine = [{"role": "assistant", "tool_calls": [_call("f")]}, {"role": "tool", "name": "f", "content": "{'x': 1}"}]
    assert tool_call_scores(fine) == [1.0]
    reward = get_tool_call_validity_reward(known_tools=[len], call_marker="")
    assert reward(completions=["<tool_call>"]) == [[None]]  # call_marker="" never counts unparsed text


def test_tool_call_validity_factory_validates():
    with pytest.raises(ValueError, match=r"known_tools='add' must be a list of tool names, e.g. \['add'\]"):
        get_tool_call_validity_reward(known_tools="add")
    with pytest.raises(ValueError, match="known_tools holds"):
        get_tool_call_validity_reward(known_tools=[3])
