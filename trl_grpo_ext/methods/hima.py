"""HiMA-R1 (JoyAgents-R1, arXiv 2506.19846): a hierarchy of agents trained together; its pieces that need no model.

A master agent routes to named sub-agents; every agent call is a node of the system's rollout tree. VR-GRPO takes
one system trajectory, samples G alternatives at a node with the prefix fixed, lets the system finish each, and
normalises the rewards within that node's group; of all node groups it keeps the K with the largest reward
variance ("marginal benefit") and updates only the agents that own them. A memory store per agent evolves with
the rewards.

This module holds the hierarchy description and its validation (`Agent`, `Hierarchy`), the node-group maths
(`node_group_advantages`, `select_node_groups`) and the memory store (`MemoryStore`).

>>> h = Hierarchy([Agent("router", "Route the question.", routes=["calc", "qa"]), Agent("calc", "Compute."),
...                Agent("qa", "Answer.")], master="router")
>>> h.order()
['router', 'calc', 'qa']
>>> select_node_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.5]), torch.tensor([0, 0, 1, 1, 2, 2]), k=1)
[1]
"""

from __future__ import annotations

import bisect
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
from accelerate.utils import gather_object

from ..advantages.group import SCALES, group_stats, normalise
from ..extension import Extension, Method, TrainerInputs, register_method
from ..registry import _import_path
from ..rewards import register_reward
from ..rewards.guard import check_reward_name
from ..rollout import Rollout, RolloutPlan
from ..tools import with_time_limit

__all__ = ["Agent", "Hierarchy", "node_group_advantages", "select_node_groups", "MemoryEntry", "MemoryStore",
           "HiMA", "HiMAConfigSection", "check_hima_config", "toy_hierarchy", "load_hierarchy"]  # fmt: skip


# ---------------------------------------------------------------------------------------------- the hierarchy
@dataclass
class Agent:
    """One agent of a hierarchy.

    Attributes:
        name: unique, what routes name (letters, digits, `_` and `-`).
        role: its role prompt (the system message of each of its calls).
        routes: the agents it may call, by name (empty: a leaf, it answers).
        tools: tools it may call, TRL's format (typed, documented functions, or their dotted import paths).
        memory: whether it keeps a memory store (retrieved into its prompt, evolved with the rewards).
        adapter: the name of its own LoRA adapter on the shared base, or None to share the policy's weights.
        max_tokens: tokens per call at most (None: the trainer's `max_completion_length`).
    """

    name: str
    role: str
    routes: list[str] = field(default_factory=list)
    tools: list = field(default_factory=list)
    memory: bool = False
    adapter: str | None = None
    max_tokens: int | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or not all(c.isalnum() or c in "_-" for c in self.name):
            raise ValueError(f"agent name {self.name!r} must be a non-empty word (letters, digits, '_' or '-').")
        if not isinstance(self.role, str) or not self.role.strip():
            raise ValueError(f"agent {self.name!r}: role must be its role prompt, a non-empty string.")
        self.routes = list(self.routes)
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter or "." in self.adapter
                                         or self.adapter == "ref"):  # fmt: skip
            raise ValueError(f"agent {self.name!r}: adapter={self.adapter!r} must be a LoRA adapter name (no '.', not "
                             "'ref', which TRL keeps for the reference), or None to share the policy's weights.")  # fmt: skip
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"agent {self.name!r}: max_tokens={self.max_tokens!r} must be a whole number >= 1.")


