"""PTA-GRPO cold start ("Plan Then Action", arXiv 2510.01833, stage 1): SFT on plan-formatted reasoning.

The paper condenses a teacher's chains of thought into short analytic plans, then fine-tunes on
`<plan>…</plan><think>…</think><answer>…</answer>`. We ship the formatter (not the teacher): give rows of
(question, plan, reasoning, answer) and get TRL's conversational prompt-completion examples, ready for `SFTTrainer`
(which then trains on the completion only).
"""

from __future__ import annotations

DEFAULT_SYSTEM = (
    "First write a short plan in <plan></plan>, then reason in <think></think>, then give the final answer in "
    "<answer></answer>."
)


def pta_sft_example(question: str, plan: str, reasoning: str, answer: str, system: str | None = DEFAULT_SYSTEM,
                    plan_tag: str = "plan") -> dict:  # fmt: skip
    """One SFT example: `{"prompt": [system?, user], "completion": [assistant]}`.

    >>> pta_sft_example("2+3?", "Add.", "2+3=5", "5", system=None)["completion"][0]["content"]
    '<plan>Add.</plan><think>2+3=5</think><answer>5</answer>'
    """
    for name, value in (("question", question), ("plan", plan), ("reasoning", reasoning), ("answer", answer)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"pta_sft_example: {name}={value!r} must be non-empty text.")
    content = (
        f"<{plan_tag}>{plan.strip()}</{plan_tag}><think>{reasoning.strip()}</think><answer>{answer.strip()}</answer>"
    )
    prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return {"prompt": prompt, "completion": [{"role": "assistant", "content": content}]}


def pta_sft_dataset(dataset, question="question", plan="plan", reasoning="reasoning", answer="answer",
                    system: str | None = DEFAULT_SYSTEM, plan_tag: str = "plan"):  # fmt: skip
    """Map a `datasets.Dataset` with the four columns (names configurable) to `pta_sft_example` rows."""
    missing = [c for c in (question, plan, reasoning, answer) if c not in dataset.column_names]
    if missing:
        raise KeyError(f"pta_sft_dataset: columns {missing} not in the dataset (columns: {dataset.column_names}).")
    return dataset.map(
        lambda row: pta_sft_example(row[question], row[plan], row[reasoning], row[answer], system, plan_tag),
        remove_columns=dataset.column_names,
    )
