"""The lab's direct measures (`benchmarks/rcc_variance.py`, `benchmarks/difficulty_mass.py`): their maths against
hand-computed cases, then each end to end on the tiny model (`--smoke`)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import common  # noqa: E402
import difficulty_mass  # noqa: E402
import rcc_variance  # noqa: E402


def test_the_three_estimators_on_one_sampling():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # a varied group, then a flat one
    log_ratio = torch.tensor([2.0, 0.0, 0.0, 0.0, 5.0, -1.0, 0.0, 0.0])
    found = rcc_variance.advantages(rewards, log_ratio, group_size=4)
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])
    assert torch.allclose(found["dr_grpo"], centred)
    assert torch.allclose(found["grpo"][:4], centred[:4] / (0.5 + 1e-4), atol=1e-4)  # sample std of 1,0,0,0: 0.5
    # Cov(r, δ) of the varied group: mean of (r - 0.25)(δ - 0.5) = (0.75·1.5 + 3·(-0.25)(-0.5)) / 4 = 0.375
    assert torch.allclose(found["rcc"], centred - torch.tensor([0.75] * 4 + [0.0] * 4))
    assert not found["rcc"][4:].any()  # a flat group: 0 under every estimator, so the script skips its rows


def test_the_variance_from_the_gram_matrix_is_the_direct_one():
    rng = np.random.default_rng(0)
    sketches = rng.normal(size=(6, 50)) + 1.0
    trace, ratio = rcc_variance.variance(sketches @ sketches.T)
    mean = sketches.mean(0)
    direct = ((sketches - mean) ** 2).sum() / 5
    assert trace == pytest.approx(direct) and ratio == pytest.approx(direct / ((mean**2).sum() - direct / 6))
    pick = np.array([0, 0, 3, 5, 5, 5])
    assert rcc_variance.variance(sketches @ sketches.T, pick)[0] == pytest.approx(
        ((sketches[pick] - sketches[pick].mean(0)) ** 2).sum() / 5
    )


def test_the_count_sketch_keeps_norms_and_inner_products():
    torch.manual_seed(0)
    params = [torch.zeros(3000), torch.zeros(40, 50)]
    a, b = [torch.randn(3000), torch.randn(40, 50)], [torch.randn(3000), torch.randn(40, 50)]
    sketch = rcc_variance.CountSketch(params, size=2**16)
    flat = lambda g: torch.cat([x.reshape(-1) for x in g]).double()  # noqa: E731
    assert float(sketch(a) @ sketch(a)) == pytest.approx(float(flat(a) @ flat(a)), rel=0.05)
    assert float(sketch(a) @ sketch(b)) == pytest.approx(float(flat(a) @ flat(b)), abs=0.05 * 5000)
    assert torch.equal(sketch([2 * x for x in a]), 2 * sketch(a))  # linear


def test_completion_mask_ends_after_the_first_eos():
    completions = torch.tensor([[5, 6, 2, 7], [5, 5, 5, 5], [2, 9, 9, 9]])
    assert common.completion_mask(completions, {2}).tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_std_scaling_moves_mass_toward_the_group_with_one_right_answer():
    # k = 1 of 8 right (hard) and k = 4 of 8 (medium): mean |A| 0.21875 and 0.5 unscaled; divided by their sample
    # stds sqrt(7/56) and sqrt(16/56): 0.6187 and 0.9354. Shares: 0.3043 / 0.6957 unscaled, 0.3981 / 0.6019 scaled.
    rewards = {"hard": np.array([[1.0] + [0.0] * 7]), "medium": np.array([[1.0] * 4 + [0.0] * 4])}
    mass = difficulty_mass.shares(rewards)
    assert mass["none"]["hard"] == pytest.approx(0.3043, abs=1e-3)
    assert mass["group"]["hard"] == pytest.approx(0.3981, abs=1e-3)
    summary = difficulty_mass.summarise(rewards, n=50)
    assert summary["hard"]["difference"]["value"] == pytest.approx(0.0938, abs=1e-3)
    assert summary["hard"]["success"] == 0.125 and summary["medium"]["flat_groups"] == 0.0


def test_both_measures_end_to_end_on_the_tiny_model(tmp_path):
    threads = str(torch.get_num_threads())
    try:
        rcc_variance.main(["--out", str(tmp_path / "rcc"), "--smoke", "--threads", "1"])
        difficulty_mass.main(["--out", str(tmp_path / "mass"), "--smoke", "--threads", "1"])
    finally:
        torch.set_num_threads(int(threads))
    result = json.loads((tmp_path / "rcc" / "step0.json").read_text())
    assert result["repeats"] == 2 and result["stats"]["log_ratio_abs"] == 0.0  # step 0: the policy is the reference
    assert {"grpo", "dr_grpo", "rcc", "rcc/dr_grpo", "rcc/grpo"} <= set(result)
    assert "| 0 |" in (tmp_path / "rcc" / "report.md").read_text()
    mass = json.loads((tmp_path / "mass" / "result.json").read_text())
    assert list(mass["summary"]) == list(difficulty_mass.TIERS) and mass["prompts"] == 2
    assert all(np.asarray(mass["rewards"][tier]).shape == (2, 8) for tier in difficulty_mass.TIERS)


def _lab_run(folder: Path, arm: str, seed: int, correct_by_step: dict, logs: list[dict]) -> None:
    """A lab run's JSON (held-out curve per problem) and its log history, as `benchmarks/lab.py` writes them."""
    heldout = [{"step": s, "generated_tokens": 100.0 * s, "accuracy": float(np.mean(c)), "correct": list(c)}
               for s, c in correct_by_step.items()]  # fmt: skip
    run = {"arm": arm, "seed": seed, "task": "rg:chain_sum", "task_args": {}, "settings": {}, "heldout": heldout,
           "train": []}  # fmt: skip
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    (folder / f"{arm}-seed{seed}.json").write_text(json.dumps(run))
    (folder / "logs" / f"{arm}-seed{seed}.json").write_text(json.dumps(logs))


