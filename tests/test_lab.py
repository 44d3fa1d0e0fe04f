"""`benchmarks/lab.py`: the paired bootstrap and its verdicts on hand-made runs, every experiment's arms parse as
`trl-grpo-ext train` flags, and `--smoke` end to end (then again: the finished runs are skipped)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import lab  # noqa: E402


def _run(arm, seed, correct, tokens=None, task="rg:chain_sum"):
    """A run's JSON as the lab writes it: `correct[k]` the per-problem correctness of evaluation k (steps 0, 10, ...)."""
    tokens = tokens or [100.0 * k for k in range(len(correct))]
    heldout = [{"step": 10 * k, "generated_tokens": t, "accuracy": float(np.mean(c)), "correct": list(map(float, c))}
               for k, (c, t) in enumerate(zip(correct, tokens, strict=True))]  # fmt: skip
    return {"arm": arm, "seed": seed, "task": task, "task_args": {}, "settings": {}, "heldout": heldout, "train": []}


def _write(folder: Path, runs):
    folder.mkdir(parents=True, exist_ok=True)
    for run in runs:
        (folder / f"{run['arm']}-seed{run['seed']}.json").write_text(json.dumps(run))
    return lab.load_runs(folder)


def test_verdict():
    assert lab.verdict(0.01, 0.2) == "shown"
    assert lab.verdict(-0.2, -0.01) == "worse"
    assert lab.verdict(-0.1, 0.1) == "not shown" and lab.verdict(0.0, 0.1) == "not shown"


def test_identical_arms_interval_contains_zero(tmp_path):
    rng = np.random.default_rng(1)
    runs = []
    for seed in range(5):
        start, end = rng.random(200) < 0.3, rng.random(200) < 0.5
        runs += [_run("grpo", seed, [start, end]), _run("same", seed, [start, end])]
    (row,) = lab.compare(_write(tmp_path, runs))
    for axis in ("steps", "tokens"):
        assert row[axis]["low"] <= 0 <= row[axis]["high"] and row[axis]["verdict"] == "not shown"
    assert row["arm"] == "same" and row["seeds"] == [0, 1, 2, 3, 4] and row["problems"] == 200


def test_constant_gain_per_problem_is_shown_and_a_loss_worse(tmp_path):
    rng = np.random.default_rng(2)
    runs = []
    for seed in range(3):
        base = rng.random(200) * 0.8
        runs += [_run("grpo", seed, [base * 0, base]), _run("better", seed, [base * 0, base + 0.1]),
                 _run("worse", seed, [base * 0, base - 0.1])]  # fmt: skip
    rows = {r["arm"]: r for r in lab.compare(_write(tmp_path, runs))}
    assert rows["better"]["steps"]["diff"] == pytest.approx(0.1)
    assert rows["better"]["steps"]["low"] == pytest.approx(0.1) and rows["better"]["steps"]["verdict"] == "shown"
    assert rows["worse"]["steps"]["verdict"] == "worse" and rows["worse"]["tokens"]["verdict"] == "worse"


def test_learned_pairs_each_run_with_its_own_start(tmp_path):
    start = np.array([1, 0, 0, 1] * 50, dtype=float)
    runs = [_run("grpo", seed, [start, np.maximum(start, np.arange(200) % 4 == 1)]) for seed in range(3)]  # +1/4
    runs += [_run("flat", seed, [start, start]) for seed in range(3)]
    runs += [_run("forgets", seed, [start, start * (np.arange(200) % 2)]) for seed in range(3)]  # loses 1/4
    rows = {r["arm"]: r for r in lab.learned(_write(tmp_path, runs), n=2000)}
    assert (rows["grpo"]["start"], rows["grpo"]["final"], rows["grpo"]["step"]) == (0.5, 0.75, 10)
    assert rows["grpo"]["diff"] == pytest.approx(0.25) and rows["grpo"]["verdict"] == "shown"
    assert (rows["flat"]["low"], rows["flat"]["high"], rows["flat"]["verdict"]) == (0.0, 0.0, "not shown")
    assert rows["forgets"]["diff"] == pytest.approx(-0.25) and rows["forgets"]["verdict"] == "worse"
    assert "| grpo | 3 | 0.500 | 0.750 (10) | +0.250 [" in lab.learned_markdown(list(rows.values()))


def test_noisy_gain_and_noise_alone(tmp_path):
    """0/1 correctness: a method that also gets a fifth of GRPO's misses right is shown over 5 seeds x 200 problems;
    a method that is GRPO with other noise is not."""
    rng = np.random.default_rng(3)
    runs = []
    for seed in range(5):
        start, base = rng.random(200) < 0.3, rng.random(200) < 0.4
        runs += [_run("grpo", seed, [start, base]), _run("gain", seed, [start, base | (rng.random(200) < 0.2)]),
                 _run("noise", seed, [start, rng.random(200) < 0.4])]  # fmt: skip
    rows = {r["arm"]: r for r in lab.compare(_write(tmp_path, runs))}
    assert rows["gain"]["steps"]["verdict"] == "shown" and 0.05 < rows["gain"]["steps"]["diff"] < 0.2
    assert rows["noise"]["steps"]["verdict"] == "not shown"
    # the interval widens with fewer problems
    narrow = rows["noise"]["steps"]["high"] - rows["noise"]["steps"]["low"]
    few = lab.bootstrap(np.stack([rng.random(20) < 0.4 for _ in range(5)]).astype(float) - 0.4)
    assert few[2] - few[1] > narrow


