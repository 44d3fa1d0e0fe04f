from transformers import AutoModelForCausalLM

from trl_grpo_ext.cli import main


def test_quickstart_trains_offline_and_says_where(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--max_steps", "2", "--output_dir", str(out), "--cache_dir", str(tmp_path / "cache")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"Trained 2 steps;" in printed and str(out.resolve()) in printed
    AutoModelForCausalLM.from_pretrained(out)  # the saved result loads back
    assert (out / "tokenizer.json").exists()


def test_yaml_config(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"output_dir: {tmp_path / 'yaml-run'}\nmax_steps: 1\nreward_funcs: [contains_solution, tag_format]\n"
        f"cache_dir: {tmp_path / 'cache'}\n"
    )
    assert main(["train", "--config", str(recipe)]) == 0
    assert "Trained 1 steps" in capsys.readouterr().out


def test_usage_and_unknown_command(capsys):
    assert main([]) == 2
    assert main(["--help"]) == 0
    assert main(["fly"]) == 2
    assert "unknown command 'fly'" in capsys.readouterr().err


def test_curriculum_recipe_runs_tiny(tmp_path, capsys):
    from pathlib import Path

    recipe = Path(__file__).resolve().parent.parent / "recipes" / "curriculum_grpo.yaml"
    argv = ["train", "--config", str(recipe), "--tiny", "--max_steps", "4", "--budget_start", "24",
            "--budget_end", "6", "--max_completion_length", "24", "--logging_steps", "1",
            "--output_dir", str(tmp_path / "run"), "--cache_dir", str(tmp_path / "cache")]  # fmt: skip
    assert main(argv) == 0
    assert "Trained 4 steps" in capsys.readouterr().out
