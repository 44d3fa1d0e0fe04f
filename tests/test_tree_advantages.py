"""Tree and segment advantages (GPG / ARPO, issue 4): hand-computed numbers."""

import math

import pytest
import torch

from trl_grpo_ext.advantages import (
    hard_advantages,
    segment_reward_advantages,
    shared_prefix_node_ids,
    soft_advantages,
    tree_token_advantages,
)

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


# ---------------------------------------------------------------- node ids from shared prefixes


def test_shared_prefix_node_ids_token_level_trie():
    # One group of 3 rows (T = 4): rows 0 and 1 share "5 6", row 2 shares "5" only; row 1 is shorter.
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 0], [5, 1, 2, 3]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    # node id = (lowest sharing row) * T + position
    expected = torch.tensor(
        [
            [0, 1, 2, 3],  # row 0 represents every node it is on
            [0, 1, 6, -1],  # 1 * 4 + 2 = 6 after the branch; padding -1
            [0, 9, 10, 11],  # 2 * 4 + 1 = 9: row 2 leaves at position 1
        ]
    )
    assert torch.equal(shared_prefix_node_ids(ids, mask, num_generations=3), expected)


def test_shared_prefix_node_ids_per_segment():
    # Segments 0 | 1 | 2. Rows 0, 1 agree on segments 0 and 1 and branch in segment 2. Row 2 has the same tokens
    # as row 0 through position 3 but cuts them differently (segment 1 ends at 2): it shares segment 0 only.
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 7], [1, 2, 3, 4, 5, 6]])
    mask = torch.ones_like(ids)
    segments = torch.tensor([[0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 2, -1], [0, 0, 1, 2, 2, 2]])
    # node id = (lowest sharing row) * T + (last position of the segment), T = 6
    expected = torch.tensor(
        [
            [1, 1, 3, 3, 5, 5],  # segment 0 ends at 1, segment 1 at 3, segment 2 at 5 (row 0)
            [1, 1, 3, 3, 6 + 4, -1],  # its own segment 2 ends at 4: 1 * 6 + 4 = 10
            [1, 1, 12 + 2, 12 + 5, 12 + 5, 12 + 5],  # 2 * 6 + 2 = 14, 2 * 6 + 5 = 17
        ]
    )
    assert torch.equal(shared_prefix_node_ids(ids, mask, 3, segment_ids=segments), expected)


def test_shared_prefix_node_ids_never_join_groups():
    # Two groups of 2 with identical completions: equal within a group, never across.
    ids = torch.tensor([[4, 4], [4, 4], [4, 4], [4, 4]])
    nodes = shared_prefix_node_ids(ids, torch.ones_like(ids), num_generations=2)
    assert torch.equal(nodes, torch.tensor([[0, 1], [0, 1], [4, 5], [4, 5]]))  # rows 0 and 2 represent


