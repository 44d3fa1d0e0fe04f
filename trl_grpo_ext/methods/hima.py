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

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

__all__ = ["Agent", "Hierarchy", "node_group_advantages", "select_node_groups", "MemoryEntry", "MemoryStore"]


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
def node_group_advantages(rewards: torch.Tensor, groups: torch.Tensor, scale: bool = True) -> torch.Tensor:
    """Advantages normalised within each node's group: (r − mean_g) / (std_g + 1e-4) (unbiased std, as TRL), or
    r − mean_g with `scale=False`. `groups` (N,) long: the node group of each row; a group of one gets 0."""
    out = torch.zeros_like(rewards, dtype=torch.float)
    for g in groups.unique():
        rows = groups == g
        values = rewards[rows].float()
        if values.numel() < 2:
            continue
        centred = values - values.mean()
        out[rows] = centred / (values.std() + 1e-4) if scale else centred
    return out


def select_node_groups(rewards: torch.Tensor, groups: torch.Tensor, k: int | str = "all") -> list[int]:
    """The node groups to update: the `k` with the largest reward variance (unbiased; ties by group id), or all
    with `k="all"`; groups whose rewards do not vary are never kept (they carry no signal). Sorted by id."""
    ids = [int(g) for g in groups.unique()]
    variance = {}
    for g in ids:
        values = rewards[groups == g].float()
        variance[g] = float(values.var()) if values.numel() > 1 else 0.0
    varying = [g for g in ids if variance[g] > 0]
    if k == "all":
        return varying
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"hima_top_k={k!r} must be a whole number >= 1 or 'all'.")
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
