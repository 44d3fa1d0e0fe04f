"""NoRD (arXiv 2602.21172): trajectory rewards for a driving policy, and the difficulty-bias diagnostic.

NoRD trains a vision-language-action model to write future waypoints directly (no reasoning text) and scores them
with a continuous driving score; its finding is that GRPO's std normalisation biases learning by difficulty: a
group whose rewards barely differ (an easy scene, all answers good) gets the same advantage mass as a group whose
rewards spread widely (a hard scene), so the easy groups' noise is inflated and the hard groups' signal shrunk.
Dr. GRPO (`loss_type="dr_grpo"`, `scale_rewards="none"`: A_i = r_i − mean(r)) removes the bias.

This module holds the pure maths (`parse_waypoints`, `score_trajectory`, `group_advantages`, `difficulty_stats`),
the `trajectory` reward (registry name; a factory) and `DifficultyBiasDiagnostic`.

Waypoints are read from the completion as `(x1, y1) (x2, y2) ...` (metres, ego frame: x forward, y left; the
format of `trl_grpo_ext.data.driving`). The toy driving score, in [0, 1], PDMS-like:

    score = (1 − collision) · (1 − offroad) · (w_imitation · exp(−(ADE + FDE) / (2·scale)) + w_progress · progress)

with ADE / FDE the mean / final displacement from the ground truth, progress = clip(x_K / x_K_true, 0, 1),
collision = the path (from the ego's position through the waypoints) comes within ego radius + car radius of a car,
offroad = a waypoint leaves the road's lateral bounds; w_imitation = 2/3, w_progress = 1/3, scale = 1 m.

>>> parse_waypoints("(1.0, 0.0) (2.0, 0.5)")
[(1.0, 0.0), (2.0, 0.5)]
>>> round(score_trajectory([(1.0, 0.5)], [(1.0, 0.0)]).score, 4)  # 0.5 m off: (2/3)·exp(-0.5) + 1/3
0.7377
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from itertools import pairwise
from pathlib import Path

import torch
from accelerate.utils import gather, gather_object
from transformers import TrainerCallback

from ..advantages.group import SCALES, group_stats, normalise
from ..extension import Extension, Method, TrainerInputs, register_method
from ..registry import _import_path
from ..rewards import completion_text, register_reward

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
WAYPOINT_PATTERN = rf"\(\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\)"


def parse_waypoints(text: str, pattern: str | re.Pattern = WAYPOINT_PATTERN) -> list[tuple[float, float]] | None:
    """The (x, y) waypoints in `text`, in order, by `pattern` (a regex with two groups); None when there are none
    or one is not a finite number."""
    regex = re.compile(pattern) if isinstance(pattern, str) else pattern
    points = []
    for match in regex.finditer(text):
        try:
            x, y = float(match.group(1)), float(match.group(2))
        except (TypeError, ValueError, IndexError):
            return None
        if not (math.isfinite(x) and math.isfinite(y)):
            return None
        points.append((x, y))
    return points or None


@dataclass(frozen=True)
class TrajectoryScore:
    """The driving score of one trajectory and its parts."""

    score: float
    ade: float
    fde: float
    imitation: float
    progress: float
    collision: bool
    offroad: bool


def _segment_distance(p, a, b) -> float:
    (px, py), (ax, ay), (bx, by) = p, a, b
    dx, dy = bx - ax, by - ay
    length = dx * dx + dy * dy
    t = 0.0 if length == 0 else max(0.0, min(1.0, ((px - ax) * dx + (py - ay) * dy) / length))
    return math.hypot(px - (ax + t * dx), py - (ay + t * dy))


def score_trajectory(pred, gt, scene: dict | None = None, *, scale: float = 1.0, w_imitation: float = 2 / 3,
                     w_progress: float = 1 / 3) -> TrajectoryScore:  # fmt: skip
    """The toy driving score (module docstring) of waypoints `pred` against `gt` (same length) in `scene`.

    `scene` (optional): `cars` as [x, y, radius], `ego_radius`, `road` as [y_min, y_max]; without it, no collision
    or offroad check. The path starts at the ego's position, (0, 0).
    """
    if len(pred) != len(gt) or not gt:
        raise ValueError(f"score_trajectory: {len(pred)} predicted waypoints for {len(gt)} ground-truth ones.")
    errors = [math.hypot(px - gx, py - gy) for (px, py), (gx, gy) in zip(pred, gt, strict=True)]
    ade, fde = sum(errors) / len(errors), errors[-1]
    imitation = math.exp(-(ade + fde) / (2 * scale))
    true_x = gt[-1][0]
    progress = 1.0 if true_x <= 0 else max(0.0, min(1.0, pred[-1][0] / true_x))
    collision = offroad = False
    if scene:
        path = [(0.0, 0.0), *[tuple(p) for p in pred]]
        ego = float(scene.get("ego_radius", 0.0))
        for cx, cy, radius in scene.get("cars") or []:
            if any(_segment_distance((cx, cy), a, b) < ego + radius for a, b in pairwise(path)):
                collision = True
        road = scene.get("road")
        if road is not None:
            offroad = any(not road[0] <= y <= road[1] for _, y in pred)
    blend = (w_imitation * imitation + w_progress * progress) / (w_imitation + w_progress)
    score = 0.0 if collision or offroad else blend
    return TrajectoryScore(score, ade, fde, imitation, progress, collision, offroad)


def driving_score(pred, gt, scene=None, **params) -> float:
    """The toy PDMS-like score in [0, 1] (`score_trajectory(...).score`): a metric for `trajectory`."""
    return score_trajectory(pred, gt, scene, **params).score


def displacement_score(pred, gt, scene=None, scale: float = 1.0) -> float:
    """exp(−ADE / scale): displacement only, no scene checks. A metric for `trajectory`."""
    return math.exp(-score_trajectory(pred, gt, None).ade / scale)


METRICS: dict[str, Callable] = {"driving_score": driving_score, "displacement": displacement_score}


def trajectory_reward(metric: str | Callable = "driving_score", pattern: str = WAYPOINT_PATTERN,
                      extra_waypoints: str = "reject", future_column: str = "future", scene_column: str = "scene",
                      **metric_params) -> Callable:  # fmt: skip
    """Build the trajectory reward: decode waypoints from each completion and score them with `metric`.

    Args:
        metric: `"driving_score"` (the toy PDMS-like score), `"displacement"`, a dotted import path or a callable
            `metric(pred, gt, scene, **metric_params) -> float`.
        pattern: regex with two groups (x, y) that finds one waypoint.
        extra_waypoints: `"reject"` (more waypoints than the ground truth scores 0) or `"ignore"` (the first K
            count). Fewer waypoints always score 0.
        future_column / scene_column: the dataset columns of the ground truth (K [x, y] pairs) and the scene.
        metric_params: passed to the metric (`scale`, `w_imitation`, `w_progress` for the driving score).

    A completion without a parsable waypoint (malformed) or with the wrong count scores 0, never raises; each batch
    logs `trajectory/malformed` and `trajectory/wrong_count` (counts), and over the parsed ones `trajectory/ade`,
    `trajectory/fde`, `trajectory/collision_rate` and `trajectory/offroad_rate`.
    """
    if extra_waypoints not in ("reject", "ignore"):
        raise ValueError(f"trajectory: extra_waypoints={extra_waypoints!r} must be 'reject' or 'ignore'.")
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"trajectory: pattern={pattern!r} is not a regular expression ({exc}).") from exc
    if regex.groups != 2:
        raise ValueError(f"trajectory: pattern={pattern!r} has {regex.groups} groups; it needs two, (x) and (y).")
    if isinstance(metric, str):
        score = METRICS.get(metric) or (_import_path(metric, "trajectory metric") if "." in metric else None)
        if score is None:
            raise ValueError(
                f"trajectory: metric={metric!r} is unknown; use one of {sorted(METRICS)} or a dotted path."
            )
    elif callable(metric):
        score = metric
    else:
        raise ValueError(f"trajectory: metric={metric!r} must be a name, a dotted import path or a callable.")

    def trajectory(completions, log_metric=None, **columns) -> list[float]:
        futures = columns[future_column]
        scenes = columns.get(scene_column) or [None] * len(futures)
        rewards, malformed, wrong, parts = [], 0, 0, []
        for completion, gt, scene in zip(completions, futures, scenes, strict=True):
            points = parse_waypoints(completion_text(completion), regex)
            gt = [tuple(p) for p in gt]
            if points is None:
                malformed += 1
                rewards.append(0.0)
                continue
            if len(points) > len(gt) and extra_waypoints == "ignore":
                points = points[: len(gt)]
            if len(points) != len(gt):
                wrong += 1
                rewards.append(0.0)
                continue
            parts.append(score_trajectory(points, gt, scene))
            rewards.append(float(score(points, gt, scene, **metric_params)))
        if log_metric is not None:
            log_metric("trajectory/malformed", float(malformed))
            log_metric("trajectory/wrong_count", float(wrong))
            if parts:
                for key, value in (("ade", [p.ade for p in parts]), ("fde", [p.fde for p in parts]),
                                   ("collision_rate", [p.collision for p in parts]),
                                   ("offroad_rate", [p.offroad for p in parts])):  # fmt: skip
                    log_metric(f"trajectory/{key}", sum(value) / len(value))
        return rewards

    params = [inspect.Parameter("completions", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter(future_column, inspect.Parameter.KEYWORD_ONLY),
              inspect.Parameter("log_metric", inspect.Parameter.KEYWORD_ONLY, default=None),
              inspect.Parameter("columns", inspect.Parameter.VAR_KEYWORD)]  # fmt: skip
    trajectory.__signature__ = inspect.Signature(params)  # the CLI reads the columns a reward needs from it
    trajectory.__name__ = "trajectory"
    return trajectory


register_reward("trajectory", trajectory_reward, factory=True)


# ---------------------------------------------------------------------------------------- difficulty bias
def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """TRL's group advantages: r − group mean, divided by the group's std (`"group"`, unbiased, + 1e-4), the batch's
    std (`"batch"`) or nothing (`"none"`, Dr. GRPO). NaN rows (unscorable) are left out of every mean and std and get
    0, as in TRL (`trl_grpo_ext.advantages.group_stats`)."""
    if scale_rewards not in SCALES:
        raise ValueError(f"scale_rewards={scale_rewards!r} must be 'group', 'batch' or 'none'.")
    return normalise(rewards, num_generations, scale_rewards)


def bucket_names(edges) -> list[str]:
    """Names of the difficulty buckets that `edges` (increasing group-mean rewards) cut: hard first."""
    if len(edges) == 1:
        return ["hard", "easy"]
    if len(edges) == 2:
        return ["hard", "medium", "easy"]
    return [f"b{i}" for i in range(len(edges) + 1)]


def bucket_by_reward(means, edges) -> list[str]:
    """Each group's bucket by its mean reward: below edges[0] is the hardest, at or above edges[-1] the easiest."""
    names = bucket_names(edges)
    return [names[sum(float(m) >= e for e in edges)] for m in means]


