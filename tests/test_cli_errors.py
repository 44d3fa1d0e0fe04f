"""Bad input to `trl-grpo-ext train` ends it with one stderr line naming the problem and the fix, and writes nothing.

Every case fails before a model is built or loaded (the cache stays empty) and before `output_dir` exists.
"""

import json

import pytest

from trl_grpo_ext.cli import main


@pytest.fixture
def jsonl(tmp_path):
    def write(name, rows):
        path = tmp_path / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(path)

    return write


def _fails(argv, tmp_path, capsys) -> str:
    out, cache = tmp_path / "out", tmp_path / "cache"
    code = main(["train", "--output_dir", str(out), "--cache_dir", str(cache), *argv])
    err = capsys.readouterr().err
    assert code == 2
    # One line; only a dataset's loading progress bar may come before it.
    *before, line = err.strip().splitlines()
    assert all("Generating" in b for b in before), err
    assert line.startswith("trl-grpo-ext train: error: "), err
    assert not out.exists() and not cache.exists()  # nothing half-done: no output, no model built
    return line


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--trainer", "ppo"], ["--trainer 'ppo' is unknown", "grpo_ext, trl, curriculum"]),
        (["--reward_funcs", "acuracy"], ["unknown reward 'acuracy'", "Known rewards: accuracy", "dotted import path"]),
        (["--reward_funcs", "no_such_module.reward"], ["cannot import module 'no_such_module'"]),
        (
            ["--reward_funcs", "tag_format:colour=red"],
            ["unexpected keyword argument 'colour'", "parameters the reward takes"],
        ),
        (["--reward_funcs", "budget_length:shape=circle"], ["shape='circle' is not one of ('triangular', 'band')"]),
        (["--reward_funcs", "tag_format:plan,think"], ["'plan' is not key=value", "write 'name:key=value"]),
        (["--reward_funcs", "tag_format:tags=a,tags=b"], ["parameter 'tags' twice"]),
        (
            ["--reward_funcs", "tag_format", "--reward_weights", "1", "2"],
            ["2 values for 1 reward", "one weight per reward"],
        ),
        (
            ["--per_device_train_batch_size", "6"],
            ["generation_batch_size (6) must be divisible by num_generations (4)", "make per_device_train_batch_size"],
        ),
        (["--max_steps", "many"], ["--max_steps", "invalid int value: 'many'"]),
        (["--config", "/no/such/recipe.yaml"], ["--config /no/such/recipe.yaml: no such file or recipe", "pta_grpo"]),
        (["--config", "pta_grop"], ["did you mean 'pta_grpo'?", "a recipe name: bicc, curriculum_grpo"]),
        (["--trainer", "ptaa"], ["did you mean 'pta'?"]),
        (["--num_generation", "4"], ["unknown flag: --num_generation (did you mean --num_generations?)"]),
        (["--max_completion_length", "0"], ["max_completion_length=0 must be a whole number of tokens >= 1"]),
        (
            ["--trainer", "trl", "--max_completion_length", "0"],
            ["max_completion_length=0 must be a whole number of tokens >= 1"],
        ),
        (
            ["--tiny", "--dataset_name", "json", "--data_files", "/tmp/nope/rows.jsonl", "--max_steps", "1"],
            ["--dataset_name is not used with --tiny", "replace --tiny with --model_name_or_path tiny"],
        ),
        (["--tiny", "--model_name_or_path", "Qwen/Qwen2.5-0.5B"], ["--model_name_or_path is not used with --tiny"]),
        (["--tiny", "--task", "addition"], ["--task addition is not used with --tiny"]),
        (
            ["--task", "addition", "--dataset_name", "json"],
            ["brings its own data, so --dataset_name would not be used"],
        ),
        (["--data_files", "rows.jsonl"], ["--data_files needs --dataset_name"]),
        (
            ["--trainer", "curriculum", "--max_steps", "1", "--budget_decays", "2"],
            ["spans 1 step(s)", "too few for budget_decays=2"],
        ),
        (["--budget_start", "128", "--max_steps", "2"], ["spans 2 step(s)", "too few for budget_decays=3"]),
        (["--budget_schedule", "cosine"], ["invalid choice: 'cosine'"]),
        (["--load_in_4bit"], ["cannot be trained itself", "add --use_peft"]),
        (["--push_to_hub", "--hub_model_id", "me/bad name"], ["--hub_model_id", "set --hub_model_id to 'user/name'"]),
        (["--dataset_name", "/no/such/folder"], ["dataset '/no/such/folder' could not be loaded", "pass --tiny"]),
        (
            ["--dataset_test_split", "val", "--eval_strategy", "steps"],
            ["no split 'val' to eval on", "--dataset_test_split"],
        ),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) and value and value[0].startswith("--") else None,
)
def test_bad_input(argv, expected, tmp_path, capsys):
    err = _fails(argv, tmp_path, capsys)
    for text in expected:
        assert text in err, err


def test_reward_needs_a_column_the_dataset_lacks(jsonl, tmp_path, capsys):
    data = jsonl("no_solution.jsonl", [{"prompt": "What is 2 + 2?", "answer": "4"}] * 4)
    err = _fails(["--dataset_name", "json", "--data_files", data, "--reward_funcs", "think_format", "accuracy"],
                 tmp_path, capsys)  # fmt: skip
    assert "reward 'accuracy_reward' needs a 'solution' column" in err
    assert "['prompt', 'answer']" in err and "add or rename the column, or leave the reward out" in err


def test_dataset_without_prompt_column(jsonl, tmp_path, capsys):
    data = jsonl("question.jsonl", [{"question": "What is 2 + 2?", "solution": "4"}] * 4)
    err = _fails(["--dataset_name", "json", "--data_files", data], tmp_path, capsys)
    assert "has no 'prompt' column (columns: ['question', 'solution'])" in err and "rename" in err


def test_prefix_column_missing(tmp_path, capsys):
    err = _fails(["--context_prefix_column", "teacher"], tmp_path, capsys)
    assert "--context_prefix_column 'teacher'" in err and "has no such column" in err


def test_unknown_yaml_key(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("max_step: 3\nnum_generation: 4\n")
    err = _fails(["--config", str(recipe)], tmp_path, capsys)
    assert (
        "unknown YAML keys: max_step (did you mean max_steps?), num_generation (did you mean num_generations?)" in err
    )


def test_push_of_a_folder_without_a_run(tmp_path, capsys):
    assert main(["push", str(tmp_path), "me/model"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "has no trl_grpo_ext_run.json" in err
