"""Unscorable rows (a reward function returned None) in every group statistic: left out, as TRL leaves them out.

TRL (`GRPOTrainer._generate_and_score_completions`) sums the weighted reward functions with `nansum`, sets the total
back to NaN where every function returned None (`unscorable_mask`), takes the group's `nanmean` and `nanstd`, and
turns the NaN advantages of those rows into 0 (`nan_to_num`). Every group statistic of ours goes through one helper,
`trl_grpo_ext.advantages.group_stats`; each consumer is fed the same scored batch here, numbers by hand.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from trl_grpo_ext import DifficultyBiasDiagnostic, GRPOExtTrainer, RolloutBatch
from trl_grpo_ext.advantages import group_advantages, group_stats, plan_values, rcc, sae_project, staged_advantages
from trl_grpo_ext.data.trees import SAMPLE_TREES, load_prefix_trees
from trl_grpo_ext.methods.dynamic_sampling import DynamicSampling, varied_groups
from trl_grpo_ext.methods.hima import HiMA, node_group_advantages, select_node_groups
from trl_grpo_ext.methods.nord import difficulty_stats
from trl_grpo_ext.methods.pta import PlanValueReward
from trl_grpo_ext.methods.tree_opo import NOTE as TREE_NOTE
from trl_grpo_ext.methods.tree_opo import TreeOPO
from trl_grpo_ext.rollout import Rollout

NAN = math.nan
G = 4
# Two groups of 4. The judge cannot score "?" (None). Group A: 1, ?, 0, 0; group B: 1, 1, 1, ?.
COMPLETIONS = ["1", "?", "0", "0", "1", "1", "1", "?"]
# By hand, over the scored rows only:
#   A: 1, 0, 0 -> mean 1/3, sample var ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3, std sqrt(1/3) = 0.57735
#   B: 1, 1, 1 -> mean 1, std 0 (flat)
#   batch: 1, 0, 0, 1, 1, 1 -> mean 2/3, var (4 (1/3)^2 + 2 (2/3)^2) / 5 = 4/15, std 0.516398
# (With the None read as 0: A would be 1, 0, 0, 0 (mean 1/4) and B 1, 1, 1, 0, which varies.)
STD_A, STD_BATCH = math.sqrt(1 / 3), math.sqrt(4 / 15)
ADV_A = [(2 / 3) / (STD_A + 1e-4), 0.0, (-1 / 3) / (STD_A + 1e-4), (-1 / 3) / (STD_A + 1e-4)]


def judge(completions, **kwargs):
    """A correctness reward that cannot score "?" (TRL: None means "cannot score this row")."""
    return [None if c == "?" else float(c) for c in completions]


def fmt(completions, **kwargs):
    """A second reward that scores every row: 0.5."""
    return [0.5 for _ in completions]


def scored(funcs, weights=None):
    """(rewards, rewards_per_func) as the trainer builds them: TRL's None -> NaN per function, then the weighted
    total with TRL's rule (`GRPOExtTrainer._total_rewards`: nansum, NaN where every function returned None)."""
    per_func = torch.tensor(
        [[NAN if v is None else v for v in f(completions=COMPLETIONS)] for f in funcs], dtype=torch.float
    ).T
    weights = torch.ones(len(funcs)) if weights is None else torch.tensor(weights)
    rewards = GRPOExtTrainer._total_rewards(SimpleNamespace(reward_weights=weights), per_func)
    return rewards, per_func


def batch_of(rewards, per_func, **fields):
    n = rewards.numel()
    return RolloutBatch(rewards=rewards, rewards_per_func=per_func, reward_func_names=["judge"][: per_func.size(1)],
                        reward_weights=torch.ones(per_func.size(1)), num_generations=G, process_slice=slice(0, n),
                        advantages=torch.zeros(n), completion_ids=torch.zeros(n, 3, dtype=torch.long),
                        completion_mask=torch.ones(n, 3, dtype=torch.long), **fields)  # fmt: skip


def stub_trainer(logged, **args):
    return SimpleNamespace(args=SimpleNamespace(**args), model=SimpleNamespace(training=True),
                           log_metric=lambda key, value, mode="train": logged.__setitem__(key, value))  # fmt: skip


