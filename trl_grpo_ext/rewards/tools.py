"""Tool-call rewards on TRL's tool-calling completions: segment rewards, one score per model turn.

What TRL 1.16 puts in `completions` when it trains with `tools=` or `environment_factory=` (`GRPOTrainer._generate`,
`_tool_call_loop`, `trl.chat_template_utils.parse_response`): each completion is a list of messages,

    [assistant, tool, ..., assistant, tool, ..., assistant]

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
`trl_grpo_ext.segments.segments_from_tool_mask`; tool messages are the runs of `tool_mask == 0` between them.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable

__all__ = ["get_tool_call_validity_reward", "tool_call_validity_reward", "tool_call_scores"]


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
    except (ValueError, SyntaxError):
        return False
    return isinstance(value, dict) and "error" in value
