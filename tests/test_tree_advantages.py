"""Tree and segment advantages (GPG / ARPO, PTA): the rollout tree and its credit, on hand-computed numbers."""

import math

import pytest
import torch

from trl_grpo_ext import Rollout, RolloutBatch
from trl_grpo_ext.advantages import segment_reward_advantages, tree_estimator, tree_token_advantages
from trl_grpo_ext.rollout import token_owners

NAN = float("nan")
EPS = 1e-4  # TRL's std epsilon, the default of every function here

# A tree of depth 3 over one group of 4 rows of unequal lengths (-1 = padding):
#             root (node 0)
#           /              \
#       node 1            node 2
#       /    \            /    \
#   node 3  node 4    node 5  node 6
DEPTH3 = torch.tensor(
    [
        [0, 0, 1, 1, 3, 3, 3],  # row 0: 7 tokens
        [0, 0, 1, 1, 4, -1, -1],  # row 1: 5 tokens
        [0, 0, 2, 5, -1, -1, -1],  # row 2: 4 tokens
        [0, 0, 2, 6, 6, 6, -1],  # row 3: 6 tokens
    ]
)


def _reference(leaf, node_ids):
    # The definition, with loops: mean of the leaves of every row that contains the token's node id.
    out = torch.zeros(node_ids.shape)
    for i in range(node_ids.size(0)):
        for t in range(node_ids.size(1)):
            node = int(node_ids[i, t])
            if node >= 0:
                rows = [j for j in range(node_ids.size(0)) if (node_ids[j] == node).any()]
                out[i, t] = sum(float(leaf[j]) for j in rows) / len(rows)
    return out


def test_tree_of_depth_3_with_unequal_lengths():
    leaf = torch.tensor([1.0, 0.0, -0.5, 2.0])
    root = (1.0 + 0.0 - 0.5 + 2.0) / 4  # 0.625: all four rows pass through node 0
    left = (1.0 + 0.0) / 2  # 0.5: rows 0, 1 through node 1
    right = (-0.5 + 2.0) / 2  # 0.75: rows 2, 3 through node 2
    expected = torch.tensor(
        [
            [root, root, left, left, 1.0, 1.0, 1.0],  # leaf node 3: row 0 alone
            [root, root, left, left, 0.0, 0.0, 0.0],  # leaf node 4: row 1 alone; then padding -> 0
            [root, root, right, -0.5, 0.0, 0.0, 0.0],
            [root, root, right, 2.0, 2.0, 2.0, 0.0],
        ]
    )
    assert torch.allclose(tree_token_advantages(leaf, DEPTH3), expected)


def test_a_row_counts_once_per_node_however_many_tokens_carry_it():
    # Row 0 carries node 7 on three tokens (two of them apart), row 1 on one.
    node_ids = torch.tensor([[7, 7, 8, 7], [7, 9, -1, -1]])
    leaf = torch.tensor([3.0, 1.0])
    # node 7: (3 + 1) / 2 = 2, not (3 + 3 + 3 + 1) / 4 = 2.5
    expected = torch.tensor([[2.0, 2.0, 3.0, 2.0], [2.0, 1.0, 0.0, 0.0]])
    assert torch.allclose(tree_token_advantages(leaf, node_ids), expected)


def test_groups_never_mix_when_their_node_ids_differ():
    # Two groups with the same shape; group 2's ids are its own (10, 11, 12), as the caller's contract asks.
    node_ids = torch.tensor([[0, 1], [0, 2], [10, 11], [10, 12]])
    leaf = torch.tensor([1.0, -1.0, 4.0, 2.0])
    # group 1 root: (1 - 1) / 2 = 0; group 2 root: (4 + 2) / 2 = 3 (a mixed root would be 6 / 4 = 1.5)
    expected = torch.tensor([[0.0, 1.0], [0.0, -1.0], [3.0, 4.0], [3.0, 2.0]])
    assert torch.allclose(tree_token_advantages(leaf, node_ids), expected)


def test_hash_like_ids_nan_leaves_and_all_padding():
    big = 2**62 + 5
    node_ids = torch.tensor([[big, 3], [big, -1], [big, 4]])
    leaf = torch.tensor([1.0, NAN, 2.0])
    # node big: the NaN row is left out -> (1 + 2) / 2 = 1.5; row 1 has only the shared node
    expected = torch.tensor([[1.5, 1.0], [1.5, 0.0], [1.5, 2.0]])
    assert torch.allclose(tree_token_advantages(leaf, node_ids), expected)
    # A node that only a NaN row reaches gets 0.
    assert torch.equal(tree_token_advantages(torch.tensor([NAN]), torch.tensor([[5, 5]])), torch.zeros(1, 2))
    assert torch.equal(tree_token_advantages(torch.ones(2), torch.full((2, 3), -1)), torch.zeros(2, 3))
    assert tree_token_advantages(torch.ones(0), torch.zeros(0, 4, dtype=torch.long)).shape == (0, 4)


