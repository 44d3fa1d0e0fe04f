"""Prefix trees for Tree-OPO (arXiv 2509.09284): read, validate, convert, build, and turn into datasets.

A prefix tree holds a teacher's partial solutions of one question: every node is one reasoning step, and a node's
prefix is the steps on the path from the root to it, joined by the tree's delimiter. Leaves are terminal (a whole
solution, or where the search stopped) and carry their correctness where it is known.

The trees file (JSONL, one tree per line)::

    {"question_id": "q7",                       # unique; the training rows name their tree by it
     "prompt": [{"role": "user", "content": "What is 3 + 4?"}],   # or plain text, as in TRL datasets
     "delimiter": "\\n\\n",                       # optional (default a blank line): joins steps into a prefix
     "solution": "7", ...,                      # any other fields: columns of the training rows (rewards see them)
     "nodes": [
        {"id": "0", "parent": null, "text": ""},                # exactly one root: the question alone
        {"id": "1", "parent": "0", "text": "3 + 4 = 7"},
        {"id": "2", "parent": "1", "text": "The answer is 7.", "correct": true},
        {"id": "3", "parent": "0", "text": "3 + 4 = 8", "correct": false}]}

`correct` on a leaf: true, false, a success rate in [0, 1] (Monte Carlo rollouts from that leaf), or null/absent
when unknown. Node values come from the known leaves of its subtree: V_E (expectation) their mean correctness, V_opt
(optimistic) 1 if any of them succeeds, V_pess (pessimistic) 1 if none of them fails. A node whose subtree has no
known leaf has no value (NaN) and is never used as a prefix. Optional per-node `teacher_logprobs` are kept in the
prefix dataset; training does not use them yet (the paper's off-policy ratio is not implemented).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "PrefixTree",
    "TreeNode",
    "load_prefix_trees",
    "write_prefix_trees",
    "prefixes_from_mcts",
    "questions_dataset",
    "from_omegaprm",
    "build_prefix_trees",
    "DEFAULT_DELIMITER",
    "SAMPLE_TREES",
    "SAMPLE_OMEGAPRM",
]

DEFAULT_DELIMITER = "\n\n"
_SAMPLES = Path(__file__).parent / "samples"
SAMPLE_TREES = str(_SAMPLES / "addition_trees.jsonl")  # scripted teacher trees for the 40 training additions
SAMPLE_OMEGAPRM = str(_SAMPLES / "omegaprm")  # one question in OmegaPRM's output layout (for `from_omegaprm`)
_RESERVED = {"question_id", "prompt", "delimiter", "nodes"}


@dataclass
class TreeNode:
    id: str
    parent: str | None
    text: str
    correct: float | None = None  # leaves: 1.0 / 0.0 / a success rate; None unknown
    teacher_logprobs: list[float] | None = None
    children: list[str] = field(default_factory=list)
    depth: int = 0
    values: dict[str, float] = field(default_factory=dict)  # expectation, optimistic, pessimistic (NaN: none)

    @property
    def terminal(self) -> bool:
        return not self.children


@dataclass
class PrefixTree:
    """One question's tree, validated: nodes by id, children, depths and values filled in."""

    question_id: str
    prompt: object
    nodes: dict[str, TreeNode]
    root: str
    delimiter: str = DEFAULT_DELIMITER
    fields: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, record: dict, where: str = "") -> PrefixTree:
        """Validate one JSONL record; every error names the question id and the node."""
        qid = record.get("question_id")
        label = f"{where}question_id={qid!r}"
        if qid is None or (isinstance(qid, str) and not qid):
            raise ValueError(f"{where}a tree has no question_id; give every tree a unique 'question_id'.")
        qid = str(qid)
        if "prompt" not in record:
            raise ValueError(f"{label}: the tree has no 'prompt' (the question, text or chat messages).")
        raw = record.get("nodes") or []
        if not raw:
            raise ValueError(f"{label}: the tree is empty (no 'nodes'); give at least a root and one terminal node.")
        nodes: dict[str, TreeNode] = {}
        for item in raw:
            if "id" not in item:
                raise ValueError(f"{label}: a node has no 'id': {item!r}.")
            node_id = str(item["id"])
            if node_id in nodes:
                raise ValueError(f"{label}: node id {node_id!r} appears twice; node ids must be unique in a tree.")
            parent = item.get("parent")
            correct = item.get("correct")
            if isinstance(correct, bool):
                correct = float(correct)
            elif correct is not None:
                if not isinstance(correct, (int, float)) or not 0.0 <= float(correct) <= 1.0:
                    raise ValueError(
                        f"{label}, node {node_id!r}: correct={correct!r} must be true, false, a success rate in "
                        "[0, 1], or null (unknown)."
                    )
                correct = float(correct)
            text = item.get("text", "")
            if not isinstance(text, str):
                raise ValueError(f"{label}, node {node_id!r}: text={text!r} must be a string (the step's text).")
            nodes[node_id] = TreeNode(id=node_id, parent=None if parent is None else str(parent), text=text,
                                      correct=correct, teacher_logprobs=item.get("teacher_logprobs"))  # fmt: skip
        roots = [n.id for n in nodes.values() if n.parent is None]
        if len(roots) != 1:
            raise ValueError(
                f"{label}: a tree has exactly one root (a node with parent null); found {len(roots)}: {roots}."
            )
        for node in nodes.values():
            if node.parent is not None:
                if node.parent not in nodes:
                    raise ValueError(
                        f"{label}, node {node.id!r}: its parent {node.parent!r} is not a node of the tree (an orphan)."
                    )
                nodes[node.parent].children.append(node.id)
        # Depths from the root; a node not reached sits on a cycle.
        order, stack = [], [(roots[0], 0)]
        while stack:
            node_id, depth = stack.pop()
            nodes[node_id].depth = depth
            order.append(node_id)
            stack.extend((child, depth + 1) for child in nodes[node_id].children)
        if len(order) != len(nodes):
            stuck = sorted(set(nodes) - set(order))
            raise ValueError(f"{label}, node {stuck[0]!r}: nodes {stuck} form a cycle (they never reach the root).")
        for node in nodes.values():
            if node.children and node.correct is not None:
                raise ValueError(
                    f"{label}, node {node.id!r}: only terminal nodes (leaves) carry 'correct'; this one has children "
                    f"{node.children}."
                )
        if not any(n.terminal and n.correct is not None for n in nodes.values()):
            raise ValueError(
                f"{label}: the tree has no terminal node with a known correctness (a leaf with 'correct'); node "
                "values cannot be computed."
            )
        delimiter = record.get("delimiter", DEFAULT_DELIMITER)
        fields = {k: v for k, v in record.items() if k not in _RESERVED}
        tree = cls(question_id=qid, prompt=record["prompt"], nodes=nodes, root=roots[0], delimiter=delimiter,
                   fields=fields)  # fmt: skip
        tree._fill_values(order)
        return tree

    def _fill_values(self, order: list[str]) -> None:
        below: dict[str, list[float]] = {}
        for node_id in reversed(order):  # children before parents
            node = self.nodes[node_id]
            known = [node.correct] if node.terminal and node.correct is not None else []
            for child in node.children:
                known += below[child]
            below[node_id] = known
            nan = float("nan")
            node.values = {
                "expectation": sum(known) / len(known) if known else nan,
                "optimistic": float(any(x > 0 for x in known)) if known else nan,
                "pessimistic": float(all(x >= 1.0 for x in known)) if known else nan,
            }

    def path(self, node_id: str) -> list[str]:
        """The node ids from the root to `node_id`, both included."""
        path = [node_id]
        while self.nodes[path[-1]].parent is not None:
            path.append(self.nodes[path[-1]].parent)
        return path[::-1]

    def prefix(self, node_id: str) -> str:
        """The text of the steps from the root to `node_id`, joined by the delimiter."""
        return self.delimiter.join(self.nodes[n].text for n in self.path(node_id) if self.nodes[n].text)

    def is_ancestor(self, ancestor: str, node: str) -> bool:
        """Whether `ancestor` is a proper ancestor of `node`."""
        while self.nodes[node].parent is not None:
            node = self.nodes[node].parent
            if node == ancestor:
                return True
        return False

    def to_dict(self) -> dict:
        nodes = []
        for node in self.nodes.values():
            item = {"id": node.id, "parent": node.parent, "text": node.text}
            if node.correct is not None:
                item["correct"] = node.correct
            if node.teacher_logprobs is not None:
                item["teacher_logprobs"] = node.teacher_logprobs
            nodes.append(item)
        return {"question_id": self.question_id, "prompt": self.prompt, "delimiter": self.delimiter, **self.fields,
                "nodes": nodes}  # fmt: skip


