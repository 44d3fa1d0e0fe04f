"""Tools never hang or crash a run: the built-in calculator bounds its own work, and `time_limited` (the config's
`tool_timeout`) stops any tool's call at its limit, with one error message to the model."""

import asyncio
import copy
import inspect
import multiprocessing
import subprocess
import time

import pytest
import torch

from trl_grpo_ext.tools import MAX_DIGITS, ToolTimeoutError, calculator, time_limited, with_time_limit


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


# ---------------------------------------------------------------------------------------------------- time limits
def sleeps(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


def loops(n: int) -> str:
    """Loop forever.

    Args:
        n: Ignored.
    """
    while True:
        pass


def fails(text: str) -> str:
    """Raise.

    Args:
        text: The error's message.
    """
    raise ValueError(text)


LIMIT = 0.5
SLACK = 1.0  # the process start, the kill and a loaded machine


@pytest.mark.parametrize(("tool", "argument"), [(sleeps, 10**6), (loops, 0)], ids=["sleeps", "loops"])
def test_a_call_past_the_limit_costs_one_error(tool, argument):
    limited = time_limited(tool, seconds=LIMIT)
    start = time.perf_counter()
    with pytest.raises(ToolTimeoutError) as info:
        limited(argument)
    elapsed = time.perf_counter() - start
    assert LIMIT <= elapsed < LIMIT + SLACK, elapsed
    assert str(info.value) == f"tool {tool.__name__!r} did not finish within 0.5 s; the call was stopped"
    assert not multiprocessing.active_children()  # the call's process is gone
    assert limited(0) if tool is sleeps else True  # the next call runs as usual


def test_results_and_the_tools_own_errors_come_back_as_they_are():
    limited = time_limited(sleeps, seconds=5)
    assert limited(0) == "slept 0" and limited(seconds=0.01) == "slept 0.01"
    with pytest.raises(ValueError, match="^bad input$"):
        time_limited(fails, seconds=5)("bad input")

    class Odd(Exception):  # cannot be pickled back (a local class): its message still reaches the model
        pass

    def odd(text: str):
        raise Odd(text)

    with pytest.raises(RuntimeError, match="^the message$"):
        time_limited(odd, seconds=5)("the message")
    with pytest.raises(RuntimeError, match="result could not be sent back"):
        time_limited(lambda: lambda: 0, seconds=5)()  # an unpicklable result


def test_the_wrapper_keeps_the_tools_schema():
    from transformers.utils import get_json_schema

    for tool in (sleeps, loops, calculator):
        limited = time_limited(tool, seconds=3)
        assert limited.__name__ == tool.__name__ and limited.__doc__ == tool.__doc__
        assert inspect.signature(limited) == inspect.signature(tool)
        assert get_json_schema(limited) == get_json_schema(tool)

    @time_limited(seconds=2)
    def decorated(a: int, b: int = 1) -> int:
        """Add.

        Args:
            a: The first.
            b: The second.
        """
        return a + b

    assert decorated(2) == 3 and decorated.time_limit == 2
    assert get_json_schema(decorated)["function"]["parameters"]["required"] == ["a"]
    again = time_limited(decorated, seconds=1)  # a new limit replaces the old one: still one process per call
    assert again.time_limit == 1 and again.__wrapped_tool__ is decorated.__wrapped_tool__


def test_an_async_tool_gets_an_async_wrapper():
    async def waits(seconds: float) -> str:
        """Wait.

        Args:
            seconds: How long.
        """
        await asyncio.sleep(seconds)
        return "done"

    limited = time_limited(waits, seconds=LIMIT)
    assert inspect.iscoroutinefunction(limited)
    assert asyncio.run(limited(0)) == "done"

    class Waiter:  # an async callable object, as TRL's is_async_callable sees it
        async def __call__(self, seconds: float) -> str:
            return await waits(seconds)

    assert inspect.iscoroutinefunction(time_limited(Waiter(), seconds=LIMIT))
    assert time_limited(Waiter(), seconds=LIMIT).__name__ == "Waiter"
    start = time.perf_counter()
    with pytest.raises(ToolTimeoutError):
        asyncio.run(limited(10**6))
    assert time.perf_counter() - start < LIMIT + SLACK


def test_processes_the_tool_started_are_stopped_with_it(tmp_path):
    pid_file = tmp_path / "pid"

    def starts_a_process(seconds: float) -> str:
        """Start a sleeping process, then wait for it.

        Args:
            seconds: How long it sleeps.
        """
        child = subprocess.Popen(["sleep", str(seconds)])
        pid_file.write_text(str(child.pid))
        child.wait()
        return "never"

    with pytest.raises(ToolTimeoutError):
        time_limited(starts_a_process, seconds=LIMIT)(1000)
    pid = int(pid_file.read_text())
    for _ in range(100):  # the killed `sleep` is reaped by init, which may take a moment
        if not _alive(pid):
            break
        time.sleep(0.05)
    assert not _alive(pid), "the tool's own subprocess outlived the call"


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), float("inf"), True, "5", None])
def test_time_limited_refuses_a_bad_limit(seconds):
    with pytest.raises(ValueError, match="seconds=.*must be a positive number of seconds"):
        time_limited(sleeps, seconds=seconds)
    with pytest.raises(ValueError, match="start_method='nope' is not available"):
        time_limited(sleeps, seconds=1, start_method="nope")