def difficulty_stats(rewards: torch.Tensor, num_generations: int, labels: list[str], names: list[str],
                     advantages: dict[str, torch.Tensor]) -> dict:  # fmt: skip
    """Per group and per bucket, how much advantage each normalisation gives.

    Args:
        rewards: (N,) rewards, groups contiguous; NaN rows (unscorable) are left out of every group statistic (the
            mean and std, and the mean |advantage|), as TRL leaves them out of its baseline.
        labels: each group's bucket. names: the buckets, in order.
        advantages: name -> (N,) advantages (e.g. {"group": ..., "none": ...}).

    Returns {"std": [G], "mean": [G], "mean_abs": {name: [G]}, "mass": {name: {bucket: share of Σ|A|}},
    "groups": {bucket: share of groups}}. A group's std is NaN with fewer than two scored rows (TRL's `nanstd`).
    """
    stats = group_stats(rewards, num_generations)
    scored = ~torch.isnan(rewards.reshape(-1))
    out = {"std": stats.std.tolist(), "mean": stats.mean.tolist(), "mean_abs": {}, "mass": {}}
    out["groups"] = {b: labels.count(b) / len(labels) for b in names}
    for key, adv in advantages.items():
        per_group = group_stats(torch.where(scored, adv.abs().float(), torch.nan), num_generations).mean
        per_group = torch.nan_to_num(per_group, nan=0.0)  # a group with no scored row carries no advantage
        out["mean_abs"][key] = per_group.tolist()
        total = float(per_group.sum())
        out["mass"][key] = {b: (sum(float(v) for v, lab in zip(per_group, labels, strict=True) if lab == b) / total
                                if total > 0 else 0.0) for b in names}  # fmt: skip
    return out


