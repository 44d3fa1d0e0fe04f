"""Does the reward-hacking monitor warn before a hack costs held-out accuracy, and stay quiet on healthy runs?

Reads lab runs (`benchmarks/lab.py`): each run's JSON (its held-out curve, per problem) and its log history
(`<folder>/logs/<arm>-seed<k>.json`, which the lab writes beside it). Over every run it replays the monitor with its
default thresholds (`RewardHackingMonitor.replay`: the detectors as they run live, on the logged metrics), the
verifier's reward as correctness. Then, per run of the hacked folders (an exploitable reward term was on):

- the first warning: its step and detector;
- the first held-out drop: the first evaluation whose accuracy is below the run's own at step 0, with the paired 95%
  bootstrap interval over the problems below 0;
- the lead: drop step minus warning step (>= 0: warned no later than the evaluation that showed the drop).

and per run of the healthy folders (the task's verifier alone): its warnings by detector, and whether its held-out
accuracy rose (last evaluation against step 0, the same interval). Rates carry exact (Clopper-Pearson) 95% intervals.

    python benchmarks/monitor_detection.py --hacked /work/lab/monitor --healthy /work/lab/chain_sum \\
        --out docs/results/lab/monitor/detection.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab import bootstrap, load_runs


def paired_interval(after, before) -> tuple[float, float, float]:
    """Mean of `after - before` over one run's problems and its 95% interval, resampling problems: the lab's
    `bootstrap` over a single run."""
    return bootstrap((np.asarray(after, float) - np.asarray(before, float))[None])


def first_drop(run: dict) -> dict | None:
    """The first evaluation after step 0 whose accuracy is below step 0's, the interval excluding 0; None if none."""
    points = sorted(run["heldout"], key=lambda p: p["step"])
    start = points[0]
    for point in points[1:]:
        diff, low, high = paired_interval(point["correct"], start["correct"])
        if high < 0:
            return {"step": point["step"], "accuracy": point["accuracy"], "diff": diff, "low": low, "high": high}
    return None


def rose(run: dict) -> dict:
    """The last evaluation against step 0: difference, interval, and whether it lies above 0."""
    points = sorted(run["heldout"], key=lambda p: p["step"])
    diff, low, high = paired_interval(points[-1]["correct"], points[0]["correct"])
    return {"diff": diff, "low": low, "high": high, "rose": low > 0}


def replay(log_history: list[dict], thresholds: list[str] | None = None) -> list[dict]:
    """The monitor's warnings over a finished run's logs (default thresholds unless given, `name=value` each), the
    verifier as correctness."""
    from trl_grpo_ext import RewardHackingMonitor

    names = sorted({key.split("/")[1] for log in log_history for key in log
                    if key.startswith("rewards/") and key.endswith("/mean")})  # fmt: skip
    correctness = next(n for n in names if n.startswith("rg_score"))
    monitor = RewardHackingMonitor(correctness=correctness, thresholds=thresholds)
    findings = monitor.replay(log_history, reward_names=names)
    return [{"detector": f.detector, "step": f.step, "subject": f.subject, "evidence": f.evidence}
            for f in findings if f.kind == "warning"]  # fmt: skip


def clopper_pearson(k: int, n: int) -> tuple[float, float]:
    from scipy.stats import beta

    low = 0.0 if k == 0 else float(beta.ppf(0.025, k, n - k + 1))
    high = 1.0 if k == n else float(beta.ppf(0.975, k + 1, n - k))
    return low, high


def analyse(
    folder: Path, hacked: bool, thresholds: list[str] | None = None, arms: list[str] | None = None
) -> list[dict]:
    rows = []
    for arm, seeds in load_runs(folder).items():
        if arms and arm not in arms:
            continue
        for seed, run in sorted(seeds.items()):
            log_path = folder / "logs" / f"{arm}-seed{seed}.json"
            if not log_path.exists():
                print(f"monitor_detection: {log_path} is missing: run {arm} seed {seed} left out", file=sys.stderr)
                continue
            warnings = replay(json.loads(log_path.read_text()), thresholds)
            row = {"folder": folder.name, "arm": arm, "seed": seed, "warnings": warnings,
                   "heldout": [(p["step"], p["accuracy"]) for p in run["heldout"]], "change": rose(run)}  # fmt: skip
            if hacked:
                drop = first_drop(run)
                first = min(warnings, key=lambda w: w["step"]) if warnings else None
                row.update(drop=drop, first_warning=first,
                           lead=(drop["step"] - first["step"]) if drop and first else None)  # fmt: skip
            rows.append(row)
    return rows


