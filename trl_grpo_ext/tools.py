"""Small built-in tools for tool-use training, examples and recipes (TRL's `tools=`: plain typed functions).

A tool's input is model output: every built-in tool bounds its own work and refuses, at once, a call that would take
long or grow memory (see `calculator`). When a tool raises, TRL's tool loop puts `{'error': '<message>'}` in the tool
message the model reads, counts the call as failed (`tools/failure_frequency`), and the run goes on.
"""

from __future__ import annotations

import ast
import math
import operator

# The calculator's bounds: an expression longer or deeper than this, or a number (an intermediate result included) of
# more digits, is refused before any work is done. 4000 digits stays below Python's limit on converting an int to a
# string (4300 digits, `sys.set_int_max_str_digits`), so every accepted result can be written back to the model.
MAX_EXPRESSION_CHARS = 1000
MAX_EXPRESSION_DEPTH = 100
MAX_DIGITS = 4000
_MAX_BITS = math.ceil(MAX_DIGITS * math.log2(10))  # a number of MAX_DIGITS digits has about this many bits

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: An arithmetic expression with numbers, + - * / // % ** and parentheses, e.g. "(3 + 4) * 2".

    >>> calculator("(3 + 4) * 2")
    '14'
    >>> calculator("(((10**100)**100)**100)**100")
    Traceback (most recent call last):
    ...
    ValueError: result too large: about 10000 digits (the calculator's limit is 4000)
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string such as '(3 + 4) * 2', got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression too long: {len(expression)} characters (the limit is {MAX_EXPRESSION_CHARS})")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise ValueError(f"not an arithmetic expression: {str(error).splitlines()[0][:80]}") from None
    value = _evaluate(tree.body, 0)
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


def _evaluate(node, depth: int):
    # Only numbers and arithmetic: no names, calls or attributes, so a model cannot run code through the tool. Every
    # operation that can grow a number is checked before it runs (`_check_size`), so the work per operation is bounded.
    if depth > MAX_EXPRESSION_DEPTH:
        raise ValueError(f"expression nested too deeply (the limit is {MAX_EXPRESSION_DEPTH} levels)")
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _check_digits(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1)
        _check_size(node.op, left, right)
        try:
            return _check_digits(_OPERATORS[type(node.op)](left, right))
        except OverflowError:  # a float result out of range, or an int too large for a float
            raise ValueError("result too large for a floating-point number") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand, depth + 1))
    raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")


def _check_size(op, left, right) -> None:
    """Refuse `left op right` when its result would have more than about MAX_DIGITS digits: estimated from the
    operands' sizes, before the operation runs (an int power or product is the only operation that can outgrow its
    operands; a float one overflows at once)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return
    if isinstance(op, ast.Pow) and right > 0 and abs(left) > 1:
        # digits of left ** right = right · log10|left|, as a base-10 logarithm: `right` may be too large for a float.
        log_digits = math.log10(right) + math.log10(math.log10(abs(left)))
    elif isinstance(op, ast.Mult) and left and right:
        log_digits = math.log10((abs(left).bit_length() + abs(right).bit_length()) * math.log10(2))
    else:
        return
    if log_digits > math.log10(MAX_DIGITS):
        size = f"{10**log_digits:.0f}" if log_digits < 15 else f"10^{log_digits:.0f}"
        raise ValueError(f"result too large: about {size} digits (the calculator's limit is {MAX_DIGITS})")


def _check_digits(value):
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise ValueError(f"number too large: more than {MAX_DIGITS} digits (the calculator's limit)")
    return value
