"""Tree-OPO: staged advantages and SAE by hand, prefix trees (read, validate, convert, build), training end to end."""

import json
import math
import random
from pathlib import Path

import pytest
import torch

from trl_grpo_ext import TreeOPOConfig, TreeOPOTrainer
from trl_grpo_ext.advantages import constraint_satisfaction, sae_project, staged_advantages, tree_order_pairs
from trl_grpo_ext.data.trees import (
    SAMPLE_OMEGAPRM,
    SAMPLE_TREES,
    build_prefix_trees,
    from_omegaprm,
    load_prefix_trees,
    prefixes_from_mcts,
    questions_dataset,
)
from trl_grpo_ext.methods.tree_opo import sample_prefixes
from trl_grpo_ext.tasks import addition_trees

from .conftest import make_config


# ---------------------------------------------------------------------------------------------- the maths by hand
def test_staged_advantages_one_group():
    # r - 0.5 V = [0.75, -0.25, 1.0, -0.5]; mean 0.25.
    a = staged_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0.5, 0.5, 0.0, 1.0]),
                          torch.zeros(4, dtype=torch.long))  # fmt: skip
    assert torch.allclose(a, torch.tensor([0.5, -0.5, 0.75, -0.75]))


def test_staged_advantages_several_groups_and_alpha_zero():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    values = torch.tensor([0.9, 0.1, 0.3, 0.3, 0.2, 0.8])
    groups = torch.tensor([7, 7, 2, 2, 5, 5])  # any labels
    assert torch.allclose(staged_advantages(rewards, values, groups, alpha=0.0),
                          torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]))  # fmt: skip
    # alpha 0.5: group 7: [0.55, -0.05] - 0.25; group 2: [-0.15, 0.85] - 0.35; group 5: [0.9, 0.6] - 0.75.
    assert torch.allclose(staged_advantages(rewards, values, groups),
                          torch.tensor([0.3, -0.3, -0.5, 0.5, 0.15, -0.15]))  # fmt: skip


def test_sae_feasible_input_is_returned_unchanged():
    r0 = torch.tensor([0.5, -0.5, 0.25, -0.25])
    assert torch.allclose(sae_project(r0, [(1, 0), (3, 2), (1, 2)], delta=0.2), r0)


def test_sae_infeasible_input_is_projected_soft_and_hard():
    r0 = torch.tensor([0.5, 0.5, -0.5, -0.5])
    # a_0 + 0.2 <= a_1: the closest point moves rows 0 and 1 apart by 0.1 each; ||a||^2 = 1.02 <= 4 (soft).
    soft = sae_project(r0, [(0, 1)], delta=0.2, mode="soft")
    assert torch.allclose(soft, torch.tensor([0.4, 0.6, -0.5, -0.5]), atol=1e-6)
    # hard: ||a||^2 = 4: a = P(s r0) = [0.5s - 0.1, 0.5s + 0.1, -0.5s, -0.5s] with s^2 + 0.02 = 4.
    s = math.sqrt(3.98)
    hard = sae_project(r0, [(0, 1)], delta=0.2, mode="hard")
    assert torch.allclose(hard, torch.tensor([0.5 * s - 0.1, 0.5 * s + 0.1, -0.5 * s, -0.5 * s]), atol=1e-5)
    for a in (soft, hard):
        assert abs(float(a.sum())) < 1e-6 and constraint_satisfaction(a, [(0, 1)], delta=0.2) == 1.0
    assert abs(float(hard @ hard) - 4.0) < 1e-5


def test_sae_soft_shrinks_onto_the_ball():
    # ||r0||^2 = 18 > N = 2: the closest point of the ball is r0 scaled to norm sqrt(2).
    assert torch.allclose(sae_project(torch.tensor([3.0, -3.0]), [], mode="soft"), torch.tensor([1.0, -1.0]))


def test_sae_satisfies_every_constraint_of_a_random_problem():
    rng = random.Random(0)
    r0 = torch.tensor([rng.gauss(0, 1) for _ in range(40)])
    r0 -= r0.mean()
    pairs = sorted({tuple(sorted(rng.sample(range(40), 2))) for _ in range(120)})  # i < j: acyclic
    for mode in ("soft", "hard"):
        a = sae_project(r0, pairs, delta=0.05, mode=mode)
        assert constraint_satisfaction(r0, pairs, 0.05) < 1.0
        assert constraint_satisfaction(a, pairs, 0.05) == 1.0
        assert abs(float(a.sum())) < 1e-5 and float(a @ a) <= 40 + 1e-4


