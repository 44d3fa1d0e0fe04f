"""The learning lab: a named experiment (arms x seeds on one task) into an output folder, and its paired comparison.

Each arm is a set of `trl-grpo-ext train` flags on top of plain GRPO (the arm `grpo`, no flags); each (arm, seed) is
one `trl-grpo-ext train` run, in its own process with one torch thread (`--jobs N` at once), evaluated on the task's
held-out problems (greedy, `--heldout_every` steps). As each run finishes, `<out>/<arm>-seed<seed>.json` is written:
`arm`, `seed`, `task`, `task_args`, `settings`, and the curves: `heldout` (per evaluation: step, generated tokens,
accuracy and the per-problem correctness) and `train` (per step: generated tokens, reward, mean completion length).
A rerun skips every (arm, seed) whose JSON is there (with the same settings; other settings are refused).

The comparison (`compare`, also `--compare DIR`) pairs each arm with GRPO on the same seed and reports the difference
of final held-out accuracy (method minus GRPO) at equal steps and at equal generated tokens (each pair at the smaller
of its two token totals, the accuracy curves interpolated linearly), with a 95% bootstrap interval that resamples
seeds and held-out problems. Verdict: "shown" when the interval lies above zero, "worse" when below, else "not
shown". It writes `<out>/report.md` (a table) and `<out>/report.png` (held-out accuracy by step and by generated
tokens, mean over seeds with 95% bands). docs/lab.md says more.

    python benchmarks/lab.py chain_sum --out lab/chain_sum --jobs 2          # the experiment, then its report
    python benchmarks/lab.py chain_sum --out lab/chain_sum --device cuda --jobs 4
    python benchmarks/lab.py --compare lab/chain_sum                            # the report again
    python benchmarks/lab.py chain_sum --smoke --out /tmp/lab                  # 1 seed, 2 steps, the tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save_figure, step_tokens

BASELINE = "grpo"
# Train flags of every run of an experiment on a CPU, and what a GPU runs instead (larger batches). Groups of 8
# (DAPO's dynamic sampling needs groups large enough to be flat often; the issue asks for G >= 8).
CPU = ["--per_device_train_batch_size", "8", "--num_generations", "8"]
CUDA = ["--per_device_train_batch_size", "64", "--num_generations", "8", "--bf16", "true"]
# Every arm the lab knows: train flags on top of plain GRPO. An experiment runs a subset of them.
ARMS = {
    BASELINE: [],
    # DAPO: flat groups (all right or all wrong on the verifier) leave the loss, after up to 2 refill rounds of fresh
    # prompts; the refills' tokens count (`dynamic_sampling/generated_tokens`)
    "dynamic_sampling": ["--dynamic_sampling", "true", "--dynamic_sampling_max_rounds", "2"],
    "dr_grpo": ["--loss_type", "dr_grpo", "--scale_rewards", "none"],
    "rcc": ["--advantage_estimator", "rcc"],
    "bicc": ["--trainer", "bicc"],
    "drafts": ["--trainer", "drafts"],
    # the `monitor` experiment's hacked runs: the verifier plus an exploitable term (`lab_rewards.verbosity`, paying
    # for words whatever they say) at the same weight, the reward-hacking monitor live
    "verbosity": (
        "--reward_funcs rg_score lab_rewards.verbosity --reward_weights 1.0 1.0 --monitor true "
        "--monitor_correctness rg_score"
    ).split(),
}


def experiment(task: str, task_args: dict, arms: tuple[str, ...] = (BASELINE, "dynamic_sampling", "bicc"),
               **settings) -> dict:  # fmt: skip
    """An experiment's definition: GRPO and the method arms, 4 seeds, 30 steps of one group of 8 (lr 3e-5 decaying
    linearly, beta 0, 24 completion tokens), 200 held-out problems evaluated before training and every 15 steps."""
    flags = ["--learning_rate", "3e-5", "--max_completion_length", "24"]
    return {"task": task, "task_args": task_args, "arms": {arm: ARMS[arm] for arm in arms}, "seeds": [0, 1, 2, 3],
            "steps": 30, "heldout_size": 200, "eval_every": 15, "flags": flags, **settings}  # fmt: skip


# name -> the task (`--task`), its args (`--task_args`), the arms, seeds, steps, held-out size (>= 200 for a
# verdict), held-out evaluation every `eval_every` steps, flags every arm gets (after the device's, before the arm's).
# The designs, and what counts as shown, are in docs/results.md (written before the first run).
CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
EXPERIMENTS = {
    # 2 terms of 1-2 digits (+ or -). SmolLM2-135M-Instruct greedy, 32 tokens: 0.10 on 100 held-out problems (one-digit
    # terms, 0.18, have fewer distinct questions than 200 held-out ones and a training set)
    # (the arm dr_grpo, NoRD's recipe, was added after GRPO's runs and before its own; docs/results.md)
    # (the arm drafts, self-refinement, was added after BiCC's runs, before its own)
    "chain_sum": experiment(
        "rg:chain_sum", CHAIN_SUM, arms=(BASELINE, "dynamic_sampling", "bicc", "dr_grpo", "drafts")
    ),
    # the confirmation task: the GCD of two numbers <= 20; greedy, 32 tokens: 0.19 on 100 held-out problems
    "gcd": experiment("rg:gcd", {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 20}),
    # chain_sum with 4 groups of 8 a step (32 rows): what a claim about the weights between groups needs (NoRD's:
    # with one group a step, GRPO and Dr. GRPO differ by a factor that gradient clipping erases; docs/results.md)
    "chain_sum_groups4": experiment(
        "rg:chain_sum",
        CHAIN_SUM,
        arms=(BASELINE, "dr_grpo"),
        seeds=[0, 1, 2, 3, 4],
        flags=["--learning_rate", "3e-5", "--max_completion_length", "24", "--per_device_train_batch_size", "32"],
    ),
    # does the reward-hacking monitor warn before a hack costs held-out accuracy? chain_sum's GRPO with an exploitable
    # term added, held-out accuracy every 5 steps; the healthy runs are chain_sum's, replayed (docs/results.md)
    "monitor": experiment("rg:chain_sum", CHAIN_SUM, arms=("verbosity",), seeds=[0, 1, 2], eval_every=5),
    # the same exploit at a third of the learning rate: a hack that needs more steps than the monitor's first 9
    # (`monitor`'s runs were hacked by step 5; their gradients, norm 3-7, were clipped to 1 at every step, so the
    # learning rate sets the pace, not the term's weight or the std scaling)
    "monitor_slow": experiment(
        "rg:chain_sum",
        CHAIN_SUM,
        arms=("verbosity",),
        seeds=[0, 1, 2],
        eval_every=5,
        flags=["--learning_rate", "1e-5", "--max_completion_length", "24"],
    ),
    # a diagnostic of chain_sum (docs/results.md): GRPO's seeds 2 and 3, whose completions grew to the 24-token cap
    # and whose accuracy did not rise, again with room for 48 tokens (training and held-out evaluation)
    "chain_sum_48": experiment(
        "rg:chain_sum",
        CHAIN_SUM,
        arms=(BASELINE,),
        seeds=[2, 3],
        flags=["--learning_rate", "3e-5", "--max_completion_length", "48"],
    ),
}
SMOKE = {"seeds": 1, "steps": 2, "heldout_size": 8, "eval_every": 1, "model": "tiny", "arms": 2}
HELDOUT_LINE = re.compile(r"The held-out \w+ .*?(before training|after step (\d+)): ([0-9.]+)")


# ------------------------------------------------------------------------------------------------------ running
def settings(experiment: dict, arm: str, model: str | None, device: str) -> dict:
    return {"experiment": experiment["name"], "steps": experiment["steps"], "heldout_size": experiment["heldout_size"],
            "eval_every": experiment["eval_every"], "model": model or "SmolLM2-135M-Instruct", "device": device,
            "flags": (CUDA if device == "cuda" else CPU) + experiment.get("flags", []),
            "arm_flags": experiment["arms"][arm]}  # fmt: skip


def train_argv(experiment: dict, arm: str, seed: int, model: str | None, device: str, run_dir: Path,
               cache_dir: str | None) -> list[str]:  # fmt: skip
    """The `trl-grpo-ext train` arguments of one run: the task, its evaluation, the device's and the experiment's
    flags, then the arm's."""
    s = settings(experiment, arm, model, device)
    argv = ["train", "--task", experiment["task"], "--task_args", json.dumps(experiment.get("task_args") or {}),
            "--heldout_size", str(s["heldout_size"]), "--heldout_every", str(s["eval_every"]),
            "--max_steps", str(s["steps"]), "--seed", str(seed), "--logging_steps", "1", "--disable_tqdm", "true",
            "--save_strategy", "no", "--report_to", "none", "--output_dir", str(run_dir),
            "--overwrite_output_dir", "true", *s["flags"], *s["arm_flags"]]  # fmt: skip
    if model:
        argv += ["--model_name_or_path", model]
    if cache_dir:
        argv += ["--cache_dir", cache_dir]
    return argv


