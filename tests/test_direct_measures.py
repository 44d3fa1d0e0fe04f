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
    assert rcc_variance.completion_mask(completions, {2}).tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


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
