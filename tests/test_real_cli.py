"""The real-model tier, from the command line: every recipe, the main job and a named trainer alone train
SmolLM2-135M-Instruct one step (a file of its own, so that pytest-xdist's `--dist loadfile` runs it beside
tests/test_real_model.py, not after it)."""

from pathlib import Path

import pytest

from trl_grpo_ext.data.trees import SAMPLE_TREES
from trl_grpo_ext.tasks import addition_dataset

pytestmark = pytest.mark.real


RECIPES = sorted(
    p for p in (Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml") if ".sft." not in p.name
)
SMALL = {
    "pta_grpo": ["--num_plans", "2", "--continuations_per_plan", "2"],
    "segment_arpo": ["--arpo_initial_rollouts", "2"],
    # the addition rows are scored by their sum (the recipe's `accuracy` reads a `solution` column)
    "hima": ["--hima_accuracy_reward", "last_integer", "--hima_alternatives", "2"],
    "hima_adapters": ["--hima_accuracy_reward", "last_integer", "--hima_alternatives", "2", "--lora_r", "4"],
    # the driving task's held-out score on 4 scenes, not 48 (two evaluations of 48 long prompts: 80 s of the 105)
    "nord": ["--heldout_size", "4"],
}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.stem)
def test_every_recipe_runs_on_the_real_model(recipe, real_path, tmp_path, capsys):
    from trl_grpo_ext.cli import main

    rows = tmp_path / "addition.jsonl"
    addition_dataset().to_json(str(rows))
    # Tree-OPO's rows are its trees' questions: the shipped trees of the addition task, with no dataset named.
    # NoRD's recipe names the built-in driving task (its rows carry `future` and `scene`, which the reward reads).
    data = (["--prefix_trees", SAMPLE_TREES] if recipe.stem == "tree_opo" else [] if recipe.stem == "nord"
            else ["--dataset_name", "json", "--data_files", str(rows)])  # fmt: skip
    out = tmp_path / "run"
    argv = ["train", "--config", str(recipe), "--model_name_or_path", real_path, *data, "--max_steps", "1", "--max_completion_length", "16", "--num_generations", "4",
            "--per_device_train_batch_size", "4", "--report_to", "none", "--save_strategy", "no",
            "--output_dir", str(out), *SMALL.get(recipe.stem, [])]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Trained 1 steps" in printed
    if recipe.stem == "nord":
        assert "held-out driving score (greedy, 4 scenes)" in printed
    assert (out / "trl_grpo_ext_run.json").exists()
    assert (out / "model.safetensors").exists() or (out / "adapter_model.safetensors").exists()


def test_the_main_job_reports_held_out_accuracy(real_path, tmp_path, capsys):
    import json

    from trl_grpo_ext.cli import main
    from trl_grpo_ext.testing import SMOLLM2

    out = tmp_path / "run"
    # the main job, cut to one step and 8 held-out problems (tests/test_cli.py checks the 60 of the default on the tiny
    # model; CI's first command runs the whole job)
    assert main(["train", "--max_steps", "1", "--heldout_size", "8", "--output_dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "held-out accuracy (greedy, 8 problems)" in printed and "Trained 1 steps" in printed
    record = json.loads((out / "trl_grpo_ext_run.json").read_text())
    assert record["model"] == SMOLLM2 and record["dataset"] == "addition"
    assert 0 <= record["heldout_accuracy_before"] <= 1 and 0 <= record["heldout_accuracy_after"] <= 1
    assert record["reward_funcs"] == ["last_integer_reward", "brevity"]
    assert "Held-out accuracy" in (out / "README.md").read_text()


def test_a_named_trainer_alone_is_a_working_run(real_path, tmp_path, capsys):
    from trl_grpo_ext.cli import main

    # `--trainer curriculum` alone (the example: its budget schedule fitted to the run), on the built-in task
    # (its held-out evaluation cut to 8 problems)
    argv = ["train", "--trainer", "curriculum", "--max_steps", "1", "--heldout_size", "8"]
    assert main([*argv, "--output_dir", str(tmp_path / "run")]) == 0
    printed = capsys.readouterr().out
    assert "Trained 1 steps" in printed and "held-out accuracy (greedy, 8 problems)" in printed
