"""Reward-hacking monitor: see when "looking correct" starts to pay more than "being correct" (arXiv 2512.07611).

`RewardHackingMonitor` is a `TrainerCallback` for any trainer (ours, or plain TRL's `GRPOTrainer`). It reads the
metrics every trainer already logs (`rewards/<name>/mean` and `/std`, `completions/mean_length`, `entropy`, `kl`,
`clip_ratio/*`, `frac_reward_zero_std`, `grad_norm`, the methods' own metrics, held-out accuracy) at each logging
step, and runs detectors on their series. Each detector warns once per episode: it fires when its condition first
holds, and re-arms only after the condition has been clear for `rearm_logs` logging steps. A finding names the
evidence (the numbers, the steps) and what to try. The warnings go to the log (Python logging), into the logged
metrics (`monitor/warnings`, `monitor/<detector>`), so `report_to` sees them, and into a Markdown and JSON report in
`output_dir` at the end. Detectors named in `stop_on` also stop training (`control.should_training_stop`).

Trends are robust and slow on purpose: a value is the median of the last `window` logs, compared with the median of
the first `baseline_logs`; nothing fires before `baseline_logs + window` logs. "Correctness" is one reward (named, or
the one marked as correctness); every other reward is "format-like" unless `format` names the ones to watch. Hacking
is a format-like reward (or the total) rising while correctness is flat; the same drop in length, entropy or
advantage signal is not flagged while correctness improves (an addition model that gets sure of its short answers
is learning, not collapsing). docs/monitor.md lists every detector, its inputs and the reasons for its defaults.

The repetition signal needs the completions, which no logged metric carries: in our trainers the monitor is also an
extension and logs `completions/repetition` itself; on plain TRL add `monitor.probe` to `reward_funcs` (it scores
nothing: it returns None for every completion, so the rewards are unchanged, and logs the metric).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from transformers import TrainerCallback

from ..extension import Extension, Method, TrainerInputs, register_method
from .bicc import correctness_column, reward_names

logger = logging.getLogger(__name__)

# detector -> (what it watches, what to try when it fires)
DETECTORS = {
    "component_hacking": (
        "a format-like reward rising while correctness is flat or falling",
        "lower that reward's weight (reward_weights), gate it on correctness, or cap it; read a few completions",
    ),
    "correctness_regression": (
        "correctness falling far below its best (the run learned, then unlearned)",
        "look at what the other rewards paid for since its best; resume from an earlier checkpoint with a lower "
        "learning rate or shaping weight",
    ),
    "reward_composition": (
        "one format-like reward holding most of the reward variance while correctness is flat",
        "the advantages mostly rank that term: lower its weight or gate it on correctness",
    ),
    "heldout_divergence": (
        "train reward rising while the held-out metric is flat or falling",
        "the policy fits what the reward pays for on the training prompts: check the reward on held-out answers, "
        "add held-out data, lower shaping weights",
    ),
    "length_collapse": (
        "completions shrinking far below their start while correctness is flat",
        "a length or format bonus may pay for empty answers: lower it, or use loss_type='dr_grpo' / 'dapo'",
    ),
    "length_explosion": (
        "completions growing far beyond their start, or most of them cut at max_completion_length, while correctness "
        "is flat",
        "raise max_completion_length, add a stop penalty (stop_penalty), or a length budget (curriculum)",
    ),
    "repetition": (
        "repeated n-grams within completions rising",
        "lower the temperature, add a stop penalty (stop_penalty) or a repetition penalty reward, or raise beta",
    ),
    "entropy_collapse": (
        "token entropy falling to a small fraction of its start while correctness is flat",
        "the policy turned deterministic before it learned: raise the temperature, epsilon_high (clip-higher), or "
        "beta; or reset (ProRL)",
    ),
    "kl_spike": (
        "the KL to the reference jumping several-fold above its recent level",
        "lower the learning rate, raise beta, or reset the reference (ProRL)",
    ),
    "kl_drift": (
        "the KL to the reference above kl_max",
        "the policy is far from the reference: raise beta, or reset the reference (prorl_reset)",
    ),
    "kl_strangled": (
        "the KL to the reference near zero while the reward is flat (a KL penalty that holds the policy in place)",
        "lower beta, or raise the learning rate",
    ),
    "clip_saturation": (
        "a large share of tokens clipped by the trust region",
        "lower the learning rate or num_iterations, or widen epsilon / epsilon_high",
    ),
    "advantage_collapse": (
        "most groups with zero reward variance for several logs while correctness is not solved",
        "no learning signal: harder or easier prompts, larger num_generations, or dynamic_sampling=True",
    ),
    "grad_explosion": (
        "a non-finite gradient norm, or one many times its start",
        "lower the learning rate; keep max_grad_norm; check the rewards for outliers",
    ),
    "plateau": (
        "no new best reward for plateau_logs logs (off unless plateau_logs is set)",
        "raise the learning rate or the group size, or stop the run",
    ),
    "pta_plans_unclosed": (
        "PTA plans mostly never closed (pta/plans_closed low)",
        "raise plan_max_tokens, or cold-start on plan-formatted answers (trl-grpo-ext sft)",
    ),
    "arpo_no_branching": (
        "ARPO never branching (arpo/branches zero for several logs)",
        "lower arpo_entropy_threshold or raise arpo_branch_probability; check that tool calls happen",
    ),
    "curriculum_overrun": (
        "completions filling the whole token budget (curriculum/budget) for several logs",
        "the budget is tighter than the answers need: decay it more slowly (budget_decays) or end higher",
    ),
}
EVENTS = {"prorl_reset": "a ProRL reset (KL detectors wait `window` logs after it)"}


@dataclass
class Thresholds:
    """The monitor's thresholds; docs/monitor.md says why each default is what it is.

    Reward thresholds are in reward units (rewards in [0, 1] as the registry's are; scale them for other rewards).
    """

    window: int = 5  # logs in the median that smooths each value (a single noisy step never fires)
    baseline_logs: int = 3  # the first logs, whose median is the start value
    patience: int = 2  # logs in a row the condition must hold before it fires
    rearm_logs: int = 3  # logs the condition must be clear before the detector can fire again
    flat: float = 0.05  # correctness changed by at most this since the start: "flat"
    regression: float = 0.3  # correctness at least this below its best: "fallen"
    hacking_rise: float = 0.2  # a format-like reward rose by at least this since the start
    composition: float = 0.8  # share of the reward variance ((weight x std)^2) held by one format-like reward
    heldout_rise: float = 0.1  # the train reward rose by at least this ...
    heldout_flat: float = 0.02  # ... while the held-out metric changed by at most this (about one problem in 60)
    heldout_points: int = 2  # ... at each of its last this many measurements
    length_collapse: float = 0.5  # mean length at most this fraction of its start
    length_explosion: float = 2.0  # mean length at least this multiple of its start
    truncation: float = 0.5  # share of completions cut at max_completion_length, and at least 0.25 above its start
    repetition: float = 0.3  # share of a completion's n-grams that repeat an earlier one
    repetition_rise: float = 0.15  # ... and at least this above its start
    repetition_ngram: int = 4  # n of the n-grams (tokens)
    entropy_collapse: float = 0.1  # entropy at most this fraction of its start
    kl_spike: float = 4.0  # KL at least this multiple of its level `window` logs before
    kl_min: float = 0.05  # ... and at least this (nats per token)
    kl_max: float = 0.5  # KL drift: at least this (nats per token)
    kl_strangled: float = 1e-3  # KL at most this while the reward is flat: held in place by the KL penalty
    clip: float = 0.2  # share of tokens clipped (clip_ratio/region_mean)
    zero_std: float = 0.9  # share of groups with zero reward variance ...
    zero_std_logs: int = 8  # ... for this many logs in a row
    solved: float = 0.9  # correctness at or above this: a solved task, not a collapse
    grad_explosion: float = 10.0  # gradient norm at least this multiple of its median over the earlier logs
    plans_closed: float = 0.5  # PTA: share of plans closed at most this
    no_branch_logs: int = 5  # ARPO: logs in a row without a branch
    plateau_logs: int | None = None  # logs without a new best reward (None: the plateau detector is off)

    @classmethod
    def parse(cls, items: list[str] | dict | Thresholds | None) -> Thresholds:
        """From `Thresholds`, a dict, or `["name=value", ...]` (the command line's and YAML's form)."""
        if isinstance(items, Thresholds):
            return items
        values = dict(items or {}) if not isinstance(items, (list, tuple)) else {}
        for item in items if isinstance(items, (list, tuple)) else []:
            if not isinstance(item, str) or "=" not in item:
                raise ValueError(f"monitor_thresholds item {item!r} must read 'name=value' (e.g. 'hacking_rise=0.3').")
            name, value = item.split("=", 1)
            values[name.strip()] = value.strip()
        known = {f.name: f for f in fields(cls)}
        parsed = {}
        for name, value in values.items():
            if name not in known:
                raise ValueError(
                    f"monitor_thresholds: {name!r} is not a threshold; known: {', '.join(known)} (docs/monitor.md)."
                )
            integer = str(known[name].type).startswith("int")  # "int" or "int | None" (string annotations)
            try:
                parsed[name] = None if value in (None, "None", "none") else (int if integer else float)(value)
            except (TypeError, ValueError):
                kind = "a whole number" if integer else "a number"
                raise ValueError(f"monitor_thresholds: {name}={value!r} must be {kind}.") from None
            if parsed[name] is not None and (parsed[name] < 0 or (integer and parsed[name] < 1)):
                raise ValueError(f"monitor_thresholds: {name}={value!r} must be {'>= 1' if integer else '>= 0'}.")
        return cls(**parsed)


@dataclass
class Finding:
    """One warning (or event): which detector, at which step, on what evidence, and what to try."""

    detector: str
    step: int
    evidence: str
    advice: str
    subject: str = ""  # the reward component it is about, for per-component detectors
    kind: str = "warning"  # or "event" (a ProRL reset): reported, never counted as a warning

    @property
    def key(self) -> str:
        return f"{self.detector}:{self.subject}" if self.subject else self.detector


def repeated_ngram_rate(ids: list[int], n: int = 4) -> float:
    """The share of a sequence's n-grams that repeat an earlier n-gram of the same sequence (0 when too short).

    >>> repeated_ngram_rate([1, 2, 3, 1, 2, 3, 1, 2, 3], n=3)  # 7 trigrams, 4 of them seen before
    0.5714285714285714
    >>> repeated_ngram_rate([1, 2, 3, 4], n=3)
    0.0
    """
    total = len(ids) - n + 1
    if total <= 0:
        return 0.0
    seen, repeats = set(), 0
    for i in range(total):
        gram = tuple(ids[i : i + n])
        repeats += gram in seen
        seen.add(gram)
    return repeats / total


class History:
    """The logged series the detectors read: key -> [(step, value)], train logs only (held-out from any log)."""

    def __init__(self):
        self.series: dict[str, list[tuple[int, float]]] = {}
        self.logs = 0

    def add(self, step: int, logs: dict) -> None:
        self.logs += 1
        for key, value in logs.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value is not None:
                self.series.setdefault(key, []).append((step, float(value)))

    def values(self, key: str) -> list[float]:
        return [v for _, v in self.series.get(key, []) if not math.isnan(v)]

    def has(self, key: str, count: int = 1) -> bool:
        return len(self.values(key)) >= count

    def recent(self, key: str, window: int) -> float:
        return statistics.median(self.values(key)[-window:])

    def start(self, key: str, count: int) -> float:
        return statistics.median(self.values(key)[:count])

    def steps(self, key: str) -> tuple[int, int]:
        points = self.series[key]
        return points[0][0], points[-1][0]


def _best_median(values: list[float], window: int) -> float:
    """The highest median of `window` consecutive values."""
    return max(statistics.median(values[i : i + window]) for i in range(len(values) - window + 1))


def _f(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def detect(history: History, th: Thresholds, correctness: str | None, format_like: list[str],
           heldout: str | None, weights: dict[str, float], quiet_kl: bool = False) -> list[Finding]:  # fmt: skip
    """Every condition that holds now (not yet once-per-episode: `RewardHackingMonitor` does that). Pure."""
    out, step, w = [], 0, th.window
    ready = th.baseline_logs + w  # logs a trend needs: the start and a window after it

    def trend(key):
        return history.start(key, th.baseline_logs), history.recent(key, w)

    def add(detector, evidence, subject=""):
        out.append(Finding(detector, step, evidence, DETECTORS[detector][1], subject))

    if history.series:
        step = max(points[-1][0] for points in history.series.values())
    c_key = f"rewards/{correctness}/mean" if correctness else None
    c_ready = c_key is not None and history.has(c_key, ready)
    c_start, c_now = trend(c_key) if c_ready else (math.nan, math.nan)
    c_best = _best_median(history.values(c_key), w) if c_ready else math.nan
    c_fell = c_ready and c_best - c_now >= th.regression  # learned, then unlearned
    c_flat = c_ready and (c_now - c_start <= th.flat or c_fell)  # flat, falling, or fallen from its best
    c_text = (f"{c_key} {_f(c_start)} -> {_f(c_now)}" + (f" (best {_f(c_best)})" if c_fell else "")) if c_ready else ""
    if c_fell:
        out.append(Finding("correctness_regression", step, f"{c_key} fell from {_f(c_best)} (its best median of {w} "
                           f"logs) to {_f(c_now)}", DETECTORS["correctness_regression"][1]))  # fmt: skip
    # Without a correctness reward, "correctness is flat" cannot be known: those conditions then rest on the trend
    # alone only where the detector is meaningful without it (length, entropy); hacking needs it.
    not_learning = c_flat if c_key is not None else True

    for name in format_like:
        key = f"rewards/{name}/mean"
        if c_ready and history.has(key, ready):
            start, now = trend(key)
            # The rule is the rise while correctness is flat, whatever either pays: a term that climbs from 0.1 to
            # 0.6 under a flat 0.7 correctness is what the advantages now rank (issue 32). The weighted pay of both
            # is evidence, not a condition.
            if now - start >= th.hacking_rise and c_flat:
                a, b = history.steps(key)
                add("component_hacking", f"{key} rose {_f(start)} -> {_f(now)} over steps {a}-{b} while {c_text} "
                    f"({'fallen from its best' if c_fell else f'change {_f(c_now - c_start)}, flat within {th.flat}'}); weighted, it pays {_f(weights.get(name, 1.0) * now)} "
                    f"against correctness's {_f(weights.get(correctness, 1.0) * c_now)}", subject=name)  # fmt: skip
    if c_ready and format_like:
        shares = {}
        for name in [correctness, *format_like]:
            key = f"rewards/{name}/std"
            if history.has(key, w):
                shares[name] = (weights.get(name, 1.0) * history.recent(key, w)) ** 2
        total = sum(shares.values())
        if total > 0 and c_flat and c_now < th.solved:
            top = max((n for n in shares if n != correctness), key=shares.get, default=None)
            if top is not None and shares[top] / total >= th.composition:
                add("reward_composition", f"rewards/{top} holds {shares[top] / total:.0%} of the reward variance "
                    f"((weight x std)^2, median of {w} logs) while {c_text}", subject=top)  # fmt: skip

    if heldout and history.has(heldout, 2) and history.has("reward", ready):
        h = history.values(heldout)
        r_start, r_now = trend("reward")
        last = h[1:][-th.heldout_points :]
        if (
            len(last) >= th.heldout_points
            and r_now - r_start >= th.heldout_rise
            and max(last) - h[0] <= th.heldout_flat
        ):
            a, b = history.steps(heldout)
            add("heldout_divergence", f"train reward rose {_f(r_start)} -> {_f(r_now)} while {heldout} went "
                f"{' -> '.join(_f(v) for v in [h[0], *last])} (steps {a}-{b})")  # fmt: skip

    length = "completions/mean_length"
    budget = "curriculum/budget"
    if history.has(length, ready):
        start, now = trend(length)
        if not_learning and start >= 4 and now <= th.length_collapse * start:
            add("length_collapse", f"{length} fell {_f(start)} -> {_f(now)} tokens ({now / start:.0%} of its start)"
                + (f" while {c_text}" if c_text else ""))  # fmt: skip
        clipped = "completions/clipped_ratio"
        cut = history.has(clipped, ready) and not history.has(budget)  # a capping budget truncates on purpose
        cut_start, cut_now = trend(clipped) if cut else (0.0, 0.0)
        cut_now = cut_now if cut_now - cut_start >= 0.25 else 0.0  # cut from the start on is the task, not a change
        if not_learning and start > 0 and (now >= th.length_explosion * start or cut_now >= th.truncation):
            why = (f"{length} grew {_f(start)} -> {_f(now)} tokens" if now >= th.length_explosion * start
                   else f"{cut_now:.0%} of completions cut at max_completion_length ({clipped})")  # fmt: skip
            add("length_explosion", why + (f" while {c_text}" if c_text else ""))
    repetition = "completions/repetition"
    if history.has(repetition, ready):
        start, now = trend(repetition)
        if now >= th.repetition and now - start >= th.repetition_rise:
            add("repetition", f"{now:.0%} of {th.repetition_ngram}-grams repeat within a completion "
                f"({repetition}; {start:.0%} at the start)")  # fmt: skip
    if history.has("entropy", ready):
        start, now = trend("entropy")
        if not_learning and start > 1e-3 and now <= th.entropy_collapse * start:
            add("entropy_collapse", f"entropy fell {_f(start)} -> {_f(now)} ({now / start:.0%} of its start)"
                + (f" while {c_text}" if c_text else ""))  # fmt: skip
    if history.has("kl", ready) and not quiet_kl:
        kl = history.values("kl")
        now, before = history.recent("kl", w), statistics.median(kl[-2 * w : -w])
        if now >= th.kl_min and now >= th.kl_spike * max(before, 1e-8):
            add("kl_spike", f"kl {_f(before)} -> {_f(now)} (median of {w} logs, {now / max(before, 1e-8):.1f}x)")
        if now >= th.kl_max:
            add("kl_drift", f"kl {_f(now)} nats per token (median of {w} logs) >= kl_max {th.kl_max}")
        r_start, r_now = trend("reward") if history.has("reward", ready) else (0.0, math.inf)
        unsolved = not (c_key is not None and history.has(c_key, 1) and history.recent(c_key, w) >= th.solved)
        if now <= th.kl_strangled and abs(r_now - r_start) <= th.flat and unsolved:
            add("kl_strangled", f"kl {_f(now)} (median of {w} logs) while the reward stayed {_f(r_start)} -> "
                f"{_f(r_now)}")  # fmt: skip
    if history.has("clip_ratio/region_mean", w):
        now = history.recent("clip_ratio/region_mean", w)
        if now >= th.clip:
            low = history.recent("clip_ratio/low_mean", w) if history.has("clip_ratio/low_mean", w) else math.nan
            high = history.recent("clip_ratio/high_mean", w) if history.has("clip_ratio/high_mean", w) else math.nan
            add("clip_saturation", f"{now:.0%} of tokens clipped (low {_f(low)}, high {_f(high)}; median of {w} logs)")
    zero = history.values("frac_reward_zero_std")
    if len(zero) >= th.zero_std_logs and min(zero[-th.zero_std_logs :]) >= th.zero_std:
        solved = c_key is not None and history.has(c_key, 1) and history.recent(c_key, w) >= th.solved
        if not solved:
            add("advantage_collapse", f"frac_reward_zero_std >= {th.zero_std} for the last {th.zero_std_logs} logs "
                f"(last {_f(zero[-1])})" + (f" while {c_text}" if c_text else ""))  # fmt: skip
    grads = history.values("grad_norm")
    if grads and not math.isfinite(grads[-1]):
        add("grad_explosion", f"grad_norm is {grads[-1]} at step {step}")
    elif len(grads) >= ready:
        before, now = statistics.median(grads[:-w]), history.recent("grad_norm", w)
        if before > 0 and now >= th.grad_explosion * before:
            add("grad_explosion", f"grad_norm {_f(before)} (median before) -> {_f(now)} (median of the last {w}), "
                f"{now / before:.0f}x")  # fmt: skip
    rewards = history.values("reward")
    if th.plateau_logs and len(rewards) > th.plateau_logs:
        best_before = max(rewards[: -th.plateau_logs])
        if max(rewards[-th.plateau_logs :]) <= best_before:
            add("plateau", f"no reward above {_f(best_before)} in the last {th.plateau_logs} logs")

    if history.has("pta/plans_closed", w) and history.recent("pta/plans_closed", w) <= th.plans_closed:
        add("pta_plans_unclosed", f"pta/plans_closed {_f(history.recent('pta/plans_closed', w))} (median of {w})")
    branches = history.values("arpo/branches")
    if len(branches) >= th.no_branch_logs and max(branches[-th.no_branch_logs :]) == 0:
        add("arpo_no_branching", f"arpo/branches 0 for the last {th.no_branch_logs} logs")
    if history.has(budget, w) and history.has(length, w):
        now, cap = history.recent(length, w), history.recent(budget, w)
        if now >= 0.95 * cap and cap < history.values(budget)[0]:  # once the budget has been cut
            add("curriculum_overrun", f"{length} {_f(now)} tokens against a budget of {_f(cap)} (median of {w})")
    return out


class RewardHackingMonitor(Extension, TrainerCallback):
    """Watches a run's logged metrics for reward hacking and training pathologies; warns once per episode.

    Args:
        correctness: the reward that says whether an answer is right: its logged name (`rewards/<name>/mean`) or
            registry name. Default: the one marked as correctness (`correctness = True`, TRL's `accuracy_reward`).
        format: the rewards to watch as format-like (default: every reward but correctness).
        heldout: the logged key of a held-out metric (default: `heldout/accuracy`, else
            `eval_rewards/<correctness>/mean`, else `eval_reward`, whichever is logged).
        stop_on: detectors that stop training when they fire (`["any"]`: every one). Default: none.
        thresholds: a `Thresholds`, a dict or `["name=value"]`.
        report: where the Markdown report goes (default `<output_dir>/reward_hacking.md`, with a `.json` beside).

    In our trainers pass it in `callbacks=[...]` (or set `monitor=True` in the config). On plain TRL's `GRPOTrainer`:
    `monitor.attach(trainer)` after building it (so that its metrics reach `report_to`), and `monitor.probe` in
    `reward_funcs` for the repetition signal.

    >>> monitor = RewardHackingMonitor(correctness="accuracy", stop_on=["component_hacking"])  # doctest: +SKIP
    """

    name = "monitor"
    order = 200  # reads the batch after every other extension

    def __init__(self, correctness: str | None = None, format: list[str] | None = None, heldout: str | None = None,
                 stop_on: list[str] | None = None, thresholds=None, report: str | None = None):  # fmt: skip
        self.thresholds = Thresholds.parse(thresholds)
        stop_on = [stop_on] if isinstance(stop_on, str) else list(stop_on or [])
        unknown = [s for s in stop_on if s != "any" and s not in DETECTORS]
        if unknown:
            raise ValueError(
                f"monitor stop_on={stop_on!r} (monitor_stop in a config) names no detector {unknown}; use 'any' or "
                f"some of: {', '.join(DETECTORS)}."
            )
        self.correctness_name, self.format_names, self.heldout_name = correctness, format, heldout
        self.stop_on, self.report = stop_on, report
        self.correctness: str | None = None
        self.format: list[str] | None = None
        self.heldout: str | None = None
        self._weights: dict[str, float] | None = None  # reward name -> its weight in the total
        self._names: list[str] = []  # the rewards, in the trainer's order
        self.history = History()
        self.findings: list[Finding] = []
        self.active: dict[str, int] = {}  # episode key -> logs since its condition last held
        self.streak: dict[str, int] = {}  # condition key -> logs in a row it has held
        self.notes: list[str] = []  # what is not watched, and why
        self._resets, self._quiet_until = 0.0, -1
        self.probe = _RepetitionProbe(self.thresholds.repetition_ngram)

    # ---- wiring
    def check(self, inputs: TrainerInputs) -> None:
        names = reward_names(inputs.reward_funcs)
        if self.correctness_name is not None:
            correctness_column(inputs.reward_funcs, self.correctness_name, option="monitor_correctness",
                               switch="the reward-hacking monitor")  # fmt: skip
        for name in self.format_names or []:
            if name not in names:
                raise ValueError(f"monitor_format names {name!r}, which is not one of this trainer's rewards {names}; "
                                 "give the names the rewards are logged under (rewards/<name>/mean).")  # fmt: skip

    def setup(self, trainer) -> None:
        super().setup(trainer)
        self.attach(trainer)

    def attach(self, trainer) -> RewardHackingMonitor:
        """Resolve the rewards' roles from the trainer and go first among its callbacks (before the reporters, so
        that `monitor/*` metrics reach `report_to`). Our trainers call it; on plain TRL call it yourself."""
        self.trainer = trainer
        funcs = list(getattr(trainer, "reward_funcs", None) or [])
        if funcs:
            names = list(getattr(trainer, "reward_func_names", None) or reward_names(funcs))
            try:
                index = correctness_column(funcs, self.correctness_name, option="monitor_correctness",
                                           switch="the reward-hacking monitor")  # fmt: skip
                self._set_roles(names, names[index])
            except ValueError:
                if self.correctness_name is not None:
                    raise
                self._set_roles(names, None)
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        return self

    def _set_roles(self, names: list[str], correctness: str | None) -> None:
        self._names, self.correctness = list(names), correctness
        self.format = (
            list(self.format_names) if self.format_names is not None else [n for n in names if n != correctness]
        )
        if correctness is None:
            self.notes.append(
                f"no correctness reward among {names} (name one with correctness= / monitor_correctness): "
                "component_hacking, reward_composition and the correctness conditions are off."
            )

    def _resolve_from_logs(self, logs: dict) -> None:
        """Plain TRL without `attach`: the roles from the logged reward names."""
        names = [k[len("rewards/") : -len("/mean")] for k in logs if k.startswith("rewards/") and k.endswith("/mean")]
        names = [n for n in names if n != self.probe.__name__]
        chosen = self._match(self.correctness_name, names)
        self._set_roles(names, chosen)

    # ---- the repetition signal, in our trainers
    def after_scoring(self, batch) -> None:
        if batch.mode != "train":
            return
        mask = batch.completion_mask.bool()
        if batch.tool_mask is not None:
            mask &= batch.tool_mask.bool()
        rows = [ids[m].tolist() for ids, m in zip(batch.completion_ids, mask, strict=True)]
        rates = [repeated_ngram_rate(r, self.thresholds.repetition_ngram) for r in rows]
        self.trainer.log_metric("completions/repetition", sum(rates) / max(len(rates), 1))

    # ---- the detectors, at each log
    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs:
            return
        train = {k: v for k, v in logs.items() if not k.startswith("eval_")}
        for key in [k for k in logs if k.startswith("eval_")]:  # held-out series come from eval logs too
            if isinstance(logs[key], (int, float)):
                self.history.series.setdefault(key, []).append((state.global_step, float(logs[key])))
        if "reward" not in train:  # an eval-only log, or the end-of-training summary
            return
        if self.format is None:  # plain TRL without `attach`: the roles from the logged reward names
            self._resolve_from_logs(logs)
        if self._weights is None:
            names = list(getattr(self.trainer, "reward_func_names", None) or self._names)  # in the weights' order
            weights = list(args.reward_weights or [1.0] * len(names))
            self._weights = {n: float(w) for n, w in zip(names, weights, strict=False) if n}
        self.history.add(state.global_step, train)
        resets = train.get("prorl/resets", self._resets)
        if resets > self._resets:
            self._resets = resets
            self._quiet_until = self.history.logs + self.thresholds.window
            self._record(Finding("prorl_reset", state.global_step, f"prorl/resets is now {resets:.0f}",
                                 "KL detectors wait a window after it", kind="event"), state)  # fmt: skip
        heldout = self._heldout_key()
        found = detect(self.history, self.thresholds, self.correctness, self.format or [], heldout, self._weights,
                       quiet_kl=self.history.logs <= self._quiet_until)  # fmt: skip
        holding = {f.key for f in found}
        for key in list(self.active):  # an episode ends after `rearm_logs` logs without its condition
            self.active[key] = 0 if key in holding else self.active[key] + 1
            if self.active[key] >= self.thresholds.rearm_logs:
                del self.active[key]
        self.streak = {k: self.streak.get(k, 0) + 1 for k in holding}  # logs in a row each condition has held
        fired = []
        for finding in found:
            if finding.key not in self.active and self.streak[finding.key] >= self.thresholds.patience:
                self.active[finding.key] = 0
                finding.step = state.global_step
                self._record(finding, state)
                fired.append(finding)
        metrics = {"monitor/warnings": float(sum(f.kind == "warning" for f in self.findings))}
        metrics.update({f"monitor/{f.detector}": 1.0 for f in fired})
        logs.update(metrics)  # the callbacks after this one (the reporters) see them
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)
        if any("any" in self.stop_on or f.detector in self.stop_on for f in fired):
            names = sorted({f.detector for f in fired if "any" in self.stop_on or f.detector in self.stop_on})
            logger.warning(f"reward-hacking monitor: stopping training at step {state.global_step} ({', '.join(names)}"
                           " fired; stop_on)")  # fmt: skip
            control.should_training_stop = True
        return control

    def _heldout_key(self) -> str | None:
        if self.heldout_name is not None:
            return self.heldout_name
        keys = [
            "heldout/accuracy",
            "heldout/driving_score",
            f"eval_rewards/{self.correctness}/mean" if self.correctness else None,
            "eval_reward",
        ]
        return next((k for k in keys if k and k in self.history.series), None)

    def _record(self, finding: Finding, state) -> None:
        self.findings.append(finding)
        if state.is_world_process_zero:
            if finding.kind == "event":
                logger.info(f"reward-hacking monitor, step {finding.step}: {finding.detector}: {finding.evidence}")
            else:
                logger.warning(f"reward-hacking monitor, step {finding.step}: {finding.detector}: {finding.evidence}. "
                               f"Try: {finding.advice}.")  # fmt: skip

    def replay(self, log_history: list[dict], reward_weights: list[float] | None = None,
               reward_names: list[str] | None = None) -> list[Finding]:  # fmt: skip
        """Run the detectors over a finished run's logs (`trainer.state.log_history`, or `trainer_state.json`'s
        `log_history`) as they would have run live; returns the findings. Without `reward_names` the roles come
        from the logged reward names."""
        from transformers import TrainerControl, TrainerState

        if reward_names is not None:
            self._set_roles(list(reward_names), self._match(self.correctness_name, reward_names))
        args = _ReplayArgs(reward_weights)
        state, control = TrainerState(), TrainerControl()
        for logs in log_history:
            state.global_step = int(logs.get("step", state.global_step + 1))
            self.on_log(args, state, control, logs=dict(logs))
        return self.findings

    def _match(self, name: str | None, names: list[str]) -> str | None:
        if name is None:
            return next((n for n in names if n in ("accuracy_reward", "reasoning_accuracy_reward")), None)
        matches = [n for n in names if n == name] or [n for n in names if n.startswith(name)]
        if len(matches) != 1:
            raise ValueError(f"monitor correctness={name!r} matches {matches or 'none'} of the logged rewards "
                             f"{names}; give the name a reward is logged under (rewards/<name>/mean).")  # fmt: skip
        return matches[0]

    # ---- the report
    def watched(self) -> dict[str, str]:
        """detector -> 'watched' or why it is not (the inputs it lacks)."""
        series = self.history.series
        needs = {
            "component_hacking": [f"rewards/{self.correctness}/mean"]
            if self.correctness
            else ["a correctness reward"],
            "correctness_regression": [f"rewards/{self.correctness}/mean"]
            if self.correctness
            else ["a correctness reward"],
            "reward_composition": [f"rewards/{self.correctness}/std"]
            if self.correctness
            else ["a correctness reward"],
            "heldout_divergence": [self._heldout_key() or "a held-out metric (heldout/accuracy, eval_reward)"],
            "length_collapse": ["completions/mean_length"],
            "length_explosion": ["completions/mean_length"],
            "repetition": ["completions/repetition (plain TRL: add monitor.probe to reward_funcs)"],
            "entropy_collapse": ["entropy"],
            "kl_spike": ["kl (logged when beta > 0)"],
            "kl_drift": ["kl (logged when beta > 0)"],
            "kl_strangled": ["kl (logged when beta > 0)"],
            "clip_saturation": ["clip_ratio/region_mean"],
            "advantage_collapse": ["frac_reward_zero_std"],
            "grad_explosion": ["grad_norm"],
            "plateau": ["reward"] if self.thresholds.plateau_logs else ["plateau_logs set"],
            "pta_plans_unclosed": ["pta/plans_closed"],
            "arpo_no_branching": ["arpo/branches"],
            "curriculum_overrun": ["curriculum/budget"],
        }
        out = {}
        for detector, keys in needs.items():
            missing = [k for k in keys if k.split(" ")[0] not in series]
            out[detector] = "watched" if not missing else f"not watched: needs {', '.join(missing)}"
        return out

    def summary(self) -> str:
        """The report, as Markdown: what fired and when, with the evidence; then what was watched."""
        warnings = [f for f in self.findings if f.kind == "warning"]
        lines = ["# Reward-hacking monitor report", "",
                 f"{len(warnings)} warning(s) over {self.history.logs} logged steps. Correctness: "
                 f"`{self.correctness or 'none'}`; format-like: {', '.join(f'`{n}`' for n in self.format or []) or 'none'}; "
                 f"held-out: `{self._heldout_key() or 'none'}`.", ""]  # fmt: skip
        if self.findings:
            lines += ["| step | detector | evidence | what to try |", "|---|---|---|---|"]
            lines += [f"| {f.step} | {f.detector}{' (event)' if f.kind == 'event' else ''} | {f.evidence} | {f.advice} |"
                      for f in self.findings]  # fmt: skip
        else:
            lines.append("Nothing fired.")
        lines += ["", "| detector | status |", "|---|---|"]
        lines += [f"| {d} | {s} |" for d, s in self.watched().items()]
        lines += [f"\n{note}" for note in self.notes]
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict:
        return {"warnings": sum(f.kind == "warning" for f in self.findings), "findings": [asdict(f) for f in self.findings],
                "correctness": self.correctness, "format": self.format, "heldout": self._heldout_key(),
                "watched": self.watched(), "thresholds": asdict(self.thresholds), "notes": self.notes}  # fmt: skip

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        path = Path(self.report or Path(args.output_dir) / "reward_hacking.md")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.summary())
        path.with_suffix(".json").write_text(json.dumps(self.to_dict(), indent=1))
        count = sum(f.kind == "warning" for f in self.findings)
        logger.warning(f"reward-hacking monitor: {count} warning(s); report in {path}") if count else logger.info(
            f"reward-hacking monitor: nothing fired; report in {path}"
        )

    # ---- checkpoints
    def state_dict(self) -> dict:
        return {"series": self.history.series, "logs": self.history.logs, "findings": [asdict(f) for f in self.findings],
                "active": self.active, "streak": self.streak, "resets": self._resets, "quiet_until": self._quiet_until}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.history.series = {k: [tuple(p) for p in v] for k, v in state["series"].items()}
        self.history.logs = state["logs"]
        self.findings = [Finding(**f) for f in state["findings"]]
        self.active, self.streak = dict(state["active"]), dict(state["streak"])
        self._resets, self._quiet_until = state["resets"], state["quiet_until"]


@dataclass
class _ReplayArgs:
    """What `on_log` reads from the training arguments, for `replay`."""

    reward_weights: list[float] | None = None


class _RepetitionProbe:
    """A reward function that scores nothing (None for every completion) and logs `completions/repetition`: the
    repetition signal for plain TRL trainers, which log no completions to callbacks."""

    __name__ = "repetition_probe"

    def __init__(self, n: int):
        self.n = n

    def __call__(self, completion_ids=None, log_metric=None, **kwargs) -> list[None]:
        ids = [list(map(int, c)) for c in completion_ids or []]
        if log_metric is not None and ids:
            log_metric("completions/repetition", sum(repeated_ngram_rate(c, self.n) for c in ids) / len(ids))
        return [None] * len(ids)


@dataclass
class MonitorConfig:
    """Config section: the reward-hacking monitor (arXiv 2512.07611; `trl_grpo_ext.methods.monitor`).

    > Parameters of the reward-hacking monitor (`trl_grpo_ext.RewardHackingMonitor`, docs/monitor.md)

    monitor (`bool`, *optional*, defaults to `False`):
        Watch the run for reward hacking (a format-like reward rising while correctness is flat, held-out
        divergence) and pathologies (length, repetition, entropy, KL, clipping, zero-variance groups, gradients,
        the methods' own signals); warn once per episode; write `reward_hacking.md` in `output_dir` at the end.
    monitor_correctness (`str`, *optional*):
        The correctness reward (logged or registry name). Default: the one marked as correctness.
    monitor_format (`list[str]`, *optional*):
        The rewards to watch as format-like. Default: every reward but correctness.
    monitor_heldout (`str`, *optional*):
        Logged key of a held-out metric. Default: `heldout/accuracy` (or `heldout/driving_score`), else `eval_rewards/<correctness>/mean`, else
        `eval_reward`.
    monitor_stop (`list[str]`, *optional*):
        Detectors that stop training when they fire (`any` for all). Default: none, only warn.
    monitor_thresholds (`list[str]`, *optional*):
        Threshold overrides, `name=value` (e.g. `hacking_rise=0.3 window=5`); see `Thresholds`.
    """

    monitor: bool = field(default=False, metadata={"help": "Watch the run for reward hacking (docs/monitor.md)."})
    monitor_correctness: str | None = field(default=None, metadata={"help": "The correctness reward's name."})
    monitor_format: list[str] | None = field(default=None, metadata={"help": "Rewards watched as format-like."})
    monitor_heldout: str | None = field(default=None, metadata={"help": "Logged key of a held-out metric."})
    monitor_stop: list[str] | None = field(
        default=None, metadata={"help": "Detectors that stop training when they fire ('any': all)."}
    )
    monitor_thresholds: list[str] | None = field(
        default=None, metadata={"help": "Threshold overrides, 'name=value' (docs/monitor.md)."}
    )

    def __post_init__(self):
        super().__post_init__()
        given = [f.name for f in fields(MonitorConfig) if f.name != "monitor" and getattr(self, f.name) is not None]
        if given and not self.monitor:
            raise ValueError(f"{given[0]} is set, but monitor=False; set monitor=True, or leave {given[0]} unset (it "
                             f"is {getattr(self, given[0])!r}).")  # fmt: skip
        if self.monitor:
            _from_config(self)  # the thresholds and stop names, checked now


def _from_config(args) -> RewardHackingMonitor | None:
    if not getattr(args, "monitor", False):
        return None
    return RewardHackingMonitor(correctness=args.monitor_correctness, format=args.monitor_format,
                                heldout=args.monitor_heldout, stop_on=args.monitor_stop,
                                thresholds=args.monitor_thresholds)  # fmt: skip


register_method(Method(name="monitor", title="Reward-hacking monitor", arxiv="2512.07611", extension=_from_config))

__all__ = ["RewardHackingMonitor", "Thresholds", "Finding", "MonitorConfig", "DETECTORS", "detect",
           "repeated_ngram_rate", "History"]  # fmt: skip
