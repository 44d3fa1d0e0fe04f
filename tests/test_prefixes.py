"""Generation from per-row prefixes: context prefixes (not trained) and completion prefixes (trained)."""

import pytest
import torch
from trl import GRPOTrainer

from trl_grpo_ext import GRPOExtTrainer
from trl_grpo_ext.testing import tiny_dataset

from .conftest import make_config, varied_reward


class FakeBackend:
    """Stands in for transformers / vLLM generation; records the blocks it is asked for."""

    def __init__(self, eos_id):
        self.calls = []
        self.eos_id = eos_id

    def __call__(self, trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        self.calls.append(([list(p) for p in prompt_ids], num_generations))
        return [[40 + i % 3, 41, self.eos_id] for i in range(len(prompt_ids))], [[-1.0, -1.0, -1.0]] * len(prompt_ids)


def _dataset(column, values):
    rows = tiny_dataset(len(values))
    return rows.add_column(column, values)


def _trainer(tiny_model_path, tokenizer, tmp_path, dataset, **overrides):
    return GRPOExtTrainer(
        model=str(tiny_model_path),
        reward_funcs=varied_reward,
        args=make_config(tmp_path, **overrides),
        train_dataset=dataset,
        processing_class=tokenizer,
    )


def _rows(dataset, group):
    return [dict(row) for row in dataset for _ in range(group)]


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def backend(monkeypatch, tokenizer):
    fake = FakeBackend(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    monkeypatch.setattr(
        GRPOTrainer, "_generate_single_turn", lambda self, *args, **kwargs: fake(self, *args, **kwargs)
    )
    return fake


def test_context_prefix_joins_the_prompt_and_is_not_trained(tiny_model_path, tokenizer, tmp_path, backend):
    dataset = _dataset("hint", ["<think>add", "<think>sum"])
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, dataset, context_prefix_column="hint")
    trainer.model.train()
    out = trainer._generate_and_score_completions(_rows(dataset, 4))
    ((prompts, block),) = backend.calls
    assert block == 4  # every group shares its prefix: vLLM may generate n=4 per block
    for i, prompt in enumerate(prompts):
        assert prompt[-len(_ids(tokenizer, dataset[i // 4]["hint"])) :] == _ids(tokenizer, dataset[i // 4]["hint"])
    # The prefix is in the prompt (context), the completion is only what the backend generated.
    assert out["completion_ids"][:, :3].tolist() == [[40 + i % 3, 41, backend.eos_id] for i in range(8)]
    hint = torch.tensor(_ids(tokenizer, "<think>add"))
    assert torch.equal(out["prompt_ids"][0, -len(hint) :], hint)
    assert trainer.last_batch.segment_ids is None  # nothing of the completion was given


def test_completion_prefix_starts_the_completion_and_is_trained(tiny_model_path, tokenizer, tmp_path, backend):
    dataset = _dataset("draft", ["<think>3 + 4", "<think>5"])
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, dataset, completion_prefix_column="draft")
    trainer.model.train()
    out = trainer._generate_and_score_completions(_rows(dataset, 4))
    ((prompts, block),) = backend.calls
    assert block == 4
    first, second = _ids(tokenizer, "<think>3 + 4"), _ids(tokenizer, "<think>5")
    assert prompts[0][-len(first) :] == first  # the backend continues the prefix
    assert out["completion_ids"][0, : len(first) + 3].tolist() == first + [40, 41, backend.eos_id]
    assert out["completion_ids"][4, : len(second) + 3].tolist() == second + [
        41,
        41,
        backend.eos_id,
    ]  # row 4: 40 + 4 % 3
    # Segment ids: 0 on the prefix, 1 on the generated tokens, -1 on padding.
    expected_row4 = [0] * len(second) + [1, 1, 1] + [-1] * (out["completion_ids"].size(1) - len(second) - 3)
    assert trainer.last_batch.segment_ids[4].tolist() == expected_row4
    # Trained: the prefix tokens are in the loss mask (no tool mask removes them).
    assert "tool_mask" not in out and out["completion_mask"][4, : len(second)].all()
    # The reward functions saw the prefix as part of the completion.
    assert trainer.last_batch.completions[0][0]["content"].startswith("<think>3 + 4")
    # vLLM's sampling log-probs have no entry for the prefix: NaN there (ratio 1), the backend's values after.
    logps = out["sampling_per_token_logps"][0]
    assert torch.isnan(logps[: len(first)]).all() and logps[len(first)].item() == -1.0


def test_rows_with_different_prefixes_are_generated_one_by_one(tiny_model_path, tokenizer, tmp_path, backend):
    prefixes = ["a", "b", "a", "a", "c", "c", "c", "c"]  # group 1 mixes prefixes; group 2 shares one
    dataset = tiny_dataset(1)
    rows = [dict(dataset[0], draft=p) for p in prefixes]
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, dataset.add_column("draft", ["a"]),
                       completion_prefix_column="draft")  # fmt: skip
    trainer.model.train()
    trainer._generate_and_score_completions(rows)
    ((_prompts, block),) = backend.calls
    assert block == 1  # a block of 4 would make vLLM server mode give group 1 four copies of prefix "a"


def test_missing_prefix_column_is_a_clear_error(tiny_model_path, tokenizer, tmp_path, backend):
    dataset = tiny_dataset(2)
    trainer = _trainer(
        tiny_model_path, tokenizer, tmp_path, _dataset("hint", ["x", "y"]), context_prefix_column="hint"
    )
    trainer.model.train()
    rows = [dict(row, hint="x") for row in _rows(dataset, 4)]
    with pytest.raises(KeyError, match="context_prefix_column='hint', but the dataset has no such column"):
        trainer._generate_and_score_completions([{k: v for k, v in row.items() if k != "hint"} for row in rows])
    # Checked before the model loads, from the training set's columns (the model path does not exist).
    with pytest.raises(ValueError, match="context_prefix_column='hint', but the training dataset has no such column"):
        _trainer(tmp_path / "no-model", tokenizer, tmp_path, dataset, context_prefix_column="hint")


def test_completion_prefix_trains_end_to_end(tiny_model_path, tokenizer, tmp_path):
    dataset = _dataset("draft", ["<think>"] * 8)
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, dataset, completion_prefix_column="draft", max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert all(c[0]["content"].startswith("<think>") for c in trainer.last_batch.completions)


def test_prefix_fields_are_validated(tmp_path):
    with pytest.raises(ValueError, match="both 'x'.*set only one"):
        make_config(tmp_path, context_prefix_column="x", completion_prefix_column="x")
    with pytest.raises(ValueError, match="context_prefix_column=''"):
        make_config(tmp_path, context_prefix_column="")


class _TwoProcesses:
    """The trainer's accelerator as one of two processes sees it."""

    def __init__(self, accelerator):
        self._accelerator, self.num_processes = accelerator, 2

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


def test_finished_rows_still_call_a_collective_backend(tiny_model_path, tokenizer, tmp_path, backend, monkeypatch):
    """Sharded parameters (ZeRO-3, FSDP) make generation collective: TRL gathers the shards of every process. A
    process whose rows are all finished (PTA plans that ended with EOS) still calls, so the others do not wait."""
    from trl_grpo_ext import RolloutPlan

    dataset = tiny_dataset(1)
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, dataset)
    rows = _rows(dataset, 4)
    prefix = _ids(tokenizer, "done")

    def rollout():
        plan = RolloutPlan(rows=rows, mode="train", num_generations=4)
        plan.add_prefix([prefix] * 4)
        return trainer.generate_rollouts([r["prompt"] for r in rows], plan, finished=[True] * 4)

    assert rollout().completion_ids == [prefix] * 4 and backend.calls == []  # one process: nothing to generate
    monkeypatch.setattr(trainer, "accelerator", _TwoProcesses(trainer.accelerator))
    monkeypatch.setattr(trainer, "is_fsdp_enabled", True)
    assert rollout().completion_ids == [prefix] * 4  # generated, and dropped
    ((prompts, _block),) = backend.calls
    assert len(prompts) == 4 and all(p[-len(prefix) :] == prefix for p in prompts)