def test_monitor_detection_finds_the_warning_the_drop_and_the_false_alarm(tmp_path):
    import monitor_detection

    # A hacked run: verbosity climbs 0.1 -> 0.9 from step 4 while correctness stays at 0.2 (component_hacking), and
    # its held-out accuracy is 0.5 at step 0, 0.5 at step 5, 0 at step 10 (a drop the interval shows).
    hacked_logs = [{"step": s, "reward": 0.2 + v, "rewards/rg_score_reward/mean": 0.2, "rewards/verbosity/mean": v,
                    "completions/mean_length": 10.0} for s, v in enumerate([0.1] * 3 + [0.9] * 9, start=1)]  # fmt: skip
    half = [1.0] * 100 + [0.0] * 100
    _lab_run(tmp_path / "hacked", "verbosity", 0, {0: half, 5: half, 10: [0.0] * 200}, hacked_logs)
    # A healthy run: flat metrics, held-out accuracy 0.5 -> 0.75 (it learned), no warning.
    healthy_logs = [{"step": s, "reward": 0.2, "rewards/rg_score_reward/mean": 0.2, "completions/mean_length": 10.0}
                    for s in range(1, 13)]  # fmt: skip
    _lab_run(tmp_path / "healthy", "grpo", 0, {0: half, 10: [1.0] * 150 + [0.0] * 50}, healthy_logs)
    # A healthy run whose correctness falls from 0.6 to 0: correctness_regression fires, a false alarm here.
    falling = [{**log, "rewards/rg_score_reward/mean": 0.6 if log["step"] <= 6 else 0.0} for log in healthy_logs]
    _lab_run(tmp_path / "healthy", "grpo", 1, {0: half, 10: half}, falling)
    out = tmp_path / "detection.json"
    assert monitor_detection.main(["--hacked", str(tmp_path / "hacked"), "--healthy", str(tmp_path / "healthy"),
                                   "--out", str(out)]) == 0  # fmt: skip
    found = json.loads(out.read_text())
    (hacked,) = found["hacked"]
    assert hacked["first_warning"]["detector"] == "component_hacking"
    assert hacked["drop"]["step"] == 10 and hacked["drop"]["diff"] == pytest.approx(-0.5)
    assert hacked["lead"] == 10 - hacked["first_warning"]["step"] > 0
    quiet, alarmed = found["healthy"]
    assert quiet["warnings"] == [] and quiet["change"]["rose"] and quiet["change"]["diff"] == pytest.approx(0.25)
    assert [w["detector"] for w in alarmed["warnings"]] == ["correctness_regression"] and not alarmed["change"]["rose"]
    summary = found["summary"]
    assert summary["caught_before_drop"][:2] == [1, 1] and summary["healthy_warned"][:2] == [1, 2]
    assert summary["healthy_warned_by_detector"] == {"correctness_regression": 1}
    assert summary["healthy_that_learned_warned"] == [0, 1] and summary["healthy_that_fell_warned"] == [0, 0]
    assert "| verbosity seed 0 |" in out.with_suffix(".md").read_text() and found["thresholds"] == "defaults"
    # Other thresholds for the replay: a shorter window and start warn sooner on the same logs.
    faster = tmp_path / "faster.json"
    assert monitor_detection.main(["--hacked", str(tmp_path / "hacked"), "--healthy", str(tmp_path / "healthy"),
                                   "--out", str(faster), "--thresholds", "window=2", "baseline_logs=2"]) == 0  # fmt: skip
    again = json.loads(faster.read_text())
    assert again["thresholds"] == ["window=2", "baseline_logs=2"]
    assert again["hacked"][0]["first_warning"]["step"] < hacked["first_warning"]["step"]
    only = tmp_path / "only.json"
    _lab_run(tmp_path / "healthy", "drafts", 0, {0: half, 10: half}, falling)  # another arm in a healthy folder
    assert monitor_detection.main(["--hacked", str(tmp_path / "hacked"), "--healthy", str(tmp_path / "healthy"),
                                   "--out", str(only), "--healthy_arms", "grpo"]) == 0  # fmt: skip
    assert [r["arm"] for r in json.loads(only.read_text())["healthy"]] == ["grpo", "grpo"]


def test_clopper_pearson_matches_its_known_values():
    import monitor_detection

    assert monitor_detection.clopper_pearson(0, 10) == pytest.approx((0.0, 0.3085), abs=1e-4)
    assert monitor_detection.clopper_pearson(3, 3) == pytest.approx((0.2924, 1.0), abs=1e-4)