def load_prefix_trees(path: str | os.PathLike) -> list[PrefixTree]:
    """Read and validate a trees file (JSONL, format in this module's docstring); errors name the line and tree."""
    trees, seen = [], {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path}, line {number}: "
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}not valid JSON ({error.msg}); one tree per line.") from None
            tree = PrefixTree.from_dict(record, where)
            if tree.question_id in seen:
                raise ValueError(
                    f"{where}question_id={tree.question_id!r} already names the tree on line {seen[tree.question_id]}."
                )
            seen[tree.question_id] = number
            trees.append(tree)
    if not trees:
        raise ValueError(f"{path} holds no trees; write one JSON tree per line.")
    return trees


def write_prefix_trees(trees: Iterable[PrefixTree | dict], path: str | os.PathLike, append: bool = False) -> None:
    """Write trees as JSONL (each validated first)."""
    with open(path, "a" if append else "w", encoding="utf-8") as handle:
        for tree in trees:
            tree = tree if isinstance(tree, PrefixTree) else PrefixTree.from_dict(tree)
            handle.write(json.dumps(tree.to_dict(), ensure_ascii=False) + "\n")


def prefixes_from_mcts(path: str | os.PathLike, layout: str = "jsonl"):
    """The prefix dataset: one row per tree node, from a trees file (`layout="jsonl"`) or OmegaPRM output
    (`layout="omegaprm"`, see `from_omegaprm`).

    Columns: `prompt`, `prefix` (the node's steps, joined), `question_id`, `root_id`, `node_id`, `parent_id`
    (None for the root), `depth`, `terminal`, `correct`, `v_expectation`, `v_optimistic`, `v_pessimistic` (NaN
    where the subtree has no known leaf), `teacher_logprobs` (if any node has them), plus the trees' other fields.
    """
    from datasets import Dataset

    trees = _read(path, layout)
    rows = []
    keep_logprobs = any(n.teacher_logprobs is not None for t in trees for n in t.nodes.values())
    for tree in trees:
        for node in tree.nodes.values():
            row = {"prompt": tree.prompt, "prefix": tree.prefix(node.id), "question_id": tree.question_id,
                   "root_id": tree.root, "node_id": node.id, "parent_id": node.parent, "depth": node.depth,
                   "terminal": node.terminal, "correct": node.correct, "v_expectation": node.values["expectation"],
                   "v_optimistic": node.values["optimistic"], "v_pessimistic": node.values["pessimistic"],
                   **tree.fields}  # fmt: skip
            if keep_logprobs:
                row["teacher_logprobs"] = node.teacher_logprobs
            rows.append(row)
    return Dataset.from_list(rows)


