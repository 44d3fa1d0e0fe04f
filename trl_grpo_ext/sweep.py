"""`trl-grpo-ext sweep`: run one recipe over a grid of settings and compare the cells in one table and plot.

    trl-grpo-ext sweep --config base.yaml --grid loss_type=grpo,dapo,dr_grpo num_generations=4,8 \\
        --output_dir sweeps/loss_types [--no_monitor] [any train flag, for every cell]

Every combination of the grid's values is a cell: `trl-grpo-ext train` with the recipe, the shared flags and the cell's
values, in its own folder `OUTPUT_DIR/<field=value,...>`, one after the other, each in a fresh process (a crash or
out-of-memory in one cell does not take the others down). Any train field is an axis, `trainer` included; a value
with spaces gives a list field several items (`"reward_weights=1.0 0.5,1.0 3.0"`). Every cell is parsed and checked
before any runs: an unknown field or a value that does not parse stops the sweep with one error. The reward-hacking
monitor runs in every cell (`--no_monitor` turns it off). A cell that finished is skipped when the sweep runs again
with the same settings; a failed one is run again. At the end: `sweep.md` and `sweep.csv` (one row per cell: final
and best correctness, held-out accuracy, reward, length, KL, wall time, monitor warnings), `sweep.json`, and
`sweep.png` (reward, correctness and length over steps, one line per cell).
"""

from __future__ import annotations

import argparse
import csv
import difflib
import itertools
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

CELL_RECORD = "sweep_cell.json"
SMOOTH = 3  # "final" and "best" are means of this many consecutive logs (a single step of 8 rows is noisy)


def parse_grid(items: list[str]) -> list[tuple[str, list[list[str]]]]:
    """`["loss_type=grpo,dapo", ...]` -> [("loss_type", [["grpo"], ["dapo"]]), ...]; each value as flag tokens."""
    from .cli import CLIError

    grid, seen = [], set()
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip().lstrip("-")
        if not sep or not name or not values.strip():
            raise CLIError(f"--grid {item!r}: write an axis as field=value1,value2 (e.g. loss_type=grpo,dapo)")
        if name in seen:
            raise CLIError(f"--grid names {name!r} twice; give each field once, with all its values")
        if name == "output_dir":
            raise CLIError("--grid output_dir: every cell gets its own folder under the sweep's --output_dir")
        seen.add(name)
        tokens = [shlex.split(v) for v in values.split(",")]
        if any(not t for t in tokens):
            raise CLIError(f"--grid {item!r} has an empty value; remove the extra comma")
        grid.append((name, tokens))
    if not grid:
        raise CLIError("--grid needs at least one axis, e.g. --grid loss_type=grpo,dapo")
    return grid


def cell_name(cell: dict[str, list[str]]) -> str:
    """A folder name for a cell: `loss_type=dapo,num_generations=8` (characters a path cannot hold replaced)."""
    text = ",".join(f"{k}={'_'.join(v)}" for k, v in cell.items())
    return "".join(c if c.isalnum() or c in "=,._-" else "_" for c in text)


def cells(grid) -> list[dict[str, list[str]]]:
    names = [name for name, _ in grid]
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*(v for _, v in grid))]


def cell_argv(base: list[str], cell: dict[str, list[str]], folder: Path, monitor: bool) -> list[str]:
    argv = list(base)
    for name, tokens in cell.items():
        argv += [f"--{name}", *tokens]
    if monitor and "--monitor" not in argv:
        argv += ["--monitor", "true"]
    # The sweep owns its cells' folders: a cell it runs again (it had not finished) replaces what is there.
    return [*argv, "--output_dir", str(folder), "--overwrite_output_dir", "true"]


def check_cell(argv: list[str], cell: dict, name: str) -> None:
    """Parse and check a cell as `train` would (nothing loads); a bad field or value raises one CLIError."""
    from .cli import CLIError, make_train_parser, parse_train, trainers

    trainer = cell.get("trainer", [None])[0]
    if trainer is None:  # from the shared flags or the recipe: the first pass reads it
        try:
            trainer = make_train_parser().parse(argv, return_remaining_strings=True)[0].trainer
        except CLIError as exc:
            raise CLIError(f"grid cell {name}: {exc}") from None
    named = trainers()
    if trainer not in named:
        raise CLIError(f"grid cell {name}: --trainer {trainer!r} is unknown; use one of: {', '.join(named)}")
    options = make_train_parser(named[trainer][1])._option_string_actions
    for field in cell:
        if f"--{field}" not in options:
            close = difflib.get_close_matches(f"--{field}", list(options), n=1)
            hint = f"; did you mean {close[0][2:]!r}?" if close else ""
            raise CLIError(f"--grid field {field!r} is not a setting of trainer {trainer!r}{hint} (`trl-grpo-ext "
                           f"train --trainer {trainer} --help` lists them)")  # fmt: skip
    try:
        parse_train(argv)
    except CLIError as exc:
        raise CLIError(f"grid cell {name}: {exc}") from None


