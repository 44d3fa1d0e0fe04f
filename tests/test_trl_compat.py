"""Fails loudly, naming the seam, when TRL renames or reshapes a method or attribute that trainer.py relies on."""

import inspect
from importlib.metadata import version

import pytest
from packaging.version import Version
from trl import GRPOTrainer

from trl_grpo_ext.trainer import TRL_ATTRIBUTES, TRL_SEAMS

HINT = "trl_grpo_ext/trainer.py must be updated for this TRL release (see its module docstring)."


def test_trl_version_is_in_the_tested_range():
    installed = Version(version("trl"))
    assert Version("1.16") <= installed < Version("1.17"), f"trl {installed} is outside the tested range >=1.16,<1.17"


@pytest.mark.parametrize("name", sorted(TRL_SEAMS))
def test_seam_signature(name):
    method = getattr(GRPOTrainer, name, None)
    assert method is not None, f"TRL seam GRPOTrainer.{name} no longer exists. {HINT}"
    params = list(inspect.signature(method).parameters)
    expected = TRL_SEAMS[name]  # the leading parameters we pass; TRL may add optional ones after them
    assert params[: len(expected)] == expected, (
        f"TRL seam GRPOTrainer.{name}{params} does not start with {expected}. {HINT}"
    )


def _source(name):
    return inspect.getsource(getattr(GRPOTrainer, name))


def test_generate_calls_the_seams_we_override():
    source = _source("_generate")
    for call in ["self._tokenize_prompts(prompts)", "self._generate_single_turn("]:
        assert call in source, f"GRPOTrainer._generate no longer calls {call}: row prefixes would be ignored. {HINT}"
    assert source.index("self._tokenize_prompts(") < source.index("self._generate_single_turn("), HINT


def test_tool_loop_counts_whole_trajectories():
    source = _source("_tool_call_loop")
    for call in [
        'completion[0].get("tool_calls")',  # a continued trajectory's loop starts from its new turn alone
        "prompt_ids[idx_with_tool] + completion_ids[idx_with_tool] + suffix_ids",  # the whole trajectory so far
        "len(pct) - len(prompt_ids[i]) > self.max_completion_length",  # the cap counts all of the completion
        "iteration_num < self.max_tool_calling_iterations",
        "self._sync_tool_dicts[idx_with_tool]",  # per-row tool tables, sliced for calls over some rows
    ]:
        assert call in source, (
            f"GRPOTrainer._tool_call_loop changed ({call} missing): ARPO branches rely on it. {HINT}"
        )


def test_loss_takes_token_level_advantages_and_the_tool_mask():
    source = _source("_compute_loss")
    assert "advantages.dim() == 1" in source, f"GRPOTrainer._compute_loss no longer accepts (B, T) advantages. {HINT}"
    assert 'completion_mask * inputs["tool_mask"]' in source, (
        f"GRPOTrainer._compute_loss no longer masks with completion_mask * tool_mask: loss weights would be lost. "
        f"{HINT}"
    )
    assert 'inputs["num_items_in_batch"]' in source, f"the dapo normaliser moved out of num_items_in_batch. {HINT}"
    # Dropped rows are rescaled away for the losses that divide by the number of rows.
    for line in ["(per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()",
                 "per_token_loss.size(0) * self.max_completion_length"]:  # fmt: skip
        assert line in source, f"GRPOTrainer._compute_loss normalises rows differently ({line} missing). {HINT}"


def test_advantages_are_shuffled_after_scoring():
    source = _source("_prepare_inputs")
    scored, shuffled = source.find("_generate_and_score_completions("), source.find("shuffle_sequence_dict(")
    assert 0 <= scored < shuffled, (
        f"GRPOTrainer._prepare_inputs no longer shuffles after _generate_and_score_completions: group maths in our "
        f"override would see shuffled rows. {HINT}"
    )


def test_scoring_output_keys():
    source = _source("_generate_and_score_completions")
    for key in ['"advantages": advantages', '"num_items_in_batch": num_items_in_batch', 'output["tool_mask"]']:
        assert key in source, f"GRPOTrainer._generate_and_score_completions output changed ({key} missing). {HINT}"
    assert "self._calculate_rewards(inputs, prompts, completions, completion_ids_list)" in source, HINT


def test_trainer_attributes(tiny_model_path, tokenizer, tmp_path):
    from trl_grpo_ext import GRPOExtTrainer
    from trl_grpo_ext.testing import tiny_dataset

    from .conftest import make_config, varied_reward

    trainer = GRPOExtTrainer(
        model=str(tiny_model_path),
        reward_funcs=varied_reward,
        args=make_config(tmp_path),
        train_dataset=tiny_dataset(4),
        processing_class=tokenizer,
    )
    missing = [name for name in TRL_ATTRIBUTES if not hasattr(trainer, name)]
    assert not missing, f"GRPOTrainer no longer sets {missing}. {HINT}"
    assert "advantages" in trainer._logs, f"GRPOTrainer._logs has no 'advantages' column. {HINT}"


def test_added_rows_are_split_into_equal_slices_and_a_reference_needs_beta():
    # `add_rows`: TRL slices a generation batch into `steps_per_generation` slices of rows // spg rows (the trainer
    # pads to a multiple); RCC's reference at beta = 0 relies on TRL building one exactly when beta != 0.
    from trl.trainer import utils

    split = inspect.getsource(utils.split_tensor_dict)
    assert "chunk_size = first_tensor.shape[0] // num_chunks" in split, f"split_tensor_dict slices differently. {HINT}"
    assert "split_tensor_dict(generation_batch, self.args.steps_per_generation)" in _source("_prepare_inputs"), (
        f"_prepare_inputs no longer splits the generation batch into steps_per_generation slices. {HINT}"
    )
    init = inspect.getsource(GRPOTrainer.__init__)
    assert "if self.beta == 0.0:" in init and "self.ref_model = None" in init, (
        f"GRPOTrainer.__init__ no longer builds the reference exactly when beta != 0 (RCC's reference). {HINT}"
    )