def test_tree_token_advantages_match_the_definition_on_random_trees():
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        node_ids = torch.randint(-1, 12, (6, 9), generator=generator)
        leaf = torch.randn(6, generator=generator)
        assert torch.allclose(tree_token_advantages(leaf, node_ids), _reference(leaf, node_ids), atol=1e-6)


def test_tree_token_advantages_bad_inputs():
    with pytest.raises(ValueError, match=r"leaf_advantages must have shape \(B,\)"):
        tree_token_advantages(torch.ones(2, 1), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"B = 2 rows like leaf_advantages, got \(3, 3\)"):
        tree_token_advantages(torch.ones(2), torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="node_ids must be an integer tensor"):
        tree_token_advantages(torch.ones(2), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="node_ids holds -2"):
        tree_token_advantages(torch.ones(2), torch.tensor([[0, -2], [0, 1]]))


# ---------------------------------------------------------------- the tree from parents and shared prefixes


def test_token_owners_follow_parent_chains():
    # Row 1 repeats row 0's first 2 tokens; row 2 repeats row 1's first 3 (2 of them row 0's); row 3 is a root.
    owners = token_owners(parents=[-1, 0, 1, -1], shared=[0, 2, 3, 0], lengths=[4, 4, 3, 2], width=4)
    expected = torch.tensor([[0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 1, -1], [3, 3, -1, -1]])
    assert torch.equal(owners, expected)
    # A child listed before its parent resolves the same way.
    assert torch.equal(token_owners([1, -1], [2, 0], [3, 3], 3), torch.tensor([[1, 1, 0], [1, 1, 1]]))


def test_rollout_tree_is_checked_and_kept_by_take():
    rollout = Rollout(prompt_ids=[[1]] * 3, completion_ids=[[5, 6, 7], [5, 6, 9], [5, 8]], completions=["a", "b", "c"],
                      parents=[-1, 0, 0], shared=[0, 2, 1])  # fmt: skip
    rollout.check_tree()
    assert rollout.roots() == [0, 0, 0]
    taken = rollout.take([2, 0])  # row 2 keeps its parent (now row 1); row 1 is gone
    assert taken.parents == [1, -1] and taken.shared == [1, 0]
    assert rollout.take([1]).parents == [-1]  # without its parent a row is a root
    bad = Rollout(prompt_ids=[[1]] * 2, completion_ids=[[5, 6], [5, 7]], completions=["a", "b"], parents=[-1, 0],
                  shared=[0, 2])  # fmt: skip
    with pytest.raises(ValueError, match="row 1 is said to share 2 token"):
        bad.check_tree()


def _batch(completion_ids, owners, advantages):
    ids = torch.tensor(completion_ids)
    mask = (ids >= 0).long()
    return RolloutBatch(rewards=advantages, rewards_per_func=advantages.unsqueeze(1), reward_func_names=["r"],
                        reward_weights=torch.ones(1), num_generations=len(ids), process_slice=slice(0, len(ids)),
                        advantages=advantages, completion_ids=ids.clamp(min=0), completion_mask=mask,
                        owners=owners)  # fmt: skip


def test_arpo_example_soft_and_hard_credit_on_the_prefix():
    # The example: advantages [-0.5, -0.5, 1.5, -0.5], row 2 branched from row 0 after 3 tokens. Every row
    # holds its whole trajectory, so the 3 prefix tokens sit in rows 0 and 2.
    ids = [[1, 2, 3, 4, 5], [6, 7, 8, 9, -1], [1, 2, 3, 10, 11], [12, 13, -1, -1, -1]]
    owners = token_owners([-1, -1, 0, -1], [0, 0, 3, 0], [5, 4, 5, 2], 5)
    leaf = torch.tensor([-0.5, -0.5, 1.5, -0.5])
    batch = _batch(ids, owners, leaf)
    # Soft (GRPO over the 4 full sequences): each copy of a prefix token carries its own row's advantage, so the
    # prefix gets -0.5 + 1.5 = +1.0 in total (it got -0.5 when only row 0 held it).
    soft = leaf.unsqueeze(1) * batch.completion_mask
    assert soft[[0, 2], :3].sum(0).tolist() == [1.0, 1.0, 1.0]
    # Hard: every copy of a shared token gets the mean of the trajectories sharing it, (-0.5 + 1.5) / 2 = 0.5,
    # once per trajectory: 2 copies x 0.5 = 1.0 in total; unshared tokens keep their row's advantage.
    hard = tree_estimator(batch)
    assert hard[0].tolist() == [0.5, 0.5, 0.5, -0.5, -0.5]
    assert hard[2].tolist() == [0.5, 0.5, 0.5, 1.5, 1.5]
    assert hard[1].tolist() == [-0.5, -0.5, -0.5, -0.5, 0.0] and hard[3].tolist() == [-0.5, -0.5, 0.0, 0.0, 0.0]
    assert hard[[0, 2], :3].sum(0).tolist() == [1.0, 1.0, 1.0]


