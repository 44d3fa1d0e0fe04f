"""Every recipe in recipes/ names a real Hub model and runs offline with `--tiny --max_steps 1`."""

import json
from pathlib import Path

import pytest
import yaml

from trl_grpo_ext.cli import TRAINERS, main

RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))


def test_one_recipe_per_named_trainer():
    assert sorted(yaml.safe_load(r.read_text()).get("trainer", "grpo_ext") for r in RECIPES) == sorted(TRAINERS)


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