def curves(run_dir: Path) -> dict:
    """The run's curves, from its run record and log history: held-out per evaluation, training per step."""
    record = json.loads((run_dir / "trl_grpo_ext_run.json").read_text())
    state = json.loads((run_dir / "trainer_state.json").read_text())
    config = record.get("config", {})
    rows = int(config.get("per_device_train_batch_size", 8)) * int(config.get("gradient_accumulation_steps", 1))
    train, tokens, at_step = [], 0.0, {0: 0.0}
    for log in state["log_history"]:
        if "reward" not in log:
            continue
        tokens += step_tokens(log, rows)
        at_step[log["step"]] = tokens
        train.append({"step": log["step"], "generated_tokens": tokens, "reward": log["reward"],
                      "completion_length": log.get("completions/mean_length")})  # fmt: skip
    heldout = [{"step": step, "generated_tokens": at_step.get(step, tokens), "accuracy": accuracy, "correct": correct}
               for (step, accuracy), correct in zip(record["heldout_accuracy_history"], record["heldout_correct"],
                                                    strict=True)]  # fmt: skip
    return {"heldout": heldout, "train": train, "heldout_before": record["heldout_accuracy_before"],
            "heldout_after": record["heldout_accuracy_after"]}  # fmt: skip


def run_one(experiment: dict, arm: str, seed: int, out: Path, model: str | None, device: str, cache_dir: str | None,
            say, model_path: str | None = None) -> bool:  # fmt: skip
    """One (arm, seed): `trl-grpo-ext train` in its own process (one torch thread), its progress said as it goes,
    then its JSON written (the model weights are not kept). `model` is the model as the settings name it, `model_path`
    where it is (default: `model`)."""
    path = out / f"{arm}-seed{seed}.json"
    run_dir = out / "runs" / f"{arm}-seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = train_argv(experiment, arm, seed, model_path or model, device, run_dir, cache_dir)
    here = str(Path(__file__).resolve().parent)  # the lab's own reward terms (lab_rewards.py)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}  # fmt: skip
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    name, steps, start = f"{arm} seed {seed}", experiment["steps"], time.perf_counter()
    say(f"[{name}] started")
    with open(run_dir / "log.txt", "w") as log:
        log.write("trl-grpo-ext " + " ".join(argv) + "\n")
        process = subprocess.Popen([sys.executable, "-m", "trl_grpo_ext", *argv], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
        last = ""
        for line in process.stdout:
            log.write(line)
            last = line.strip() or last
            if found := HELDOUT_LINE.search(line):
                step = 0 if found.group(1) == "before training" else int(found.group(2))
                say(f"[{name}] step {step}/{steps}: held-out accuracy {float(found.group(3)):.3f} "
                    f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
        code = process.wait()
    if code != 0:
        say(f"[{name}] FAILED (exit {code}): {last}; log: {run_dir / 'log.txt'}")
        return False
    result = {"arm": arm, "seed": seed, "task": experiment["task"], "task_args": experiment.get("task_args") or {},
              "settings": settings(experiment, arm, model, device), **curves(run_dir),
              "seconds": time.perf_counter() - start, "argv": argv}  # fmt: skip
    # the run's whole log history beside it (what `monitor_detection.py` replays the monitor over), then its JSON
    (out / "logs").mkdir(exist_ok=True)
    state = json.loads((run_dir / "trainer_state.json").read_text())
    (out / "logs" / path.name).write_text(json.dumps(state["log_history"]))
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)  # whole or absent: a killed run leaves no half-written JSON
    for weights in [*run_dir.glob("*.safetensors"), *run_dir.glob("*.bin")]:
        weights.unlink()
    say(f"[{name}] done: held-out accuracy {result['heldout_before']:.3f} -> {result['heldout_after']:.3f} in "
        f"{result['seconds']:.0f} s; {path}")  # fmt: skip
    return True


def run_experiment(experiment: dict, out: Path, jobs: int = 1, model: str | None = None, device: str = "cpu",
                   cache_dir: str | None = None) -> list[tuple[str, int]]:  # fmt: skip
    """Every (arm, seed) not done yet, `jobs` at a time; returns the failed ones."""
    out.mkdir(parents=True, exist_ok=True)
    todo = []
    for seed in experiment["seeds"]:
        for arm in experiment["arms"]:
            path = out / f"{arm}-seed{seed}.json"
            if path.exists():
                done = json.loads(path.read_text())
                if done.get("settings") != settings(experiment, arm, model, device):
                    raise SystemExit(f"lab: {path} was run with other settings ({done.get('settings')}); use another "
                                     "--out, or delete it to run it again")  # fmt: skip
                print(f"[{arm} seed {seed}] done before: skipped ({path})", flush=True)
                continue
            todo.append((arm, seed))
    if not todo:
        return []
    model_path = _resolve_model(model, cache_dir)
    lock = threading.Lock()

    def say(text: str) -> None:
        with lock:
            print(text, flush=True)

    say(f"lab: {experiment['name']}: {len(todo)} run(s) to do, {jobs} at a time, on {device}")
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        ok = list(
            pool.map(lambda job: run_one(experiment, *job, out, model, device, cache_dir, say, model_path), todo)
        )
    return [job for job, good in zip(todo, ok, strict=True) if not good]


def _resolve_model(model: str | None, cache_dir: str | None) -> str | None:
    """Build the offline model once here, not in each parallel run at the same time."""
    if model == "tiny":
        from trl_grpo_ext.testing import build_tiny_model

        cache = Path(cache_dir or os.environ.get("TRL_GRPO_EXT_CACHE", "~/.cache/trl_grpo_ext")).expanduser()
        build_tiny_model(cache / "tiny-model")
        return model
    if model is None:
        from trl_grpo_ext.testing import real_model

        return real_model(cache_dir)
    return model


# ------------------------------------------------------------------------------------------------ comparison
def bootstrap(values: np.ndarray, n: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of a (seeds x problems) array and its 95% percentile interval, resampling seeds and problems (with
    replacement, independently): each resample is the mean over resampled seeds of the mean over resampled problems."""
    values = np.asarray(values, dtype=float)
    seeds, problems = values.shape
    rng = np.random.default_rng(seed)
    seed_counts = rng.multinomial(seeds, np.full(seeds, 1 / seeds), size=n)  # (n, seeds)
    problem_counts = rng.multinomial(problems, np.full(problems, 1 / problems), size=n)  # (n, problems)
    stats = ((seed_counts @ values) * problem_counts).sum(axis=1) / (seeds * problems)
    low, high = np.percentile(stats, [2.5, 97.5])
    return float(values.mean()), float(low), float(high)


def verdict(low: float, high: float) -> str:
    """The verdict on an interval of (method - GRPO): "shown" when it excludes zero in the method's favour, "worse"
    when it excludes zero against, else "not shown"."""
    return "shown" if low > 0 else "worse" if high < 0 else "not shown"


def correct_at_tokens(run: dict, budget: float) -> np.ndarray:
    """Per-problem correctness at `budget` generated tokens, interpolated linearly between evaluations."""
    points = run["heldout"]
    tokens = [p["generated_tokens"] for p in points]
    if budget >= tokens[-1]:
        return np.asarray(points[-1]["correct"], dtype=float)
    after = next(i for i, t in enumerate(tokens) if t >= budget)
    if after == 0:
        return np.asarray(points[0]["correct"], dtype=float)
    t0, t1 = tokens[after - 1], tokens[after]
    c0, c1 = np.asarray(points[after - 1]["correct"], float), np.asarray(points[after]["correct"], float)
    return c0 + (c1 - c0) * (budget - t0) / (t1 - t0)


def correct_at_step(run: dict, step: int) -> np.ndarray:
    return np.asarray(next(p["correct"] for p in run["heldout"] if p["step"] == step), dtype=float)


def load_runs(out: Path) -> dict[str, dict[int, dict]]:
    """arm -> seed -> run, from the JSONs in `out`; all of one task, its args and held-out set."""
    runs: dict[str, dict[int, dict]] = {}
    for path in sorted(Path(out).glob("*-seed*.json")):
        run = json.loads(path.read_text())
        runs.setdefault(run["arm"], {})[run["seed"]] = run
    tasks = {(r["task"], json.dumps(r["task_args"], sort_keys=True), len(r["heldout"][-1]["correct"]))
             for seeds in runs.values() for r in seeds.values()}  # fmt: skip
    if len(tasks) > 1:
        raise SystemExit(f"lab: the runs in {out} are of different tasks or held-out sets: {sorted(tasks)}")
    return runs


def compare(runs: dict[str, dict[int, dict]], baseline: str = BASELINE, n: int = 10000) -> list[dict]:
    """Per arm other than `baseline`: the paired difference (arm - baseline, same seed) of final held-out accuracy
    at equal steps and at equal generated tokens, each with its 95% bootstrap interval over seeds and problems, and
    its verdict."""
    rows = []
    base = runs.get(baseline, {})
    for arm, seeds in runs.items():
        if arm == baseline:
            continue
        paired = sorted(set(seeds) & set(base))
        if not paired:
            continue
        by_steps, by_tokens, budgets, finals = [], [], [], {arm: [], baseline: []}
        for seed in paired:
            ours, theirs = seeds[seed], base[seed]
            step = max({p["step"] for p in ours["heldout"]} & {p["step"] for p in theirs["heldout"]})
            by_steps.append(correct_at_step(ours, step) - correct_at_step(theirs, step))
            budget = min(ours["heldout"][-1]["generated_tokens"], theirs["heldout"][-1]["generated_tokens"])
            budgets.append(budget)
            by_tokens.append(correct_at_tokens(ours, budget) - correct_at_tokens(theirs, budget))
            finals[arm].append(ours["heldout"][-1]["accuracy"])
            finals[baseline].append(theirs["heldout"][-1]["accuracy"])
        steps_mean, steps_low, steps_high = bootstrap(np.stack(by_steps), n=n)
        tokens_mean, tokens_low, tokens_high = bootstrap(np.stack(by_tokens), n=n)
        rows.append({"arm": arm, "seeds": paired, "problems": len(by_steps[0]),
                     "baseline_final": float(np.mean(finals[baseline])), "arm_final": float(np.mean(finals[arm])),
                     "steps": {"diff": steps_mean, "low": steps_low, "high": steps_high,
                               "verdict": verdict(steps_low, steps_high)},
                     "tokens": {"diff": tokens_mean, "low": tokens_low, "high": tokens_high,
                                "verdict": verdict(tokens_low, tokens_high), "budget": float(np.mean(budgets))}})  # fmt: skip
    return rows


def restrict(runs: dict[str, dict[int, dict]], keep: np.ndarray) -> dict[str, dict[int, dict]]:
    """The runs with each evaluation cut to the held-out problems where `keep` (bool, per problem) is true."""
    keep = np.asarray(keep, bool)

    def cut(point: dict) -> dict:
        correct = [c for c, k in zip(point["correct"], keep, strict=True) if k]
        return {**point, "correct": correct, "accuracy": float(np.mean(correct))}

    return {arm: {seed: {**run, "heldout": [cut(p) for p in run["heldout"]]} for seed, run in seeds.items()}
            for arm, seeds in runs.items()}  # fmt: skip


def chain_sum_tiers(task_args: dict, heldout_size: int) -> dict[str, np.ndarray]:
    """The held-out chain sums by difficulty: `hardest` where every term has two digits or more, `easier` the rest."""
    from trl_grpo_ext.tasks import RGTask

    rows = RGTask("chain_sum", dict(task_args), heldout_size=heldout_size).dataset("heldout")
    terms = [
        re.findall(r"\d+", prompt[-1]["content"].split("problem:")[-1].split("=")[0]) for prompt in rows["prompt"]
    ]
    hardest = np.array([all(len(t) >= 2 for t in found) for found in terms])
    return {"hardest (every term 2+ digits)": hardest, "easier (a 1-digit term)": ~hardest}


# held-out tiers per task: task -> (task_args, heldout size) -> tier name -> bool per held-out problem
TIERS = {"rg:chain_sum": chain_sum_tiers}


def learned(runs: dict[str, dict[int, dict]], n: int = 10000) -> list[dict]:
    """Per arm: did it learn? The paired difference of each run's final held-out correctness and its own before
    training (the same model on the same problems), with its 95% bootstrap interval over seeds and problems."""
    rows = []
    for arm, seeds in runs.items():
        runs_ = [seeds[s] for s in sorted(seeds)]
        diffs = np.stack([np.asarray(r["heldout"][-1]["correct"], float) - np.asarray(r["heldout"][0]["correct"], float)
                          for r in runs_])  # fmt: skip
        mean, low, high = bootstrap(diffs, n=n)
        rows.append({"arm": arm, "seeds": sorted(seeds), "start": float(np.mean([r["heldout"][0]["accuracy"] for r in runs_])),
                     "final": float(np.mean([r["heldout"][-1]["accuracy"] for r in runs_])),
                     "step": runs_[0]["heldout"][-1]["step"], "diff": mean, "low": low, "high": high,
                     "verdict": verdict(low, high)})  # fmt: skip
    return rows


def learned_markdown(rows: list[dict]) -> str:
    lines = ["| arm | seeds | held-out before | after (step) | Δ [95% CI] | verdict |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {len(r['seeds'])} | {r['start']:.3f} | {r['final']:.3f} ({r['step']}) | "
                     f"{r['diff']:+.3f} [{r['low']:+.3f}, {r['high']:+.3f}] | {r['verdict']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict], baseline: str = BASELINE) -> str:
    lines = [f"| arm | seeds x problems | {baseline} final | arm final | Δ at equal steps [95% CI] | verdict | "
             "token budget (mean) | Δ at equal tokens [95% CI] | verdict |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        s, t = r["steps"], r["tokens"]
        lines.append(f"| {r['arm']} | {len(r['seeds'])} x {r['problems']} | {r['baseline_final']:.3f} | "
                     f"{r['arm_final']:.3f} | {s['diff']:+.3f} [{s['low']:+.3f}, {s['high']:+.3f}] | {s['verdict']} | "
                     f"{t['budget']:.0f} | {t['diff']:+.3f} [{t['low']:+.3f}, {t['high']:+.3f}] | {t['verdict']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, dict[int, dict]], path: Path, n: int = 2000) -> None:
    """Held-out accuracy by step and by generated tokens: per arm the mean over seeds, with a 95% band (bootstrap
    over seeds and problems)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (steps_ax, tokens_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, seeds in runs.items():
        group = list(seeds.values())
        steps = sorted(set.intersection(*({p["step"] for p in r["heldout"]} for r in group)))
        stats = [bootstrap(np.stack([correct_at_step(r, s) for r in group]), n=n) for s in steps]
        line = steps_ax.plot(steps, [m for m, _, _ in stats], marker="o", label=arm)[0]
        steps_ax.fill_between(steps, [lo for _, lo, _ in stats], [hi for _, _, hi in stats], alpha=0.2,
                              color=line.get_color())  # fmt: skip
        grid = np.linspace(0, min(r["heldout"][-1]["generated_tokens"] for r in group), 21)
        stats = [bootstrap(np.stack([correct_at_tokens(r, b) for r in group]), n=n) for b in grid]
        tokens_ax.plot(grid, [m for m, _, _ in stats], label=arm, color=line.get_color())
        tokens_ax.fill_between(grid, [lo for _, lo, _ in stats], [hi for _, _, hi in stats], alpha=0.2,
                               color=line.get_color())  # fmt: skip
    steps_ax.set(xlabel="step", ylabel="held-out accuracy (greedy)", title="by step (mean over seeds, 95% band)")
    tokens_ax.set(xlabel="completion tokens generated", title="by generated tokens (interpolated)")
    save_figure(fig, (steps_ax, tokens_ax), path)


def report(out: Path, baseline: str = BASELINE) -> str:
    """`<out>/report.md` and `<out>/report.png` from the JSONs in `out`; returns the table."""
    runs = load_runs(out)
    if not runs:
        raise SystemExit(f"lab: no finished run in {out} (no <arm>-seed<seed>.json) to report on")
    rows = compare(runs, baseline)
    table = ("Did each arm learn (its final held-out correctness minus its own before training):\n\n"
             + learned_markdown(learned(runs)) + "\nEach arm against " + baseline + ":\n\n" + markdown(rows, baseline))  # fmt: skip
    task = next((r["task"], r["task_args"]) for seeds in runs.values() for r in seeds.values())
    if task[0] in TIERS:
        size = len(next(r for seeds in runs.values() for r in seeds.values())["heldout"][0]["correct"])
        for name, keep in TIERS[task[0]](task[1], size).items():
            if not keep.any():  # a small held-out set (--smoke) may have no problem of a tier
                continue
            table += (f"\nEach arm against {baseline} on the {int(keep.sum())} held-out problems of the tier "
                      f"{name}:\n\n" + markdown(compare(restrict(runs, keep), baseline), baseline))  # fmt: skip
    head = (f"# Lab report: {out.name}\n\nTask `{task[0]}` {json.dumps(task[1])}; arms against `{baseline}` on the "
            "same seed; final held-out accuracy, 95% bootstrap intervals over seeds and held-out problems; verdict "
            "'shown' when the interval excludes 0 in the arm's favour, 'worse' against, else 'not shown'.\n\n")  # fmt: skip
    (out / "report.md").write_text(head + table + "\n![held-out accuracy](report.png)\n")
    (out / "report.json").write_text(json.dumps(rows, indent=1))
    plot(runs, out / "report.png")
    return table


# ------------------------------------------------------------------------------------------------------ main
def experiment_for(name: str, smoke: bool = False, arms: list[str] | None = None, seeds: list[int] | None = None):
    if name not in EXPERIMENTS:
        raise SystemExit(f"lab: unknown experiment {name!r}; use one of: {', '.join(EXPERIMENTS)}")
    experiment = {**EXPERIMENTS[name], "name": name}
    if smoke:  # the pipeline end to end in seconds: GRPO and the first method arm, 1 seed, 2 steps, tiny model
        experiment.update(seeds=experiment["seeds"][: SMOKE["seeds"]], steps=SMOKE["steps"],
                          heldout_size=SMOKE["heldout_size"], eval_every=SMOKE["eval_every"],
                          arms=dict(list(experiment["arms"].items())[: SMOKE["arms"]]))  # fmt: skip
    if arms:
        unknown = [a for a in arms if a not in experiment["arms"] and a not in EXPERIMENTS[name]["arms"]]
        if unknown:
            raise SystemExit(f"lab: unknown arm(s) {unknown}; {name}'s arms: {', '.join(EXPERIMENTS[name]['arms'])}")
        experiment["arms"] = {a: EXPERIMENTS[name]["arms"][a] for a in arms}
    if seeds is not None:
        experiment["seeds"] = seeds
    return experiment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", nargs="?", help=f"one of: {', '.join(EXPERIMENTS)}")
    parser.add_argument("--out", help="output folder (default lab/<experiment>, lab/<experiment>-smoke with --smoke)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (each its own process, one torch thread)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the GPU's larger batches")
    parser.add_argument("--arms", nargs="+", help="only these arms (default: the experiment's)")
    parser.add_argument("--seeds", nargs="+", type=int, help="only these seeds (default: the experiment's)")
    parser.add_argument("--model_name_or_path", help="the model (default SmolLM2-135M-Instruct, offline; 'tiny')")
    parser.add_argument("--cache_dir", help="where the offline models are built (trl-grpo-ext train --cache_dir)")
    parser.add_argument("--smoke", action="store_true", help="1 seed, 2 steps, the tiny model, 8 held-out problems")
    parser.add_argument("--compare", metavar="DIR", help="only write the report of the runs in DIR")
    args = parser.parse_args(argv)
    if args.compare:
        print(report(Path(args.compare)))
        return 0
    if not args.experiment:
        parser.error("name an experiment (or --compare DIR)")
    experiment = experiment_for(args.experiment, args.smoke, args.arms, args.seeds)
    model = args.model_name_or_path or (SMOKE["model"] if args.smoke else None)
    out = Path(args.out or f"lab/{args.experiment}{'-smoke' if args.smoke else ''}")
    failed = run_experiment(experiment, out, args.jobs, model, args.device, args.cache_dir)
    if (
        BASELINE in experiment["arms"]
        and len(experiment["arms"]) > 1
        and len(failed) < len(experiment["arms"]) * len(experiment["seeds"])
    ):
        print(report(out), flush=True)
        print(f"lab: report in {out / 'report.md'}", flush=True)
    if failed:
        print(f"lab: {len(failed)} run(s) failed: {failed}; rerun the same command to retry them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
