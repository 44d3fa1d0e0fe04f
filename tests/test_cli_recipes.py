"""Every recipe in recipes/ names a real Hub model and runs offline with `--tiny --max_steps 1`.

`*.sft.yaml` recipes are for `trl-grpo-ext sft` (a cold start), the others for `trl-grpo-ext train`."""

import json
from pathlib import Path

import pytest
import yaml

from trl_grpo_ext.cli import main, trainers

TRAINERS = trainers()

FOLDER = Path(__file__).resolve().parent.parent / "recipes"
SFT_RECIPES = sorted(FOLDER.glob("*.sft.yaml"))
RECIPES = sorted(set(FOLDER.glob("*.yaml")) - set(SFT_RECIPES))


def test_every_named_trainer_has_a_recipe():
    # `trl` is TRL's own GRPOTrainer, the baseline: no method, no recipe of ours
    assert {yaml.safe_load(r.read_text()).get("trainer", "grpo_ext") for r in RECIPES} == set(TRAINERS) - {"trl"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.stem)
def test_recipe_runs_tiny(recipe, tmp_path, tiny_cache_dir, capsys):
    settings = yaml.safe_load(recipe.read_text())
    model = settings["model_name_or_path"]
    assert model.count("/") == 1 and not Path(model).exists(), f"{recipe.name}: use a Hub model id, not {model!r}"
    out = tmp_path / "run"
    argv = ["train", "--config", str(recipe), "--tiny", "--max_steps", "1", "--output_dir", str(out),
            "--cache_dir", str(tiny_cache_dir)]  # fmt: skip
    assert main(argv) == 0
    assert "Trained 1 steps" in capsys.readouterr().out
    record = json.loads((out / "trl_grpo_ext_run.json").read_text())
    trainer = settings.get("trainer", "grpo_ext")
    assert record["trainer"] == trainer and record["trainer_class"] == TRAINERS[trainer][0].__name__
    assert record["model"] == "tiny" and record["config"]["model_name_or_path"] == model


@pytest.mark.parametrize("recipe", SFT_RECIPES, ids=lambda path: path.stem)
def test_sft_recipe_runs_tiny_and_feeds_the_pta_trainer(recipe, tmp_path, tiny_cache_dir, capsys):
    from trl_grpo_ext.cli import main as cli

    model = yaml.safe_load(recipe.read_text())["model_name_or_path"]
    assert model.count("/") == 1 and not Path(model).exists(), f"{recipe.name}: use a Hub model id, not {model!r}"
    out = tmp_path / "cold-start"
    argv = ["sft", "--config", str(recipe), "--tiny", "--max_steps", "2", "--output_dir", str(out),
            "--cache_dir", str(tiny_cache_dir)]  # fmt: skip
    assert cli(argv) == 0
    assert "Cold start done (2 steps)" in capsys.readouterr().out
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)


def test_sft_reports_missing_columns(tmp_path, capsys):
    data = tmp_path / "rows.json"
    data.write_text('{"q": "1+1?", "plan": "Add.", "reasoning": "2", "answer": "2"}\n')
    argv = ["sft", "--dataset_name", "json", "--data_files", str(data), "--output_dir", str(tmp_path / "out")]
    assert main(argv) == 2
    assert "columns ['question'] not in the dataset" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