def test_sae_errors():
    with pytest.raises(ValueError, match="cycle"):
        sae_project(torch.tensor([0.5, -0.5]), [(0, 1), (1, 0)], delta=0.1)
    with pytest.raises(ValueError, match="mode"):
        sae_project(torch.tensor([0.5, -0.5]), [], mode="medium")
    with pytest.raises(ValueError, match="distinct row indices"):
        sae_project(torch.tensor([0.5, -0.5]), [(0, 2)])


def test_order_pairs_from_the_sample_tree():
    tree = load_prefix_trees(SAMPLE_TREES)[0]
    # rows start from: the root (V 3/4), "We add" (V 2/3), a right sum (V 1), a wrong sum (V 0); rewards:
    nodes, rewards = ["0", "1", "2", "5"], [1.0, 1.0, 0.0, 0.0]
    values = [tree.nodes[n].values["expectation"] for n in nodes]

    def related(i, j):
        a, b = nodes[i], nodes[j]
        return tree.is_ancestor(a, b) or tree.is_ancestor(b, a) or tree.nodes[a].parent == tree.nodes[b].parent

    pairs = set(tree_order_pairs(rewards, values, related))
    # Outcome pairs (failures below successes), then: two successes from the root (3/4) and from node 1 (2/3):
    # the root is the easier start, so (0, 1); two failures from siblings 2 (1) and 5 (0): (2, 3).
    assert pairs == {(2, 0), (2, 1), (3, 0), (3, 1), (0, 1), (2, 3)}
    staged = staged_advantages(torch.tensor(rewards), torch.tensor(values), torch.zeros(4, dtype=torch.long))
    assert constraint_satisfaction(staged, pairs, 1e-4) == 1.0  # r - alpha V orders related starts by V
    assert constraint_satisfaction(torch.tensor(rewards) - 0.5, pairs, 1e-4) == 4 / 6  # ties do not order


# ---------------------------------------------------------------------------------------------- prefix trees
def _write(tmp_path, *trees):
    path = tmp_path / "trees.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in trees))
    return path


def _tree(nodes, qid="q1"):
    return {"question_id": qid, "prompt": "What is 1 + 1?", "solution": "2", "nodes": nodes}


def test_the_shipped_trees_are_the_scripted_teachers():
    assert [json.loads(line) for line in Path(SAMPLE_TREES).read_text().splitlines()] == addition_trees()


def test_node_values_and_the_prefix_dataset():
    tree = load_prefix_trees(SAMPLE_TREES)[0]
    values = {n: tree.nodes[n].values for n in ("0", "1", "2", "5")}
    assert values["0"] == {"expectation": 0.75, "optimistic": 1.0, "pessimistic": 0.0}  # leaves 3, 4, 7 right; 6 not
    assert values["1"]["expectation"] == pytest.approx(2 / 3)
    assert values["2"] == {"expectation": 1.0, "optimistic": 1.0, "pessimistic": 1.0}
    assert values["5"] == {"expectation": 0.0, "optimistic": 0.0, "pessimistic": 0.0}
    assert tree.nodes["3"].values["pessimistic"] == 1.0
    rows = prefixes_from_mcts(SAMPLE_TREES)
    assert len(rows) == 40 * 8
    row = rows[2]
    a, b = row["question_id"].split("-")[1:]
    assert row["prefix"] == f"We add {a} and {b}.\n\n{a} + {b} = {int(a) + int(b)}."
    assert (row["root_id"], row["node_id"], row["parent_id"], row["depth"]) == ("0", "2", "1", 2)
    assert (row["v_expectation"], row["v_optimistic"], row["v_pessimistic"]) == (1.0, 1.0, 1.0)
    questions = questions_dataset(SAMPLE_TREES)
    assert questions.column_names == ["prompt", "question_id", "solution"] and len(questions) == 40


def test_omegaprm_converter():
    (tree,) = from_omegaprm(SAMPLE_OMEGAPRM)
    assert tree.question_id == "question_0" and tree.fields == {"solution": "13"}
    leaves = {n.text: n.correct for n in tree.nodes.values() if n.terminal}
    assert leaves == {"The answer is 13.": 1.0, "6 + 7 = 12.": 0.0, "13": 1.0, "6 + 7 is about 14.": 0.25}
    assert tree.nodes[tree.root].values["expectation"] == pytest.approx((1 + 0 + 1 + 0.25) / 4)
    assert len(prefixes_from_mcts(SAMPLE_OMEGAPRM, layout="omegaprm")) == 7


