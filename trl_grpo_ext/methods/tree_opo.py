"""Tree-OPO: learn from a teacher's prefix trees ("Tree-OPO: Off-policy Monte Carlo Tree-Guided Advantage
Optimization for Multistep Reasoning", arXiv 2509.09284).

A teacher's search gives, per question, a tree of partial solutions (`trl_grpo_ext.data.trees`). Each group of
`num_generations` rows of one question gets K = num_generations / `treeopo_completions_per_prefix` prefixes of that
question's tree at mixed depths; the student completes each, the prefix is context (after the assistant header, never
trained), and the reward scores the student's completion. Deep prefixes are easy, so credit is staged:

- `treeopo_advantage="staged"` (default): a_i = r_i - alpha * V(p_i), minus its group mean, no std division;
- `"sae_soft"` / `"sae_hard"`: the mean-centred rewards projected onto the tree's ordering constraints
  (`trl_grpo_ext.advantages.sae_project`, pairs from `tree_order_pairs`), ||a||^2 <= N or = N per group.

The tree lives in this extension (read from `prefix_trees`); the training rows carry only the question id, and the
node each row started from is a plan note (`RolloutPlan.note`), never a column that reward functions see.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
from dataclasses import dataclass, field

import torch

from ..advantages import constraint_satisfaction, group_stats, sae_project, staged_advantages, tree_order_pairs
from ..extension import Extension, Method, TrainerInputs, register_method
from ..rollout import RolloutPlan

ADVANTAGES = ("staged", "sae_soft", "sae_hard")
VALUES = ("expectation", "optimistic", "pessimistic")
NOTE = "treeopo_node"
STRICT = 1e-4  # the margin that counts as "ordered" for the staged advantages


@dataclass
class TreeOPOConfigSection:
    """Config section: Tree-OPO (arXiv 2509.09284).

    > Parameters of Tree-OPO (prefix trees, staged advantages; `trl_grpo_ext.methods.tree_opo`)

    prefix_trees (`str`, *optional*):
        Path of the trees file (JSONL, `trl_grpo_ext.data.trees`). Setting it switches Tree-OPO on; the training
        rows name their tree in `treeopo_question_column`.
    treeopo_question_column (`str`, *optional*, defaults to `"question_id"`):
        Dataset column holding each row's tree id.
    treeopo_completions_per_prefix (`int`, *optional*, defaults to `1`):
        Completions of each prefix (the paper: 1). A group holds num_generations / this many prefixes.
    treeopo_depth_mix (`str`, *optional*, defaults to `"uniform_depth"`):
        How a group's prefixes are drawn from the tree's inner nodes: `"uniform_depth"` (a depth uniformly among
        those the tree has, then a node of it), `"uniform_node"` (every inner node alike), or weights per depth
        `"w0,w1,..."` (depth 0 is the bare question; depths beyond the list get weight 0). Distinct nodes while
        the tree has enough.
    treeopo_max_prefix_tokens (`int`, *optional*, defaults to `512`):
        The prompt budget of a prefix: a tree with a longer prefix is an error naming the question and node.
    treeopo_advantage (`str`, *optional*, defaults to `"staged"`):
        `"staged"` (r - alpha V, centred per group), `"sae_soft"` or `"sae_hard"` (SAE projection).
    treeopo_alpha (`float`, *optional*, defaults to `0.5`):
        alpha of the staged advantage (the paper's 0.5).
    treeopo_value (`str`, *optional*, defaults to `"expectation"`):
        V(p): `"expectation"` (success rate below p; the paper's best), `"optimistic"`, `"pessimistic"`.
    treeopo_sae_delta (`float`, *optional*, defaults to `0.1`):
        The margin delta of SAE's ordering constraints a_i + delta <= a_j.
    """

    prefix_trees: str | None = field(
        default=None, metadata={"help": "Tree-OPO: path of the prefix-trees file (JSONL); switches Tree-OPO on."}
    )
    treeopo_question_column: str = field(
        default="question_id", metadata={"help": "Tree-OPO: dataset column naming each row's tree."}
    )
    treeopo_completions_per_prefix: int = field(
        default=1, metadata={"help": "Tree-OPO: completions per prefix; num_generations / this prefixes a group."}
    )
    treeopo_depth_mix: str = field(
        default="uniform_depth",
        metadata={"help": "Tree-OPO: 'uniform_depth', 'uniform_node', or weights per depth 'w0,w1,...'."},
    )
    treeopo_max_prefix_tokens: int = field(
        default=512, metadata={"help": "Tree-OPO: the longest prefix (tokens) a tree may hold."}
    )
    treeopo_advantage: str = field(
        default="staged", metadata={"help": "Tree-OPO: 'staged' (r - alpha V, centred), 'sae_soft' or 'sae_hard'."}
    )
    treeopo_alpha: float = field(default=0.5, metadata={"help": "Tree-OPO: alpha of r - alpha V. Paper: 0.5."})
    treeopo_value: str = field(
        default="expectation", metadata={"help": "Tree-OPO: V(p): 'expectation', 'optimistic' or 'pessimistic'."}
    )
    treeopo_sae_delta: float = field(
        default=0.1, metadata={"help": "Tree-OPO: SAE margin delta (a_i + delta <= a_j)."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.prefix_trees is None:
            return
        if not isinstance(self.prefix_trees, str) or not self.prefix_trees:
            raise ValueError(f"prefix_trees={self.prefix_trees!r} must be the path of a trees file (JSONL).")
        if not os.path.isfile(self.prefix_trees):
            raise ValueError(
                f"prefix_trees={self.prefix_trees!r}: no such file; grow the trees first (`trl-grpo-ext trees`, or "
                "trl_grpo_ext.data.build_prefix_trees), or give the path of an existing trees file (JSONL)."
            )
        per = self.treeopo_completions_per_prefix
        if isinstance(per, bool) or not isinstance(per, int) or per < 1 or self.num_generations % per:
            raise ValueError(
                f"treeopo_completions_per_prefix={per!r} must be a whole number >= 1 dividing num_generations "
                f"({self.num_generations}); e.g. 1 (the paper: one completion per prefix)."
            )
        if self.treeopo_advantage not in ADVANTAGES:
            raise ValueError(f"treeopo_advantage={self.treeopo_advantage!r}; use one of {', '.join(ADVANTAGES)}.")
        if self.treeopo_value not in VALUES:
            raise ValueError(f"treeopo_value={self.treeopo_value!r}; use one of {', '.join(VALUES)}.")
        if self.treeopo_sae_delta < 0:
            raise ValueError(f"treeopo_sae_delta={self.treeopo_sae_delta!r} must be >= 0.")
        if isinstance(self.treeopo_max_prefix_tokens, bool) or self.treeopo_max_prefix_tokens < 1:
            raise ValueError(f"treeopo_max_prefix_tokens={self.treeopo_max_prefix_tokens!r} must be >= 1.")
        depth_weights(self.treeopo_depth_mix)
        self.require_whole_groups("Tree-OPO (a group's prefixes are drawn together)")


def depth_weights(mix: str) -> list[float] | None:
    """The per-depth weights of `treeopo_depth_mix` ("w0,w1,..."), or None for the named mixes."""
    if mix in ("uniform_depth", "uniform_node"):
        return None
    try:
        weights = [float(w) for w in str(mix).split(",")]
    except ValueError:
        weights = []
    if not weights or any(w < 0 or math.isnan(w) for w in weights) or not any(weights):
        raise ValueError(
            f"treeopo_depth_mix={mix!r}; use 'uniform_depth', 'uniform_node', or non-negative weights per depth such "
            "as '1,1,2' (depth 0 is the bare question), at least one of them > 0."
        )
    return weights


def sample_prefixes(tree, k: int, mix: str, rng: random.Random) -> list[str]:
    """K node ids of `tree` for one group: inner nodes with a value, drawn by `mix`, distinct while enough exist."""
    candidates = [n for n in tree.nodes.values() if not n.terminal and not math.isnan(n.values["expectation"])]
    weights = depth_weights(mix)
    if weights is not None:
        candidates = [n for n in candidates if n.depth < len(weights) and weights[n.depth] > 0]
    if not candidates:
        raise ValueError(
            f"question_id={tree.question_id!r}: no prefix node fits treeopo_depth_mix={mix!r} (inner nodes with a "
            "known value at the weighted depths)."
        )
    chosen: list[str] = []
    pool = list(candidates)
    while len(chosen) < k:
        if not pool:
            pool = list(candidates)  # fewer nodes than prefixes: draw again, with repeats
        if mix == "uniform_node":
            node = rng.choice(pool)
        else:
            depths = sorted({n.depth for n in pool})
            depth_w = [1.0] * len(depths) if weights is None else [weights[d] for d in depths]
            depth = rng.choices(depths, weights=depth_w)[0]
            node = rng.choice([n for n in pool if n.depth == depth])
        chosen.append(node.id)
        pool.remove(node)
    return chosen


class TreeOPO(Extension):
    """Tree-OPO's extension: prefixes from the trees into each group's context, staged or SAE advantages."""

    name = "treeopo"

    def __init__(self, args):
        self.path = args.prefix_trees
        self.column = args.treeopo_question_column
        self.per_prefix = args.treeopo_completions_per_prefix
        self.mix = args.treeopo_depth_mix
        self.max_prefix_tokens = args.treeopo_max_prefix_tokens
        self.advantage = args.treeopo_advantage
        self.alpha = args.treeopo_alpha
        self.value = args.treeopo_value
        self.delta = args.treeopo_sae_delta
        self.seed = args.seed
        self.trees: dict = {}
        self._prefix_ids: dict[tuple[str, str], list[int]] = {}
        self._calls = (-1, 0)  # (step, prepare calls in it): refills of one step draw new prefixes

    def check(self, inputs: TrainerInputs) -> None:
        from ..data.trees import load_prefix_trees

        estimator = getattr(inputs.args, "advantage_estimator", "group")
        if estimator != "group":
            raise ValueError(
                f"advantage_estimator={estimator!r}, but Tree-OPO computes its own advantages (treeopo_advantage="
                f"{self.advantage!r}); leave advantage_estimator='group' with prefix_trees set."
            )
        self.trees = {tree.question_id: tree for tree in load_prefix_trees(self.path)}
        dataset = inputs.train_dataset
        names = getattr(dataset, "column_names", None)
        if names is not None:
            if self.column not in names:
                raise ValueError(
                    f"treeopo_question_column={self.column!r}, but the training dataset has no such column (columns: "
                    f"{names}); each row names its tree there (`trl_grpo_ext.data.trees.questions_dataset` builds it)."
                )
            missing = sorted({str(q) for q in dataset[self.column]} - set(self.trees))
            if missing:
                raise ValueError(
                    f"{len(missing)} question id(s) of the training dataset have no tree in {self.path}: "
                    f"{missing[:5]}{' ...' if len(missing) > 5 else ''}; add their trees or drop those rows."
                )

    def setup(self, trainer) -> None:
        super().setup(trainer)
        tokenizer = trainer.tokenizer
        for tree in self.trees.values():
            for node in tree.nodes.values():
                if node.terminal:
                    continue
                text = tree.prefix(node.id)
                ids = tokenizer((text + tree.delimiter) if text else "", add_special_tokens=False)["input_ids"]
                if len(ids) > self.max_prefix_tokens:
                    raise ValueError(
                        f"question_id={tree.question_id!r}, node {node.id!r}: its prefix is {len(ids)} tokens, longer "
                        f"than treeopo_max_prefix_tokens={self.max_prefix_tokens}; raise the budget or prune the tree."
                    )
                self._prefix_ids[(tree.question_id, node.id)] = ids

    def _rng(self, qid: str, group: int) -> random.Random:
        # `group` counts the batch's groups over all processes: a group draws the prefixes it would draw with the
        # whole batch on one process, whichever process holds it.
        step = self.trainer.state.global_step
        calls = self._calls[1] if self._calls[0] == step else 0
        key = f"{self.seed}/{step}/{calls}/{group}/{qid}"
        return random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))

    def prepare(self, plan: RolloutPlan) -> None:
        if plan.mode != "train":
            return  # evaluation: the student alone, from the bare question
        g = plan.num_generations
        k = g // self.per_prefix
        nodes, context = [], []
        first = self.trainer.accelerator.process_index * (len(plan.rows) // g)  # every process holds as many groups
        for start in range(0, len(plan.rows), g):
            qid = str(plan.rows[start][self.column])
            if qid not in self.trees:
                raise KeyError(f"{self.column}={qid!r} has no tree in {self.path}.")
            chosen = sample_prefixes(self.trees[qid], k, self.mix, self._rng(qid, first + start // g))
            for offset in range(g):
                node = chosen[offset // self.per_prefix]
                nodes.append((qid, node))
                context.append(self._prefix_ids[(qid, node)])
        step = self.trainer.state.global_step
        self._calls = (step, (self._calls[1] if self._calls[0] == step else 0) + 1)
        for row in plan.rows:
            row.pop("nodes", None)  # a trees file used as the dataset: the structure stays out of the rewards
        plan.add_context(context)
        plan.note(NOTE, nodes)

    def after_scoring(self, batch) -> None:
        if batch.mode != "train" or NOTE not in batch.notes:
            return
        nodes = batch.notes[NOTE]
        rewards = batch.local(batch.rewards).float().cpu()  # NaN: unscorable, left out of every group statistic
        values = torch.tensor([self.trees[q].nodes[n].values[self.value] for q, n in nodes])
        g = batch.num_generations
        groups = torch.arange(len(nodes)) // g
        advantages = torch.zeros_like(rewards)
        before, after, depths = [], [], []
        for start in range(0, len(nodes), g):
            rows = slice(start, start + g)
            r, v = rewards[rows], values[rows]
            stats = group_stats(r, g)
            r0 = r - stats.mean  # NaN on unscored rows: they are in no pair, and SAE leaves them out (advantage 0)
            pairs = self.order_pairs(nodes[rows], r, v)
            if self.advantage == "staged":
                a = staged_advantages(r, v, groups[rows], alpha=self.alpha)
            else:
                a = sae_project(r0, pairs, delta=self.delta, mode=self.advantage.removeprefix("sae_"))
            advantages[rows] = a
            delta = self.delta if self.advantage != "staged" else STRICT  # staged: a tie does not order two rows
            before.append(constraint_satisfaction(r0, pairs, delta))
            after.append(constraint_satisfaction(a, pairs, delta))
            depths.append(len({self.trees[q].nodes[n].depth for q, n in nodes[rows]}))
        batch.set_advantages(advantages.to(batch.completion_mask.device), source="Tree-OPO")
        self.log("constraint_satisfaction_before", sum(before) / len(before))
        self.log("constraint_satisfaction", sum(after) / len(after))
        self.log("advantage_var", float(advantages.var(unbiased=False)))
        self.log("prefix_depth", sum(self.trees[q].nodes[n].depth for q, n in nodes) / len(nodes))
        self.log("prefix_value", float(values.mean()))
        self.log("depths_per_group", sum(depths) / len(depths))

    def order_pairs(self, nodes: list[tuple[str, str]], rewards, values) -> list[tuple[int, int]]:
        """The SAE ordering pairs of one group's rows (`tree_order_pairs`), from their prefix nodes."""
        tree = self.trees[nodes[0][0]]
        ids = [n for _, n in nodes]

        def related(i, j):
            a, b = ids[i], ids[j]
            siblings = tree.nodes[a].parent is not None and tree.nodes[a].parent == tree.nodes[b].parent
            return a != b and (siblings or tree.is_ancestor(a, b) or tree.is_ancestor(b, a))

        return tree_order_pairs(rewards, values, related)


def _from_config(args) -> TreeOPO | None:
    if getattr(args, "prefix_trees", None) is None:
        return None
    return TreeOPO(args)


register_method(Method(name="treeopo", title="Tree-OPO (tree-guided staged advantages)", arxiv="2509.09284",
                       extension=_from_config, trainer="TreeOPOTrainer", config="TreeOPOConfig",
                       cli_name="tree_opo"))  # fmt: skip