def smoothed(values: list[float], k: int = SMOOTH) -> list[float]:
    """Means of `k` consecutive values (fewer at the start).

    >>> smoothed([0.0, 1.0, 1.0, 0.0])
    [0.0, 0.5, 0.6666666666666666, 0.6666666666666666]
    """
    return [
        sum(values[max(0, i - k + 1) : i + 1]) / len(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))
    ]


def read_cell(folder: Path) -> dict:
    """The numbers of a finished cell: its log history, the monitor's report and the sweep's record."""
    state = json.loads((folder / "trainer_state.json").read_text()) if (folder / "trainer_state.json").exists() else {}
    logs = [log for log in state.get("log_history", []) if "reward" in log]
    report_file = folder / "reward_hacking.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else None
    correctness = report.get("correctness") if report else None
    key = f"rewards/{correctness}/mean" if correctness else None

    def series(name):
        return [(log["step"], log[name]) for log in logs if log.get(name) is not None] if name else []

    def final_best(name):
        values = smoothed([v for _, v in series(name)])
        return (values[-1], max(values)) if values else (None, None)

    run_file = folder / "trl_grpo_ext_run.json"  # the built-in task's held-out accuracy, before and after training
    run = json.loads(run_file.read_text()) if run_file.exists() else {}
    metric = "driving_score" if "heldout_driving_score_after" in run or series("heldout/driving_score") else "accuracy"
    heldout = series(f"heldout/{metric}")
    before, after = run.get(f"heldout_{metric}_before"), run.get(f"heldout_{metric}_after")
    return {
        "steps": state.get("global_step"),
        "correctness_key": key,
        "correctness": final_best(key),
        "heldout": (before, after)
        if after is not None
        else (heldout[0][1], heldout[-1][1])
        if heldout
        else (None, None),
        "reward": final_best("reward")[0],
        "length": final_best("completions/mean_length")[0],
        "kl": final_best("kl")[0],
        "warnings": report["warnings"] if report else None,
        "fired": sorted({f["detector"] for f in report["findings"] if f["kind"] == "warning"}) if report else [],
        "series": {
            name: series(k)
            for name, k in (("reward", "reward"), ("correctness", key), ("length", "completions/mean_length"))
        },
    }