@pytest.mark.parametrize(
    ("nodes", "match"),
    [
        ([], "question_id='q1': the tree is empty"),
        ([{"id": "0", "parent": None, "text": ""}, {"id": "1", "parent": "9", "text": "x", "correct": True}],
         "node '1': its parent '9' is not a node of the tree"),
        ([{"id": "0", "parent": None, "text": ""}, {"id": "1", "parent": "2", "text": "a"},
          {"id": "2", "parent": "1", "text": "b"}, {"id": "3", "parent": "0", "text": "c", "correct": True}],
         "node '1': nodes \\['1', '2'\\] form a cycle"),
        ([{"id": "0", "parent": None, "text": ""}, {"id": "1", "parent": "0", "text": "a"}],
         "question_id='q1': the tree has no terminal node with a known correctness"),
        ([{"id": "0", "parent": None, "text": ""}, {"id": "0", "parent": None, "text": ""}], "node id '0' appears twice"),
        ([{"id": "0", "parent": None, "text": ""}, {"id": "1", "parent": None, "text": "a", "correct": True}],
         "exactly one root"),
    ],
)  # fmt: skip
def test_bad_trees_fail_with_the_question_and_node(tmp_path, nodes, match):
    with pytest.raises(ValueError, match=match):
        load_prefix_trees(_write(tmp_path, _tree(nodes)))


def test_sampler_mixes_depths_of_one_root():
    tree = load_prefix_trees(SAMPLE_TREES)[0]
    rng = random.Random(0)
    for _ in range(20):
        chosen = sample_prefixes(tree, 4, "uniform_depth", rng)
        assert len(set(chosen)) == 4  # the tree has 4 inner nodes: all distinct
        assert all(not tree.nodes[n].terminal for n in chosen)
    deep = [sample_prefixes(tree, 2, "0,0,1", rng) for _ in range(10)]
    assert all(tree.nodes[n].depth == 2 for pair in deep for n in pair)
    with pytest.raises(ValueError, match="treeopo_depth_mix"):
        sample_prefixes(tree, 2, "0,0,0,1", rng)  # no inner node at depth 3


def test_build_prefix_trees_is_resumable(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    questions = questions_dataset(SAMPLE_TREES).select(range(3)).remove_columns([])

    def even_length(completions, **kwargs):  # some right, some wrong on a random model
        return [float(len(c[0]["content"]) % 2 == 0) for c in completions]

    out = tmp_path / "grown.jsonl"
    trees = build_prefix_trees(model, tokenizer, questions.select(range(2)), even_length, out, width=2, max_depth=2,
                               max_new_tokens=6, progress=False)  # fmt: skip
    assert [t.question_id for t in trees] == questions["question_id"][:2]
    for tree in trees:
        assert len(tree.nodes[tree.root].children) >= 1
        assert all(n.correct in (0.0, 1.0, 0.5) for n in tree.nodes.values() if n.terminal)
    calls = []
    original = model.generate
    monkeypatch.setattr(model, "generate", lambda *a, **k: calls.append(1) or original(*a, **k))
    again = build_prefix_trees(model, tokenizer, questions, even_length, out, width=2, max_depth=2, max_new_tokens=6,
                               progress=False)  # fmt: skip
    assert [t.question_id for t in again] == questions["question_id"]  # two kept, one grown
    assert calls and len(out.read_text().splitlines()) == 3
    before = len(calls)
    build_prefix_trees(model, tokenizer, questions, even_length, out, width=2, max_depth=2, progress=False)
    assert len(calls) == before  # everything done: nothing generated


# ---------------------------------------------------------------------------------------------- training
def _trainer(tiny_model_path, tokenizer, tmp_path, **overrides):
    settings = {"prefix_trees": SAMPLE_TREES, "per_device_train_batch_size": 8, "max_steps": 2, "logging_steps": 1}
    args = make_config(tmp_path, TreeOPOConfig, **{**settings, **overrides})
    return TreeOPOTrainer(model=str(tiny_model_path), reward_funcs="last_integer", args=args,
                          processing_class=tokenizer)  # fmt: skip


def test_tree_opo_trains_from_prefixes_with_staged_advantages(tiny_model_path, tokenizer, tmp_path):
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path)
    trees = trainer.extension("treeopo").trees
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    batch = trainer.last_batch
    nodes = batch.notes["treeopo_node"]
    assert len(nodes) == 8 and len({q for q, _ in nodes[:4]}) == 1 and len({q for q, _ in nodes[4:]}) == 1
    for start in (0, 4):  # a group: 4 distinct prefixes of one root, at mixed depths
        group = nodes[start : start + 4]
        assert len({n for _, n in group}) == 4
        assert len({trees[q].nodes[n].depth for q, n in group}) > 1
    # The prefix is context: the prompt ends with it, the completion (all the loss sees) does not hold it.
    for row, (qid, node) in enumerate(nodes):
        prefix = trees[qid].prefix(node)
        ids = tokenizer((prefix + "\n\n") if prefix else "", add_special_tokens=False)["input_ids"]
        prompt = batch._output["prompt_ids"][row][batch._output["prompt_mask"][row].bool()].tolist()
        assert prompt[len(prompt) - len(ids) :] == ids
        assert not prefix or prefix not in tokenizer.decode(batch.completion_ids[row])
    # Advantages are the staged heuristic of this batch's rewards and prefix values.
    values = torch.tensor([trees[q].nodes[n].values["expectation"] for q, n in nodes])
    expected = staged_advantages(batch.rewards, values, torch.arange(8) // 4)
    assert torch.allclose(batch.loss_advantages, expected)
    logged = [log for log in trainer.state.log_history if "treeopo/constraint_satisfaction" in log]
    assert len(logged) == 2 and logged[0]["treeopo/depths_per_group"] > 1
    assert logged[0]["treeopo/constraint_satisfaction"] == 1.0  # staged orders every related pair by V
    changed = sum((p - before[n]).abs().sum().item() for n, p in trainer.model.named_parameters())
    assert changed > 0


def test_tree_opo_sae_meets_every_constraint(tiny_model_path, tokenizer, tmp_path):
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, treeopo_advantage="sae_hard", max_steps=1)
    trainer.train()
    (logged,) = [log for log in trainer.state.log_history if "treeopo/constraint_satisfaction" in log]
    assert logged["treeopo/constraint_satisfaction"] == 1.0
    assert logged["treeopo/constraint_satisfaction_before"] < 1.0  # equal rewards leave related starts unordered
    a = trainer.last_batch.loss_advantages
    for start in (0, 4):
        assert abs(float(a[start : start + 4].sum())) < 1e-5
        assert float(a[start : start + 4] @ a[start : start + 4]) == pytest.approx(4.0, abs=1e-4)