# ------------------------------------------------------------------------------------------- the rule itself
def test_a_row_is_unscorable_only_when_every_reward_function_returns_none():
    rewards, _ = scored([judge])
    assert torch.isnan(rewards).tolist() == [False, True, False, False, False, False, False, True]
    rewards, _ = scored([judge, fmt], weights=[1.0, 2.0])  # fmt scores row 1: nansum -> 0 + 2 * 0.5 = 1
    assert rewards.tolist() == [2.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 1.0]


def test_group_stats_by_hand():
    rewards, _ = scored([judge])
    stats = group_stats(rewards, G)
    assert stats.count.tolist() == [3.0, 3.0]
    assert stats.mean.tolist() == pytest.approx([1 / 3, 1.0])
    assert stats.std.tolist() == pytest.approx([STD_A, 0.0])
    assert (stats.low.tolist(), stats.high.tolist()) == ([0.0, 1.0], [1.0, 1.0])
    assert stats.rows(stats.mean).tolist() == pytest.approx([1 / 3] * 4 + [1.0] * 4)
    assert group_stats(rewards, rewards.numel()).std.tolist() == pytest.approx([STD_BATCH])  # one group: the batch
    # Labels instead of a size: any values, rows of a group anywhere.
    labelled = group_stats(torch.tensor([0.0, 5.0, NAN, 2.0]), torch.tensor([7, 3, 3, 7]))
    assert labelled.count.tolist() == [1.0, 2.0] and labelled.mean.tolist() == [5.0, 1.0]
    # TRL's nanstd: NaN with fewer than two scored rows; a group with none has NaN statistics and count 0.
    lone = group_stats(torch.tensor([1.0, NAN, NAN, NAN]), 2)
    assert lone.count.tolist() == [1.0, 0.0] and math.isnan(lone.std[0]) and math.isnan(lone.mean[1])
    assert math.isnan(lone.low[1]) and math.isnan(lone.high[1])
    with pytest.raises(ValueError, match="cannot be split into groups of 4"):
        group_stats(torch.zeros(6), 4)


# ------------------------------------------------------------------------------------------- every consumer
def _group(rewards, per_func):
    return group_advantages(rewards, G).tolist(), ADV_A + [0.0] * 4


def _hima(rewards, per_func):
    logged = {}
    hima = HiMA("toy", alternatives=G)  # node groups of 4 rows: one node slot per question here
    hima.trainer, hima.memories, hima._owners = stub_trainer(logged, scale_rewards="group"), {}, ["router"] * 8
    batch = batch_of(rewards, per_func)
    hima.after_scoring(batch)
    # B's scored rows agree: it carries no signal and leaves the loss (read as 0, its None would make it vary)
    assert batch.dropped.tolist() == [False] * 4 + [True] * 4 and logged["hima/selected_groups"] == 1
    return batch.current_advantages.tolist(), ADV_A + [0.0] * 4


def _nord(rewards, per_func):
    logged = {}
    diagnostic = DifficultyBiasDiagnostic(edges=[0.5])
    diagnostic.trainer = stub_trainer(logged)
    diagnostic.after_scoring(batch_of(rewards, per_func, loss_advantages=group_advantages(rewards, G, "none")))
    a, b = diagnostic.groups
    assert (a["bucket"], b["bucket"]) == ("hard", "easy")  # A's mean 1/3 < 0.5 (read as 0: still hard, but 1/4)
    # mean |A| over A's scored rows, unscaled: (2/3 + 1/3 + 1/3) / 3 = 4/9; B's: 0
    assert [a["mean_abs_unscaled"], b["mean_abs_unscaled"], a["mean_abs_loss"]] == pytest.approx([4 / 9, 0, 4 / 9])
    assert logged["difficulty/mass_hard_unscaled"] == 1.0
    return [a["mean"], a["std"], b["mean"], b["std"]], [1 / 3, STD_A, 1.0, 0.0]


