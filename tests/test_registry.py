import pytest

from trl_grpo_ext import (
    get_advantage,
    get_reward,
    list_advantages,
    list_rewards,
    register_advantage,
    register_reward,
)
from trl_grpo_ext.registry import Registry


def _reward_a(completions, **kwargs):
    return [0.0] * len(completions)


def _reward_b(completions, **kwargs):
    return [1.0] * len(completions)


def test_builtins_are_listed():
    assert {"accuracy", "think_format", "soft_overlong", "tag_format", "contains_solution"} <= set(list_rewards())
    assert "group" in list_advantages()


def test_register_and_get():
    registry = Registry("reward")
    registry.register("a", _reward_a)
    assert registry.get("a") is _reward_a
    registry.register("a", _reward_a)  # the same function again is fine
    assert registry.names() == ["a"]


def test_duplicate_name_with_another_function_raises():
    registry = Registry("reward")
    registry.register("a", _reward_a)
    with pytest.raises(ValueError, match="'a' is already registered.*_reward_a.*_reward_b"):
        registry.register("a", _reward_b)


def test_public_register_reward_rejects_taken_builtin():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("accuracy", _reward_b)


def test_unknown_name_lists_known_ones():
    with pytest.raises(KeyError, match="unknown reward 'acuracy'.*accuracy, .*tag_format"):
        get_reward("acuracy")
    with pytest.raises(KeyError, match="unknown advantage 'grup'.*group"):
        get_advantage("grup")


def test_dotted_import_path_works_where_a_name_does():
    from trl.rewards import think_format_reward

    assert get_reward("trl.rewards.think_format_reward") is think_format_reward
    assert get_reward("tests.test_registry._reward_b") is _reward_b
    factory_built = get_reward("trl_grpo_ext.rewards.tag_format_reward", tags=["answer"])
    assert factory_built(completions=["<answer>1</answer>"]) == [1.0]


def test_bad_import_paths_raise_clearly():
    with pytest.raises(KeyError, match="cannot import module 'no_such_module'"):
        get_reward("no_such_module.fn")
    with pytest.raises(KeyError, match="has no attribute 'nope'"):
        get_reward("trl.rewards.nope")


def test_factory_parameters():
    reward = get_reward("soft_overlong", max_completion_len=10, soft_punish_cache=4)
    # 8 tokens: (10 - 4 - 8) / 4 = -0.5; 5 tokens: 0; 12 tokens: -1
    assert reward(completion_ids=[[0] * 8, [0] * 5, [0] * 12]) == [-0.5, 0.0, -1.0]
    with pytest.raises(ValueError, match="takes no parameters"):
        get_reward("accuracy", foo=1)


def test_invalid_names_rejected():
    for bad in ["", "a.b", "a:b"]:
        with pytest.raises(ValueError, match="invalid"):
            register_advantage(bad, _reward_a)
    with pytest.raises(TypeError, match="not callable"):
        register_advantage("not_callable", 3)


def test_trainer_resolves_names_and_paths(tiny_model_path, tokenizer, tmp_path):
    from trl_grpo_ext import GRPOExtTrainer
    from trl_grpo_ext.testing import tiny_dataset

    from .conftest import make_config

    trainer = GRPOExtTrainer(
        model=str(tiny_model_path),
        reward_funcs=["tag_format", "tests.test_registry._reward_b"],
        args=make_config(tmp_path),
        train_dataset=tiny_dataset(4),
        processing_class=tokenizer,
    )
    assert trainer.reward_func_names == ["tag_format_think_answer", "_reward_b"]


def test_unknown_estimator_fails_before_the_model_loads(tmp_path):
    from .conftest import make_config

    with pytest.raises(ValueError, match="advantage_estimator='nope' is not a registered estimator. Known: group"):
        make_config(tmp_path, advantage_estimator="nope")


def test_misspelt_reward_name_fails_in_the_trainer_not_on_the_hub(tiny_model_path, tokenizer, tmp_path):
    from trl_grpo_ext import GRPOExtTrainer
    from trl_grpo_ext.testing import tiny_dataset

    from .conftest import make_config

    with pytest.raises(KeyError, match="unknown reward 'acuracy'. Known rewards: accuracy"):
        GRPOExtTrainer(model=str(tiny_model_path), reward_funcs=["acuracy"], args=make_config(tmp_path),
                       train_dataset=tiny_dataset(4), processing_class=tokenizer)  # fmt: skip


def _closure_estimator():
    def estimator(batch):
        return batch.advantages

    return estimator


def test_callable_estimator_checkpoints(tiny_model_path, tokenizer, tmp_path):
    from trl_grpo_ext import GRPOExtTrainer
    from trl_grpo_ext.testing import tiny_dataset

    from .conftest import make_config, varied_reward

    args = make_config(tmp_path, advantage_estimator=_closure_estimator(), max_steps=1, save_strategy="steps",
                       save_steps=1)  # fmt: skip
    trainer = GRPOExtTrainer(model=str(tiny_model_path), reward_funcs=varied_reward, args=args,
                             train_dataset=tiny_dataset(4), processing_class=tokenizer)  # fmt: skip
    trainer.train()  # saving a checkpoint pickles the config: a closure there would fail
    assert (tmp_path / "out" / "checkpoint-1" / "training_args.bin").exists()
    assert trainer.args.advantage_estimator == "tests.test_registry._closure_estimator.<locals>.estimator"
