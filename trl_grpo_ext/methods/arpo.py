"""ARPO's entropy-guided branching after tool results ("Agentic Reinforced Policy Optimization", arXiv 2507.19849).

Of a group of M rollouts, N are full rollouts. After each tool result a trajectory may branch: the branch repeats the
trajectory up to there (tool call and tool result included) and generates the rest itself. Branches may branch
again. Slots that no branch takes get fresh rollouts. Every row is a whole trajectory: reward functions see a branch
as they would see an unbranched rollout, and TRL's length and tool-call limits count the whole trajectory.

The branching rule follows the reference code (dongguanting/ARPO, `vllm_rollout_with_tools.py`):

- H(s) is the entropy of the first k (20) tokens of the model turn that starts at s, from the top-10 log-probs of
  each token, summed and normalised by log V;
- at the trajectory's j-th tool result, ΔH = H(start of its turn j-1) − H(start of its first turn): the entropy of
  the turn that made the tool call, against the trajectory's first turn (so ΔH = 0 at the first tool result);
- each of the beam size Z − 1 candidate branches draws u ~ U(0, 1) and branches when clip(u − β·ΔH, 0, 1) ≤ α,
  i.e. with probability clip(α + β·ΔH, 0, 1); a beam size Z = 2 means the parent plus one branch;
- trajectories are visited round by round, as the reference's synchronous rollout reaches them: round r is every
  trajectory's r-th tool-calling turn, in row order, while the group has free slots.

`arpo_entropy_delta="relative"` keeps this package's first reading: the mean entropy of the k tokens generated after
the tool result against the first k of the response, as a relative change (ΔH ≥ −1, so the probability never falls
below α − β). Credit: `segment_advantage="soft"` is GRPO over the M whole trajectories (ARPO's soft setting; the
reference trains this way), `"hard"` gives every copy of a shared token the mean advantage of the trajectories that
share it.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..extension import Extension, Method, TrainerInputs, register_method
from ..rewards import completion_text, register_reward
from ..rollout import Rollout, RolloutPlan

DELTAS = ("reference", "relative")


# ---------------------------------------------------------------------------------------------------- maths
def resume_points(tool_mask: list[int]) -> list[int]:
    """Completion positions where the model resumes generating after a tool result (TRL's tool_mask goes 0 → 1).

    >>> resume_points([1, 1, 0, 0, 1, 1, 0, 1])
    [4, 7]
    """
    return [t for t in range(1, len(tool_mask)) if tool_mask[t] == 1 and tool_mask[t - 1] == 0]


def turn_entropy(entropies: torch.Tensor, tool_mask: list[int], start: int, k: int, reduce: str = "sum") -> float:
    """The entropy of the first `k` tokens of the model turn that starts at `start` (it ends at a tool result).

    `reduce="sum"` adds the tokens' entropies (the reference), `"mean"` averages them. A turn with no token is 0.

    >>> turn_entropy(torch.tensor([1.0, 2.0, 9.0, 3.0]), [1, 1, 0, 1], start=0, k=3)
    3.0
    """
    end = start
    while end < min(start + k, len(tool_mask)) and tool_mask[end] == 1:
        end += 1
    window = entropies[start:end]
    if window.numel() == 0:
        return 0.0
    return float(window.sum() if reduce == "sum" else window.mean())


def branch_probability(delta: float, alpha: float, beta: float) -> float:
    """P(branch) = clip(α + β·ΔH, 0, 1) (arXiv 2507.19849, eq. 2).

    >>> branch_probability(0.5, alpha=0.5, beta=0.2)
    0.6
    """
    return min(1.0, max(0.0, alpha + beta * delta))


def branches(u: float, delta: float, alpha: float, beta: float) -> bool:
    """The reference's draw: branch when clip(u − β·ΔH, 0, 1) ≤ α, for u ~ U(0, 1).

    >>> branches(0.65, delta=0.5, alpha=0.5, beta=0.2), branches(0.55, delta=0.5, alpha=0.5, beta=0.2)
    (False, True)
    """
    return min(1.0, max(0.0, u - beta * delta)) <= alpha


def entropy_delta(entropies, tool_mask, turn_starts: list[int], j: int, k: int, mode: str, log_vocab: float) -> float:
    """ΔH at a trajectory's j-th tool result (j ≥ 1). `turn_starts[0]` is where its own tokens start, `turn_starts[i]`
    its i-th resume point.

    `"reference"`: (H(turn_starts[j-1]) − H(turn_starts[0])) / log V with summed top-k entropies. `"relative"`:
    (mean over the k tokens after the j-th tool result − mean over its first k) / the latter.
    """
    if mode == "reference":
        now = turn_entropy(entropies, tool_mask, turn_starts[j - 1], k)
        initial = turn_entropy(entropies, tool_mask, turn_starts[0], k)
        return (now - initial) / log_vocab
    after = turn_entropy(entropies, tool_mask, turn_starts[j], k, reduce="mean")
    initial = turn_entropy(entropies, tool_mask, turn_starts[0], k, reduce="mean")
    return (after - initial) / max(initial, 1e-6)


# ---------------------------------------------------------------------------------------------------- config
@dataclass
class ARPOConfig:
    """Config section: ARPO's entropy-guided branching after tool results (arXiv 2507.19849).

    > Parameters of ARPO branching (arXiv 2507.19849; reference code dongguanting/ARPO; `trl_grpo_ext.methods.arpo`)

    arpo (`bool`, *optional*, defaults to `False`):
        ARPO rollouts (needs `tools=`): of each group of M = `num_generations`, start `arpo_initial_rollouts`
        full rollouts; after each tool result a trajectory branches by the entropy rule; branches may branch
        again; free slots get fresh rollouts. Every row is a whole trajectory.
    arpo_initial_rollouts (`int`, *optional*):
        N; default M / 2 (the paper: 8 of 16).
    arpo_beam_size (`int`, *optional*, defaults to `2`):
        Z, the reference's beam size: at a tool result, up to Z − 1 branches, each drawn on its own (2: the parent
        plus one branch).
    arpo_max_depth (`int`, *optional*):
        How many branchings deep a trajectory may be (default: no limit but the slots and the tool-call limit).
    arpo_entropy_tokens (`int`, *optional*, defaults to `20`):
        k, the tokens of a model turn whose entropy counts (the reference: 20).
    arpo_entropy_top_k (`int`, *optional*, defaults to `10`):
        Entropy from each token's top-k log-probs (the reference: 10); None for the full distribution.
    arpo_entropy_delta (`str`, *optional*, defaults to `"reference"`):
        `"reference"`: ΔH = (H of the turn that made the tool call − H of the first turn) / log V, summed over k
        tokens; `"relative"`: the relative change of the mean entropy of the k tokens after the tool result.
    arpo_alpha (`float`, *optional*, defaults to `0.5`) and arpo_beta (`float`, *optional*, defaults to `0.2`):
        Branch when clip(u − β·ΔH, 0, 1) ≤ α, u ~ U(0, 1): with probability clip(α + β·ΔH, 0, 1).
    """

    arpo: bool = field(default=False, metadata={"help": "ARPO entropy-guided branching after tool results."})
    arpo_initial_rollouts: int | None = field(
        default=None, metadata={"help": "ARPO: N full rollouts per group (default num_generations / 2)."}
    )
    arpo_beam_size: int = field(
        default=2, metadata={"help": "ARPO: Z, the reference's beam size: the parent plus up to Z-1 branches a point."}
    )
    arpo_max_depth: int | None = field(
        default=None, metadata={"help": "ARPO: how many times a trajectory may branch in a row (default: no limit)."}
    )
    arpo_entropy_tokens: int = field(default=20, metadata={"help": "ARPO: k, tokens of a turn whose entropy counts."})
    arpo_entropy_top_k: int | None = field(
        default=10,
        metadata={"help": "ARPO: entropy from the top-k log-probs of each token (reference: 10; None: all)."},
    )
    arpo_entropy_delta: str = field(
        default="reference",
        metadata={"help": "ARPO: how ΔH is measured (see trl_grpo_ext.methods.arpo).", "choices": list(DELTAS)},
    )
    arpo_alpha: float = field(default=0.5, metadata={"help": "ARPO: α in clip(α + β·ΔH, 0, 1). Paper: 0.5."})
    arpo_beta: float = field(default=0.2, metadata={"help": "ARPO: β in clip(α + β·ΔH, 0, 1). Paper: 0.2."})

    def __post_init__(self):
        super().__post_init__()
        if not self.arpo:
            return
        m = self.num_generations
        if self.arpo_initial_rollouts is None:
            self.arpo_initial_rollouts = max(1, m // 2)
        n = self.arpo_initial_rollouts
        if not 1 <= n < m:
            raise ValueError(
                f"arpo_initial_rollouts={n} must be between 1 and num_generations - 1 ({m - 1}): the other rows of a "
                "group are the slots that branches fill (the paper: 8 of 16)."
            )
        if self.arpo_beam_size < 2:
            raise ValueError(
                f"arpo_beam_size={self.arpo_beam_size} never branches; use 2 (the parent plus one branch)."
            )
        for name in ("arpo_entropy_tokens", "arpo_entropy_top_k", "arpo_max_depth"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a whole number >= 1.")
        if self.arpo_entropy_delta not in DELTAS:
            raise ValueError(f"arpo_entropy_delta={self.arpo_entropy_delta!r} is not one of {DELTAS}.")
        self.require_whole_groups("ARPO branching (branches fill their own group's slots)")


# ---------------------------------------------------------------------------------------------------- the rollout
@dataclass
class _Trajectory:
    row: int  # index among the rows generated so far
    slot: int  # the batch row it fills
    start: int  # where its own tokens start (0, or its branch point)
    depth: int  # branches above it
    round0: int  # tool-calling turns in its shared prefix
    points: list[int] = field(default_factory=list)  # its own resume points (after its start)


class ARPO(Extension):
    """Owns the training rollout: N full rollouts per group, then branches after tool results, then fresh rollouts.

    Metrics: `arpo/branches` (branch rows), `arpo/fresh` (fresh rollouts in free slots), `arpo/depth` (deepest
    branch), `arpo/branch_probability` (mean over the points considered), `arpo/generated_tokens_saved` (shared
    tokens the branches did not generate again).
    """

    name = "arpo"
    owns_rollout = True

    def __init__(self, initial_rollouts: int, beam_size: int = 2, max_depth: int | None = None, entropy_tokens: int = 20,
                 top_k: int | None = 10, delta: str = "reference", alpha: float = 0.5, beta: float = 0.2, seed: int = 0):  # fmt: skip
        self.n, self.beam, self.max_depth = initial_rollouts, beam_size, max_depth
        self.k, self.top_k, self.delta, self.alpha, self.beta = entropy_tokens, top_k, delta, alpha, beta
        self.generator = torch.Generator().manual_seed(seed)

    def check(self, inputs: TrainerInputs) -> None:
        if not inputs.tools:
            raise ValueError(
                "arpo=True branches after tool results: pass tools=[...] to the trainer, or set arpo=False."
            )
        if inputs.environment_factory is not None:
            raise ValueError(
                "arpo=True with environment_factory: a branch would need a copy of its parent's environment state; use "
                "tools=[...] with environment-free functions."
            )
        if inputs.rollout_func is not None:
            raise ValueError("ARPO generates its branching rollouts itself; unset rollout_func.")

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if trainer.accelerator.num_processes > 1 and trainer.use_vllm and trainer.args.vllm_mode == "server":
            raise NotImplementedError(
                "ARPO branching with vLLM server mode on several processes is not supported yet (processes would make "
                "different numbers of generation calls); use vllm_mode='colocate' or transformers generation."
            )
        if trainer.accelerator.num_processes > 1 and trainer.sharded_parameters:
            # Sharded parameters make every forward pass collective (generation, TRL's tool loop, the entropies), and
            # processes branch, and continue their branches' tool calls, differently: they would wait on each other.
            raise NotImplementedError(
                "ARPO branching with sharded parameters (FSDP, DeepSpeed ZeRO-3) on several processes is not supported "
                "yet (processes make different numbers of forward passes); use DDP (accelerate's multi_gpu) or "
                "DeepSpeed ZeRO-1/2, or one process."
            )
        self.log_vocab = math.log(len(trainer.tokenizer))

    def rollout(self, plan: RolloutPlan, prompts: list) -> Rollout | None:
        if plan.mode != "train":
            return None
        trainer, m, n = self.trainer, plan.num_generations, self.n
        groups = len(plan.rows) // m
        # Each group draws its branches from its own generator, seeded from one draw of `self.generator` per batch
        # (alike on every process) and the group's index over all processes: a group branches as it would with the
        # whole batch on one process, whichever process holds it, and a resumed run as the uninterrupted one.
        seed = int(torch.randint(2**62, (1,), generator=self.generator))
        first = trainer.accelerator.process_index * groups
        draws = [torch.Generator().manual_seed(seed + first + g) for g in range(groups)]
        initial = [g * m + j for g in range(groups) for j in range(n)]
        parts = [trainer.generate_rollouts([prompts[i] for i in initial], plan.select(initial), num_generations=n,
                                           rows=initial)]  # fmt: skip
        made = parts[0]
        parents, shared = [-1] * len(initial), [0] * len(initial)
        trajectories = [_Trajectory(row=i, slot=s, start=0, depth=0, round0=0) for i, s in enumerate(initial)]
        for t in trajectories:
            t.points = resume_points(made.tool_mask[t.row])
        entropies = trainer.token_entropies(made.prompt_ids, made.completion_ids, self.top_k)
        used = [n] * groups  # rows of each group taken so far
        probabilities, round_ = [], 1
        while any(u < m for u in used) and any(round_ <= t.round0 + len(t.points) for t in trajectories):
            new = []  # (trajectory, point)
            for t in list(trajectories):
                j = round_ - t.round0
                g = t.slot // m
                if not 1 <= j <= len(t.points) or (self.max_depth is not None and t.depth >= self.max_depth):
                    continue
                starts = [t.start, *t.points]
                delta = entropy_delta(entropies[t.row], made.tool_mask[t.row], starts, j, self.k, self.delta,
                                      self.log_vocab)  # fmt: skip
                probabilities.append(branch_probability(delta, self.alpha, self.beta))
                for _ in range(self.beam - 1):
                    if used[g] + sum(1 for s, _ in new if s.slot // m == g) >= m:
                        break
                    if branches(torch.rand((), generator=draws[g]).item(), delta, self.alpha, self.beta):
                        new.append((t, t.points[j - 1]))
            if new:
                slots = []
                for t, _ in new:
                    g = t.slot // m
                    slots.append(g * m + used[g])
                    used[g] += 1
                left = trainer.max_tool_calling_iterations - round_
                part = trainer.continue_rollouts([prompts[s] for s in slots], made, [(t.row, p) for t, p in new],
                                                 rows=slots, tool_iterations=left)  # fmt: skip
                offset = len(made)
                parts.append(part)
                made = Rollout.concat([made, part])
                parents += [t.row for t, _ in new]
                shared += [p for _, p in new]
                more = trainer.token_entropies(part.prompt_ids, part.completion_ids, self.top_k)
                for i, ((t, p), slot) in enumerate(zip(new, slots, strict=True)):
                    child = _Trajectory(row=offset + i, slot=slot, start=p, depth=t.depth + 1, round0=round_)
                    child.points = [q for q in resume_points(made.tool_mask[child.row]) if q > p]
                    trajectories.append(child)
                entropies += more
            round_ += 1
        fresh = [g * m + k for g in range(groups) for k in range(used[g], m)]
        # TRL's `_generate` gathers per-row values over the processes (`self.accelerator.gather(prompt_lengths)`),
        # and processes branch differently: each generates as many fresh rows as the one with the most, the rows
        # beyond its own (copies of a row of its batch) thrown away.
        most = int(trainer.accelerator.gather(torch.tensor([len(fresh)], device=trainer.accelerator.device)).max())
        if most:
            rows = fresh + [(fresh or initial)[-1]] * (most - len(fresh))
            part = trainer.generate_rollouts([prompts[i] for i in rows], plan.select(rows), num_generations=1,
                                             rows=rows)  # fmt: skip
            made = Rollout.concat([made, part.take(list(range(len(fresh))))])
            parents += [-1] * len(fresh)
            shared += [0] * len(fresh)
        slots = [t.slot for t in trajectories] + fresh
        made.parents, made.shared = parents, shared
        order = sorted(range(len(slots)), key=slots.__getitem__)
        rollout = made.take(order)
        branch_rows = [s for s in shared if s > 0]
        self.log("branches", len(branch_rows))
        self.log("fresh", len(fresh))
        self.log("depth", max((t.depth for t in trajectories), default=0))
        self.log("branch_probability", sum(probabilities) / len(probabilities) if probabilities else 0.0)
        self.log("generated_tokens_saved", sum(branch_rows))
        return rollout

    def state_dict(self) -> dict:
        # Branching decisions draw from this generator: a resumed run branches where the uninterrupted run does.
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if "generator" in state:
            self.generator.set_state(state["generator"])


def _from_config(args) -> ARPO | None:
    if not getattr(args, "arpo", False):
        return None
    return ARPO(args.arpo_initial_rollouts, args.arpo_beam_size, args.arpo_max_depth, args.arpo_entropy_tokens,
                args.arpo_entropy_top_k, args.arpo_entropy_delta, args.arpo_alpha, args.arpo_beta, seed=args.seed)  # fmt: skip


register_method(Method(name="arpo", title="ARPO entropy-guided branching", arxiv="2507.19849", extension=_from_config))


# ---------------------------------------------------------------------------------------------------- the reward
_BOXED = re.compile(r"\\boxed\{")
_PUNCTUATION = frozenset(string.punctuation)  # built once: a set per character took 0.5 s on a 100k-character answer


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles (a, an, the), single spaces: SQuAD's answer normalisation.

    >>> normalize_answer("The  Eiffel Tower!")
    'eiffel tower'
    """
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, truth: str) -> float:
    """Token-level F1 of two normalised answers; a yes/no/noanswer answer must match exactly.

    >>> f1_score("Eiffel Tower", "the Eiffel tower in Paris")
    0.6666666666666666
    """
    pred, gold = normalize_answer(prediction), normalize_answer(truth)
    if (pred in ("yes", "no", "noanswer") or gold in ("yes", "no", "noanswer")) and pred != gold:
        return 0.0
    common = sum((Counter(pred.split()) & Counter(gold.split())).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred.split()), common / len(gold.split())
    return 2 * precision * recall / (precision + recall)


