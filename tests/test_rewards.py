import pytest

from trl_grpo_ext import get_reward
from trl_grpo_ext.rewards import completion_text, contains_solution_reward, tag_format_reward


def test_completion_text_reads_standard_and_conversational():
    assert completion_text("abc") == "abc"
    assert completion_text([{"role": "assistant", "content": "a"}, {"role": "tool", "content": "T"},
                            {"role": "assistant", "content": "b"}]) == "ab"  # fmt: skip
    assert completion_text([{"role": "assistant", "content": None}]) == ""


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>x</think><answer>7</answer>", 1.0),
        ("  <think>x</think>\n\n<answer>7</answer>\n", 1.0),  # white space between and around is fine
        ("<answer>7</answer><think>x</think>", 0.0),  # wrong order
        ("<think>x</think>", 0.0),  # missing answer
        ("<think>x</think><answer>7</answer> trailing", 0.0),  # text outside the blocks
        ("<think><think>x</think><answer>7</answer>", 0.0),  # opened twice
        ("<think>x</think><answer>7</answer><answer>8</answer>", 0.0),  # answered twice
        ("", 0.0),
    ],
)
def test_tag_format_strict(text, expected):
    reward = tag_format_reward(["think", "answer"])
    assert reward(completions=[text]) == [expected]
    assert reward(completions=[[{"role": "assistant", "content": text}]]) == [expected]


def test_tag_format_partial_and_three_tags():
    reward = tag_format_reward("plan,think,answer", partial=True)
    # plan ok, think ok, answer missing: 2/3
    assert reward(completions=["<plan>p</plan><think>t</think> 7"]) == [pytest.approx(2 / 3)]
    # answer closed before opened: 0 for answer; think opened twice: 0 -> 1/3
    assert reward(completions=["<plan>p</plan><think><think></answer><answer>"]) == [pytest.approx(1 / 3)]
    assert reward.__name__ == "tag_format_plan_think_answer"


def test_tag_format_validates_arguments():
    with pytest.raises(ValueError, match="empty"):
        tag_format_reward([])
    with pytest.raises(ValueError, match=r"invalid names \['<think>'\].*no angle brackets"):
        tag_format_reward(["<think>"])
    with pytest.raises(ValueError, match="repeats"):
        tag_format_reward(["a", "a"])
    with pytest.raises(ValueError, match="partial='yes'"):
        get_reward("tag_format", partial="yes")


def test_contains_solution():
    completions = ["it is 12.", "it is 123", "12", "1.25", "", "x"]
    assert contains_solution_reward(completions, solution=["12", "12", "12", "1.2", "3", ""]) == [
        1.0,  # "12." ends a sentence
        0.0,  # 123 is another number
        1.0,
        0.0,  # 1.25 is not 1.2
        0.0,
        None,  # nothing to check against: skipped
    ]