def _fmt(value, digits=3) -> str:
    return "" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def write_results(out: Path, grid, rows: list[dict]) -> None:
    """sweep.md, sweep.csv, sweep.json and sweep.png."""
    axes = [name for name, _ in grid]
    header = [*axes, "status", "steps", "final correctness", "best correctness", "held-out (first -> last)",
              "final reward", "final length", "final KL", "wall time (s)", "monitor warnings"]  # fmt: skip
    table = []
    for row in rows:
        r = row.get("result") or {}
        heldout = r.get("heldout", (None, None))
        fired = f"{r['warnings']} ({', '.join(r['fired'])})" if r.get("fired") else _fmt(r.get("warnings"))
        table.append([*(" ".join(row["cell"][a]) for a in axes), row["status"], _fmt(r.get("steps")),
                      _fmt((r.get("correctness") or (None, None))[0]), _fmt((r.get("correctness") or (None, None))[1]),
                      f"{heldout[0]:.3f} -> {heldout[1]:.3f}" if heldout[0] is not None else "",
                      _fmt(r.get("reward")), _fmt(r.get("length"), 1), _fmt(r.get("kl"), 4),
                      _fmt(row.get("seconds"), 0), fired])  # fmt: skip
    keys = {(row.get("result") or {}).get("correctness_key") for row in rows} - {None}
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells_) + " |" for cells_ in table]
    note = (f"\nCorrectness: `{', '.join(sorted(keys))}`. Final and best are means of {SMOOTH} consecutive logged "
            "steps; held-out accuracy is measured before and after training (the built-in task's greedy held-out accuracy).\n")  # fmt: skip
    (out / "sweep.md").write_text("\n".join(lines) + "\n" + note)
    with open(out / "sweep.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(table)
    (out / "sweep.json").write_text(json.dumps(rows, indent=1, default=str))
    plot(out / "sweep.png", rows)


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for index, row in enumerate(rows):
        series = (row.get("result") or {}).get("series") or {}
        style = ("-", "--", ":", "-.")[index % 4]  # cells that trained alike stay visible over each other
        for axis, name in zip(axes, ("reward", "correctness", "length"), strict=True):
            points = series.get(name) or []
            if points:
                axis.plot([s for s, _ in points], smoothed([v for _, v in points]), style, label=row["name"])
    titles = ("reward", "correctness", "completion length (tokens)")
    for axis, title in zip(axes, titles, strict=True):
        axis.set(xlabel="step", title=f"{title}, mean of {SMOOTH} steps")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def make_sweep_parser() -> argparse.ArgumentParser:
    from .cli import _PushParser

    parser = _PushParser(prog="trl-grpo-ext sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="the recipe (YAML) every cell starts from")
    parser.add_argument("--grid", nargs="+", required=True, metavar="FIELD=V1,V2",
                        help="axes: a train field and its values, comma-separated")  # fmt: skip
    parser.add_argument("--output_dir", default="sweeps/sweep", help="the sweep's folder (one subfolder per cell)")
    parser.add_argument("--no_monitor", action="store_true", help="do not run the reward-hacking monitor in the cells")
    return parser


def sweep(argv: list[str]) -> int:
    """`trl-grpo-ext sweep`: check every cell, run the unfinished ones, write the comparison. Returns the exit
    status: 0 when every cell finished, 1 when some failed (the table says which)."""
    from .cli import CLIError, resolve_recipe

    args, shared = make_sweep_parser().parse_known_args(argv)
    if args.config:
        args.config = resolve_recipe(args.config)
    if "--output_dir" in shared:
        raise CLIError("--output_dir is the sweep's folder; each cell's comes from it")
    grid = parse_grid(args.grid)
    out = Path(args.output_dir).resolve()
    base = (["--config", str(Path(args.config).resolve())] if args.config else []) + shared
    planned = []
    for cell in cells(grid):
        name = cell_name(cell)
        argv_cell = cell_argv(base, cell, out / name, monitor=not args.no_monitor)
        check_cell(argv_cell, cell, name)
        planned.append((name, cell, argv_cell))
    out.mkdir(parents=True, exist_ok=True)
    print(f"sweep: {len(planned)} cell(s) in {out}", flush=True)
    rows = []
    for index, (name, cell, argv_cell) in enumerate(planned, 1):
        folder = out / name
        record_file = folder / CELL_RECORD
        record = json.loads(record_file.read_text()) if record_file.exists() else None
        if record and record.get("status") == "ok" and record.get("argv") == argv_cell:
            print(f"[{index}/{len(planned)}] {name}: finished before, skipped", flush=True)
        else:
            folder.mkdir(parents=True, exist_ok=True)
            log = folder / "train.log"
            print(f"[{index}/{len(planned)}] {name}: training (log: {log})", flush=True)
            start = time.perf_counter()
            with open(log, "w") as handle:
                code = subprocess.run([sys.executable, "-m", "trl_grpo_ext.cli", "train", *argv_cell], stdout=handle,
                                      stderr=subprocess.STDOUT, check=False).returncode  # fmt: skip
            seconds = time.perf_counter() - start
            tail = log.read_text().strip().splitlines()[-1:] if code else []
            record = {"argv": argv_cell, "status": "ok" if code == 0 else "failed", "seconds": seconds,
                      "returncode": code, "error": tail[0] if tail else None}  # fmt: skip
            record_file.write_text(json.dumps(record, indent=1))
            if code:
                print(f"    failed (exit status {code}) after {seconds:.0f} s: {record['error']}", flush=True)
        row = {"name": name, "cell": cell, "status": record["status"], "seconds": record["seconds"],
               "error": record.get("error")}  # fmt: skip
        if record["status"] == "ok":
            row["result"] = read_cell(folder)
            r = row["result"]
            final = r["correctness"][0]
            print(f"    done in {record['seconds']:.0f} s: correctness {_fmt(final)}, reward {_fmt(r['reward'])}, "
                  f"{r['warnings'] or 0} monitor warning(s)", flush=True)  # fmt: skip
        rows.append(row)
    write_results(out, grid, rows)
    failed = [row["name"] for row in rows if row["status"] != "ok"]
    print(f"sweep: table {out / 'sweep.md'}, {out / 'sweep.csv'}; plot {out / 'sweep.png'}", flush=True)
    if failed:
        print(f"sweep: {len(failed)} of {len(rows)} cell(s) failed ({', '.join(failed)}); their train.log says why; "
              "run the same command again to retry them (finished cells are skipped)", file=sys.stderr)  # fmt: skip
        return 1
    return 0
