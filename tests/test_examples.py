"""Every example runs offline with --tiny, as CI runs it."""

import json
import os
from pathlib import Path

import pytest

from trl_grpo_ext.testing import run_python

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(script: str, out: Path, *extra: str) -> str:
    """Run `examples/<script> --tiny --output-dir out ...` offline, as `python` runs it (in a process forked from one
    that has imported the libraries already: `run_python`); return its stdout (fail with its stderr)."""
    result = run_python(str(EXAMPLES / script), ["--tiny", "--output-dir", str(out), *extra], timeout=400,
                        env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize(
    "script, extra",
    [
        ("quickstart.py", ["--shared-prefix"]),
        ("quickstart.py", ["--lora", "--load-in-4bit", "--estimator", "centred_token_ramp"]),
    ],
)
def test_example_runs_tiny(script, extra, tmp_path):
    stdout = run_example(script, tmp_path / "out", *extra)
    assert f"saved to {tmp_path / 'out'}" in stdout


def test_curriculum_example_length_follows_the_budget(tmp_path):
    out = tmp_path / "out"
    run_example("curriculum_grpo.py", out)
    rows = json.loads((out / "budget_vs_length.json").read_text())
    assert [r["budget"] for r in rows] == [24] * 4 + [15] * 4 + [10] * 4 + [6] * 4
    assert all(r["mean_length"] <= r["budget"] for r in rows)  # the cap follows the budget
    assert (out / "budget_vs_length.png").stat().st_size > 10_000


@pytest.mark.parametrize("extra, expected", [([], "reset at step 3: reference=True optimizer=False (every 3 steps)"),
                                             (["--preset", "v1", "--lora"], "reference=True optimizer=True (eval_reward did not improve")])  # fmt: skip
def test_prorl_example_resets(tmp_path, extra, expected):
    stdout = run_example("prorl.py", tmp_path / "out", *extra)
    assert expected in stdout


def test_pta_example_cold_start_then_rl(tmp_path):
    stdout = run_example("pta_grpo.py", tmp_path / "out")
    steps = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 4
    # After the cold start the tiny model closes some of its plans, and sharing plans saves tokens.
    closed = [float(line.split("plans closed ")[1].split(",")[0]) for line in steps]
    assert max(closed) > 0
    for line in steps:
        generated, independent = (
            float(x) for x in line.split("generated ")[1].split(" independently")[0].split(" tokens vs ")
        )
        assert generated < independent


def test_segment_arpo_example_branches_on_the_tiny_model(tmp_path):
    stdout = run_example("segment_arpo.py", tmp_path / "out")
    steps = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 4
    # After the tool-format cold start the tiny model calls the calculator, and ARPO branches after tool results.
    branches = [float(line.split("branches ")[1].split(",")[0]) for line in steps]
    saved = [float(line.split("tokens not regenerated ")[1].split(",")[0]) for line in steps]
    assert sum(branches) > 0 and sum(saved) > 0


@pytest.mark.parametrize("extra", [[], ["--grow", "--advantage", "sae_hard"]], ids=["shipped_trees", "grown_trees"])
def test_tree_opo_example_trains_from_prefixes(tmp_path, extra):
    stdout = run_example("tree_opo.py", tmp_path / "out", *extra)
    steps = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 4
    depths = [float(line.split("prefix depth ")[1].split(",")[0]) for line in steps]
    satisfied = [float(line.split("constraints satisfied ")[1].split(" ")[0]) for line in steps]
    if extra:  # the tiny model grew 8 trees of its own; it writes no blank lines, so every prefix is the question
        assert "grew 8 trees" in stdout and (tmp_path / "out" / "trees.jsonl").exists()
        assert depths == [0.0] * 4
    else:  # the shipped trees: 4 prefixes per group at depths 0, 1, 2, 2
        assert depths == [1.25] * 4
    assert all(s == 1.0 for s in satisfied)


@pytest.mark.parametrize("extra", [[], ["--pairing", "all", "--no-rcc"]], ids=["random_rcc", "all_pairs"])
def test_bicc_example_adds_conditioned_rows(tmp_path, extra):
    stdout = run_example("bicc.py", tmp_path / "out", *extra)
    # The stand-in correctness alternates, so both groups of each step are mixed; one random opposite per row adds 8
    # rows, all pairs (2 x 2 x 2 per group, capped at the group size 4) add 8 too.
    assert "mixed groups 1.00; conditioned rows added per step 8.0" in stdout


@pytest.mark.parametrize("extra", [[], ["--source", "model", "--mismatched-wrong", "--mode", "refine"]],
                         ids=["self_alternate", "model_mismatched_wrong"])  # fmt: skip
def test_drafts_example_refines(tmp_path, extra):
    stdout = run_example("drafts.py", tmp_path / "out", *extra)
    # 4 steps: alternate solves at steps 1 and 3 and refines at 2 and 4; refine mode refines every step.
    assert ("refine steps 2 of 4" if not extra else "refine steps 4 of 4") in stdout
    assert f"saved to {tmp_path / 'out'}" in stdout


@pytest.mark.parametrize("extra", [[], ["--ours", "--stop"]])
def test_monitor_example_writes_its_report(tmp_path, extra):
    stdout = run_example("monitor.py", tmp_path / "out", *extra)
    assert "# Reward-hacking monitor report" in stdout and "| component_hacking | watched |" in stdout
    assert (tmp_path / "out" / "reward_hacking.json").exists()


def test_nord_example_drives_a_tiny_vlm(tmp_path):
    stdout = run_example("nord.py", tmp_path / "out")
    assert "advantage mass by difficulty over 6 groups (this run: scale_rewards='none')" in stdout
    assert "      loss: cruise" in stdout and f"saved to {tmp_path / 'out'}" in stdout
    assert (tmp_path / "out" / "difficulty_bias.png").exists()


@pytest.mark.parametrize("extra", [[], ["--adapters", "--top-k", "1"]], ids=["shared", "adapters"])
def test_hima_example_trains_the_hierarchy(tmp_path, extra):
    stdout = run_example("hima.py", tmp_path / "out", *extra)
    assert "node groups: 8 built" in stdout and "  router: 1.00 of the training rows" in stdout
    assert "0 kept" not in stdout  # the stand-in accuracy varies within node groups
    if extra:  # the tiny model never routes: only the router's rows train, so only its adapter can move
        assert "adapters: default, router, calc, qa; updated: router\n" in stdout
        assert (tmp_path / "out" / "calc" / "adapter_model.safetensors").exists()
    assert f"saved to {tmp_path / 'out'}" in stdout


def test_run_python_runs_a_script_as_python_would(tmp_path):
    import subprocess

    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys\n"
        "print('argv', sys.argv[1:], 'cwd', os.getcwd(), 'x', os.environ.get('X'), 'dir', sys.path[0])\n"
        "print('to stderr', file=sys.stderr)\n"
        "if sys.argv[1] == 'fail':\n    raise RuntimeError('it broke')\n"
        "if sys.argv[1] == 'sleep':\n    import time; time.sleep(60)\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    done = run_python(str(script), ["3"], env={**os.environ, "X": "y"}, cwd=tmp_path)
    assert done.returncode == 3 and done.stderr == "to stderr\n"
    assert done.stdout == f"argv ['3'] cwd {tmp_path} x y dir {tmp_path}\n"
    failed = run_python(str(script), ["fail"])
    assert failed.returncode == 1 and failed.stderr.rstrip().endswith("RuntimeError: it broke")
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(str(script), ["sleep"], timeout=2)
    (tmp_path / "pkg_mod.py").write_text("import sys\nprint(sys.argv)\n")
    module = run_python("-m pkg_mod", ["a"], env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert module.returncode == 0 and module.stdout.strip().endswith("'a']")
