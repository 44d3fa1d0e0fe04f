from transformers import AutoModelForCausalLM

from trl_grpo_ext.cli import main


def test_quickstart_trains_offline_and_says_where(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--tiny", "--max_steps", "2", "--output_dir", str(out), "--cache_dir", str(tmp_path / "cache")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Trained 2 steps;" in printed and str(out.resolve()) in printed
    AutoModelForCausalLM.from_pretrained(out)  # the saved result loads back
    assert (out / "tokenizer.json").exists()


def test_yaml_config(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"tiny: true\noutput_dir: {tmp_path / 'yaml-run'}\nmax_steps: 1\nreward_funcs: [contains_solution, tag_format]\n"
        f"cache_dir: {tmp_path / 'cache'}\n"
    )
    assert main(["train", "--config", str(recipe), "--max_steps", "1"]) == 0  # --tiny's sizes beat the file's
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


def test_reward_spec_parameters_are_typed():
    from trl_grpo_ext.rewards import parse_reward_spec

    assert parse_reward_spec("accuracy") == ("accuracy", {})
    assert parse_reward_spec("tag_format:tags=plan,think,answer,partial=true") == (
        "tag_format",
        {"tags": ["plan", "think", "answer"], "partial": True},
    )
    assert parse_reward_spec("budget_length:shape=band,width=0.3") == (
        "budget_length",
        {"shape": "band", "width": 0.3},
    )
    assert parse_reward_spec("soft_overlong:max_completion_len=512,soft_punish_cache=64") == (
        "soft_overlong",
        {"max_completion_len": 512, "soft_punish_cache": 64},
    )
    assert parse_reward_spec("my.mod.factory:x=none,y=False,z= 2") == (
        "my.mod.factory",
        {"x": None, "y": False, "z": 2},
    )


def test_yaml_recipe_with_trainer_reward_parameters_and_lora(tmp_path, tiny_cache_dir, capsys):
    import json

    import yaml

    out = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "trainer": "curriculum",
                "tiny": True,
                "reward_funcs": [
                    "tag_format:tags=think,answer,partial=true",
                    "budget_length:shape=band,width=0.3",
                    "tests.conftest.varied_reward",
                ],
                "reward_weights": [0.2, 0.3, 0.5],
                "budget_start": 24,
                "budget_end": 6,
                "budget_total_steps": 8,
                "use_peft": True,
                "lora_r": 4,
                "lora_target_modules": ["q_proj", "v_proj"],
                "max_steps": 5,
                "logging_steps": 1,
                "output_dir": str(out),
                "cache_dir": str(tiny_cache_dir),
            }
        )
    )
    assert main(["train", "--config", str(recipe), "--max_steps", "2"]) == 0  # the flag beats the file
    assert "Trained 2 steps" in capsys.readouterr().out
    record = json.loads((out / "trl_grpo_ext_run.json").read_text())
    assert record["trainer_class"] == "CurriculumGRPOTrainer"
    assert record["methods"] == ["grpo", "curriculum"]
    assert record["reward_funcs"] == ["tag_format_think_answer", "budget_length_band", "varied_reward"]
    assert record["adapter"] and (out / "adapter_config.json").exists() and not (out / "model.safetensors").exists()
    assert record["config"]["lora_r"] == 4 and record["config"]["max_steps"] == 2
    assert record["metrics"]["curriculum/budget"] == 24  # our metric, logged with TRL's under its method's prefix
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]


def test_dataset_mixture_from_yaml_and_4bit_lora(tmp_path, tiny_cache_dir, capsys):
    import json

    from trl_grpo_ext.testing import tiny_dataset

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in tiny_dataset(8, seed=3)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"datasets:\n  - path: json\n    data_files: {data}\nreward_funcs: [contains_solution]\n")
    out = tmp_path / "run"
    argv = ["train", "--config", str(recipe), "--model_name_or_path", "tiny", "--use_peft", "--load_in_4bit", "--max_steps", "1",
            "--output_dir", str(out), "--cache_dir", str(tiny_cache_dir)]  # fmt: skip
    assert main(argv) == 0
    assert "Trained 1 steps" in capsys.readouterr().out
    record = json.loads((out / "trl_grpo_ext_run.json").read_text())
    assert record["dataset"] == "mixture" and record["adapter"]
    assert record["config"]["load_in_4bit"] is True
    assert record["config"]["datasets"] == [
        {"path": "json", "name": None, "data_dir": None, "data_files": str(data), "split": "train", "columns": None,
         "fraction": None}
    ]  # fmt: skip