def _rcc(rewards, per_func):
    # δ = 1, 100, -1, 0 | 2, 2, 2, 50: A's covariance over its scored rows, population: mean of (r - 1/3) δ' with
    # δ' centred on the scored rows (1, -1, 0: mean 0) = (2/3 - (-1/3) + 0) / 3 = 1/3; baseline 1/3 + 2/3 = 1.
    # B: rewards all 1, covariance 0, baseline 1. An unscored row's δ (100, 50) counts nowhere.
    batch = batch_of(rewards, per_func, seq_log_ratio=torch.tensor([1.0, 100.0, -1.0, 0.0, 2.0, 2.0, 2.0, 50.0]))
    out = rcc(batch)
    assert batch.metrics["rcc/covariance"] == pytest.approx((1 / 3 + 0) / 2)
    return out.tolist(), [0.0, 0.0, -1.0, -1.0, 0.0, 0.0, 0.0, 0.0]


def _pta(rewards, per_func):
    def reward(roots, normalize):
        value = PlanValueReward(judge, normalize=normalize)
        parents = [-1 if r == i else r for i, r in enumerate(roots)]
        rollout = Rollout(prompt_ids=[[1]] * 8, completion_ids=[[5]] * 8, completions=[""] * 8, parents=parents,
                          shared=[0 if p < 0 else 1 for p in parents])  # fmt: skip
        value.trainer = SimpleNamespace(current_rollout=rollout, num_generations=G,
                                        model=SimpleNamespace(training=True))  # fmt: skip
        return value(COMPLETIONS)

    # Plans of two rows: (1, ?) is worth 1, not 1/2; (0, 0) 0; (1, 1) 1; (1, ?) 1.
    assert reward([0, 0, 2, 2, 4, 4, 6, 6], normalize=False) == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert plan_values(rewards, torch.tensor([0, 0, 2, 2, 4, 4, 6, 6])).tolist() == [1.0, 1.0, 0, 0, 1, 1, 1, 1]
    # Every row its own plan, standardised across the plans of its prompt: the unscored plan is left out of the
    # mean and std (which it made NaN for every plan) and stays unscored (None).
    values = reward(list(range(8)), normalize=True)
    assert values[1] is None and values[7] is None
    return [v for v in values if v is not None], [ADV_A[0], *ADV_A[2:], 0.0, 0.0, 0.0]