def test_equal_tokens_interpolates(tmp_path):
    """The method spends half GRPO's tokens a step: at equal tokens (its total, 200) GRPO is read at its step 10."""
    zeros, ones = np.zeros(10), np.ones(10)
    grpo = _run("grpo", 0, [zeros, ones, zeros], tokens=[0.0, 200.0, 400.0])
    cheap = _run("cheap", 0, [zeros, zeros, ones], tokens=[0.0, 100.0, 200.0])
    assert lab.correct_at_tokens(grpo, 100.0) == pytest.approx(np.full(10, 0.5))
    assert lab.correct_at_tokens(grpo, 1e9) == pytest.approx(zeros)
    (row,) = lab.compare(_write(tmp_path, [grpo, cheap]))
    assert row["tokens"]["budget"] == 200.0 and row["tokens"]["diff"] == pytest.approx(0.0)
    assert row["steps"]["diff"] == pytest.approx(1.0) and row["steps"]["verdict"] == "shown"


def test_runs_of_different_tasks_are_refused(tmp_path):
    runs = [_run("grpo", 0, [np.zeros(4)]), _run("x", 0, [np.zeros(4)], task="rg:gcd")]
    with pytest.raises(SystemExit, match="different tasks"):
        _write(tmp_path, runs)


def test_every_experiment_arm_parses(tmp_path):
    from trl_grpo_ext.cli import parse_train

    for name in lab.EXPERIMENTS:
        experiment = lab.experiment_for(name)
        assert experiment["heldout_size"] >= 200
        for arm in experiment["arms"]:
            for device in ("cpu", "cuda"):
                argv = lab.train_argv(experiment, arm, 0, "tiny", device, tmp_path / f"{name}-{arm}", None)
                run = parse_train(argv[1:])
                assert run.args.max_steps == experiment["steps"] and run.script_args.heldout_every > 0


@pytest.mark.slow
def test_smoke_end_to_end_then_skips(tmp_path, tiny_cache_dir):
    out = tmp_path / "lab"
    command = [sys.executable, str(REPO / "benchmarks" / "lab.py"), "chain_sum", "--smoke", "--jobs", "2", "--out",
               str(out), "--cache_dir", str(tiny_cache_dir)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[grpo seed 0] step 2/2: held-out accuracy" in done.stdout
    run = json.loads((out / "grpo-seed0.json").read_text())
    assert {"arm", "seed", "task", "task_args", "settings", "heldout", "train"} <= set(run)
    assert run["arm"] == "grpo" and run["seed"] == 0 and run["task"] == "rg:chain_sum"
    assert run["settings"]["steps"] == 2 and run["settings"]["model"] == "tiny"
    assert [p["step"] for p in run["heldout"]] == [0, 1, 2] and all(len(p["correct"]) == 8 for p in run["heldout"])
    assert [s["step"] for s in run["train"]] == [1, 2]
    tokens = [p["generated_tokens"] for p in run["heldout"]]
    assert tokens[0] == 0 and tokens[0] < tokens[1] < tokens[2] == run["train"][-1]["generated_tokens"]
    assert all({"reward", "completion_length"} <= set(s) for s in run["train"])
    assert not list((out / "runs" / "grpo-seed0").glob("*.safetensors"))  # the weights are not kept
    assert (out / "report.md").exists() and (out / "report.png").exists() and "| dynamic_sampling |" in done.stdout
    written = {p.name: p.stat().st_mtime_ns for p in out.glob("*-seed*.json")}
    assert len(written) == 2

    again = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[grpo seed 0] done before: skipped" in again.stdout and "started" not in again.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*-seed*.json")} == written


def test_a_tier_keeps_only_its_problems_and_compares_on_them(tmp_path):
    # The arm is better on the first 100 problems only: shown on that tier, nothing on the other.
    rng = np.random.default_rng(3)
    runs, keep = [], np.arange(200) < 100
    for seed in range(4):
        base = (rng.random(200) < 0.4).astype(float)
        better = np.where(keep, 1.0, base)
        runs += [_run("grpo", seed, [base * 0, base]), _run("arm", seed, [base * 0, better])]
    runs = _write(tmp_path, runs)
    first, rest = lab.restrict(runs, keep), lab.restrict(runs, ~keep)
    assert len(first["arm"][0]["heldout"][-1]["correct"]) == 100 and first["arm"][0]["heldout"][-1]["accuracy"] == 1.0
    assert lab.compare(first)[0]["steps"]["verdict"] == "shown"
    assert lab.compare(rest)[0]["steps"]["diff"] == 0.0


def test_chain_sum_tiers_split_by_the_terms_digits():
    tiers = lab.chain_sum_tiers(lab.CHAIN_SUM, 20)
    hardest, easier = tiers.values()
    assert len(hardest) == 20 and (hardest ^ easier).all()
    from trl_grpo_ext.tasks import RGTask

    rows = RGTask("chain_sum", dict(lab.CHAIN_SUM), heldout_size=20).dataset("heldout")
    for prompt, hard in zip(rows["prompt"], hardest, strict=True):
        question = prompt[-1]["content"].split("problem:")[1].split("=")[0]  # "84 - 12 "
        terms = question.replace("+", " ").replace("-", " ").split()
        assert hard == all(len(t) == 2 for t in terms), question
