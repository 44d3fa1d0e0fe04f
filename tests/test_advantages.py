import pytest
import torch

from trl_grpo_ext.advantages import group_advantages


def test_group_scale_none_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 4.0, 0.0])
    # group 1: mean 0.25 -> 0.75, -0.25, -0.25, -0.25; group 2: mean 2 -> 0, 0, 2, -2
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 2.0, -2.0])
    assert torch.allclose(group_advantages(rewards, 4, scale="none"), expected)


def test_group_scale_group_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # mean 0.25; sample std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-4)
    assert torch.allclose(group_advantages(rewards, 4), expected)


def test_group_scale_batch_and_nan_rows():
    rewards = torch.tensor([1.0, float("nan"), 3.0, 0.0, 0.0, 2.0])
    out = group_advantages(rewards, 3, scale="batch")
    # group means: 2 (NaN left out) and 2/3; batch std over the 5 scored values [1, 3, 0, 0, 2]: mean 1.2,
    # var (0.04 + 3.24 + 1.44 + 1.44 + 0.64) / 4 = 1.7
    std = 1.7**0.5 + 1e-4
    expected = torch.tensor([-1.0, 0.0, 1.0, -2 / 3, -2 / 3, 4 / 3]) / std
    expected[1] = 0.0
    assert torch.allclose(out, expected, atol=1e-6)


def test_group_advantages_rejects_bad_shapes():
    with pytest.raises(ValueError, match="num_generations=4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="scale='std'"):
        group_advantages(torch.zeros(4), 4, scale="std")
