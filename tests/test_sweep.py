"""`trl-grpo-ext sweep`: a 2x2 grid on the tiny model, reruns that skip, a failing cell, and bad grids."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from trl_grpo_ext import sweep as sweep_module
from trl_grpo_ext.cli import main
from trl_grpo_ext.sweep import cell_name, parse_grid, smoothed
from trl_grpo_ext.testing import run_python

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def forked_cells(monkeypatch):
    """The sweep's own command for each cell, `python -m trl_grpo_ext.cli train ...`, run forked from a process that
    has imported the libraries already (`run_python`): about 10 s less a cell, with the same argv, environment and log."""

    def run(argv, stdout, stderr, check):
        assert argv[:4] == [sys.executable, "-m", "trl_grpo_ext.cli", "train"] and stderr == subprocess.STDOUT
        done = run_python("-m trl_grpo_ext.cli", argv[3:], timeout=300)
        stdout.write(done.stdout + done.stderr)
        return subprocess.CompletedProcess(argv, done.returncode)

    monkeypatch.setattr(sweep_module, "subprocess", SimpleNamespace(run=run, STDOUT=subprocess.STDOUT))


@pytest.fixture
def base(tmp_path, tiny_cache_dir, monkeypatch):
    """A recipe on the tiny model: 3 steps of 4 rows, a log every step; `tests.*` importable by the cells."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    recipe = tmp_path / "base.yaml"
    recipe.write_text(yaml.safe_dump({"tiny": True, "cache_dir": str(tiny_cache_dir), "per_device_train_batch_size": 4,
                                      "logging_steps": 1, "max_completion_length": 8}))  # fmt: skip
    return recipe


def test_a_2x2_sweep_writes_the_table_csv_and_plot_and_a_rerun_skips(base, tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", "--config", str(base), "--grid", "loss_type=grpo,dr_grpo", "num_generations=2,4",
            "--output_dir", str(out), "--max_steps", "2"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("training (log:") == 4
    with open(out / "sweep.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["loss_type"], r["num_generations"]) for r in rows] == [
        ("grpo", "2"), ("grpo", "4"), ("dr_grpo", "2"), ("dr_grpo", "4")]  # fmt: skip
    for row in rows:
        folder = out / cell_name({"loss_type": [row["loss_type"]], "num_generations": [row["num_generations"]]})
        logs = [
            log for log in json.loads((folder / "trainer_state.json").read_text())["log_history"] if "reward" in log
        ]
        assert row["status"] == "ok" and row["steps"] == "2" and len(logs) == 2
        assert float(row["final reward"]) == pytest.approx(smoothed([log["reward"] for log in logs])[-1], abs=1e-3)
        length = smoothed([log["completions/mean_length"] for log in logs])[-1]
        assert float(row["final length"]) == pytest.approx(length, abs=0.05)
        report = json.loads((folder / "reward_hacking.json").read_text())  # the monitor ran in the cell
        assert row["monitor warnings"].split(" ")[0] == str(report["warnings"])
        args = json.loads((folder / "trl_grpo_ext_run.json").read_text())["config"]
        assert args["loss_type"] == row["loss_type"] and args["num_generations"] == int(row["num_generations"])
    table = (out / "sweep.md").read_text()
    assert table.count("| ok |") == 4 and "final correctness" in table
    assert (out / "sweep.png").stat().st_size > 10_000
    records = {p: p.stat().st_mtime for p in out.glob("*/sweep_cell.json")}
    assert main(argv) == 0  # the rerun trains nothing
    assert capsys.readouterr().out.count("finished before, skipped") == 4
    assert {p: p.stat().st_mtime for p in out.glob("*/sweep_cell.json")} == records


def test_a_failing_cell_is_reported_and_the_others_go_on(base, tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", "--config", str(base), "--grid", "reward_funcs=tests.test_sweep.broken_reward,accuracy",
            "--output_dir", str(out), "--max_steps", "2", "--num_generations", "2", "--no_monitor"]  # fmt: skip
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "1 of 2 cell(s) failed" in captured.err and "done in" in captured.out
    with open(out / "sweep.csv") as handle:
        status = {r["reward_funcs"]: r["status"] for r in csv.DictReader(handle)}
    assert status == {"tests.test_sweep.broken_reward": "failed", "accuracy": "ok"}
    folder = out / cell_name({"reward_funcs": ["tests.test_sweep.broken_reward"]})
    assert "the reward server is down" in (folder / "train.log").read_text()
    assert main(argv) == 1  # the failed cell runs again; the finished one is skipped
    assert capsys.readouterr().out.count("finished before, skipped") == 1


def broken_reward(completions, **kwargs):
    raise RuntimeError("the reward server is down")


@pytest.mark.parametrize(
    "grid, message",
    [
        (
            ["loss_typ=grpo,dapo"],
            "--grid field 'loss_typ' is not a setting of trainer 'grpo_ext'; did you mean 'loss_type'",
        ),
        (
            ["num_generations=4,x"],
            "grid cell num_generations=x: argument --num_generations/--num-generations: invalid int value: 'x'",
        ),
        (["loss_type=grpo,"], "has an empty value"),
        (["loss_type"], "write an axis as field=value1,value2"),
        (["trainer=grpo_ext,nope"], "grid cell trainer=nope: --trainer 'nope' is unknown"),
        (["beta=0,0.01", "beta=0.1"], "names 'beta' twice"),
    ],
)
def test_a_bad_grid_fails_before_any_cell_runs(grid, message, base, tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", "--config", str(base), "--grid", *grid, "--output_dir", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_grid_values_with_spaces_are_list_items():
    assert parse_grid(["reward_weights=1.0 0.5,1.0 3.0"]) == [("reward_weights", [["1.0", "0.5"], ["1.0", "3.0"]])]
    assert cell_name({"reward_weights": ["1.0", "3.0"], "reward_funcs": ["a:b=1"]}) == (
        "reward_weights=1.0_3.0,reward_funcs=a_b=1"
    )
