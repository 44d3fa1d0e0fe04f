"""Every function that reads model text returns quickly and raises nothing, whatever the model writes (issue 32).

Each parser (reward functions, tag / plan / route / tool-call / waypoint readers, answer checkers, segmenters, the
built-in calculator tool) gets the same inputs: adversarial ones (huge numbers, deep nesting, 100k characters, unclosed
tags, lone surrogates, NUL bytes) and a few hundred seeded random mixes of the fragments models write. Each parser runs
in a forked process that reports every call: a call slower than `PER_CALL` seconds fails the test, and a call that
never returns is killed at `PER_CALL + HANG` and fails it too (the suite does not hang). A reward returns one float or
None per completion; only a tool may raise (TRL's tool loop shows the model the error).
"""

from __future__ import annotations

import copy
import multiprocessing
import random
import time
from dataclasses import dataclass

import pytest
import torch

PER_CALL = 2.0  # seconds a call may take
HANG = 3.0  # more seconds before a call counts as hung and its process is killed
BIG = 100_000
SEED = 32  # issue 32

FRAGMENTS = [
    "<think>", "</think>", "<answer>", "</answer>", "<plan>", "</plan>", "<tool_call>", "</tool_call>", "<route>",
    "</route>", "<tool_response>", "\\boxed{", "{", "}", "[", "]", "(", ")", ",", ":", '"', "'", "\\", "\n", "\n\n",
    " ", "\t", "12", "13", "-3.5", "0.", "1e999", "9" * 50, "10**10**10", "**", "+", "-", "*", "/", "=", ".",
    '{"name": "calculator", "arguments": {"expression": "', '"}}', '{"name": ', '"arguments": ', "calculator",
    "calc", "qa", "router", "\ud800", "\udfff", "\ufffd", "\x00", "é", "漢", "🙂", "\\frac{", "\\sqrt{", "^", "_",
    "$", "\\(", "\\)", "\\[", "(1.0, 2.0)", "(1, 2) ", "nan", "inf", "the", "Paris", "{'error': '", "Step 1",
    "<|im_end|>", "<|endoftext|>", "x", "a b c d", "Draft:",
]  # fmt: skip

ADVERSARIAL = [
    "", " ", "\n", "12", "9" * BIG, "9" * 5000, "-" + "9" * 5000, "1e999999", "-1e999999", "10**10**10", "(((10**100)**100)**100)**100",
    "0." + "0" * BIG + "1", "(" * 5000, "[" * 5000, "{" * 5000, "(" * 5000 + ")" * 5000, "{" * 5000 + "}" * 5000,
    "x" * BIG, "a " * (BIG // 2), "\n" * BIG, "\n \n" * (BIG // 3), " " * BIG,
    "<plan>" * 15000, "</plan>" * 15000, "<think>" * 15000, "<answer>" * 12000, "<tool_call>" * 9000,
    "<tool_call>{" * 8000, "<tool_call>{}" * 7000, "<tool_call>{}</tool_call>" * 4000, "<route>" * 12000,
    "<route>x" * 10000, "<route>calc</route>" * 5000, "\\boxed{" * 14000, "<think>" + "x" * BIG,
    "<think></think>" * 6000, "<think>a</think><answer>" + "9" * BIG + "</answer>",
    "<think>x</think><answer>\\boxed{" + "{" * 5000 + "</answer>", "<answer>" * 2 + "</answer>" * 2,
    "<tool_call>" + '{"a":' * 5000 + "1" + "}" * 5000 + "</tool_call>",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "(((10**100)**100)**100)**100"}}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expression": "' + "9" * BIG + '"}}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expression": "' + "(" * 3000 + '"}}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": "3"}</tool_call>', '<tool_call>{"name": 3}</tool_call>',
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', '<tool_call>[1, 2]</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expression": "1e999 ** 2"}}</tool_call>',
    "(1.0, 2.0) " * 9000, "(" + "9" * BIG + ", 1)", "(1e999, 1)", "(" + "1" * 5000 + "." + "1" * 5000 + ", 2)",
    "(1" * 40000, "(1, " * 25000, "(" + " " * BIG + "1, 2)",
    "\ud800", "\udfff" * 1000, "\ufffd" * (BIG // 2), "\x00" * 1000, "a\x00<think>\ud800</think>\x00<answer>1</answer>",
    "<route>calc</route>" + "x" * BIG, "<route>" + "a" * BIG + "</route>", "<route> </route>", "<route>qa</route>",
    "{'error': " + "[" * 5000, "{" + "-" * BIG + "1}", "{'error': '" + "x" * BIG + "'}", "{" + "(" * 5000,
    "{'error': 'x'}", "{'a': " + "9" * 5000 + "}", "{'a': 1e999999}",
    "$" + "\\frac{" * 3000 + "$", "\\boxed{" + "\\frac{1}{" * 2000 + "}", "$\\sqrt{" * 2000, "\\boxed{" + "9" * 5000 + "}",
    "\\boxed{10^{10^{10^{10}}}}", "\\boxed{9^{9^{9^{9}}}}", "$2^{2^{2^{2^{2^{2}}}}}$", "\\boxed{" + "x+" * 5000 + "x}",
    "\\boxed{(((10^{100})^{100})^{100})^{100}}", "$" + "9" * 5000 + "!$", "\\boxed{10000000!}", "\\boxed{99999^{99999}}",
    "Step 1\n\nStep 2\n\n" * 5000, "Draft:\n" * 10000,
]  # fmt: skip