@dataclass
class Hierarchy:
    """Agents and who routes to whom; validated when built (a route to an unknown agent, a cycle, a master that is
    missing or routed to, two agents of one name: each is an error naming it).

    Attributes:
        agents: the agents.
        master: the agent that receives the question and routes.
        max_calls: agent calls per system trajectory at most (the master's included).
        max_tokens: generated tokens per system trajectory at most, over all its calls.
    """

    agents: list[Agent]
    master: str
    max_calls: int = 8
    max_tokens: int = 1024

    def __post_init__(self):
        self.agents = [a if isinstance(a, Agent) else Agent(**a) for a in self.agents]
        names = [a.name for a in self.agents]
        seen = set()
        for name in names:
            if name in seen:
                raise ValueError(f"hierarchy: two agents are named {name!r}; names must be unique.")
            seen.add(name)
        if self.master not in seen:
            raise ValueError(f"hierarchy: master={self.master!r} is not one of the agents ({', '.join(names)}).")
        for agent in self.agents:
            for route in agent.routes:
                if route not in seen:
                    raise ValueError(f"hierarchy: agent {agent.name!r} routes to {route!r}, which does not exist "
                                     f"(agents: {', '.join(names)}); add it or fix the route.")  # fmt: skip
                if route == self.master:
                    raise ValueError(f"hierarchy: agent {agent.name!r} routes back to the master {self.master!r}; "
                                     "the master only receives the question.")  # fmt: skip
        cycle = self._cycle()
        if cycle:
            raise ValueError(f"hierarchy: the routes form a cycle ({' -> '.join(cycle)}); a hierarchy is a tree of "
                             "calls: remove one of these routes.")  # fmt: skip
        for key, value in (("max_calls", self.max_calls), ("max_tokens", self.max_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"hierarchy: {key}={value!r} must be a whole number >= 1.")
        unreachable = [n for n in names if n not in self.order()]
        if unreachable:
            raise ValueError(f"hierarchy: agents {unreachable} are never called (no route from {self.master!r} "
                             "reaches them); route to them or leave them out.")  # fmt: skip

    def agent(self, name: str) -> Agent:
        for agent in self.agents:
            if agent.name == name:
                return agent
        raise KeyError(f"no agent {name!r} in the hierarchy ({', '.join(a.name for a in self.agents)}).")

    def order(self) -> list[str]:
        """The agents reachable from the master, breadth first."""
        order, queue = [], [self.master]
        while queue:
            name = queue.pop(0)
            if name not in order:
                order.append(name)
                queue.extend(self.agent(name).routes)
        return order

    def _cycle(self) -> list[str] | None:
        routes = {a.name: a.routes for a in self.agents}
        state: dict[str, int] = {}  # 1 on the current path, 2 done

        def visit(name, path):
            state[name] = 1
            for nxt in routes[name]:
                if state.get(nxt) == 1:
                    return [*path[path.index(nxt) :], nxt]
                if nxt not in state:
                    found = visit(nxt, [*path, nxt])
                    if found:
                        return found
            state[name] = 2
            return None

        for name in routes:
            if name not in state:
                found = visit(name, [name])
                if found:
                    return found
        return None

    @classmethod
    def from_dict(cls, spec: Mapping) -> Hierarchy:
        """From a mapping (a YAML file's): `{master: router, max_calls: 4, agents: {router: {role: ..., routes:
        [calc]}, calc: {role: ..., tools: [my_pkg.calculator]}}}`; `agents` may also be a list of mappings with
        `name`."""
        if not isinstance(spec, Mapping) or "agents" not in spec or "master" not in spec:
            raise ValueError("hierarchy: the spec needs `master` (an agent name) and `agents` (name -> {role, routes, "
                             "tools, memory, adapter, max_tokens}).")  # fmt: skip
        agents = spec["agents"]
        if isinstance(agents, Mapping):
            agents = [{"name": name, **(fields or {})} for name, fields in agents.items()]
        known = {"name", "role", "routes", "tools", "memory", "adapter", "max_tokens"}
        for entry in agents:
            unknown = set(entry) - known
            if unknown:
                raise ValueError(f"hierarchy: agent {entry.get('name')!r} has unknown fields {sorted(unknown)}; "
                                 f"known: {sorted(known)}.")  # fmt: skip
        extra = set(spec) - {"agents", "master", "max_calls", "max_tokens"}
        if extra:
            raise ValueError(
                f"hierarchy: unknown fields {sorted(extra)}; known: agents, master, max_calls, max_tokens."
            )
        return cls(agents=[Agent(**entry) for entry in agents], master=spec["master"],
                   **{k: spec[k] for k in ("max_calls", "max_tokens") if k in spec})  # fmt: skip


# ---------------------------------------------------------------------------------------------- node groups
def node_group_advantages(rewards: torch.Tensor, groups: torch.Tensor, scale: str = "group") -> torch.Tensor:
    """Advantages normalised within each node's group, as TRL's `scale_rewards`: r − mean_g, divided by the group's
    std + 1e-4 (`"group"`, unbiased, as TRL), by the std of the whole batch's rewards + 1e-4 (`"batch"`: centred per
    node group, scaled over every row of `rewards`), or not at all (`"none"`). `groups` (N,) long: the node group of
    each row; a group of one gets 0. NaN rows (unscorable) are left out of every mean and std and get 0, as in TRL.
    `scale=True` / `False` read as `"group"` / `"none"`."""
    if isinstance(scale, bool):
        scale = "group" if scale else "none"
    if scale not in SCALES:
        raise ValueError(f"scale_rewards={scale!r} is not one of {', '.join(map(repr, SCALES))} (TRL's values).")
    return normalise(rewards.float(), groups, scale)


def select_node_groups(rewards: torch.Tensor, groups: torch.Tensor, k: int | str = "all") -> list[int]:
    """The node groups to update: the `k` with the largest reward variance (unbiased, over the group's scored rows;
    ties by group id), or all with `k="all"`; groups whose scored rewards do not vary (or that have fewer than two
    scored rows) are never kept (they carry no signal). Sorted by id."""
    if k != "all" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"hima_top_k={k!r} must be a whole number >= 1 or 'all'.")
    ids = [int(g) for g in groups.unique()]  # sorted: the order of `group_stats`'s groups
    stats = group_stats(rewards.float(), groups)
    variance = dict(zip(ids, torch.nan_to_num(stats.std**2, nan=0.0).tolist(), strict=True))
    varying = [g for g in ids if variance[g] > 0]
    if k == "all":
        return varying
    ranked = sorted(varying, key=lambda g: (-variance[g], g))
    return sorted(ranked[:k])


# ---------------------------------------------------------------------------------------------- memory
@dataclass
class MemoryEntry:
    """One remembered experience: what the agent was asked, what worked, when and how well."""

    key: str
    content: str
    step: int
    reward: float
    uses: int = 1


