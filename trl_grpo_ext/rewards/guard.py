"""Reward functions checked before training (names, dataset columns) and guarded during it (errors name the row).

Before any model loads, `check_reward_columns` finds a dataset column a reward function needs (a parameter without a
default, such as `accuracy`'s `solution`) missing from the training or evaluation set, and `check_reward_name` a
config field that names no known reward.

During training, a reward function that raises names itself and the row it failed on.

TRL calls every reward function once per generation batch, on all rows of the process at once
(`GRPOTrainer._calculate_rewards`). When one raises, its traceback says neither which rows it was scoring nor what
they held. `guard_reward` wraps a reward function for one such call: on an exception it calls the function again
on one row at a time, finds the first row that fails on its own, and raises `RewardFunctionError` naming the
function, the row (its index in the batch, and a short excerpt of its prompt and completion) and the step, with the
original exception chained as its cause. A reward that succeeds costs one Python call more. Reward models
(`nn.Module`) are scored by TRL itself and are never wrapped.

>>> def needs_digits(completions, **kwargs):
...     return [float(int(c)) for c in completions]
>>> guard_reward(needs_digits)(prompts=["1+1=", "2+2="], completions=["2", "four"], completion_ids=[[1], [2]])
Traceback (most recent call last):
...
trl_grpo_ext.rewards.guard.RewardFunctionError: reward function 'needs_digits' raised ValueError: invalid literal for \
int() with base 10: 'four'. It fails on row 1 of the 2 rows it scored (prompt: '2+2=', completion: 'four'); fix \
the function for such rows, or return None for a row it cannot score.
"""

from __future__ import annotations

import inspect

from torch import nn
from trl.trainer.utils import get_callable_name

try:  # how TRL's `_calculate_rewards` tells the reward functions it awaits: async callable objects too
    from trl.trainer.utils import is_async_callable
except ImportError:  # older releases (trl 1.10): `elif inspect.iscoroutinefunction(reward_func):`
    from inspect import iscoroutinefunction as is_async_callable

__all__ = ["RewardFunctionError", "guard_reward", "guard_rewards", "excerpt", "check_reward_name", "required_columns",
           "check_reward_columns"]  # fmt: skip

# The logging callbacks TRL passes every reward function (a column of the completions table, a scalar metric): silenced
# while rows are called one by one, so that nothing is logged twice.
_SILENCED = ("log_extra", "log_metric")
EXCERPT_CHARS = 80


class RewardFunctionError(RuntimeError):
    """A reward function raised while scoring a batch. The original exception is the `__cause__`.

    Attributes:
        reward: the function's name (TRL's: `__name__`, or the class name of a callable object).
        row: the index, among the rows the function scored in that call, of the first row that fails alone; None
            when every row passes alone (the failure depends on the batch as a whole).
        rows: how many rows the function scored in that call (this process's rows of the generation batch).
        prompt, completion: the failing row's prompt and completion, as the function received them (None without a
            row).
        step: the trainer's global step, when TRL passed `trainer_state`.
        checkpoint: the checkpoint of the last completed step that `GRPOExtTrainer.train` wrote (or found) before
            re-raising; None when there is none.
    """

    def __init__(self, message: str, *, reward: str, row: int | None, rows: int, prompt=None, completion=None,
                 step: int | None = None):  # fmt: skip
        super().__init__(message)
        self.reward, self.row, self.rows = reward, row, rows
        self.prompt, self.completion, self.step = prompt, completion, step
        self.checkpoint: str | None = None


def excerpt(value, limit: int = EXCERPT_CHARS) -> str:
    """A one-line excerpt of a prompt or completion: text, or the text of its last message (a conversation).

    >>> excerpt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is\\n 2 + 2?"}])
    'What is 2 + 2?'
    >>> excerpt("x" * 100, limit=10)
    'xxxxxxxxx…'
    """
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        value = value[-1].get("content")
        if isinstance(value, list):  # multimodal content: its text parts
            value = " ".join(part.get("text", "") for part in value if isinstance(part, dict))
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def guard_reward(func, name: str | None = None):
    """`func` wrapped so that an exception becomes a `RewardFunctionError` naming `name` and the first failing row.

    Sync and async reward functions alike (the wrapper is async when `func` is, as TRL's `is_async_callable` reads
    it); a reward model (`nn.Module`) or anything not callable is returned as it is. `name` defaults to TRL's name
    for the function (`__name__`, or the class name of a callable object).
    """
    if isinstance(func, nn.Module) or not callable(func):
        return func
    name = name or get_callable_name(func)

    if is_async_callable(func):

        async def guarded(**kwargs):
            try:
                return await func(**kwargs)
            except Exception as error:
                row = None
                for index, row_kwargs in _one_row_each(kwargs):
                    try:
                        await func(**row_kwargs)
                    except Exception:
                        row = index
                        break
                raise _error(name, error, kwargs, row) from error

    else:

        def guarded(**kwargs):
            try:
                return func(**kwargs)
            except Exception as error:
                row = None
                for index, row_kwargs in _one_row_each(kwargs):
                    try:
                        func(**row_kwargs)
                    except Exception:
                        row = index
                        break
                raise _error(name, error, kwargs, row) from error

    guarded.__name__ = guarded.__qualname__ = name
    guarded.__wrapped__ = func
    return guarded