def test_reward_parameters_as_a_yaml_mapping(tmp_path, tiny_cache_dir, capsys):
    import json

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"tiny: true\noutput_dir: {tmp_path / 'run'}\nmax_steps: 1\ncache_dir: {tiny_cache_dir}\n"
        "reward_funcs:\n  - tag_format: {tags: [think, answer], partial: true}\n  - contains_solution\n"
    )
    assert main(["train", "--config", str(recipe), "--max_steps", "1"]) == 0
    record = json.loads((tmp_path / "run" / "trl_grpo_ext_run.json").read_text())
    assert record["reward_funcs"] == ["tag_format_think_answer", "contains_solution_reward"]


def test_named_trainer_alone_is_a_working_run(tmp_path, tiny_cache_dir, capsys):
    # `--trainer segment` needs nothing more: segments by tool calls, with the built-in calculator tool.
    argv = ["train", "--tiny", "--trainer", "segment", "--max_steps", "1", "--max_completion_length", "16",
            "--output_dir", str(tmp_path / "run"), "--cache_dir", str(tiny_cache_dir)]  # fmt: skip
    assert main(argv) == 0
    assert "Trained 1 steps" in capsys.readouterr().out


def test_trl_names_trls_own_trainer_the_baseline(tmp_path, tiny_cache_dir, capsys, monkeypatch):
    from trl import GRPOTrainer

    from trl_grpo_ext import GRPOExtTrainer

    built, train = [], GRPOTrainer.train
    monkeypatch.setattr(GRPOTrainer, "train", lambda self, **kwargs: built.append(type(self)) or train(self, **kwargs))
    # the built-in task on the tiny model: its held-out evaluation runs on TRL's trainer too
    argv = ["train", "--model_name_or_path", "tiny", "--trainer", "trl", "--max_steps", "1", "--output_dir",
            str(tmp_path / "run"), "--cache_dir", str(tiny_cache_dir)]  # fmt: skip
    assert main(argv) == 0
    assert built == [GRPOTrainer] and not issubclass(built[0], GRPOExtTrainer)
    assert "held-out accuracy (greedy, 60 problems)" in capsys.readouterr().out
    assert main([*argv, "--dynamic_sampling", "true"]) == 2  # our fields are not TRL's
    assert "--dynamic_sampling" in capsys.readouterr().err


def test_nord_defaults_to_the_driving_task():
    from trl_grpo_ext.cli import parse_train

    run = parse_train(["--trainer", "nord", "--output_dir", "/tmp/nord-parse"])
    assert run.task == "driving" and [r.__name__ for r in run.rewards] == ["trajectory"]
    assert (run.args.loss_type, run.args.scale_rewards, run.args.max_completion_length) == ("dr_grpo", "none", 48)
    assert parse_train(["--trainer", "grpo_ext", "--output_dir", "/tmp/x"]).task == "addition"


def test_nord_tiny_drives_from_images(tmp_path, capsys):
    import json

    out = tmp_path / "run"
    argv = ["train", "--tiny", "--trainer", "nord", "--max_steps", "2", "--per_device_train_batch_size", "4",
            "--num_generations", "2", "--output_dir", str(out), "--cache_dir", str(tmp_path / "cache")]  # fmt: skip
    assert main(argv) == 0
    assert "Trained 2 steps" in capsys.readouterr().out
    assert json.loads((out / "processor_config.json").read_text())["processor_class"] == "TinyQwen2_5_VLProcessor"
    assert (out / "difficulty_bias.png").exists()
    assert json.loads((out / "trl_grpo_ext_run.json").read_text())["methods"] == ["grpo", "difficulty"]


def test_driving_cold_start(tmp_path, capsys):
    out = tmp_path / "sft"
    argv = ["sft", "--task", "driving", "--tiny", "--max_steps", "2", "--output_dir", str(out), "--report_to", "none",
            "--cache_dir", str(tmp_path / "cache")]  # fmt: skip
    assert main(argv) == 0
    assert f"Next: trl-grpo-ext train --trainer nord --model_name_or_path {out.resolve()}" in capsys.readouterr().out
    assert (out / "processor_config.json").exists()  # the images went through the VLM's processor


def test_driving_sft_rows_are_the_ground_truth():
    from trl_grpo_ext.data.driving import driving_sft_dataset, format_waypoints

    rows = driving_sft_dataset(3, seed=7)
    assert rows.column_names == ["prompt", "completion"]
    from trl_grpo_ext.data.driving import driving_dataset

    truth = driving_dataset(3, images=False, seed=7)
    assert [c[0]["content"] for c in rows["completion"]] == [format_waypoints(f) for f in truth["future"]]