def random_texts(count: int, seed: int = SEED) -> list[str]:
    """Seeded random mixes of `FRAGMENTS`: mostly short, some long, a few near 100k characters."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        size = rng.choice([1, 3, 10, 30, 100, 300])
        text = "".join(rng.choice(FRAGMENTS) for _ in range(size))
        if rng.random() < 0.05:
            text = (text or "x") * (BIG // max(1, len(text)))
        texts.append(text)
    return texts


INPUTS = ADVERSARIAL + random_texts(250)
SHORTER = ADVERSARIAL + random_texts(60)  # for the parsers that tokenize every input first
LATEX = [text for text in ADVERSARIAL if "\\" in text or "$" in text]  # math_verify's inputs: LaTeX


def excerpt(text: str) -> str:
    return f"{text[:60]!r}{'...' if len(text) > 60 else ''} ({len(text)} characters)"


@dataclass
class Parser:
    """One function that reads model text: `build(tokenizer)` returns `call(text)`; `check(out)` asserts the result's
    type; `may_raise`: a tool, whose exceptions TRL's tool loop shows the model."""

    name: str
    build: object
    check: object = None
    may_raise: bool = False
    inputs: list[str] | None = None  # None: INPUTS
    per_call: float = PER_CALL


def run_parser(parser: Parser, call, inputs: list[str]) -> list[str]:
    """Run `call` on each input in a forked process; the list of failures (slow, hung, raised, wrong result)."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child():
        torch.set_num_threads(1)  # the parent's OpenMP threads do not survive the fork (as in tools.time_limited)
        for index, text in enumerate(inputs):
            send.send(("start", index))
            start = time.perf_counter()
            error = None
            try:
                out = call(text)
                if parser.check is not None:
                    parser.check(out)
            except AssertionError as failure:
                error = f"wrong result: {failure}"[:300]
            except Exception as failure:
                if not parser.may_raise:
                    error = f"{type(failure).__name__}: {failure}"[:300]
            send.send(("done", index, time.perf_counter() - start, error))
        send.send(("end", None))

    process = context.Process(target=child)
    process.start()
    send.close()
    failures, current = [], None

    def where() -> str:
        return "before the first input" if current is None else f"input {current} {excerpt(inputs[current])}"

    try:
        while True:
            if not receive.poll(parser.per_call + HANG):
                failures.append(f"{where()}: no return within {parser.per_call + HANG} s")
                break
            try:
                message = receive.recv()
            except EOFError:
                process.join()
                failures.append(f"{where()}: the process died (exit code {process.exitcode})")
                break
            if message[0] == "end":
                break
            if message[0] == "start":
                current = message[1]
                continue
            _, current, elapsed, error = message
            if elapsed > parser.per_call:
                failures.append(f"{where()}: {elapsed:.1f} s")
            if error:
                failures.append(f"{where()}: {error}")
    finally:
        process.kill()
        process.join()
    return failures


# ---------------------------------------------------------------------------------------------------- the parsers
def token_ids(tokenizer, text: str, limit: int = 2048) -> list[int]:
    """The first `limit` token ids of `text` (a completion is at most `max_completion_length` tokens), for the parsers
    that read ids; a lone surrogate is replaced first, as decoding ids never gives one."""
    text = text[: 8 * limit].encode("utf-8", "replace").decode("utf-8")
    return tokenizer(text, add_special_tokens=False)["input_ids"][:limit]


def rewards(n: int):
    def check(out):
        assert isinstance(out, list) and len(out) == n, out
        for value in out:
            assert value is None or (isinstance(value, int | float) and not isinstance(value, bool)), out

    return check


def segment_rewards(out):
    assert isinstance(out, list) and all(isinstance(row, list) for row in out), out
    assert all(v is None or isinstance(v, float) for row in out for v in row), out


def both(text):
    """One completion in each format: standard (a string) and conversational (a list of messages)."""
    return [text, [{"role": "assistant", "content": text}]]


def conversational(text):
    return [[{"role": "assistant", "content": text}]]


def reward_parser(name, columns=None, params=None, completions=both, n=2, **kwargs):
    def build(tokenizer):
        from trl_grpo_ext import get_reward

        reward = get_reward(name, **(params or {}))
        if hasattr(reward, "tokenizer") and reward.tokenizer is None:
            reward.tokenizer = tokenizer
        return lambda text: reward(prompts=["q"] * n, completions=completions(text),
                                   completion_ids=[[1, 2, 3]] * n, **(columns or {}))  # fmt: skip

    label = name + "".join(f"_{v}" for v in (params or {}).values() if isinstance(v, str | bool))
    return Parser(label, build, rewards(n), **kwargs)


MATH_TIMEOUT = 1  # seconds (math_verify's alarm takes whole seconds)


def math_reward_parser(name: str, **kwargs) -> Parser:
    """TRL's math-verify reward `name`, bounded by math_verify's own timeouts only: TRL passes 10 s to parse the answer
    (and the solution) and 5 s to verify, enforced by SIGALRM in the main thread, where the trainer calls rewards.
    Here they are scaled to `MATH_TIMEOUT`, so that the bound (three timeouts) is checked in seconds, not minutes."""

    def build(tokenizer):
        import trl.rewards.accuracy_rewards as module

        from trl_grpo_ext import get_reward

        reward = get_reward(name)
        parse, verify = module.parse, module.verify

        def scaled_parse(*args, parsing_timeout=None, **params):
            return parse(*args, parsing_timeout=parsing_timeout and MATH_TIMEOUT, **params)

        def scaled_verify(*args, timeout_seconds=None, **params):
            return verify(*args, timeout_seconds=timeout_seconds and MATH_TIMEOUT, **params)

        def call(text):
            module.parse, module.verify = scaled_parse, scaled_verify  # in the forked process only
            try:
                return reward(completions=conversational(text), solution=["12"])
            finally:
                module.parse, module.verify = parse, verify

        return call

    # SIGALRM interrupts Python between bytecodes only: a long step inside the parser (measured: 1.6 to 2.3 s on an
    # 18k-character nest of \frac, after the suite had trained a model) overruns the timeout before it stops. The bound
    # is the three timeouts plus that overrun, with room for a busy machine.
    return Parser(name, build, rewards(1), per_call=3 * MATH_TIMEOUT + 5, **kwargs)


def calculator_parser(tokenizer):
    from trl_grpo_ext.tools import calculator

    return calculator


def waypoints_parser(tokenizer):
    from trl_grpo_ext.methods.nord import parse_waypoints

    def call(text):
        points = parse_waypoints(text)
        assert points is None or all(isinstance(x, float) and isinstance(y, float) for x, y in points), points
        return points

    return call


def last_integer_parser(tokenizer):
    from trl_grpo_ext.tasks import last_integer

    def call(text):
        value = last_integer(text)
        assert value is None or isinstance(value, int), value

    return call


def f1_parser(tokenizer):
    from trl_grpo_ext.methods.arpo import f1_score

    return lambda text: f1_score(text, "the Eiffel Tower")


def tool_call_scores_parser(tokenizer):
    from trl_grpo_ext import get_reward

    reward = get_reward("tool_call_validity", known_tools=["calculator"])

    def call(text):
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": text}}}
        turns = [{"role": "assistant", "content": text, "tool_calls": [call]},
                 {"role": "tool", "name": "calculator", "content": text}, {"role": "assistant", "content": text}]  # fmt: skip
        out = reward(prompts=["q", "q"], completions=[text, turns], completion_ids=[[1], [1]])
        segment_rewards(out)

    return call


def segmenter_parser(kind):
    def build(tokenizer):
        from trl_grpo_ext.methods.segments import cut_segments

        def call(text):
            ids = token_ids(tokenizer, text) or [tokenizer.eos_token_id]
            ids = torch.tensor([ids])
            segments = cut_segments(kind, ids, torch.ones_like(ids), tokenizer=tokenizer,
                                    tags=("plan", "think", "answer"), require_match=False)  # fmt: skip
            assert segments.shape == ids.shape and int(segments.min()) == 0

        return call

    return build


def parse_response_parser(tokenizer):
    from trl.chat_template_utils import add_response_schema

    from trl_grpo_ext import _trl_compat
    from trl_grpo_ext.tools import calculator

    tok = add_response_schema(copy.deepcopy(tokenizer))

    def call(text):
        ids = token_ids(tok, text) + [tok.eos_token_id]
        message = _trl_compat.parse_response(tok, ids, None, [calculator])
        assert isinstance(message, dict) and message.get("role") == "assistant", message

    return call


def hima_parser(agent):
    def build(tokenizer):
        from trl_grpo_ext.methods.hima import HiMA, _Call, _System

        hima = HiMA("toy", alternatives=2)

        def call(text):
            system = _System(row=0, question="What is 3 * 4?")
            system.calls.append(_Call(agent, [], text=text))
            hima._advance(system)
            assert (system.answer is None) != (system.pending is None), system
            assert system.answer is None or isinstance(system.answer, str)

        return call

    return build


def final_answer_parser(tokenizer):
    from trl_grpo_ext.tasks import final_answer

    def call(text):
        for numeric in (True, False):
            answer = final_answer(text, numeric=numeric)
            assert answer is None or isinstance(answer, str)

    return call


def truncate_at_tag_parser(tokenizer):
    from trl_grpo_ext.methods.pta import truncate_at_tag

    class Characters:  # one token per character: the text's own code points
        def decode(self, ids, skip_special_tokens=False):
            return "".join(map(chr, ids))

    def call(text):
        ids = [ord(c) for c in text]
        kept, closed = truncate_at_tag(ids, Characters(), "</plan>")
        assert kept == ids[: len(kept)] and closed == ("</plan>" in text)

    return call


def ngram_overlap_parser(tokenizer):
    from trl_grpo_ext.methods.drafts import ngram_overlap

    return lambda text: ngram_overlap(text, text[::-1], n=4)


def repetition_probe_parser(tokenizer):
    from trl_grpo_ext import RewardHackingMonitor

    probe = RewardHackingMonitor().probe

    def call(text):
        ids = token_ids(tokenizer, text, 4096)
        assert probe(completion_ids=[ids], log_metric=lambda key, value: None) == [None]

    return call


FUTURE = [[1.0, 0.0], [2.0, 0.5]]
SCENE = {"cars": [[5.0, 0.0, 1.0]], "ego_radius": 1.0, "road": [-2.0, 2.0]}
PARSERS = [
    Parser("calculator", calculator_parser, may_raise=True),
    reward_parser("tag_format", params={"tags": ["plan", "think", "answer"]}),
    reward_parser("tag_format", params={"tags": ["think", "answer"], "partial": True}),
    reward_parser("think_format", completions=conversational, n=1),
    reward_parser("contains_solution", columns={"solution": ["12", "12"]}),
    reward_parser("last_integer", columns={"solution": ["12", "12"]}),
    Parser("last_integer_text", last_integer_parser),
    math_reward_parser("accuracy", inputs=LATEX + random_texts(40)),
    math_reward_parser("reasoning_accuracy", inputs=[f"<think>x</think>{text}" for text in LATEX[:6]] + INPUTS),
    reward_parser("arpo", columns={"solution": ["Paris", ["Paris", "the Eiffel Tower"]]}),
    Parser("f1_score", f1_parser),
    reward_parser("trajectory", columns={"future": [FUTURE] * 2, "scene": [SCENE] * 2}),
    Parser("parse_waypoints", waypoints_parser),
    reward_parser("budget_length", params={"count": "think"}, columns={"budget": [16, 16]}),
    reward_parser("draft_copy_penalty", columns={"drafts": [["Draft: the answer is 12"], []]}),
    reward_parser(
        "draft_improvement",
        params={"reward": "contains_solution"},
        columns={"drafts": [["it is 12"], ["13"]], "solution": ["12", "12"]},
    ),
    Parser("ngram_overlap", ngram_overlap_parser),
    Parser("tool_call_validity", tool_call_scores_parser),
    Parser("segments_tags", segmenter_parser("tags"), inputs=SHORTER),
    Parser("segments_paragraphs", segmenter_parser("paragraphs"), inputs=SHORTER),
    Parser("segments_regex", segmenter_parser("regex:(?=Step \\d)"), inputs=SHORTER),
    Parser("parse_response", parse_response_parser, inputs=SHORTER),
    Parser("hima_router", hima_parser("router")),
    Parser("hima_calc", hima_parser("calc")),
    Parser("hima_qa", hima_parser("qa")),
    Parser("final_answer", final_answer_parser),  # the reasoning-gym tasks' answer rule
    Parser("truncate_at_tag", truncate_at_tag_parser),
    Parser("repetition_probe", repetition_probe_parser, inputs=SHORTER),
]


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
def test_parser_returns_quickly_and_raises_nothing(parser, tokenizer):
    inputs = INPUTS if parser.inputs is None else parser.inputs
    failures = run_parser(parser, parser.build(tokenizer), inputs)
    assert not failures, f"{parser.name}: {len(failures)} failure(s)\n" + "\n".join(failures[:10])


def test_the_harness_catches_hangs_slow_calls_and_errors(tokenizer):
    """A parser that hangs (in C code, the GIL held), one that is slow and one that raises are each reported."""
    import re

    hangs = Parser("hangs", lambda tok: lambda text: re.match(r"(a+)+$", "a" * 40 + "b") if text == "x" else None,
                   per_call=0.5)  # fmt: skip
    start = time.perf_counter()
    (failure,) = run_parser(hangs, hangs.build(tokenizer), ["", "x", "never reached"])
    assert "input 1 'x'" in failure and "no return within" in failure
    assert time.perf_counter() - start < 0.5 + HANG + 3
    raises = Parser("raises", lambda tok: lambda text: int(text))
    (failure,) = run_parser(raises, raises.build(tokenizer), ["1", "x"])
    assert failure.startswith("input 1 'x'") and "ValueError" in failure


def test_the_harness_catches_a_crash(tokenizer):
    import os

    crashes = Parser("crashes", lambda tok: lambda text: os._exit(3) if text == "x" else None)
    (failure,) = run_parser(crashes, crashes.build(tokenizer), ["", "x"])
    assert failure == "input 1 'x' (1 characters): the process died (exit code 3)"