def test_hard_credit_with_depth_2_branching():
    # Row 1 branched from row 0 after 2 tokens; row 2 branched from row 1 after 3 tokens (depth 2); row 3 fresh.
    ids = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 5, 7], [8, 9, 10, -1]]
    owners = token_owners([-1, 0, 1, -1], [0, 2, 3, 0], [4, 4, 4, 3], 4)
    leaf = torch.tensor([1.0, -1.0, 2.0, 0.0])
    out = tree_estimator(_batch(ids, owners, leaf))
    top = (1.0 - 1.0 + 2.0) / 3  # tokens 0-1: rows 0, 1, 2 share them -> 2/3
    mid = (-1.0 + 2.0) / 2  # token 2 of rows 1 and 2 (row 1's token 5) -> 0.5
    expected = torch.tensor([[top, top, 1.0, 1.0], [top, top, mid, -1.0], [top, top, mid, 2.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(out, expected)
    # Summed over copies, each shared token carries the sum of the advantages of the trajectories through it.
    assert out[:3, 0].sum().item() == pytest.approx(2.0) and out[1:3, 2].sum().item() == pytest.approx(1.0)


def test_without_a_tree_hard_credit_is_grpo():
    leaf = torch.tensor([2.0, -1.0])
    batch = _batch([[1, 2, -1], [3, 4, 5]], None, leaf)
    assert torch.equal(tree_estimator(batch), torch.tensor([[2.0, 2.0, 0.0], [-1.0, -1.0, -1.0]]))
    assert batch.node_ids.tolist() == [[0, 1, -1], [3, 4, 5]]


def test_segment_reward_advantages_group_normalisation():
    outcome = torch.tensor([0.5, -0.5])
    scores = torch.tensor([[1.0, NAN, 0.0], [1.0, NAN, NAN]])  # segment 1 is a tool result: unscored
    segments = torch.tensor([[0, 0, 1, 2, 2], [0, 1, 1, -1, -1]])
    # pooled over the group: scored values 1, 0, 1 -> mean 2/3,
    # sample std sqrt(((1/3)^2 + (2/3)^2 + (1/3)^2) / 2) = sqrt(1/3) = 0.57735
    std = math.sqrt(1 / 3) + EPS
    up, down = (1 / 3) / std, (-2 / 3) / std  # 0.5772, -1.1545
    lam = 0.5
    expected = torch.tensor(
        [
            [0.5 + lam * up, 0.5 + lam * up, 0.5, 0.5 + lam * down, 0.5 + lam * down],
            [-0.5 + lam * up, -0.5, -0.5, 0.0, 0.0],  # row 1's segment 1 is missing: outcome alone; padding 0
        ]
    )
    out = segment_reward_advantages(outcome, scores, segments, num_generations=2, lam=lam)
    assert torch.allclose(out, expected, atol=1e-6)


def test_segment_reward_advantages_position_and_none():
    outcome = torch.tensor([0.0, 0.0, 1.0, 1.0])
    scores = torch.tensor([[1.0, 3.0], [0.0, 3.0], [2.0, NAN], [2.0, 0.0]])
    segments = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1]])
    out = segment_reward_advantages(outcome, scores, segments, 2, lam=1.0, normalize="position")
    # group 1, segment 0: 1, 0 -> mean 0.5, std sqrt(0.5) = 0.70711 -> +-0.5 / 0.70721; segment 1: 3, 3 -> std 0 -> 0
    # group 2, segment 0: 2, 2 -> 0; segment 1: only row 3 scored -> std 0 -> 0; row 2's NaN -> 0
    z = 0.5 / (math.sqrt(0.5) + EPS)
    assert torch.allclose(out, torch.tensor([[z, 0.0], [-z, 0.0], [1.0, 1.0], [1.0, 1.0]]), atol=1e-6)
    raw = segment_reward_advantages(outcome, scores, segments, 2, lam=2.0, normalize="none")
    # outcome + 2 * s; NaN adds nothing
    assert torch.allclose(raw, torch.tensor([[2.0, 6.0], [0.0, 6.0], [5.0, 1.0], [5.0, 1.0]]))


def test_segment_reward_advantages_bad_inputs():
    outcome, segments = torch.zeros(2), torch.tensor([[0, 1, 2], [0, 0, -1]])
    with pytest.raises(ValueError, match=r"segment 2 but segment_rewards has only S=2 columns; pad .* NaN up to 3"):
        segment_reward_advantages(outcome, torch.zeros(2, 2), segments, 2)
    with pytest.raises(ValueError, match="normalize='batch' is not one of"):
        segment_reward_advantages(outcome, torch.zeros(2, 3), segments, 2, normalize="batch")
    with pytest.raises(ValueError, match="lam=nan must be a finite number"):
        segment_reward_advantages(outcome, torch.zeros(2, 3), segments, 2, lam=NAN)
    with pytest.raises(ValueError, match="num_generations=3"):
        segment_reward_advantages(outcome, torch.zeros(2, 3), segments, 3)
    # No segment scored at all (S = 0, padding only): zeros.
    out = segment_reward_advantages(outcome, torch.zeros(2, 0), torch.full((2, 3), -1), 2)
    assert torch.equal(out, torch.zeros(2, 3))