class MemoryStore:
    """An agent's memory, evolved with the rewards of the trajectories that used it (our reading of HiMA-R1's
    memory evolution; the paper gives the thresholds, not every rule).

    Each finished trajectory brings (key, content, r) with r = R_accuracy + R_format. Against the last `window`
    rewards seen (the reward distribution), with q_lo / q_hi its `low` / `high` quantiles (2.5% and 97.5%):

    - r >= q_hi: **add** the entry (or, if its key is stored, replace its content and reward);
    - r <= q_lo: **delete** the stored entry of that key (an experience that led to a failure), if any;
    - otherwise **update**: a stored entry's reward moves to the running mean of its rewards; nothing is added.

    Until `warmup` rewards have been seen, every trajectory is added (the store fills) and none deleted. The entry
    score is `decay_weight · 0.5 ** ((now − step) / half_life) + (1 − decay_weight) · reward`; over `capacity`,
    the lowest score goes. `retrieve(query, n)` returns the n entries with the best score times word overlap with
    the query (all entries tie at overlap 0 on score). `state_dict` / `load_state_dict` persist it exactly.
    """

    def __init__(self, capacity: int = 64, window: int = 200, low: float = 0.025, high: float = 0.975,
                 warmup: int = 20, half_life: float = 50.0, decay_weight: float = 0.5):  # fmt: skip
        if not 0 <= low < high <= 1:
            raise ValueError(f"memory: low={low} and high={high} must satisfy 0 <= low < high <= 1.")
        if capacity < 1 or window < 2 or warmup < 0 or half_life <= 0 or not 0 <= decay_weight <= 1:
            raise ValueError(f"memory: capacity={capacity} >= 1, window={window} >= 2, warmup={warmup} >= 0, "
                             f"half_life={half_life} > 0 and decay_weight={decay_weight} in [0, 1] are required.")  # fmt: skip
        self.capacity, self.window, self.low, self.high = capacity, window, low, high
        self.warmup, self.half_life, self.decay_weight = warmup, half_life, decay_weight
        self.entries: dict[str, MemoryEntry] = {}
        self.history: list[float] = []
        self.step = 0

    def thresholds(self) -> tuple[float, float] | None:
        """(q_lo, q_hi) of the rewards seen (the last `window`), or None during the warm-up."""
        if len(self.history) < max(self.warmup, 2):
            return None
        recent = torch.tensor(self.history[-self.window :], dtype=torch.float64)
        return float(torch.quantile(recent, self.low)), float(torch.quantile(recent, self.high))

    def score(self, entry: MemoryEntry, now: int | None = None) -> float:
        age = (self.step if now is None else now) - entry.step
        return self.decay_weight * 0.5 ** (age / self.half_life) + (1 - self.decay_weight) * entry.reward

    def observe(self, key: str, content: str, reward: float, step: int | None = None) -> str:
        """Apply one trajectory's outcome; returns the decision: "add", "update", "delete" or "keep" (nothing to do).
        The thresholds come from the rewards seen before this one."""
        if not math.isfinite(reward):
            raise ValueError(f"memory: reward={reward} is not a finite number.")
        self.step = self.step if step is None else step
        bounds = self.thresholds()
        self.history.append(float(reward))
        self.history = self.history[-self.window :]
        stored = self.entries.get(key)
        if bounds is None or reward >= bounds[1]:
            if stored is not None:
                stored.content, stored.reward, stored.step, stored.uses = content, float(reward), self.step, 1
            else:
                self.entries[key] = MemoryEntry(key, content, self.step, float(reward))
                self._evict()
            return "add"
        if reward <= bounds[0]:
            if stored is None:
                return "keep"
            del self.entries[key]
            return "delete"
        if stored is None:
            return "keep"
        stored.uses += 1
        stored.reward += (float(reward) - stored.reward) / stored.uses
        return "update"

    def _evict(self) -> None:
        while len(self.entries) > self.capacity:
            worst = min(self.entries.values(), key=lambda e: (self.score(e), e.step, e.key))
            del self.entries[worst.key]

    def retrieve(self, query: str, n: int = 2) -> list[MemoryEntry]:
        words = set(query.lower().split())

        def rank(entry):
            overlap = len(words & set(entry.key.lower().split())) / max(len(words), 1)
            return (-(overlap + 1e-6) * self.score(entry), -entry.step, entry.key)

        return sorted(self.entries.values(), key=rank)[:n]

    def state_dict(self) -> dict:
        return {"entries": [vars(e).copy() for e in self.entries.values()], "history": list(self.history),
                "step": self.step}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.entries = {e["key"]: MemoryEntry(**e) for e in state.get("entries", [])}
        self.history = list(state.get("history", []))
        self.step = int(state.get("step", 0))


# ---------------------------------------------------------------------------------------------- the toy
def toy_hierarchy() -> Hierarchy:
    """The two-level toy of the tests, the CLI's built-in task and the example: a router that sends a question to a
    calculator agent (with the `calculator` tool) or a QA agent, which answers."""
    from ..tools import calculator

    return Hierarchy(
        [
            Agent(
                "router", "You route questions. Arithmetic goes to calc, anything else to qa.", routes=["calc", "qa"]
            ),
            Agent("calc", "You solve arithmetic with the calculator tool.", tools=[calculator], max_tokens=64),
            Agent("qa", "You answer the question with just the answer.", memory=True, max_tokens=32),
        ],
        master="router",
        max_calls=3,
        max_tokens=160,
    )