def _reference_nodes(ids, mask, g, segments):
    # The definition, with loops: lowest row of the group with the same tokens and segments through the end e of the
    # token's segment, and a segment ending at e too; node = row * T + e.
    rows, length = ids.shape
    seg = torch.where(mask.bool(), segments, -1)
    out = torch.full((rows, length), -1)
    for i in range(rows):
        for t in range(length):
            if seg[i, t] < 0:
                continue
            e = max(p for p in range(length) if seg[i, p] == seg[i, t])
            for j in range(i // g * g, i + 1):
                ends = e + 1 == length or seg[j, e + 1] != seg[j, e]
                if torch.equal(ids[j, : e + 1], ids[i, : e + 1]) and torch.equal(seg[j, : e + 1], seg[i, : e + 1]):
                    if ends:
                        out[i, t] = j * length + e
                        break
    return out


def test_shared_prefix_node_ids_match_the_definition_on_random_trees():
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids = torch.randint(0, 2, (6, 7), generator=generator)  # two token values: many shared prefixes
        lengths = torch.randint(1, 8, (6,), generator=generator)
        mask = (torch.arange(7) < lengths.unsqueeze(1)).long()
        segments = torch.randint(0, 2, (6, 7), generator=generator).cumsum(1)  # random cuts
        segments = segments - segments[:, :1]
        nodes = shared_prefix_node_ids(ids, mask, 3, segments)
        assert torch.equal(nodes, _reference_nodes(ids, mask, 3, segments))
        tokens = shared_prefix_node_ids(ids, mask, 3)  # every token its own segment: the trie
        assert torch.equal(tokens, _reference_nodes(ids, mask, 3, torch.arange(7).expand(6, 7)))


def test_shared_prefix_node_ids_bad_inputs():
    ids = torch.ones(4, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"4 rows cannot be split into groups of num_generations=3.*whole groups"):
        shared_prefix_node_ids(ids, torch.ones_like(ids), 3)
    with pytest.raises(ValueError, match="must be right-padded"):
        shared_prefix_node_ids(ids, torch.tensor([[0, 1, 1]] * 4), 2)
    with pytest.raises(ValueError, match="segment_ids must have shape"):
        shared_prefix_node_ids(ids, torch.ones_like(ids), 2, segment_ids=torch.zeros(4, 2, dtype=torch.long))


# ---------------------------------------------------------------- the three advantage modes


def test_soft_advantages_broadcast_grpo():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    # mean 0.25, sample std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    a, b = 0.75 / (0.5 + EPS), -0.25 / (0.5 + EPS)
    expected = torch.tensor([[a, a, a], [b, b, 0.0], [b, 0.0, 0.0], [b, b, b]])
    assert torch.allclose(soft_advantages(rewards, 4, token_mask=mask), expected)
    assert torch.allclose(soft_advantages(rewards, 4), torch.tensor([a, b, b, b]))  # (N,) without a mask


def test_hard_advantages_on_the_depth_3_tree():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # scale "none": mean 0.5 -> leaves 0.5, -0.5, -0.5, 0.5; root 0; node 1 (rows 0, 1) 0; node 2 (rows 2, 3) 0
    expected = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5],
            [0.0, 0.0, 0.0, 0.0, -0.5, 0.0, 0.0],
            [0.0, 0.0, 0.0, -0.5, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.0],
        ]
    )
    assert torch.allclose(hard_advantages(rewards, 4, DEPTH3, scale="none"), expected)
    # ARPO's scale: sample std sqrt(4 * 0.25 / 3) = 0.57735; rewards 1, 1, 0, 0 make the inner nodes non-zero
    std = math.sqrt(1 / 3) + EPS
    out = hard_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), 4, DEPTH3)
    assert out[0, 0] == pytest.approx(0.0, abs=1e-6)  # root: (0.5 + 0.5 - 0.5 - 0.5) / 4
    assert out[0, 2] == pytest.approx(0.5 / std)  # node 1: rows 0, 1 -> (0.5 + 0.5) / 2
    assert out[2, 2] == pytest.approx(-0.5 / std)  # node 2: rows 2, 3
    assert out[3, 5] == pytest.approx(-0.5 / std) and out[3, 6] == 0.0  # leaf, then padding


def test_hard_equals_soft_when_nothing_is_shared_and_leaves_out_nan_rows():
    rewards = torch.tensor([2.0, 0.0, 1.0, 3.0])
    node_ids = torch.tensor([[0, 0, -1], [1, 1, 1], [2, -1, -1], [3, 3, 3]])
    assert torch.allclose(hard_advantages(rewards, 2, node_ids), soft_advantages(rewards, 2, node_ids >= 0))
    # A NaN row shares node 0 with row 0: it is left out of node 0's mean and its own tokens get 0.
    out = hard_advantages(torch.tensor([1.0, NAN, 0.0]), 3, torch.tensor([[0, 1], [0, 2], [3, 4]]), scale="none")
    # group mean over scored rows 0.5 -> leaves 0.5, NaN, -0.5; node 0: 0.5 (row 1 left out)
    assert torch.allclose(out, torch.tensor([[0.5, 0.5], [0.5, 0.0], [-0.5, -0.5]]))


def test_hard_advantages_with_node_ids_built_from_prefixes():
    # Rows 0 and 1 branched after a shared first segment; rows 2 and 3 are independent with distinct prefixes.
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 5], [6, 7, 8, 9], [7, 7, 7, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]])
    segments = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, -1]])
    nodes = shared_prefix_node_ids(ids, mask, 4, segments)
    out = hard_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, nodes, scale="none")
    # leaves 0.75, -0.25, -0.25, -0.25; the shared segment of rows 0, 1: (0.75 - 0.25) / 2 = 0.25
    expected = torch.tensor(
        [[0.25, 0.25, 0.75, 0.75], [0.25, 0.25, -0.25, -0.25], [-0.25] * 4, [-0.25, -0.25, -0.25, 0.0]]
    )
    assert torch.allclose(out, expected)


def test_hard_advantages_need_every_row_of_the_groups():
    with pytest.raises(ValueError, match="needs the node ids of every row"):
        hard_advantages(torch.zeros(4), 2, torch.zeros(2, 3, dtype=torch.long))


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
