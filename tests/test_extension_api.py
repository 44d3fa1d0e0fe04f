"""The extension API: a new method written against it (examples/custom_method.py) trains, and the pipeline's rules."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from trl import GRPOTrainer

from trl_grpo_ext import Extension, GRPOExtTrainer, get_reward
from trl_grpo_ext.testing import cpu_test_config_kwargs, tiny_dataset
from trl_grpo_ext.trainer import KEPT_ROWS

from .conftest import make_config, varied_reward

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "custom_method.py"


@pytest.fixture(scope="module")
def custom():
    spec = importlib.util.spec_from_file_location("custom_method", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["custom_method"] = module
    spec.loader.exec_module(module)
    return module


def test_a_new_method_is_one_module(custom, tiny_model_path, tokenizer, tmp_path, monkeypatch):
    calls = []
    original = GRPOTrainer._generate_single_turn

    def spy(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        calls.append(([list(p) for p in prompt_ids], num_generations))
        return original(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", spy)
    args = custom.HintsGRPOConfig(output_dir=str(tmp_path / "out"), hints_column="hint", hints_train_hinted=False,
                                  per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                                  max_steps=2, learning_rate=1e-2, **cpu_test_config_kwargs())  # fmt: skip
    dataset = tiny_dataset(8).map(lambda row: {"hint": "<think>add</think>"})
    trainer = GRPOExtTrainer(model=str(tiny_model_path), reward_funcs=varied_reward, args=args, train_dataset=dataset,
                             processing_class=tokenizer)  # fmt: skip
    assert [e.name for e in trainer.extensions] == ["hints"]
    trainer.model.train()
    out = trainer._generate_and_score_completions([dict(row) for row in dataset.select([0, 1]) for _ in range(4)])
    hint = tokenizer("<think>add</think>", add_special_tokens=False)["input_ids"]
    ((prompts, block),) = calls
    assert block == 1  # the rows of a group differ now: the backend generates them one by one
    assert [p[-len(hint) :] == hint for p in prompts] == [False, False, True, True] * 2
    assert out[KEPT_ROWS].tolist() == [1.0, 1.0, 0.0, 0.0] * 2  # hinted rows out of the loss
    gain = trainer._metrics["train"]["hints/reward_gain"][0]
    rewards = trainer.last_batch.rewards.view(2, 4)
    assert gain == pytest.approx((rewards[:, 2:].mean() - rewards[:, :2].mean()).item(), abs=1e-6)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert "hints/reward_gain" in trainer.state.log_history[0]
    with pytest.raises(ValueError, match="hints_column='nope', but the dataset has no such column"):
        GRPOExtTrainer(model=str(tmp_path / "no-model"), reward_funcs=varied_reward, train_dataset=dataset,
                       args=custom.HintsGRPOConfig(output_dir=str(tmp_path), hints_column="nope",
                                                   **cpu_test_config_kwargs()))  # fmt: skip


class Owner(Extension):
    owns_rollout = True

    def __init__(self, name):
        self.name = name


class Recorder(Extension):
    def __init__(self, name, order, seen):
        self.name, self.order, self.seen = name, order, seen

    def after_scoring(self, batch):
        self.seen.append(self.name)


def test_pipeline_rules(tiny_model_path, tokenizer, tmp_path):
    kwargs = dict(model=str(tiny_model_path), reward_funcs=varied_reward, args=make_config(tmp_path),
                  train_dataset=tiny_dataset(4), processing_class=tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match="'a' and 'b' both generate the rollout themselves"):
        GRPOExtTrainer(**kwargs, extensions=[Owner("a"), Owner("b")])
    with pytest.raises(ValueError, match="two extensions are named 'x'"):
        GRPOExtTrainer(**kwargs, extensions=[Recorder("x", 0, []), Recorder("x", 1, [])])
    with pytest.raises(TypeError, match="is not a trl_grpo_ext.Extension"):
        GRPOExtTrainer(**kwargs, extensions=[get_reward("accuracy")])
    seen = []
    trainer = GRPOExtTrainer(**kwargs, extensions=[Recorder("late", 100, seen), Recorder("early", 0, seen)])
    trainer.model.train()
    trainer._generate_and_score_completions([dict(tiny_dataset(1)[0]) for _ in range(4)])
    assert seen == ["early", "late"]  # after_scoring runs by order, whatever the list's order
    assert trainer.extension("late").order == 100
    with pytest.raises(KeyError, match="no 'nope' extension; it has: \\['late', 'early'\\]"):
        trainer.extension("nope")