def load_hierarchy(spec) -> Hierarchy:
    """A `Hierarchy` from itself, `"toy"`, a mapping, or the path of a YAML / JSON file holding the mapping."""
    if isinstance(spec, Hierarchy):
        return spec
    if spec == "toy":
        return toy_hierarchy()
    if isinstance(spec, Mapping):
        return Hierarchy.from_dict(spec)
    if not isinstance(spec, str | os.PathLike):
        raise ValueError(f"hima_hierarchy={spec!r} must be a YAML / JSON hierarchy file, 'toy', a mapping or a "
                         "Hierarchy.")  # fmt: skip
    path = Path(spec)
    if not str(spec) or not path.is_file():
        raise ValueError(f"hima_hierarchy={str(spec)!r}: no such file; give a YAML / JSON hierarchy file or 'toy'.")
    import yaml

    try:
        return Hierarchy.from_dict(yaml.safe_load(path.read_text()))
    except (yaml.YAMLError, TypeError, ValueError) as error:  # the file's own mistakes, named with the field
        raise ValueError(f"hima_hierarchy={str(spec)!r}: {error}") from None


# ---------------------------------------------------------------------------------------------- config
@dataclass
class HiMAConfigSection:
    """Config section: HiMA-R1's hierarchy of agents (arXiv 2506.19846; `trl_grpo_ext.methods.hima`).

    > Parameters of HiMA-R1 (hierarchical multi-agent RL, VR-GRPO; docs/hima.md)

    hima_hierarchy (`str`, *optional*):
        The hierarchy: a YAML / JSON file (`master`, `agents: {name: {role, routes, tools, memory, max_tokens}}`,
        `max_calls`, `max_tokens`) or `toy` (router, calculator agent, QA agent). Setting it switches HiMA on.
    hima_alternatives (`int`, *optional*, defaults to `4`):
        G, alternatives sampled at each node with the system's prefix fixed. `num_generations` must be a multiple
        of G: each question gets num_generations / G node groups.
    hima_top_k (`str`, *optional*, defaults to `"all"`):
        Node groups kept per question, those with the largest reward variance (a whole number, or `all`); the rows
        of the others leave the loss, so their agents get no update from them.
    hima_accuracy_reward (`str`, *optional*, defaults to `"accuracy"`):
        R_accuracy of `HiMATrainer`'s default rewards (R = R_accuracy + R_format − R_efficiency).
    hima_memory_capacity (`int`, *optional*, defaults to `64`):
        Entries per memory store (agents with `memory: true`).
    hima_memory_retrieve (`int`, *optional*, defaults to `2`):
        Entries retrieved into a memory agent's prompt.
    hima_agent_adapters (`bool`, *optional*, defaults to `False`):
        Give every agent without an `adapter` its own LoRA adapter, named after it, on the one base (needs a LoRA
        policy, `use_peft`): each agent's calls are generated with, and train, its adapter only.
    """

    hima_hierarchy: str | None = field(default=None, metadata={"help": "HiMA: hierarchy file (YAML/JSON) or 'toy'."})
    hima_alternatives: int = field(default=4, metadata={"help": "HiMA: alternatives per node (G)."})
    hima_top_k: str = field(default="all", metadata={"help": "HiMA: node groups kept per question (int or 'all')."})
    hima_accuracy_reward: str = field(default="accuracy", metadata={"help": "HiMA: the R_accuracy reward."})
    hima_memory_capacity: int = field(default=64, metadata={"help": "HiMA: entries per memory store."})
    hima_memory_retrieve: int = field(default=2, metadata={"help": "HiMA: entries retrieved into a prompt."})
    hima_agent_adapters: bool = field(default=False, metadata={"help": "HiMA: one LoRA adapter per agent."})

    # `check_hima_config` checks these itself: the hierarchy may be a mapping or a `Hierarchy`, and top-K an int.
    _untyped_fields = ("hima_hierarchy", "hima_top_k")

    def __post_init__(self):
        super().__post_init__()
        if self.hima_hierarchy is not None:  # `HiMATrainer(hierarchy=...)` may set it later: checked there again
            check_hima_config(self)


def check_hima_config(args) -> None:
    """The HiMA fields of a config whose `hima_hierarchy` is set (the hierarchy itself included), before any model
    loads."""
    load_hierarchy(args.hima_hierarchy)
    g = args.hima_alternatives
    if isinstance(g, bool) or not isinstance(g, int) or g < 2:
        raise ValueError(f"hima_alternatives={g!r} must be a whole number >= 2 (a node group needs variance).")
    if args.num_generations % g:
        raise ValueError(f"num_generations={args.num_generations} must be a multiple of hima_alternatives={g}: "
                         f"each question gets num_generations / G node groups; e.g. num_generations={2 * g}.")  # fmt: skip
    _top_k(args.hima_top_k)
    check_reward_name("hima_accuracy_reward", args.hima_accuracy_reward)
    for name in ("hima_memory_capacity", "hima_memory_retrieve"):
        value, low = getattr(args, name), 1 if name.endswith("capacity") else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be a whole number >= {low}.")
    args.require_whole_groups("HiMA (a question's node groups are generated together)")


def _top_k(value) -> int | str:
    if value == "all":
        return "all"
    whole = (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, str) and value.isdigit())
    if not whole or int(value) < 1:
        raise ValueError(f"hima_top_k={value!r} must be a whole number >= 1 or 'all'.")
    return int(value)