def guard_rewards(reward_funcs: list, names: list[str] | None = None) -> list:
    """`guard_reward` on each reward function, named as TRL logs it (`names`, TRL's `reward_func_names`)."""
    names = names or [None] * len(reward_funcs)
    return [guard_reward(func, name) for func, name in zip(reward_funcs, names, strict=True)]


def _rows(kwargs: dict) -> int:
    values = kwargs.get("completions", kwargs.get("prompts"))
    return len(values) if isinstance(values, list | tuple) else 0


def _one_row_each(kwargs: dict):
    """(index, kwargs of that row alone) for each row: every per-row list sliced, the logging callbacks silenced."""
    rows = _rows(kwargs)
    for index in range(rows):
        row_kwargs = {}
        for key, value in kwargs.items():
            if key in _SILENCED and callable(value):
                value = _ignore
            elif isinstance(value, list | tuple) and len(value) == rows:
                value = value[index : index + 1]
            row_kwargs[key] = value
        yield index, row_kwargs


def _ignore(*args, **kwargs) -> None:
    return None


def _error(name: str, error: Exception, kwargs: dict, row: int | None) -> RewardFunctionError:
    rows = _rows(kwargs)
    state = kwargs.get("trainer_state")
    step = getattr(state, "global_step", None)
    when = f" at step {step}" if step is not None else ""
    cause = f"{type(error).__name__}: {error}"
    if row is None:
        where = (
            f"Every one of the {rows} rows it scored passes alone, so the failure depends on the batch as a whole (its "
            "size, or rows together); fix the function for such batches."
        )
        prompt = completion = None
    else:
        prompt, completion = kwargs.get("prompts", [None] * rows)[row], kwargs.get("completions", [None] * rows)[row]
        where = (
            f"It fails on row {row} of the {rows} rows it scored (prompt: {excerpt(prompt)!r}, completion: "
            f"{excerpt(completion)!r}); fix the function for such rows, or return None for a row it cannot score."
        )
    message = f"reward function {name!r} raised {cause}{when}. {where}"
    return RewardFunctionError(message, reward=name, row=row, rows=rows, prompt=prompt, completion=completion,
                               step=step)  # fmt: skip


def check_reward_name(option: str, value) -> None:
    """Raise a ValueError naming the config field `option` unless `value` names a reward `get_reward` can build
    without parameters: a registered name, a dotted import path, or a callable. Called before any model loads."""
    from . import list_rewards

    if callable(value) or (isinstance(value, str) and (value in list_rewards() or "." in value)):
        return
    raise ValueError(
        f"{option}={value!r} is not a registered reward. Known: {', '.join(list_rewards())}; register yours with "
        "`trl_grpo_ext.register_reward` before building the config, or give its dotted import path (e.g. "
        "'my_package.my_reward')."
    )


# What `GRPOTrainer._calculate_rewards` passes every reward function besides the rows' columns:
# `reward_func(prompts=prompts, completions=completions, completion_ids=completion_ids_list, **reward_kwargs)`, with
# `reward_kwargs["trainer_state"]`, `["log_extra"]`, `["log_metric"]` and, with environments, `["environments"]`.
TRL_REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                        "environments")  # fmt: skip


def required_columns(reward) -> list[str]:
    """The dataset columns a reward function needs: its parameters without a default that TRL does not fill itself.

    >>> def accuracy(completions, solution, tolerance=0.0, **kwargs): ...
    >>> required_columns(accuracy)
    ['solution']
    """
    if isinstance(reward, nn.Module) or not callable(reward):
        return []
    try:
        parameters = inspect.signature(reward).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: nothing to read
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters
            if p.kind in kinds and p.default is inspect.Parameter.empty and p.name not in TRL_REWARD_ARGUMENTS]  # fmt: skip


def check_reward_columns(reward_funcs, dataset, where: str = "train_dataset", provided=()) -> None:
    """Raise a ValueError before any model loads when `dataset` lacks `prompt` or a column a reward function needs.

    `provided` are columns something else adds to every row (an extension's `columns`). A dataset that does not
    list its columns (a streamed one, a dict of evaluation sets) is not checked.
    """
    names = getattr(dataset, "column_names", None)
    if not isinstance(names, list | tuple):
        return
    if "prompt" not in names:
        raise ValueError(
            f"{where} has no 'prompt' column (columns: {list(names)}); GRPO generates from `prompt`: rename your "
            "prompt column to 'prompt' (`dataset.rename_column`)."
        )
    available = set(names) | set(provided)
    for reward in reward_funcs or []:
        missing = [column for column in required_columns(reward) if column not in available]
        if missing:
            raise ValueError(
                f"reward function {get_callable_name(reward)!r} needs the column(s) {missing} (its parameters without "
                f"a default), but {where} has only {list(names)}; add the column(s) to the dataset, or give the "
                f"parameter a default (`{missing[0]}=None`) if something else passes it."
            )