def _boxed(text: str) -> str | None:
    # The content of the last \boxed{...}, braces balanced.
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def arpo_reward(boxed: bool = True):
    """Build ARPO's reward (the reference's `deep_research` score): −1 bad format, 0 wrong, F1 if right.

    Format: `<think>` blocks paired (at least one), exactly one `<answer>…</answer>`, and with `boxed=True` a
    `\\boxed{…}` inside it (the reference's rule), whose content is the answer; with `boxed=False` the answer
    block's text is. Score: the best token F1 against the `solution` column (a string, or a list of accepted
    answers), 0 when it is 0. Reads all assistant turns of a tool-calling completion.

    >>> reward = arpo_reward()
    >>> reward(completions=["<think>x</think><answer>\\\\boxed{Paris}</answer>", "Paris"], solution=["Paris", "Paris"])
    [1.0, -1.0]
    """

    def score(text: str, solutions) -> float:
        opened, closed = text.count("<think>"), text.count("</think>")
        if opened == 0 or opened != closed or text.count("<answer>") != 1 or text.count("</answer>") != 1:
            return -1.0
        start, end = text.index("<answer>") + len("<answer>"), text.index("</answer>")
        if start > end:
            return -1.0
        answer = text[start:end]
        if boxed:
            answer = _boxed(answer)
            if answer is None:
                return -1.0
        truths = [solutions] if isinstance(solutions, str) else list(solutions)
        return max((f1_score(answer, str(t)) for t in truths), default=0.0)

    def reward(completions, solution, **kwargs) -> list[float]:
        return [score(completion_text(c), s) for c, s in zip(completions, solution, strict=True)]

    reward.__name__ = "arpo_reward"
    reward.__qualname__ = "arpo_reward"
    return reward


register_reward("arpo", arpo_reward, factory=True)