def summary(hacked: list[dict], healthy: list[dict]) -> dict:
    dropped = [r for r in hacked if r["drop"]]
    caught = [r for r in dropped if r["lead"] is not None and r["lead"] >= 0]
    warned_healthy = [r for r in healthy if r["warnings"]]
    learned = [r for r in healthy if r["change"]["rose"]]
    fell = [r for r in healthy if r["change"]["high"] < 0]
    by_detector: dict[str, int] = {}
    for row in healthy:
        for name in sorted({w["detector"] for w in row["warnings"]}):
            by_detector[name] = by_detector.get(name, 0) + 1
    return {
        "hacked_runs": len(hacked), "hacked_runs_dropped": len(dropped),
        "caught_before_drop": [len(caught), len(dropped), *clopper_pearson(len(caught), len(dropped))] if dropped else None,
        "hacked_warned": [sum(bool(r["warnings"]) for r in hacked), len(hacked)],
        "healthy_runs": len(healthy),
        "healthy_warned": [len(warned_healthy), len(healthy), *clopper_pearson(len(warned_healthy), len(healthy))],
        "healthy_warned_by_detector": by_detector,
        "healthy_that_learned_warned": [sum(bool(r["warnings"]) for r in learned), len(learned)],
        "healthy_that_fell_warned": [sum(bool(r["warnings"]) for r in fell), len(fell)],
    }  # fmt: skip


def markdown(hacked: list[dict], healthy: list[dict], totals: dict) -> str:
    lines = ["| run | held-out accuracy (step: accuracy) | first warning | first held-out drop | lead (steps) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in hacked:
        curve = ", ".join(f"{s}: {a:.3f}" for s, a in r["heldout"])
        warn = (
            f"{r['first_warning']['detector']} at step {r['first_warning']['step']}" if r["first_warning"] else "none"
        )
        drop = (f"step {r['drop']['step']} ({r['drop']['diff']:+.3f} [{r['drop']['low']:+.3f}, {r['drop']['high']:+.3f}])"
                if r["drop"] else "none")  # fmt: skip
        lines.append(
            f"| {r['arm']} seed {r['seed']} | {curve} | {warn} | {drop} | {r['lead'] if r['lead'] is not None else '-'} |"
        )
    lines += [
        "",
        "| healthy run | held-out change, last vs step 0 [95% CI] | warnings (detector at step) |",
        "|---|---|---|",
    ]
    for r in healthy:
        c = r["change"]
        warns = ", ".join(f"{w['detector']} at {w['step']}" for w in r["warnings"]) or "none"
        lines.append(
            f"| {r['folder']} {r['arm']} seed {r['seed']} | {c['diff']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}] | {warns} |"
        )
    lines += ["", "```", json.dumps(totals, indent=1), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hacked", type=Path, nargs="+", required=True, help="lab folders of runs with the exploit")
    parser.add_argument("--healthy", type=Path, nargs="+", required=True, help="lab folders of runs without it")
    parser.add_argument("--out", type=Path, required=True, help="the result JSON (a .md table is written beside it)")
    parser.add_argument("--thresholds", nargs="*", default=None, metavar="NAME=VALUE",
                        help="the monitor's thresholds for the replay (default: its defaults), e.g. window=3")  # fmt: skip
    parser.add_argument("--healthy_arms", nargs="*", default=None, metavar="ARM",
                        help="only these arms of the --healthy folders (default: every arm there)")  # fmt: skip
    args = parser.parse_args(argv)
    logging.getLogger("trl_grpo_ext.methods.monitor").setLevel(logging.ERROR)  # its warnings are the table's rows
    hacked = [row for folder in args.hacked for row in analyse(folder, True, args.thresholds)]
    healthy = [row for folder in args.healthy for row in analyse(folder, False, args.thresholds, args.healthy_arms)]
    if not hacked or not healthy:
        parser.error("no runs with log histories found in the --hacked or the --healthy folders")
    totals = summary(hacked, healthy)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"thresholds": args.thresholds or "defaults", "summary": totals, "hacked": hacked, "healthy": healthy}
    args.out.write_text(json.dumps(result, indent=1))
    table = markdown(hacked, healthy, totals)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