def _tree_opo(rewards, per_func):
    # Staged: r - 0.5 V, V = 0.75, 2/3 alternating (the sample tree's nodes "0" and "1"), centred on the scored rows.
    # A: 0.625, ?, -0.375, -1/3 -> mean -0.083333 / 3 = -0.027778; B: 0.625, 2/3, 0.625, ? -> mean 0.638889.
    values = torch.tensor([0.75, 2 / 3] * 4)
    got = staged_advantages(rewards, values, torch.arange(8) // G, alpha=0.5)
    expected = [0.652778, 0.0, -0.347222, -0.305556, -0.013889, 0.027778, -0.013889, 0.0]
    # The extension, on rows started from those nodes: the same advantages for the loss.
    extension = TreeOPO(SimpleNamespace(prefix_trees=SAMPLE_TREES, treeopo_question_column="question_id",
                                        treeopo_completions_per_prefix=1, treeopo_depth_mix="uniform_depth",
                                        treeopo_max_prefix_tokens=64, treeopo_advantage="staged", treeopo_alpha=0.5,
                                        treeopo_value="expectation", treeopo_sae_delta=0.1, seed=0))  # fmt: skip
    extension.trees = {tree.question_id: tree for tree in load_prefix_trees(SAMPLE_TREES)}
    extension.trainer = stub_trainer({})
    assert [extension.trees["add-5-8"].nodes[n].values["expectation"] for n in "01"] == pytest.approx([0.75, 2 / 3])
    batch = batch_of(rewards, per_func, notes={TREE_NOTE: [("add-5-8", "0"), ("add-5-8", "1")] * 4})
    extension.after_scoring(batch)
    assert batch.current_advantages.tolist() == pytest.approx(expected, abs=1e-4)
    # SAE: the unscored row is left out of the projection (and of N); pairs among the scored rows only.
    r0 = rewards[:G] - group_stats(rewards[:G], G).mean  # 2/3, NaN, -1/3, -1/3
    a = sae_project(r0, [(2, 0), (3, 0), (2, 3)], delta=0.1, mode="hard")
    assert a[1] == 0.0 and float((a**2).sum()) == pytest.approx(3.0) and float(a.sum()) == pytest.approx(0.0, abs=1e-6)
    assert a[2] + 0.1 <= a[3] + 1e-6 and a[3] + 0.1 <= a[0] + 1e-6
    with pytest.raises(ValueError, match=r"order_pairs name rows \[1\], whose r0 is NaN"):
        sae_project(r0, [(1, 0)])
    return got.tolist(), expected


def _dynamic_sampling(rewards, per_func):
    extension = DynamicSampling(0, None, seed=0)
    extension.column = None  # the filter reads the total
    # A varies over its scored rows; B's scored rows agree: flat, dropped (read as 0, B would vary and stay)
    assert varied_groups(rewards, G).tolist() == [True, False]
    return extension._varied_rows(batch_of(rewards, per_func)).tolist(), [True] * 4 + [False] * 4


CONSUMERS = {"group": _group, "hima": _hima, "nord": _nord, "rcc": _rcc, "pta": _pta, "tree_opo": _tree_opo,
             "dynamic_sampling": _dynamic_sampling}  # fmt: skip


@pytest.mark.parametrize("consumer", sorted(CONSUMERS))
def test_an_unscorable_row_is_left_out_of_every_group_statistic(consumer):
    rewards, per_func = scored([judge])
    got, expected = CONSUMERS[consumer](rewards, per_func)
    assert got == pytest.approx(expected, abs=1e-4)
    assert not any(isinstance(v, float) and math.isnan(v) for v in got)  # nothing is NaN where TRL's is not


# ------------------------------------------------------------------------------------------- pure functions
def test_node_group_statistics_leave_unscored_rows_out():
    rewards = torch.tensor([1.0, NAN, 0.0, 1.0, 1.0, NAN, 0.5])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    # group 0: 1, 0 (mean 0.5, std sqrt(0.5)); group 1: 1, 1 (flat); group 2: one row
    half = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert node_group_advantages(rewards, groups).tolist() == pytest.approx([half, 0, -half, 0, 0, 0, 0])
    assert select_node_groups(rewards, groups, k="all") == [0]  # read as 0, group 1 (1, 1, 0) would vary


def test_difficulty_stats_leave_unscored_rows_out():
    rewards = torch.tensor([1.0, NAN, 0.0, 0.0])  # one group of 4: mean 1/3 over 3 scored rows
    adv = {"none": group_advantages(rewards, 4, "none")}  # 2/3, 0, -1/3, -1/3
    stats = difficulty_stats(rewards, 4, ["hard"], ["hard"], adv)
    assert stats["mean"] == pytest.approx([1 / 3]) and stats["std"] == pytest.approx([STD_A])
    assert stats["mean_abs"]["none"] == pytest.approx([4 / 9])  # over the 3 scored rows, not 4


def test_plans_normalised_with_an_unscored_plan():
    from trl_grpo_ext.methods.pta import _normalise_across_plans

    # 3 plans of one prompt, worth 0.5, 0 and NaN (no row scored): mean 0.25, std sqrt(0.125) over the first two.
    values = torch.tensor([0.5, 0.5, 0.0, 0.0, NAN, NAN])
    out = _normalise_across_plans(values, torch.tensor([0, 0, 2, 2, 4, 4]), torch.zeros(6, dtype=torch.long))
    step = 0.25 / (math.sqrt(0.125) + 1e-4)
    assert out[:4].tolist() == pytest.approx([step, step, -step, -step]) and torch.isnan(out[4:]).all()


def test_all_unscored_groups_give_zero_advantages_as_in_trl():
    rewards = torch.tensor([NAN, NAN, 1.0, 0.0])
    for scale in ("group", "batch", "none"):
        out = group_advantages(rewards, 2, scale)
        assert out[:2].tolist() == [0.0, 0.0] and not torch.isnan(out).any()
    assert staged_advantages(rewards, torch.zeros(4), torch.tensor([0, 0, 1, 1])).tolist() == [0.0, 0.0, 0.5, -0.5]
    assert sae_project(torch.tensor([NAN, NAN]), []).tolist() == [0.0, 0.0]
