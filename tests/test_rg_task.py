"""reasoning-gym datasets as tasks (`--task rg:NAME`): checked before anything loads, rows the verifier can score, a
held-out set disjoint from training, and a tiny-model run that records held-out accuracy before and after.

reasoning-gym is the `tasks` extra, which the `dev` extra installs."""

import json
import sys

import pytest

from trl_grpo_ext.cli import main, parse_train
from trl_grpo_ext.tasks import RGTask, final_answer, rg_score_reward

ARGS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def _fails(argv, tmp_path, capsys) -> str:
    out, cache = tmp_path / "out", tmp_path / "cache"
    code = main(["train", "--output_dir", str(out), "--cache_dir", str(cache), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not cache.exists()  # checked before a model is built or output written
    return err.strip()


def test_rg_task_is_parsed_with_its_args_and_rewards(tmp_path):
    run = parse_train(["--task", "rg:chain_sum", "--task_args", "{min_terms: 3, max_terms: 3}", "--output_dir",
                       str(tmp_path / "out")])  # fmt: skip
    assert run.task == "rg:chain_sum" and run.rg.name == "chain_sum"
    assert run.rg.args == {"min_terms": 3, "max_terms": 3} and run.rg.heldout_size == 200
    assert [r.__name__ for r in run.rewards] == ["rg_score_reward"] and run.args.reward_weights == [1.0]
    assert run.args.max_completion_length == 24 and run.args.max_steps == 30  # the built-in task's defaults
    # PTA reads its outcome from the task's verifier, not from the addition task's reward
    pta = parse_train(["--trainer", "pta", "--task", "rg:gcd", "--output_dir", str(tmp_path / "pta")])
    assert pta.args.pta_outcome_reward == "rg_score"


def test_rg_task_args_in_yaml(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"task: rg:chain_sum\ntask_args: {{min_terms: 3, max_terms: 3}}\nheldout_size: 50\n"
                      f"output_dir: {tmp_path / 'out'}\n")  # fmt: skip
    run = parse_train(["--config", str(recipe)])
    assert run.rg.args == {"min_terms": 3, "max_terms": 3} and run.rg.heldout_size == 50


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--task", "rg:chain_su"], ["rg:chain_su is not a reasoning-gym dataset", "close names: chain_sum"]),
        (["--task", "rg:chain_sum", "--task_args", "{min_terms: 3"], ["--task_args '{min_terms: 3' is not YAML"]),
        (["--task", "rg:chain_sum", "--task_args", "[3]"], ["is not a mapping"]),
        (["--task", "rg:chain_sum", "--task_args", "{min_term: 3}"], ["'min_term'", "its fields: min_terms"]),
        (["--task", "rg:chain_sum", "--task_args", "{min_terms: 0}"], ["min_terms must be positive"]),
        (["--task", "adition"], ["--task 'adition' is unknown; did you mean 'addition'?", "rg:NAME"]),
        (["--task", "addition", "--task_args", "{a: 1}"], ["--task_args is for a reasoning-gym task"]),
        (["--task", "addition", "--heldout_size", "61"], ["--heldout_size 61: choose 1 to 60"]),
        (["--task", "driving", "--heldout_size", "0"], ["--heldout_size 0: choose 1 or more"]),
        (["--dataset_name", "json", "--heldout_size", "5"], ["--heldout_size is for a task run (--task)"]),
    ],
)
def test_bad_rg_task_is_one_line(argv, expected, tmp_path, capsys):
    line = _fails(argv, tmp_path, capsys)
    for part in expected:
        assert part in line, line


def test_missing_extra_names_the_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ImportError
    line = _fails(["--task", "rg:chain_sum"], tmp_path, capsys)
    assert 'pip install "trl-grpo-ext[tasks]"' in line, line