def _json_safe(value):
    """`value` with NaN and infinities as None (null): a group with fewer than two scored rows has no std, and strict
    JSON has no NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


class DifficultyBiasDiagnostic(Extension, TrainerCallback):
    """Logs, each step, how the run's reward scaling spreads advantage over groups of different difficulty.

    Per scored batch (training): each group's reward std, its mean |advantage| under the loss's advantages and under
    both normalisations (`scale_rewards="group"` and `"none"`), and, per difficulty bucket (by group mean reward,
    cut at `edges`; or by a dataset column such as `kind`), the share of the total advantage mass
    (`difficulty/mass_<bucket>`, `_scaled`, `_unscaled`) and of the groups (`difficulty/groups_<bucket>`). At the
    end of training, `difficulty_bias.json` (every group's numbers) and `difficulty_bias.png` in `output_dir`.
    Works on this package's trainers (it reads scored batches); on plain TRL it raises at the start of training.
    """

    name = "difficulty"
    order = 50  # after the advantage estimator, before filters that drop rows

    def __init__(self, by: str = "reward", edges=(1 / 3, 2 / 3), plot: bool = True):
        edges = [float(e) for e in edges]
        if not edges or any(b <= a for a, b in pairwise(edges)):
            raise ValueError(
                f"difficulty_edges={edges} must be one or more increasing mean rewards, e.g. [0.33, 0.67]."
            )
        self.by, self.edges, self.plot = by, edges, plot
        self.groups: list[dict] = []

    def check(self, inputs: TrainerInputs) -> None:
        columns = getattr(inputs.train_dataset, "column_names", None)
        if self.by != "reward" and columns is not None and self.by not in columns:
            raise ValueError(f"difficulty_by={self.by!r} is not a column of the training set ({columns}); name a "
                             "column that labels each prompt's difficulty, or use 'reward'.")  # fmt: skip

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise TypeError("DifficultyBiasDiagnostic reads scored batches: pass it to a trl_grpo_ext trainer "
                            "(GRPOExtTrainer, NoRDTrainer ...), `callbacks=[...]` or `difficulty_diagnostic=True`.")  # fmt: skip

    def after_scoring(self, batch) -> None:
        if batch.mode != "train":
            return
        g = batch.num_generations
        # Every group of the batch, on every process (groups may be split between processes): each process logs and
        # keeps the same numbers, those of one process holding the whole batch.
        # NaN rewards (every reward function returned None) are unscorable: left out of each group's statistics, as
        # TRL leaves them out of its baseline; a group with no scored row is left out of the diagnostic.
        group_rewards = batch.rewards.float().cpu()  # (N,)
        adv = batch.current_advantages[: batch.num_scored].float()
        if adv.dim() == 2:
            mask = batch.loss_mask[: batch.num_scored].float()
            adv = (adv * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        adv = gather(adv).cpu()  # (N,)
        values = None
        if self.by != "reward":
            values = batch.columns.get(self.by)
            values = None if values is None else gather_object(list(values[: batch.num_scored]))  # (N,)
        scored = group_stats(group_rewards, g).count > 0  # (N/G,)
        if not bool(scored.any()):
            return
        rows = scored.repeat_interleave(g)
        group_rewards, adv = group_rewards[rows], adv[rows]
        advantages = {"loss": adv, "scaled": group_advantages(group_rewards, g, "group"),
                      "unscaled": group_advantages(group_rewards, g, "none")}  # fmt: skip
        means = group_stats(group_rewards, g).mean.tolist()
        if self.by == "reward":
            labels, names = bucket_by_reward(means, self.edges), bucket_names(self.edges)
        else:
            firsts = [v for v, keep in zip(values[::g], scored.tolist(), strict=True) if keep] if values else None
            labels = ["?"] * len(means) if firsts is None else [str(v) for v in firsts]
            names = sorted(set(labels))
        stats = difficulty_stats(group_rewards, g, labels, names, advantages)
        for bucket in names:
            self.log(f"groups_{bucket}", stats["groups"][bucket])
            self.log(f"mass_{bucket}", stats["mass"]["loss"][bucket])
            self.log(f"mass_{bucket}_scaled", stats["mass"]["scaled"][bucket])
            self.log(f"mass_{bucket}_unscaled", stats["mass"]["unscaled"][bucket])
        for i, label in enumerate(labels):
            self.groups.append({"step": batch.step, "bucket": label, "mean": means[i], "std": stats["std"][i],
                                **{f"mean_abs_{k}": v[i] for k, v in stats["mean_abs"].items()}})  # fmt: skip

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or not self.groups:
            return
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        record = {"edges": self.edges, "by": self.by, "groups": _json_safe(self.groups)}
        (out / "difficulty_bias.json").write_text(json.dumps(record, allow_nan=False))
        if self.plot:
            plot_difficulty(self.groups, out / "difficulty_bias.png")

    def state_dict(self) -> dict:
        return {"groups": list(self.groups)}

    def load_state_dict(self, state: dict) -> None:
        self.groups = list(state.get("groups", []))


def plot_difficulty(groups: list[dict], path) -> None:
    """Group reward std against mean |advantage| under both normalisations, and the advantage mass per bucket."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = sorted({g["bucket"] for g in groups})
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, title in ((axes[0], "mean_abs_scaled", 'scale_rewards="group" (GRPO)'),
                           (axes[1], "mean_abs_unscaled", 'scale_rewards="none" (Dr. GRPO)')):  # fmt: skip
        for bucket in buckets:
            points = [g for g in groups if g["bucket"] == bucket]
            ax.scatter([g["std"] for g in points], [g[key] for g in points], s=8, alpha=0.6, label=bucket)
        ax.set(xlabel="group reward std", ylabel="group mean |advantage|", title=title)
        ax.grid(alpha=0.3)
        ax.legend()
    width = 0.25
    for i, (key, label) in enumerate((("mean_abs_scaled", "group"), ("mean_abs_unscaled", "none"),
                                      ("mean_abs_loss", "this run"))):  # fmt: skip
        total = sum(g[key] for g in groups) or 1.0
        shares = [sum(g[key] for g in groups if g["bucket"] == b) / total for b in buckets]
        axes[2].bar([j + (i - 1) * width for j in range(len(buckets))], shares, width, label=label)
    axes[2].set_xticks(range(len(buckets)), buckets)
    axes[2].set(ylabel="share of advantage mass", title="advantage mass by difficulty")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------- config section
@dataclass
class NoRDConfigSection:
    """Config section: the difficulty-bias diagnostic of NoRD (arXiv 2602.21172; `trl_grpo_ext.methods.nord`).

    > Parameters of the difficulty-bias diagnostic (`trl_grpo_ext.DifficultyBiasDiagnostic`, docs/nord.md)

    difficulty_diagnostic (`bool`, *optional*, defaults to `False`):
        Log, each step, how the reward scaling spreads advantage over easy and hard groups
        (`difficulty/mass_<bucket>`, `_scaled`, `_unscaled`), and write `difficulty_bias.json` / `.png` in
        `output_dir` at the end.
    difficulty_by (`str`, *optional*):
        What sorts groups into buckets: `reward` (the group's mean reward, cut at `difficulty_edges`) or a dataset
        column that labels each prompt (e.g. `kind`). Default: `reward`.
    difficulty_edges (`list[float]`, *optional*):
        Increasing group-mean rewards that cut the buckets, hard first. Default: [1/3, 2/3] (hard, medium, easy).
    """

    difficulty_diagnostic: bool = field(
        default=False, metadata={"help": "Log the difficulty-bias diagnostic (docs/nord.md)."}
    )
    difficulty_by: str | None = field(
        default=None, metadata={"help": "'reward' (group mean, cut at difficulty_edges) or a dataset column."}
    )
    difficulty_edges: list[float] | None = field(
        default=None, metadata={"help": "Increasing group-mean rewards that cut the buckets. Default: 1/3 2/3."}
    )

    def __post_init__(self):
        super().__post_init__()
        given = [f.name for f in fields(NoRDConfigSection)
                 if f.name != "difficulty_diagnostic" and getattr(self, f.name) is not None]  # fmt: skip
        if given and not self.difficulty_diagnostic:
            raise ValueError(f"{given[0]} is set, but difficulty_diagnostic=False; set difficulty_diagnostic=True, "
                             f"or leave {given[0]} unset (it is {getattr(self, given[0])!r}).")  # fmt: skip
        if self.difficulty_diagnostic:
            _from_config(self)  # the edges, checked now


def _from_config(args) -> DifficultyBiasDiagnostic | None:
    if not getattr(args, "difficulty_diagnostic", False):
        return None
    edges = args.difficulty_edges if args.difficulty_edges is not None else (1 / 3, 2 / 3)
    return DifficultyBiasDiagnostic(by=args.difficulty_by or "reward", edges=edges)


# The record's name is the extension's (its metric prefix, what the model card matches); `--trainer nord`.
register_method(Method(name="difficulty", title="NoRD (Dr. GRPO on trajectory rewards; difficulty-bias diagnostic)",
                       arxiv="2602.21172", extension=_from_config, trainer="NoRDTrainer", config="NoRDConfig",
                       cli_name="nord"))  # fmt: skip


__all__ = [
    "NoRDConfigSection",
    "WAYPOINT_PATTERN",
    "METRICS",
    "TrajectoryScore",
    "parse_waypoints",
    "score_trajectory",
    "driving_score",
    "displacement_score",
    "trajectory_reward",
    "group_advantages",
    "bucket_names",
    "bucket_by_reward",
    "DifficultyBiasDiagnostic",
    "difficulty_stats",
]
