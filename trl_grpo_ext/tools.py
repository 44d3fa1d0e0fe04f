"""Small built-in tools for tool-use training, examples and recipes (TRL's `tools=`: plain typed functions)."""

from __future__ import annotations

import ast
import operator

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
    """
    tree = ast.parse(expression, mode="eval")
    value = _evaluate(tree.body)
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


def _evaluate(node):
    # Only numbers and arithmetic: no names, calls or attributes, so a model cannot run code through the tool.
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        right = _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 100:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](_evaluate(node.left), right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")