def test_tree_opo_input_errors(tiny_model_path, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="prefix_trees"):
        TreeOPOTrainer(model=str(tiny_model_path), reward_funcs="last_integer",
                       args=make_config(tmp_path, TreeOPOConfig), processing_class=tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match="treeopo_completions_per_prefix=3"):
        make_config(tmp_path, TreeOPOConfig, prefix_trees=SAMPLE_TREES, treeopo_completions_per_prefix=3)
    with pytest.raises(ValueError, match="treeopo_advantage"):
        make_config(tmp_path, TreeOPOConfig, prefix_trees=SAMPLE_TREES, treeopo_advantage="sae")
    long_tree = _tree([{"id": "0", "parent": None, "text": ""}, {"id": "1", "parent": "0", "text": "step " * 400},
                       {"id": "2", "parent": "1", "text": "2", "correct": True}], qid="long")  # fmt: skip
    with pytest.raises(ValueError, match="question_id='long', node '1': its prefix is .* tokens, longer than"):
        _trainer(tiny_model_path, tokenizer, tmp_path, prefix_trees=str(_write(tmp_path, long_tree)))
    with pytest.raises(ValueError, match="have no tree in"):
        args = make_config(tmp_path, TreeOPOConfig, prefix_trees=SAMPLE_TREES, per_device_train_batch_size=8)
        missing = questions_dataset(SAMPLE_TREES).map(lambda row: {"question_id": "nope-" + row["question_id"]})
        TreeOPOTrainer(model=str(tiny_model_path), reward_funcs="last_integer", args=args, train_dataset=missing,
                       processing_class=tokenizer)  # fmt: skip


# ---------------------------------------------------------------------------------------------- the command line
def test_cli_grows_trees_then_trains_on_them(tmp_path, tiny_cache_dir, capsys):
    from trl_grpo_ext.cli import main

    trees = tmp_path / "trees.jsonl"
    grow = ["trees", "--tiny", "--cache_dir", str(tiny_cache_dir), "--limit", "2", "--width", "2", "--max_depth", "2",
            "--max_new_tokens", "6", "--output", str(trees)]  # fmt: skip
    assert main(grow) == 0
    assert "2 prefix trees" in capsys.readouterr().out and len(load_prefix_trees(trees)) == 2
    train = ["train", "--tiny", "--cache_dir", str(tiny_cache_dir), "--trainer", "tree_opo", "--prefix_trees",
             str(trees), "--max_steps", "1", "--output_dir", str(tmp_path / "run")]  # fmt: skip
    assert main(train) == 0
    assert "Trained 1 steps" in capsys.readouterr().out
    assert main([*train[:7], str(tmp_path / "missing.jsonl"), *train[8:]]) == 2
    err = capsys.readouterr().err
    assert "prefix_trees=" in err and "missing.jsonl" in err and "no such file" in err
