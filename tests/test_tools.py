"""Tools never hang or crash a run: the built-in calculator bounds its own work, and `time_limited` (the config's
`tool_timeout`) stops any tool's call at its limit, with one error message to the model."""

import multiprocessing
import time

import pytest

from trl_grpo_ext.tools import MAX_DIGITS, calculator


def bounded(seconds, func, *args):
    """`func(*args)` run in a forked process killed after `seconds`: ("ok", result), ("error", exception) or
    ("timeout", None), and the wall time. A check of code that may hang fails instead of hanging the suite."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child():
        try:
            send.send(("ok", func(*args)))
        except Exception as error:
            send.send(("error", error))

    process = context.Process(target=child)
    start = time.perf_counter()
    process.start()
    outcome = receive.recv() if receive.poll(seconds) else ("timeout", None)
    elapsed = time.perf_counter() - start
    process.kill()
    process.join()
    return outcome, elapsed


# ---------------------------------------------------------------------------------------------------- calculator
@pytest.mark.parametrize(
    "expression",
    [
        "(((10**100)**100)**100)**100",  # issue 32: more than 20 s and growing memory before the bounds
        "((10**100)**100)**100",
        "9**9**9**9",
        "10**3999 * 10**3999",
        "(10**100)**(10**100)",
        "2**(2**(2**(2**(2**2))))",
        "(10**1000)**(10**1000)**(10**1000)",
    ],
)
def test_calculator_refuses_huge_results_at_once(expression):
    (status, error), elapsed = bounded(5, calculator, expression)
    assert status == "error", (status, elapsed)
    assert isinstance(error, ValueError) and "too large" in str(error), error
    assert elapsed < 1.0, elapsed


def test_calculator_still_computes():
    assert calculator("(3 + 4) * 2") == "14"
    assert calculator("2**200") == str(2**200)  # the old rule refused every exponent above 100
    assert calculator("10**-2") == "0.01"
    assert calculator(" 7 // 2 ") == "3"
    assert calculator("-3 % 5") == "2"
    assert calculator("1.5 * 4") == "6"
    assert calculator("10**3999") == str(10**3999)  # up to MAX_DIGITS digits
    assert len(calculator("-(10**3999)")) == MAX_DIGITS + 1


@pytest.mark.parametrize(
    ("expression", "words"),
    [
        ("1+" * 600 + "1", "too long"),
        ("-" * 150 + "1", "nested too deeply"),
        ("(" * 250 + "1" + ")" * 250, "not an arithmetic expression"),
        ("2.0 ** 5000", "too large for a floating-point number"),
        ("10**400 / 3.0", "too large for a floating-point number"),
        ("__import__('os')", "unsupported expression"),
        ("3 +", "not an arithmetic expression"),
        ("1\x00", "not an arithmetic expression"),
        ("\ud800", "not an arithmetic expression"),
        (12, "must be a string"),
    ],
)
def test_calculator_refuses_bad_expressions_with_a_message(expression, words):
    (status, error), elapsed = bounded(5, calculator, expression)
    assert status == "error" and isinstance(error, ValueError), (status, error)
    assert words in str(error), error
    assert elapsed < 1.0, elapsed