# ---------------------------------------------------------------------------------------------- the rollout
_ROUTE = re.compile(r"<route>\s*([\w-]+)\s*</route>(.*)", re.DOTALL)


def find_tool_call(text: str) -> str | None:
    """The `{...}` of the first tool call `<tool_call>{...}</tool_call>` in an agent's output, or None.

    What `re.search(r"<tool_call>\\s*(\\{.*?\\})\\s*</tool_call>", text, re.DOTALL)` finds (its group), in linear time:
    the regex scans to the end of the text again from every `<tool_call>` of a text whose calls never close, which
    takes seconds on a long output.

    >>> find_tool_call('<tool_call> {"name": "f"} </tool_call>'), find_tool_call("<tool_call>{" * 3)
    ('{"name": "f"}', None)
    """
    opening, closing = "<tool_call>", "</tool_call>"
    ends = []  # the "}" right before each closing tag (white space apart), in order: where a call's object may end
    at = text.find(closing)
    while at >= 0:
        end = at - 1
        while end >= 0 and text[end].isspace():
            end -= 1
        if end >= 0 and text[end] == "}":
            ends.append(end)
        at = text.find(closing, at + len(closing))
    at = text.find(opening) if ends else -1
    while at >= 0:
        brace = at + len(opening)
        while brace < len(text) and text[brace].isspace():
            brace += 1
        if brace < len(text) and text[brace] == "{":
            # The shortest object: the first "}" after the brace that a closing tag follows. A later opening tag's
            # brace is further on, so when this one has none, no call does.
            index = bisect.bisect_right(ends, brace)
            return text[brace : ends[index] + 1] if index < len(ends) else None
        at = text.find(opening, at + len(opening))
    return None


@dataclass
class _Call:
    """One agent call of a system trajectory: who, after what, and what it wrote."""

    agent: str
    messages: list
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float | None] | None = None  # the backend's sampling log-probs of output_ids (vLLM), else None


@dataclass
class _System:
    """A system trajectory being run: the calls so far, the next one, its final answer."""

    row: int  # the batch row whose columns and tool tables it uses
    question: str
    calls: list[_Call] = field(default_factory=list)
    pending: _Call | None = None
    answer: str | None = None
    format_ok: list[bool] = field(default_factory=list)
    bad_route: bool = False

    @property
    def tokens(self) -> int:
        return sum(len(c.output_ids) for c in self.calls)


