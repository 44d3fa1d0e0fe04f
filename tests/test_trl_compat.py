"""Fails loudly, naming the seam, when TRL renames or reshapes a method or attribute that trainer.py relies on.

CI runs this file on the newest and on the oldest TRL release of the supported range (`.ci/run`).
"""

import inspect
from importlib.metadata import requires, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from trl import GRPOTrainer

from trl_grpo_ext.trainer import TRL_ATTRIBUTES, TRL_SEAMS

INSTALLED = Version(version("trl"))
HINT = (
    f"trl_grpo_ext/trainer.py (and its shims, trl_grpo_ext/_trl_compat.py) must be updated for trl {INSTALLED} (see "
    "docs/trl-seams.md, 'Supported TRL releases')."
)


def _trl_requirements() -> list[Requirement]:
    """The `trl` requirements pyproject.toml declares: the dependency, then the optional ones (the vllm extra)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the same requirements, from the installed package's metadata
        return [r for r in map(Requirement, requires("trl-grpo-ext")) if r.name == "trl"]
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + [r for reqs in project["optional-dependencies"].values() for r in reqs]
    return [r for r in map(Requirement, declared) if r.name == "trl"]


SUPPORTED = next(r.specifier for r in _trl_requirements() if r.marker is None)


def test_trl_version_is_in_the_supported_range():
    assert INSTALLED in SUPPORTED, f"trl {INSTALLED} is outside the supported range {SUPPORTED} (pyproject.toml)"
    declared = [str(r) for r in _trl_requirements()]
    assert all(r.specifier == SUPPORTED for r in _trl_requirements()), (
        f"pyproject.toml declares different trl ranges: {declared}; keep them equal."
    )


def _expected(name: str) -> tuple[list[str], str]:
    """The leading parameters `TRL_SEAMS` declares for seam `name` in the installed release, and their release range."""
    entry = TRL_SEAMS[name]
    if isinstance(entry, list):
        return entry, str(SUPPORTED)
    ranges = [spec for spec in entry if INSTALLED in SpecifierSet(spec)]
    assert len(ranges) == 1, (
        f"TRL_SEAMS[{name!r}] needs exactly one release range holding trl {INSTALLED}: {list(entry)}"
    )
    return entry[ranges[0]], ranges[0]


def _parameters(function) -> list[str]:
    kinds = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [kinds.get(p.kind, "") + p.name for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("name", sorted(TRL_SEAMS))
def test_seam_signature(name):
    expected, releases = _expected(name)
    method = getattr(GRPOTrainer, name, None)
    assert method is not None, f"TRL seam GRPOTrainer.{name} (expected in trl {releases}) no longer exists. {HINT}"
    params = _parameters(method)
    # The leading parameters we pass; TRL may add optional ones after them.
    assert params[: len(expected)] == expected, (
        f"TRL seam GRPOTrainer.{name}{params} does not start with {expected}, its parameters in trl {releases}. {HINT}"
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


def test_the_block_size_reaches_trl_in_the_form_each_release_takes():
    # `_trl_compat.generate_single_turn`: trl >= 1.14.1 takes `num_generations`; trl 1.11.0 to 1.14.0 read the trainer's
    # `num_generations` (training) or `num_generations_eval` (evaluation), which hold the block size for the one call.
    from types import SimpleNamespace

    from trl_grpo_ext._trl_compat import generate_single_turn

    trainer = SimpleNamespace(model=SimpleNamespace(training=True), num_generations=8, num_generations_eval=2)
    seen = []

    def old(prompt_ids, images, multimodal_fields, has_tool_images=False):  # trl 1.11.0 to 1.14.0
        seen.append((trainer.num_generations, trainer.num_generations_eval, has_tool_images))
        if prompt_ids == "fail":
            raise RuntimeError("backend failed")
        return prompt_ids, None

    def new(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):  # trl >= 1.14.1
        seen.append((num_generations, has_tool_images))
        return prompt_ids, None

    assert generate_single_turn(trainer, old, [[5]], None, {}, 4, False) == ([[5]], None)
    generate_single_turn(trainer, old, [[5]], None, {}, None, True)  # TRL's own `_generate` before 1.14.1: no block
    trainer.model.training = False
    generate_single_turn(trainer, old, [[5]], None, {}, 1, False)
    with pytest.raises(RuntimeError, match="backend failed"):
        generate_single_turn(trainer, old, "fail", None, {}, 4, False)
    generate_single_turn(trainer, new, [[5]], None, {}, None, False)  # the group size, as trl 1.14.1 passes it
    generate_single_turn(trainer, new, [[5]], None, {}, 3, True)
    assert seen == [(4, 2, False), (8, 2, True), (8, 1, False), (8, 4, False), (2, False), (3, True)]
    assert (trainer.num_generations, trainer.num_generations_eval) == (8, 2)  # set back after every call


def test_shared_prefix_forward_is_refused_before_trl_1_15(monkeypatch, tmp_path):
    from trl_grpo_ext import GRPOExtConfig, GRPOExtTrainer, _trl_compat

    from .conftest import varied_reward

    monkeypatch.setattr(_trl_compat, "TRL_VERSION", Version("1.14.2"))
    args = GRPOExtConfig(output_dir=str(tmp_path), shared_prefix_forward=True, bf16=False)
    with pytest.raises(ValueError, match=r"shared_prefix_forward=True needs trl>=1.15 .* trl 1.14.2 is installed"):
        GRPOExtTrainer(str(tmp_path / "no-model"), reward_funcs=varied_reward, args=args)