def questions_dataset(path: str | os.PathLike, layout: str = "jsonl"):
    """One training row per tree: `prompt`, `question_id` and the trees' other fields (no tree structure)."""
    from datasets import Dataset

    return Dataset.from_list(
        [{"prompt": t.prompt, "question_id": t.question_id, **t.fields} for t in _read(path, layout)]
    )


def _read(path, layout: str) -> list[PrefixTree]:
    if layout == "jsonl":
        return load_prefix_trees(path)
    if layout == "omegaprm":
        return from_omegaprm(path)
    raise ValueError(f"layout={layout!r}; use 'jsonl' (our trees file) or 'omegaprm' (OpenR's OmegaPRM output).")


def from_omegaprm(path: str | os.PathLike, out: str | os.PathLike | None = None) -> list[PrefixTree]:
    """Convert OmegaPRM output (OpenR, github.com/openreasoner/openr, `data/omegaPRM_v2/run_omegaprm.py` with
    `--save_data_tree True`) into prefix trees; write them to `out` (JSONL) when given.

    That layout: one JSON file per question (`question_<i>.json`; `path` is such a file or a folder of them) holding
    `{"question", "final_answer", "reasoning_steps": {"text", "mc_value", "children": [...]}}`, a nested tree whose
    node texts are the step each node adds and whose `mc_value` is the share of the node's Monte Carlo rollouts that
    reached the final answer. Here: `question_id` is the file name's stem, `prompt` one user message with the
    question, `solution` the final answer, the delimiter a blank line (OmegaPRM's), and each leaf's correctness its
    `mc_value` (a success rate; 1.0 or 0.0 for a decided leaf). A root whose text is the question itself gets "".
    """
    source = Path(path)
    files = sorted(source.glob("*.json")) if source.is_dir() else [source]
    if not files:
        raise ValueError(f"{path}: no OmegaPRM .json files found.")
    trees = []
    for file in files:
        data = json.loads(file.read_text(encoding="utf-8"))
        for key in ("question", "reasoning_steps"):
            if key not in data:
                raise ValueError(f"{file}: no {key!r} key; is this OmegaPRM output written with save_data_tree=True?")
        nodes = _omegaprm_nodes(data["reasoning_steps"], str(data["question"]))
        record = {"question_id": file.stem, "prompt": [{"role": "user", "content": data["question"]}],
                  "delimiter": DEFAULT_DELIMITER, "solution": str(data.get("final_answer", "")), "nodes": nodes}  # fmt: skip
        trees.append(PrefixTree.from_dict(record, f"{file}: "))
    if out is not None:
        write_prefix_trees(trees, out)
    return trees