def _question(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content") for m in prompt if m.get("role") == "user"]
    content = users[-1] if users else ""
    if isinstance(content, list):
        content = " ".join(part.get("text", "") for part in content if part.get("type") == "text")
    return content


class HiMA(Extension):
    """Owns the training rollout: the hierarchy's system trajectories and VR-GRPO's node groups.

    Per question (a group of `num_generations` rows, S = num_generations / G node slots): one reference system
    trajectory is sampled (the master's call, then the agent it routes to, and so on, until an agent answers, or
    `max_calls` / `max_tokens` run out). For node slot j its node is call j of the reference (slot j cycles over
    the calls when there are fewer than S): G alternatives of that call are sampled with the system's prefix fixed,
    and the system finishes from each (later calls sampled afresh). Each training row is one alternative: its prompt
    is the agent's prompt at that node (role, routes, tools, retrieved memory, the question), its completion the
    agent's output; reward functions see the system's final answer (`completions`), the question's columns, and
    `hima_format` / `hima_cost` (extra fields: the share of calls that followed the protocol, and
    (calls / max_calls + tokens / max_tokens) / 2).

    After scoring, rewards are normalised within each node group; per question the `hima_top_k` groups with the
    largest reward variance are kept and the rows of the others dropped (their owners get no gradient from them).
    Memory agents' stores observe every row's R_accuracy + R_format (the rewards other than `hima_efficiency`).

    Protocol: a routing agent writes `<route>NAME</route>` (text after it is passed on to NAME); an agent with tools
    calls one in TRL's format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and the tool's result is
    its answer; any other output of an agent is its answer.
    """

    name = "hima"
    columns = ("hima_format", "hima_cost", "hima_agent")  # the rollout's extra fields, a column for the rewards
    owns_rollout = True

    def __init__(self, hierarchy, alternatives: int = 4, top_k: int | str = "all", memory_capacity: int = 64,
                 memory_retrieve: int = 2, agent_adapters: bool = False):  # fmt: skip
        self.hierarchy = load_hierarchy(hierarchy)
        if agent_adapters:  # every agent without its own adapter gets one, named after it
            agents = [replace(a, adapter=a.adapter or a.name) for a in self.hierarchy.agents]
            self.hierarchy = replace(self.hierarchy, agents=agents)  # a copy: the caller's hierarchy stays as it is
        self.alternatives, self.top_k, self.retrieve = alternatives, _top_k(top_k), memory_retrieve
        self.memories = {a.name: MemoryStore(capacity=memory_capacity) for a in self.hierarchy.agents if a.memory}
        self.tools = {}
        for agent in self.hierarchy.agents:
            resolved = [_import_path(t, "tool") if isinstance(t, str) else t for t in agent.tools]
            self.tools[agent.name] = {fn.__name__: fn for fn in resolved}
        self._systems: list[_System] = []
        self._owners: list[str] = []
        self._generated = 0

    def check(self, inputs: TrainerInputs) -> None:
        if inputs.rollout_func is not None or inputs.environment_factory is not None or inputs.tools:
            raise ValueError("HiMA runs the hierarchy itself: its agents carry their tools (hierarchy `tools:`); unset "
                             "rollout_func, environment_factory and the trainer's tools.")  # fmt: skip
        if inputs.args.num_generations % self.alternatives:
            raise ValueError(f"num_generations={inputs.args.num_generations} must be a multiple of "
                             f"hima_alternatives={self.alternatives}.")  # fmt: skip
        if self.adapters and getattr(inputs.args, "use_vllm", False):
            raise ValueError(f"per-agent LoRA adapters {self.adapters} (hima_agent_adapters, or agents' `adapter:`) "
                             "generate with transformers' `generate`, which switches adapters per call; vLLM serves one "
                             "policy: set use_vllm=False, or let the agents share the policy's weights.")  # fmt: skip

    def setup(self, trainer) -> None:
        super().setup(trainer)
        seconds = getattr(trainer.args, "tool_timeout", None)  # the agents' tools, like the trainer's own tools=
        self.tools = {agent: dict(zip(tools, with_time_limit(list(tools.values()), seconds), strict=True))
                      for agent, tools in self.tools.items()}  # fmt: skip
        if self.adapters:  # each agent's calls are generated with, and train, its own LoRA adapter
            trainer.add_adapters(self.adapters)

    @property
    def adapter_users(self) -> dict[str, list[str]]:
        """Per agent adapter, the agents whose calls use it (for the model card)."""
        users: dict[str, list[str]] = {}
        for name in self.hierarchy.order():
            adapter = self.hierarchy.agent(name).adapter
            if adapter is not None:
                users.setdefault(adapter, []).append(f"agent {name}")
        return users

    @property
    def adapters(self) -> list[str]:
        """The agents' own LoRA adapters (`Agent.adapter`), in hierarchy order; agents without one share the policy's."""
        names = [self.hierarchy.agent(n).adapter for n in self.hierarchy.order()]
        return list(dict.fromkeys(n for n in names if n is not None))

    # ---- prompts
    def _messages(self, agent_name: str, question: str, message: str = "") -> list:
        agent = self.hierarchy.agent(agent_name)
        system = agent.role
        if agent.routes:
            system += f" Route by writing <route>NAME</route>, NAME one of: {', '.join(agent.routes)}."
        if self.tools[agent_name]:
            from transformers.utils import get_json_schema

            schemas = json.dumps([get_json_schema(fn) for fn in self.tools[agent_name].values()])
            system += (" You may call a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>; "
                       f"its result is your answer. Tools: {schemas}")  # fmt: skip
        memory = self.memories.get(agent_name)
        if memory is not None and self.retrieve:
            found = memory.retrieve(question, self.retrieve)
            if found:
                system += " Earlier experience: " + " | ".join(f"{e.key} -> {e.content}" for e in found)
        user = question if not message.strip() else f"{question}\n{message.strip()}"
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    # ---- running calls
    def _run_calls(self, plan: RolloutPlan, systems: list[_System], block: int = 1) -> None:
        """Generate the pending call of every system (in blocks of `block` rows that share their call); with
        per-agent adapters, one generation per adapter, each under its own.

        Every process makes the same generation calls (each is collective: the block size is agreed on all rows,
        vLLM and ZeRO-3 generate for all processes at once): one per adapter that any process has calls for, in
        hierarchy order, with no rows of its own where it has none (`_generate_calls` then stands in)."""
        if not self.adapters:
            self._generate_calls(plan, systems, block)
            return
        parts: dict = {}
        for system in systems:  # a block's rows share their call, so its agent: blocks stay whole
            parts.setdefault(self.hierarchy.agent(system.pending.agent).adapter, []).append(system)
        names = [None, *self.adapters]
        for adapter, used in zip(names, self.trainer.any_process(*(n in parts for n in names)), strict=True):
            if used:
                with self.trainer.use_adapter(adapter):
                    self._generate_calls(plan, parts.get(adapter, []), block)

    def _generate_calls(self, plan: RolloutPlan, systems: list[_System], block: int) -> None:
        trainer = self.trainer
        if not systems:  # another process has calls to generate: take part in the call with one block, thrown away
            messages = self._messages(self.hierarchy.master, "")
            stage = RolloutPlan(rows=[plan.rows[0]] * block, mode=plan.mode, num_generations=block)
            trainer.generate_stage(
                [messages] * block, stage, num_generations=block, max_new_tokens=1, rows=[0] * block
            )
            return
        caps = []
        for system in systems:
            agent = self.hierarchy.agent(system.pending.agent)
            caps.append(
                min(agent.max_tokens or trainer.max_completion_length, self.hierarchy.max_tokens - system.tokens)
            )
        rows = [s.row for s in systems]
        prompts = [s.pending.messages for s in systems]
        stage = RolloutPlan(rows=[plan.rows[r] for r in rows], mode=plan.mode, num_generations=block)
        routing = any(self.hierarchy.agent(s.pending.agent).routes for s in systems)
        ids, logprobs = trainer.generate_stage(prompts, stage, num_generations=block,
                                               max_new_tokens=max(max(caps), 1), stop=["</route>"] if routing else [],
                                               rows=rows)  # fmt: skip
        prompt_ids = trainer.tokenize_prompts(prompts, rows=rows)
        for k, (system, out, cap, p_ids) in enumerate(zip(systems, ids, caps, prompt_ids, strict=True)):
            call = system.pending
            call.prompt_ids, call.output_ids = list(p_ids), list(out)[: max(cap, 0)]
            if logprobs is not None:  # vLLM's importance-sampling correction needs them for the trained calls
                call.logprobs = list(logprobs[k])[: len(call.output_ids)]
            call.text = trainer.tokenizer.decode(call.output_ids, skip_special_tokens=True)
            self._generated += len(call.output_ids)
            system.calls.append(call)
            system.pending = None
            self._advance(system)

    def _advance(self, system: _System) -> None:
        """Read the last call's output: route on, run a tool, or answer."""
        call = system.calls[-1]
        agent = self.hierarchy.agent(call.agent)
        route = _ROUTE.search(call.text) if agent.routes else None
        if agent.routes:
            target = route.group(1) if route else None
            if target in agent.routes and len(system.calls) < self.hierarchy.max_calls and \
                    system.tokens < self.hierarchy.max_tokens:  # fmt: skip
                system.format_ok.append(True)
                system.pending = _Call(target, self._messages(target, system.question, route.group(2)))
                return
            system.format_ok.append(target in agent.routes)
            system.bad_route = target not in agent.routes
            system.answer = call.text
            return
        tool = find_tool_call(call.text) if self.tools[call.agent] else None
        if tool is None and self.tools[call.agent] and "<tool_call>" in call.text:
            system.answer = call.text  # a tool call cut short (the call's token cap) or never closed
            system.format_ok.append(False)
            return
        if tool is not None:
            try:
                request = json.loads(tool)
                system.answer = str(self.tools[call.agent][request["name"]](**request.get("arguments", {})))
                system.format_ok.append(True)
            except Exception as exc:  # a malformed call, an unknown tool, the tool's own error: the answer says so
                system.answer = f"tool error: {exc}"
                system.format_ok.append(False)
            return
        system.answer = call.text
        system.format_ok.append(bool(call.text.strip()))

    def _finish(self, plan: RolloutPlan, systems: list[_System]) -> None:
        # Round by round, until no system of any process has a call pending: the processes' systems take different
        # numbers of calls, and every process joins each round's generation call.
        while True:
            pending = [s for s in systems if s.pending is not None]
            if not self.trainer.any_process(bool(pending))[0]:
                return
            self._run_calls(plan, pending)

    # ---- the hook
    def rollout(self, plan: RolloutPlan, prompts: list) -> Rollout | None:
        rows = len(plan.rows)
        master = self.hierarchy.master
        self._generated = 0  # every call's tokens: the reference trajectories, the alternatives, their finishes
        if plan.mode != "train":  # evaluation: every row runs the system once
            systems = [_System(r, _question(prompts[r])) for r in range(rows)]
            for s in systems:
                s.pending = _Call(master, self._messages(master, s.question))
            self._finish(plan, systems)
            return self._to_rollout(systems, [s.calls[0] for s in systems])
        ng, g = plan.num_generations, self.alternatives
        slots = ng // g
        references = [_System(p, _question(prompts[p])) for p in range(0, rows, ng)]
        for s in references:
            s.pending = _Call(master, self._messages(master, s.question))
        self._finish(plan, references)
        systems, nodes = [], []
        for ref in references:
            for j in range(slots):
                k = j % len(ref.calls)
                node = ref.calls[k]
                for _ in range(g):
                    alt = _System(ref.row, ref.question, calls=[_Call(c.agent, c.messages, c.prompt_ids, c.output_ids,
                                                                       c.text) for c in ref.calls[:k]],
                                  format_ok=list(ref.format_ok[:k]))  # fmt: skip
                    alt.pending = _Call(node.agent, node.messages)
                    systems.append(alt)
                    nodes.append(k)
        self._run_calls(plan, systems, block=g)  # the alternatives of a node: blocks of G rows with one prompt
        self._finish(plan, systems)
        return self._to_rollout(systems, [s.calls[k] for s, k in zip(systems, nodes, strict=True)])

    def _to_rollout(self, systems: list[_System], trained: list[_Call]) -> Rollout:
        h = self.hierarchy
        self._systems, self._owners = systems, [c.agent for c in trained]
        cost = [(len(s.calls) / h.max_calls + min(s.tokens, h.max_tokens) / h.max_tokens) / 2 for s in systems]
        fmt = [sum(s.format_ok) / max(len(s.format_ok), 1) for s in systems]
        self.log("calls", sum(len(s.calls) for s in systems) / len(systems))
        self.log("system_tokens", sum(s.tokens for s in systems) / len(systems))
        self.log("bad_routes", sum(s.bad_route for s in systems) / len(systems))
        self.log("generated_tokens", self._generated)
        for agent in h.order():
            self.log(f"rows_{agent}", self._owners.count(agent) / len(systems))
        return Rollout(
            prompt_ids=[list(c.prompt_ids) for c in trained],
            completion_ids=[list(c.output_ids) for c in trained],
            completions=[[{"role": "assistant", "content": s.answer or ""}] for s in systems],
            logprobs=[list(c.logprobs) for c in trained] if all(c.logprobs is not None for c in trained) else None,
            extra_fields={"hima_format": fmt, "hima_cost": cost, "hima_agent": list(self._owners)},
            adapters=[h.agent(a).adapter for a in self._owners] if self.adapters else None,
        )

    def after_scoring(self, batch) -> None:
        if batch.mode != "train" or len(self._owners) != batch.num_scored:
            return
        g = self.alternatives
        rewards = batch.rewards.float().cpu()  # NaN: unscorable, left out of every node group's statistics
        groups = torch.arange(rewards.numel()) // g
        slots = batch.num_generations // g
        selected = []
        for start in range(0, int(groups.max()) + 1, slots):
            mine = (groups >= start) & (groups < start + slots)
            selected += select_node_groups(rewards[mine], groups[mine], self.top_k)
        keep = torch.isin(groups, torch.tensor(selected, dtype=torch.long))
        # TRL's three `scale_rewards` values: "batch" centres per node group and divides by the whole batch's std.
        advantages = node_group_advantages(rewards, groups, scale=self.trainer.args.scale_rewards)
        batch.set_advantages(batch.local(advantages), source="HiMA")
        batch.drop_rows(batch.local(~keep))
        total = int(groups.max()) + 1
        self.log("node_groups", total)
        self.log("selected_groups", len(selected))
        owners = gather_object(list(self._owners))  # (N,) the node groups are numbered over all processes' rows
        kept_owners = [owners[int(gr) * g] for gr in selected]
        for agent in self.hierarchy.order():
            self.log(f"selected_{agent}", kept_owners.count(agent) / max(len(selected), 1))
        self._update_memories(batch)

    def _update_memories(self, batch) -> None:
        if not self.memories:
            return
        names = batch.reward_func_names
        weights = batch.reward_weights.float().cpu()
        keep = [i for i, n in enumerate(names) if n != "hima_efficiency"]
        per_func = batch.rewards_per_func.float().cpu()[:, keep] * weights[keep]
        outcome = per_func.nansum(dim=1)  # (N,) TRL's rule: NaN only where every function returned None
        outcome[torch.isnan(per_func).all(dim=1)] = torch.nan
        # Every process's stores observe every process's systems, in row order: they stay one store, as on one
        # process (what is retrieved into the next prompts, and what a checkpoint saves from the main process).
        seen = gather_object([[(call.agent, system.question, system.answer or call.text) for call in system.calls
                               if call.agent in self.memories] for system in self._systems])  # fmt: skip
        decisions = {"add": 0, "update": 0, "delete": 0, "keep": 0}
        for calls, value in zip(seen, outcome.tolist(), strict=True):
            if math.isnan(value):  # unscorable: no evidence for or against what the agents remembered
                continue
            for agent, question, content in calls:
                decisions[self.memories[agent].observe(question, content, value, step=batch.step)] += 1
        for key, count in decisions.items():
            self.log(f"memory_{key}", count)
        for name, memory in self.memories.items():
            self.log(f"memory_size_{name}", len(memory.entries))

    def state_dict(self) -> dict:
        return {"memories": {name: m.state_dict() for name, m in self.memories.items()}}

    def load_state_dict(self, state: dict) -> None:
        for name, stored in state.get("memories", {}).items():
            if name in self.memories:
                self.memories[name].load_state_dict(stored)


def hima_format_reward(completions, hima_format=None, **kwargs) -> list[float]:
    """R_format: the share of the system's agent calls that followed the protocol (a HiMA rollout's `hima_format`);
    outside one, None (left out of the reward)."""
    if hima_format is None:
        return [None] * len(completions)
    return [float(v) for v in hima_format]


def hima_efficiency_reward(completions, hima_cost=None, **kwargs) -> list[float]:
    """−R_efficiency: minus (calls / max_calls + tokens / max_tokens) / 2 of the system trajectory (`hima_cost`)."""
    if hima_cost is None:
        return [None] * len(completions)
    return [-float(v) for v in hima_cost]


hima_format_reward.__name__ = "hima_format"
hima_efficiency_reward.__name__ = "hima_efficiency"
register_reward("hima_format", hima_format_reward)
register_reward("hima_efficiency", hima_efficiency_reward)


def _from_config(args) -> HiMA | None:
    if getattr(args, "hima_hierarchy", None) is None:
        changed = [f.name for f in fields(HiMAConfigSection)
                   if f.name != "hima_hierarchy" and getattr(args, f.name, f.default) != f.default]  # fmt: skip
        if changed:
            raise ValueError(f"{changed[0]} is set, but hima_hierarchy is not; set hima_hierarchy (a file, or 'toy'; "
                             f"or HiMATrainer(hierarchy=...)), or leave {changed[0]} unset (it is "
                             f"{getattr(args, changed[0])!r}).")  # fmt: skip
        return None
    return HiMA(args.hima_hierarchy, args.hima_alternatives, args.hima_top_k, args.hima_memory_capacity,
                args.hima_memory_retrieve, args.hima_agent_adapters)  # fmt: skip


register_method(Method(name="hima", title="HiMA-R1 (hierarchical multi-agent RL, VR-GRPO)", arxiv="2506.19846",
                       extension=_from_config, trainer="HiMATrainer", config="HiMAConfig"))  # fmt: skip
