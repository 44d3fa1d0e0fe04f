"""Every example runs offline with --tiny, as CI runs it."""

import os
import subprocess
import sys
from pathlib import Path

import json

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(
    "script, extra",
    [
        ("quickstart.py", []),
        ("quickstart.py", ["--lora", "--load-in-4bit", "--estimator", "centred_token_ramp"]),
    ],
)
def test_example_runs_tiny(script, extra, tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--tiny", "--output-dir", str(tmp_path / "out"), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"saved to {tmp_path / 'out'}" in result.stdout


def test_curriculum_example_length_follows_the_budget(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "curriculum_grpo.py"), "--tiny", "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((out / "budget_vs_length.json").read_text())
    assert [r["budget"] for r in rows] == [24] * 4 + [15] * 4 + [10] * 4 + [6] * 4
    assert all(r["mean_length"] <= r["budget"] for r in rows)  # the cap follows the budget
    assert (out / "budget_vs_length.png").stat().st_size > 10_000


@pytest.mark.parametrize("extra, expected", [([], "reset at step 3: reference=True optimizer=False (every 3 steps)"),
                                             (["--preset", "v1", "--lora"], "reference=True optimizer=True (eval_reward did not improve")])  # fmt: skip
def test_prorl_example_resets(tmp_path, extra, expected):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "prorl.py"), "--tiny", "--output-dir", str(tmp_path / "out"), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert expected in result.stdout


def test_pta_example_cold_start_then_rl(tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "pta_grpo.py"), "--tiny", "--output-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 4
    # After the cold start the tiny model closes some of its plans, and sharing plans saves tokens.
    closed = [float(line.split("plans closed ")[1].split(",")[0]) for line in steps]
    assert max(closed) > 0
    for line in steps:
        generated, independent = (float(x) for x in line.split("generated ")[1].split(" independently")[0].split(" tokens vs "))
        assert generated < independent


def test_segment_arpo_example_branches_on_the_tiny_model(tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "segment_arpo.py"), "--tiny", "--output-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 4
    # After the tool-format cold start the tiny model calls the calculator, and ARPO branches after tool results.
    branches = [float(line.split("branches ")[1].split(",")[0]) for line in steps]
    saved = [float(line.split("tokens not regenerated ")[1].split(",")[0]) for line in steps]
    assert sum(branches) > 0 and sum(saved) > 0