def _omegaprm_nodes(root: dict, question: str) -> list[dict]:
    # Flatten OmegaPRM's nested {"text", "mc_value", "children"} tree into our node records (ids in visit order).
    nodes: list[dict] = []
    stack = [(root, None)]
    while stack:
        item, parent = stack.pop()
        node_id = str(len(nodes))
        text = item.get("text", "") or ""
        if parent is None and text.strip() == question.strip():
            text = ""
        children = item.get("children") or []
        node = {"id": node_id, "parent": parent, "text": text}
        if not children:
            node["correct"] = float(item.get("mc_value", 0.0))
        nodes.append(node)
        stack.extend((child, node_id) for child in reversed(children))
    return nodes


def build_prefix_trees(
    model,
    tokenizer,
    dataset,
    reward: str | Callable,
    out: str | os.PathLike,
    *,
    width: int = 4,
    max_depth: int = 3,
    delimiter: str = DEFAULT_DELIMITER,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    threshold: float = 1.0,
    question_column: str = "question_id",
    seed: int = 0,
    progress: bool = True,
) -> list[PrefixTree]:
    """Grow one prefix tree per dataset row with a teacher model, and write them to `out` (JSONL).

    Per question: the teacher samples `width` solutions of the bare question; each is split into steps on
    `delimiter` and added to the tree as a path (a step identical to an existing child's is merged into it); then
    every node at depths 1 .. `max_depth` - 1 that has no sibling branch yet gets `width` - 1 more solutions sampled
    from its prefix. The last node of every solution is a leaf, correct when `reward` (a registry name, a name with
    parameters, or a TRL-style reward function) gives it at least `threshold`; it sees the whole solution (prefix and
    continuation) as the completion, and the row's columns. Steps past `max_depth` stay in the last node.

    Resumable: questions already in `out` are skipped, and each tree is appended as soon as it is grown. `dataset`
    rows need `prompt` and a unique `question_column` (TRL's format otherwise; other columns are kept as fields).
    A progress bar counts questions. Returns every tree in `out`.
    """
    import torch
    from tqdm.auto import tqdm

    from ..rewards import resolve_reward

    for name, value in (("width", width), ("max_depth", max_depth), ("max_new_tokens", max_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"build_prefix_trees: {name}={value!r} must be a whole number >= 1.")
    if not delimiter:
        raise ValueError("build_prefix_trees: delimiter='' cannot split steps; use e.g. '\\n\\n' or '\\n'.")
    columns = getattr(dataset, "column_names", None) or list(dataset[0])
    for column in ("prompt", question_column):
        if column not in columns:
            raise ValueError(f"build_prefix_trees: the dataset has no {column!r} column (columns: {columns}).")
    reward_fn = resolve_reward(reward)
    out = Path(out)
    done = {t.question_id for t in load_prefix_trees(out)} if out.exists() and out.stat().st_size else set()
    generator = torch.Generator(device="cpu").manual_seed(seed)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        rows = [dataset[i] for i in range(len(dataset))]
        for row in tqdm(rows, desc="prefix trees", disable=not progress):
            qid = str(row[question_column])
            if qid in done:
                continue
            tree = _grow(model, tokenizer, row, qid, reward_fn, width, max_depth, delimiter, max_new_tokens,
                         temperature, threshold, question_column, generator, device)  # fmt: skip
            write_prefix_trees([tree], out, append=True)
            done.add(qid)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return load_prefix_trees(out)


def _grow(model, tokenizer, row, qid, reward_fn, width, max_depth, delimiter, max_new_tokens, temperature,
          threshold, question_column, generator, device) -> PrefixTree:  # fmt: skip
    import torch

    prompt = row["prompt"]
    fields = {k: v for k, v in row.items() if k not in ("prompt", question_column)}
    conversational = isinstance(prompt, list)
    head = (tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            if conversational else prompt)  # fmt: skip
    nodes = {"0": {"id": "0", "parent": None, "text": "", "children": []}}

    def steps_of(node_id):
        steps = []
        while node_id is not None:
            if nodes[node_id]["text"]:
                steps.append(nodes[node_id]["text"])
            node_id = nodes[node_id]["parent"]
        return steps[::-1]

    def sample(node_id, n):
        given = delimiter.join(steps_of(node_id))
        text = head + (given + delimiter if given else "")
        inputs = tokenizer([text] * n, return_tensors="pt", add_special_tokens=False).to(device)
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                                    pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        return given, tokenizer.batch_decode(output[:, inputs["input_ids"].size(1) :], skip_special_tokens=True)

    def score(given, continuations):
        whole = [(given + delimiter if given else "") + c for c in continuations]
        completions = [[{"role": "assistant", "content": w}] for w in whole] if conversational else whole
        ids = [tokenizer(w, add_special_tokens=False)["input_ids"] for w in whole]
        extra = {k: [v] * len(whole) for k, v in fields.items()}
        scores = reward_fn(prompts=[prompt] * len(whole), completions=completions, completion_ids=ids, **extra)
        return [float(s is not None and s >= threshold) for s in scores]

    def insert(node_id, continuation, correct):
        depth = len(steps_of(node_id)) if node_id != "0" else 0
        steps = [s.strip() for s in continuation.split(delimiter) if s.strip()] or [continuation.strip()]
        room = max(max_depth - depth, 1)
        if len(steps) > room:
            steps = steps[: room - 1] + [delimiter.join(steps[room - 1 :])]
        parent = node_id
        for index, step in enumerate(steps):
            last = index == len(steps) - 1
            # A leaf (a whole solution, with outcomes) is matched only by a last step, an inner node only by an inner
            # step: a leaf never grows children, so every outcome stays on a terminal node.
            match = next((c for c in nodes[parent]["children"] if nodes[c]["text"] == step
                          and ("outcomes" in nodes[c]) == last), None)  # fmt: skip
            if match is not None and not last:
                parent = match
                continue
            if match is not None and last:  # the same whole solution again: one more outcome for that leaf
                nodes[match]["outcomes"].append(correct)
                return
            new = str(len(nodes))
            nodes[new] = {"id": new, "parent": parent, "text": step, "children": []}
            nodes[parent]["children"].append(new)
            if last:
                nodes[new]["outcomes"] = [correct]
            parent = new

    given, continuations = sample("0", width)
    for continuation, correct in zip(continuations, score(given, continuations), strict=True):
        insert("0", continuation, correct)
    for depth in range(1, max_depth):
        frontier = [n for n in list(nodes) if n != "0" and len(steps_of(n)) == depth and nodes[n]["children"]
                    and len(nodes[n]["children"]) == 1]  # fmt: skip
        for node_id in frontier:
            if width > 1:
                given, continuations = sample(node_id, width - 1)
                for continuation, correct in zip(continuations, score(given, continuations), strict=True):
                    insert(node_id, continuation, correct)
    records = []
    for node in nodes.values():
        item = {"id": node["id"], "parent": node["parent"], "text": node["text"]}
        if "outcomes" in node:
            item["correct"] = sum(node["outcomes"]) / len(node["outcomes"])
        records.append(item)
    record = {"question_id": qid, "prompt": prompt, "delimiter": delimiter, **fields, "nodes": records}
    if not any("correct" in r and r["correct"] is not None for r in records):
        raise ValueError(f"question_id={qid!r}: the teacher produced no scorable solution.")
    return PrefixTree.from_dict(record)
