"""Built-in tools for tool-use training (TRL's `tools=`: plain typed functions), and a time limit for any tool.

A tool's input is model output. Every built-in tool bounds its own work and refuses, at once, a call that would take
long or grow memory (see `calculator`). When a tool raises, TRL's tool loop puts `{'error': '<message>'}` in the tool
message the model reads, counts the call as failed (`tools/failure_frequency`), and the run goes on; but TRL's loop
has no time limit, so a tool that sleeps or loops forever stops the run. `time_limited` runs each call of a tool in a
child process that is killed at the limit, and the config field `tool_timeout` wraps every tool of a trainer with it
(docs/tools.md).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import functools
import inspect
import math
import multiprocessing
import operator
import os
import pickle
import signal
import sys
from dataclasses import dataclass, field

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


# ---------------------------------------------------------------------------------------------------- time limits
class ToolTimeoutError(TimeoutError):
    """A tool call ran past its time limit; its process was killed. TRL shows the model `{'error': str(error)}`."""


def time_limited(func=None, *, seconds: float, start_method: str | None = None):
    """Run every call of the tool `func` in a child process, killed after `seconds`: a call that sleeps, loops
    forever or deadlocks costs the model one error message, not the run. Usable as `time_limited(tool, seconds=5)`
    or as the decorator `@time_limited(seconds=5)`.

    The wrapper keeps the tool's name, docstring, signature and type hints, so TRL builds the same JSON schema from it
    (`transformers.utils.get_json_schema`); an async tool gives an async wrapper. A call past the limit raises
    `ToolTimeoutError("tool 'name' did not finish within 5 s; the call was stopped")`, which TRL's tool loop turns
    into the tool message `{'error': ...}` (a failed call, as for any exception the tool raises itself: those are
    raised again in the trainer's process, with their own message).

    Why a process: a Python thread cannot be stopped, so a looping tool run in a thread would keep a core busy for
    the rest of the run; a process is killed (SIGKILL, with the process group it leads, so a subprocess it started
    goes too).

    The cost, per call: starting the process. With the `fork` start method (the default on Linux) that is copying
    the trainer process's page tables, so it grows with the process's memory: about 30 ms in a 0.5 GB process
    (torch, transformers and trl loaded, 2 CPU cores; up to 60 ms while busy), 85 ms at 2.5 GB, 150 ms at 4.5 GB
    (`tests/test_tools.py::test_per_call_overhead` prints it), against 14 µs for a plain calculator call. TRL runs a
    batch's calls one after another, so 128 calls a step cost about 4 s more: to limit only the slow or untrusted
    tools, wrap those and leave the config's `tool_timeout` unset (the calculator bounds its own work). With `spawn`
    or `forkserver` (`spawn` is the default off Linux) each call's process imports the tool's module and this
    package: 7 to 13 s per call measured here.

    What crosses the process boundary: the return value (and an exception) is pickled back, so it must be picklable
    (text is); under `spawn` the tool itself (a module-level function) and its arguments are pickled too. The call
    runs in a copy of the trainer process: what it changes in memory (a global, an object's attribute) does not
    reach the trainer; files and network calls do. It must not use the GPU (a forked process cannot initialise
    CUDA). Environment methods (`environment_factory=`) keep their state in the trainer's process, so they cannot be
    wrapped this way.

    Args:
        func: the tool, a typed function with a Google-style docstring (TRL's `tools=`); omit it for a decorator.
        seconds: the time limit of one call, in seconds (> 0).
        start_method: `"fork"`, `"spawn"` or `"forkserver"` (`multiprocessing`); default `"fork"` on Linux, else
            `"spawn"`.

    >>> def add(a: int, b: int) -> int:
    ...     \"""Add two integers.
    ...
    ...     Args:
    ...         a: The first integer.
    ...         b: The second integer.
    ...     \"""
    ...     return a + b
    >>> limited = time_limited(add, seconds=5)
    >>> limited(2, b=3), limited.__name__, limited.time_limit
    (5, 'add', 5)
    """
    _check_seconds(seconds, "time_limited: seconds")
    method = start_method or _default_start_method()
    if method not in multiprocessing.get_all_start_methods():
        raise ValueError(
            f"time_limited: start_method={start_method!r} is not available here; use one of "
            f"{multiprocessing.get_all_start_methods()}."
        )
    if func is None:
        return functools.partial(time_limited, seconds=seconds, start_method=start_method)
    if not callable(func):
        raise TypeError(f"time_limited: {func!r} is not callable; give the tool function.")
    func = getattr(func, "__wrapped_tool__", func)  # a new limit replaces an earlier one: one process per call
    name = getattr(func, "__name__", type(func).__name__)

    if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__):

        @functools.wraps(func)
        async def limited(*args, **kwargs):
            return await asyncio.to_thread(_call_in_process, func, name, seconds, method, args, kwargs)

    else:

        @functools.wraps(func)
        def limited(*args, **kwargs):
            return _call_in_process(func, name, seconds, method, args, kwargs)

    limited.__name__ = name  # TRL calls a tool by its name (a callable object's class name, if it has none)
    limited.time_limit = seconds
    limited.__wrapped_tool__ = func
    return limited


def with_time_limit(tools, seconds: float | None) -> list | None:
    """`tools` with each one that has no time limit of its own wrapped by `time_limited(tool, seconds=seconds)`; as
    they are when `seconds` is None. The trainer applies it to its `tools=` with the config's `tool_timeout`, and HiMA
    to its agents' tools. A tool already wrapped by `time_limited` keeps its own limit."""
    if seconds is None or tools is None:
        return tools
    return [tool if hasattr(tool, "__wrapped_tool__") else time_limited(tool, seconds=seconds) for tool in tools]


def _default_start_method() -> str:
    return "fork" if sys.platform.startswith("linux") else "spawn"


def _check_seconds(seconds, what: str) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds < math.inf:
        raise ValueError(
            f"{what}={seconds!r} must be a positive number of seconds, e.g. 10 (a tool call that takes longer is "
            "stopped and the model gets an error message)."
        )


def _call_in_process(func, name: str, seconds: float, method: str, args: tuple, kwargs: dict):
    context = multiprocessing.get_context(method)
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_run_tool, args=(send, func, args, kwargs), name=f"tool-{name}")
    process.start()
    send.close()  # the child holds the only write end: a child that dies unexpectedly gives EOF at once
    try:
        if not receive.poll(seconds):
            raise ToolTimeoutError(f"tool {name!r} did not finish within {seconds:g} s; the call was stopped")
        try:
            status, value = pickle.loads(receive.recv_bytes())
        except EOFError:
            process.join()
            raise RuntimeError(f"tool {name!r} ended without a result (exit code {process.exitcode})") from None
    finally:
        _kill(process)
        receive.close()
    if status == "error":
        raise value
    return value


def _run_tool(send, func, args, kwargs) -> None:
    # In the child process: lead a process group (so that killing it stops whatever the tool started), run the tool,
    # send back the pickled ("ok", result) or ("error", exception).
    if hasattr(os, "setpgid"):
        os.setpgid(0, 0)
    _one_thread_after_fork()
    try:
        result = func(*args, **kwargs)
        if inspect.isawaitable(result):
            result = asyncio.run(result)
    except BaseException as error:  # every failure goes back to the trainer as an exception
        payload = pickle.dumps(("error", _portable(error)))
    else:
        try:
            payload = pickle.dumps(("ok", result))
        except Exception as error:
            failure = RuntimeError(f"the tool's result could not be sent back (it must pickle): {error}")
            payload = pickle.dumps(("error", failure))
    with contextlib.suppress(OSError):  # the trainer stopped waiting
        send.send_bytes(payload)
    send.close()


def _one_thread_after_fork() -> None:
    """In a forked child: torch ops on one thread. The parent's OpenMP thread pool does not survive a fork (GNU libgomp
    is not fork-safe), and the child's first parallel region would wait forever for its threads (seen: a tool that ran
    a 2048-token tensor op after the trainer had trained)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _portable(error: BaseException) -> Exception:
    """`error` if it survives pickling as an exception TRL catches, else a RuntimeError with its message (TRL shows
    the model `str(error)` either way)."""
    if isinstance(error, Exception):
        try:
            if type(pickle.loads(pickle.dumps(error))) is type(error):
                return error
        except Exception:  # it does not pickle, or does not unpickle as itself
            pass
    return RuntimeError(str(error) or type(error).__name__)


def _kill(process) -> None:
    if process.is_alive():
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the tool's process group: it and any process it started
        except (AttributeError, ProcessLookupError, PermissionError):
            process.kill()  # no process groups here, or the child had not made its group yet
    process.join()
    process.close()


@dataclass
class ToolsConfig:
    """Config section: a time limit for every tool call (`trl_grpo_ext.tools`).

    > Parameters of tool calls (`trl_grpo_ext.tools`, docs/tools.md)

    tool_timeout (`float`, *optional*):
        Seconds one tool call may take. Every tool the trainer gets (`tools=`, and HiMA's agents' tools) runs each
        call in a child process that is killed at the limit; the model gets an error message and the run goes on.
        None (the default): tools run as TRL runs them, in the trainer's process, without a limit. Costs about
        30 ms per call in a 0.5 GB trainer process, about 30 ms more per GB (Linux, fork; docs/tools.md); a tool
        already wrapped by `time_limited` keeps its own limit.
    """

    tool_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds one tool call may take; the call is stopped and the model gets an error (None: no limit)."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.tool_timeout is not None:
            _check_seconds(self.tool_timeout, "tool_timeout")