def test_with_time_limit_wraps_each_tool_once():
    own = time_limited(loops, seconds=7)
    wrapped = with_time_limit([sleeps, own], 3)
    assert [t.time_limit for t in wrapped] == [3, 7] and wrapped[1] is own
    assert with_time_limit([sleeps], None) == [sleeps] and with_time_limit(None, 3) is None


def test_per_call_overhead(capsys):
    """What a time limit costs per call, measured here (the number docs/tools.md and the docstring quote)."""
    import resource

    import torch  # noqa: F401 - measured in a process as large as a trainer's
    import transformers  # noqa: F401

    calls = 50
    limited = time_limited(calculator, seconds=5)
    limited("3 * 4")
    start = time.perf_counter()
    for _ in range(calls):
        limited("3 * 4")
    per_call = (time.perf_counter() - start) / calls
    start = time.perf_counter()
    for _ in range(calls):
        calculator("3 * 4")
    plain = (time.perf_counter() - start) / calls
    memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GB (Linux reports kB)
    with capsys.disabled():
        print(f"\ntime_limited: {1000 * per_call:.1f} ms per call in a {memory:.1f} GB process; the plain call "
              f"{1e6 * plain:.0f} µs")  # fmt: skip
    assert per_call < 0.5


# ---------------------------------------------------------------------------------------------------- in training
def test_tool_timeout_in_the_trainers_tool_loop(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    """A tool that sleeps forever and one that loops forever, called through TRL's tool loop on the tiny model under
    `tool_timeout`: each call costs one error message to the model, and the step trains."""
    from trl import GRPOTrainer
    from trl.chat_template_utils import add_response_schema

    from trl_grpo_ext import GRPOExtConfig, SegmentGRPOTrainer
    from trl_grpo_ext.testing import cpu_test_config_kwargs, tiny_dataset

    tok = add_response_schema(copy.deepcopy(tokenizer))
    response = tok.convert_tokens_to_ids("<tool_response>")

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    calls = [ids('<tool_call>\n{"name": "sleeps", "arguments": {"seconds": 1000000}}\n</tool_call>'),
             ids('<tool_call>\n{"name": "loops", "arguments": {"n": 1}}\n</tool_call>')]  # fmt: skip
    answers = [ids("<answer>12</answer>"), ids("<answer>13</answer>")]

    def backend(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return [answers[i % 2] if response in p else calls[i % 2] for i, p in enumerate(prompt_ids)], None

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", backend)
    seen = []

    def reward(completions, **kwargs):
        seen.extend(completions)
        return [float("12" in str(c[-1]["content"])) for c in completions]

    args = GRPOExtConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                         max_completion_length=256, max_steps=1, learning_rate=1e-2, seed=0, segment_by="tool_calls",
                         tool_timeout=LIMIT, **cpu_test_config_kwargs())  # fmt: skip
    trainer = SegmentGRPOTrainer(model=str(tiny_model_path), reward_funcs=[reward], args=args, processing_class=tok,
                                 train_dataset=tiny_dataset(4), tools=[sleeps, loops])  # fmt: skip
    assert [t.time_limit for t in trainer.tools] == [LIMIT, LIMIT]
    start = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - start
    assert trainer.state.global_step == 1
    assert len(seen) == 4
    for row, completion in enumerate(seen):
        name = ("sleeps", "loops")[row % 2]
        assert [m["role"] for m in completion] == ["assistant", "tool", "assistant"], completion
        error = f"tool {name!r} did not finish within {LIMIT:g} s; the call was stopped"
        assert completion[1] == {"role": "tool", "name": name, "content": str({"error": error})}
    assert trainer.state.log_history[0]["tools/failure_frequency"] == 1.0
    assert elapsed < 4 * LIMIT + 30, elapsed  # four calls stopped at the limit, plus one step of the tiny model
    assert not multiprocessing.active_children()


def test_hima_agents_tools_get_the_time_limit():
    from types import SimpleNamespace

    from trl_grpo_ext.methods.hima import HiMA

    hima = HiMA("toy", alternatives=2)
    hima.setup(SimpleNamespace(args=SimpleNamespace(tool_timeout=2.0)))
    (calculator_tool,) = hima.tools["calc"].values()
    assert calculator_tool.time_limit == 2.0 and calculator_tool("3 * 4") == "12"
    hima = HiMA("toy", alternatives=2)
    hima.setup(SimpleNamespace(args=SimpleNamespace(tool_timeout=None)))
    assert hima.tools["calc"]["calculator"] is calculator


def big_tensor_sum(n: int) -> float:
    """A tool that runs a large torch op (parallel in the parent)."""
    return float(torch.ones(n).sum())


def test_a_tool_that_uses_torch_after_training_does_not_hang(monkeypatch):
    """The parent's OpenMP pool (warm after any training) does not survive the fork: the child runs on one thread."""
    torch.ones(10**7).sum()  # the parent's parallel region: its thread pool is now up
    tool = time_limited(big_tensor_sum, seconds=20)
    start = time.perf_counter()
    assert tool(10**7) == 1e7
    assert time.perf_counter() - start < 10
