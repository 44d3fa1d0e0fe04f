"""NoRD's pure maths, against numbers computed by hand (the trainer and the VLM path are not in yet)."""

import math

import pytest
import torch

from trl_grpo_ext import get_reward
from trl_grpo_ext.data.driving import driving_dataset
from trl_grpo_ext.methods.nord import difficulty_stats, group_advantages, parse_waypoints, score_trajectory

GT = [(1.0, 0.0), (2.0, 0.0)]
SCENE = {"cars": [[4.5, 0.0, 1.2]], "ego_radius": 1.0, "road": [-1.75, 5.25]}


def test_trajectory_cases_by_hand():
    assert score_trajectory(GT, GT, SCENE).score == pytest.approx(1.0)
    offset = score_trajectory([(1.0, 0.5), (2.0, 0.5)], GT, SCENE)  # ADE = FDE = 0.5
    assert offset.score == pytest.approx(2 / 3 * math.exp(-0.5) + 1 / 3)
    assert score_trajectory([(1.0, 0.0), (2.5, 0.0)], GT, SCENE).collision  # 2.0 m from the car, radii 2.2
    assert score_trajectory([(1.0, 0.0), (2.0, 9.0)], GT, SCENE).offroad
    reward = get_reward("trajectory")
    got = reward(completions=["(1.0, 0.0) (2.0, 0.0)", "turn left", "(1.0, 0.0)", "(1, 0) (2, 0) (3, 0)"],
                 future=[GT] * 4, scene=[SCENE] * 4)  # fmt: skip
    assert got == [pytest.approx(1.0), 0.0, 0.0, 0.0]  # perfect, malformed, too few, too many
    assert parse_waypoints("nothing") is None


def test_difficulty_bias_by_hand():
    rewards = torch.tensor([0.9, 1.0, 0.0, 0.6])  # an easy group (std 0.0707) and a hard one (std 0.4243)
    adv = {k: group_advantages(rewards, 2, k) for k in ("group", "none")}
    stats = difficulty_stats(rewards, 2, ["easy", "hard"], ["hard", "easy"], adv)
    assert stats["mass"]["none"]["hard"] == pytest.approx(0.6 / 0.7)
    assert stats["mass"]["group"]["hard"] == pytest.approx(0.5, abs=1e-3)  # std normalisation evens them out


def test_driving_ground_truth_scores_one():
    for row in driving_dataset(40, images=False, seed=3):
        assert score_trajectory([tuple(p) for p in row["future"]], [tuple(p) for p in row["future"]],
                                row["scene"]).score == pytest.approx(1.0)  # fmt: skip
