"""HiMA-R1's model-free pieces: the hierarchy's validation, node-group maths and the memory store, by hand."""

import json
import math

import pytest
import torch

from trl_grpo_ext.methods.hima import Agent, Hierarchy, MemoryStore, node_group_advantages, select_node_groups


def toy(**changes):
    agents = {"router": {"role": "Route.", "routes": ["calc", "qa"]}, "calc": {"role": "Compute."},
              "qa": {"role": "Answer."}}  # fmt: skip
    for name, fields in changes.items():
        agents[name] = {**agents.get(name, {"role": "x"}), **fields}
    return {"master": "router", "agents": agents}


def test_hierarchy_from_a_mapping():
    h = Hierarchy.from_dict({**toy(), "max_calls": 3})
    assert h.order() == ["router", "calc", "qa"] and h.max_calls == 3
    assert h.agent("calc").routes == []


@pytest.mark.parametrize(
    "spec, message",
    [
        (toy(router={"routes": ["calc", "search"]}), "routes to 'search', which does not exist"),
        (toy(calc={"routes": ["qa"]}, qa={"routes": ["calc"]}), r"cycle \((calc -> qa -> calc|qa -> calc -> qa)\)"),
        (toy(qa={"routes": ["router"]}), "routes back to the master 'router'"),
        (toy(extra={"role": "Never called."}), r"agents \['extra'\] are never called"),
        ({**toy(), "master": "boss"}, "master='boss' is not one of the agents"),
        (toy(calc={"temperature": 0.3}), r"unknown fields \['temperature'\]"),
        ({**toy(), "max_calls": 0}, "max_calls=0 must be a whole number >= 1"),
    ],
    ids=["unknown_route", "cycle", "back_to_master", "unreachable", "no_master", "unknown_field", "max_calls"],
)
def test_bad_hierarchies_fail_before_training(spec, message):
    with pytest.raises(ValueError, match=message):
        Hierarchy.from_dict(spec)


def test_bad_agents():
    with pytest.raises(ValueError, match="agent name 'my agent'"):
        Agent("my agent", "Route.")
    with pytest.raises(ValueError, match="two agents are named 'a'"):
        Hierarchy([Agent("a", "x"), Agent("a", "y")], master="a")


def test_node_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.2])
    groups = torch.tensor([0, 0, 1, 1, 2])
    adv = node_group_advantages(rewards, groups)
    half = 0.5 / (math.sqrt(0.5) + 1e-4)  # group 0: mean 0.5, unbiased std sqrt(0.5)
    assert adv.tolist() == pytest.approx([half, -half, 0.0, 0.0, 0.0])  # group 1 does not vary; group 2 is alone
    assert node_group_advantages(rewards, groups, scale=False).tolist() == pytest.approx([0.5, -0.5, 0, 0, 0])


def test_top_k_node_groups_by_variance():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.9, 0.1])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])  # variances 0.5, 0, 0.125, 0.32
    assert select_node_groups(rewards, groups, k=1) == [0]
    assert select_node_groups(rewards, groups, k=2) == [0, 3]
    assert select_node_groups(rewards, groups, k="all") == [0, 2, 3]  # group 1 carries no signal
    assert select_node_groups(rewards, groups, k=9) == [0, 2, 3]
    with pytest.raises(ValueError, match="hima_top_k=0"):
        select_node_groups(rewards, groups, k=0)


def test_memory_decisions_on_a_hand_built_stream():
    memory = MemoryStore(warmup=4, window=10, capacity=3)
    decisions = [memory.observe(k, f"{k} worked", r, step=i) for i, (k, r) in
                 enumerate([("a", 0.2), ("b", 0.4), ("c", 0.6), ("d", 0.8)])]  # fmt: skip
    assert decisions == ["add"] * 4  # warm-up: the store fills
    assert sorted(memory.entries) == ["b", "c", "d"]  # capacity 3: 'a' (oldest, lowest reward) went
    # rewards seen 0.2 0.4 0.6 0.8: q_2.5 = 0.2 + 0.075 * 0.2 = 0.215, q_97.5 = 0.8 - 0.075 * 0.2 = 0.785
    assert memory.thresholds() == pytest.approx((0.215, 0.785))
    assert memory.observe("c", "c again", 0.5, step=5) == "update"  # between the quantiles: reward mean (0.6+0.5)/2
    assert memory.entries["c"].reward == pytest.approx(0.55) and memory.entries["c"].content == "c worked"
    assert memory.observe("zz", "new", 0.5, step=6) == "keep"  # ordinary and unknown: not added
    assert memory.observe("b", "failed", 0.0, step=7) == "delete"  # below q_2.5
    assert "b" not in memory.entries
    assert memory.observe("e", "great", 1.0, step=8) == "add"  # above q_97.5
    assert memory.entries["e"].content == "great"
    # score = 0.5 * 0.5 ** (age / 50) + 0.5 * reward
    assert memory.score(memory.entries["d"], now=53) == pytest.approx(0.5 * 0.5 + 0.5 * 0.8)


def test_memory_resume_is_exact():
    memory = MemoryStore(warmup=3, capacity=4)
    stream = [("what is 2 + 3", "add them", 1.0), ("what is 4 + 4", "add", 0.0), ("capital of france", "paris", 0.7),
              ("what is 9 + 1", "add them", 0.9), ("what is 1 + 1", "guess", 0.1)]  # fmt: skip
    for i, (k, c, r) in enumerate(stream):
        memory.observe(k, c, r, step=i)
    restored = MemoryStore(warmup=3, capacity=4)
    restored.load_state_dict(json.loads(json.dumps(memory.state_dict())))  # through a checkpoint's JSON
    assert restored.state_dict() == memory.state_dict()
    assert [e.key for e in restored.retrieve("what is 2 + 2")] == [e.key for e in memory.retrieve("what is 2 + 2")]
    assert restored.observe("what is 5 + 5", "add", 0.95, step=9) == memory.observe(
        "what is 5 + 5", "add", 0.95, step=9
    )
    assert restored.state_dict() == memory.state_dict()