def test_rows_have_a_prompt_and_what_the_verifier_needs_and_the_reward_scores_them():
    task = RGTask("chain_sum", ARGS, heldout_size=50)
    rows = task.dataset("train")
    assert {"prompt", "answer", "rg_task", "rg_index"} <= set(rows.column_names)
    first = rows[0]
    (message,) = first["prompt"]
    assert message["role"] == "user" and message["content"].endswith("Answer with just the final answer.")
    assert "State the final answer to the following arithmetic problem" in message["content"]
    right, wrong = first["answer"], str(int(first["answer"]) + 1)
    completions = [right, f"The answer is {right}.", wrong, f"<answer>{right}</answer>", "no idea",
                   [{"role": "assistant", "content": right}]]  # fmt: skip
    scores = rg_score_reward(completions, [first["rg_task"]] * 6, [first["rg_index"]] * 6)
    assert scores == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]


def test_final_answer_rule():
    assert final_answer("3 + 4 = 7", numeric=True) == "7"
    assert final_answer("-1,000.5 is it", numeric=True) == "-1,000.5"
    assert final_answer("<answer>12</answer> and then 13", numeric=True) == "12"
    assert final_answer("Thinking...\nThe final answer is: cat.") == "cat"
    assert final_answer("**Answer:** dog") == "dog"
    assert final_answer("   ") is None and final_answer("no number", numeric=True) is None


def test_heldout_is_disjoint_from_training_and_fixed():
    task = RGTask("chain_sum", ARGS, heldout_size=200)
    train, heldout = task.dataset("train"), task.dataset("heldout")
    questions = {p[0]["content"] for p in heldout["prompt"]}
    assert len(heldout) == 200 and len(questions) == 200  # distinct questions
    assert not questions & {p[0]["content"] for p in train["prompt"]}
    assert len(train) < 1000  # this small problem space overlaps: the held-out questions left training
    # another training seed: the same held-out problems
    other = RGTask("chain_sum", {**ARGS, "seed": 7}, heldout_size=200)
    assert other.dataset("heldout")["prompt"] == heldout["prompt"]
    assert other.dataset("train")["prompt"] != train["prompt"]
    # a problem space too small for a held-out set and training: one line that says what to change
    tiny_space = RGTask("chain_sum", {**ARGS, "max_digits": 1}, heldout_size=200)  # 200 questions in all
    with pytest.raises(ValueError, match="every training problem is a held-out one"):
        tiny_space.dataset("train")


@pytest.mark.slow
def test_tiny_model_trains_on_rg_task_and_records_heldout(tmp_path, tiny_cache_dir, capsys):
    out = tmp_path / "run"
    argv = ["train", "--model_name_or_path", "tiny", "--task", "rg:chain_sum", "--task_args", json.dumps(ARGS),
            "--max_steps", "2", "--heldout_size", "12", "--heldout_every", "1", "--output_dir", str(out),
            "--cache_dir", str(tiny_cache_dir)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Trained 2 steps;" in printed and "held-out accuracy (greedy, 12 rg:chain_sum problems)" in printed
    record = json.loads((out / "trl_grpo_ext_run.json").read_text())
    assert record["dataset"] == "rg:chain_sum" and record["reward_funcs"] == ["rg_score_reward"]
    assert 0 <= record["heldout_accuracy_before"] <= 1 and 0 <= record["heldout_accuracy_after"] <= 1
    assert [step for step, _ in record["heldout_accuracy_history"]] == [0, 1, 2]
    assert [len(c) for c in record["heldout_correct"]] == [12, 12, 12]
    assert record["heldout_accuracy_after"] == sum(record["heldout_correct"][-1]) / 12
    card = (out / "README.md").read_text()
    assert "the reasoning-gym task `rg:chain_sum`" in card and "the task's held-out set" in card


def test_heldout_size_cuts_the_built_in_tasks_held_out_sets():
    from trl_grpo_ext.tasks import HeldoutAccuracy, HeldoutDrivingScore, addition_problems

    probe = HeldoutAccuracy(size=8)
    assert probe.problems == addition_problems("heldout")[:8] and probe.label.endswith("(greedy, 8 problems)")
    assert len(HeldoutAccuracy().problems) == 60
    with pytest.raises(ValueError, match="heldout_size=61: the addition task has 60 held-out problems"):
        HeldoutAccuracy(size=61)
    scenes = HeldoutDrivingScore(size=4)
    assert len(scenes.rows) == 4 and scenes.label.endswith("(greedy, 4 scenes)")
    assert len(HeldoutDrivingScore().rows) == 48
