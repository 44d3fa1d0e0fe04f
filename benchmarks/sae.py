"""Cost of Tree-OPO's SAE projection (`sae_project`) against the staged heuristic and TRL's group normalisation.

For each group size N (default 4, 16, 64, 256) and number of ordering pairs M (default 4N, capped at 1000) it draws
binary rewards and prefix values, builds M acyclic pairs (i, j) that order rows by their staged advantage r - 0.5 V
(so every pair is meetable, as the tree's pairs are) and times, for one group:

- TRL's advantage: (r - mean) / (std + 1e-4) (`GRPOTrainer`'s group normalisation, the baseline);
- `staged_advantages` (r - alpha V, centred);
- `sae_project` soft and hard with delta = 0.1 (least-distance programming through SciPy's NNLS, then a bisection on
  the scale for the norm constraint).

It prints the fastest of `--repeats` runs per call, and SAE's time over TRL's. A step of the paper's setting runs one
projection per group: 8 groups of 4 to 16 rows; the projection is then a few milliseconds a step at most, against
seconds of generation.

Run:
    python benchmarks/sae.py                          # a few seconds
    python benchmarks/sae.py --sizes 4 16 64 256 512 --repeats 21
"""

from __future__ import annotations

import argparse
import time

import torch

from trl_grpo_ext.advantages import constraint_satisfaction, sae_project, staged_advantages

SIZES = (4, 16, 64, 256)
MAX_PAIRS = 1000
DELTA = 0.1
REPEATS = 11
SEED = 0


def group(n: int, pairs: int, generator: torch.Generator):
    rewards = torch.randint(0, 2, (n,), generator=generator).double()
    values = torch.rand(n, generator=generator, dtype=torch.float64)
    staged = rewards - 0.5 * values
    order = torch.argsort(staged)  # rank k of the order: pairs only go up it, so there is no cycle
    chosen = set()
    while len(chosen) < min(pairs, n * (n - 1) // 2):
        i, j = sorted(torch.randint(0, n, (2,), generator=generator).tolist())
        if i != j:
            chosen.add((int(order[i]), int(order[j])))
    return rewards, values, sorted(chosen)


def fastest(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--max-pairs", type=int, default=MAX_PAIRS)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--png", help="also plot milliseconds per group against N into this PNG file (log-log)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(SEED)

    print("| N | pairs | TRL group norm (ms) | staged (ms) | SAE soft (ms) | SAE hard (ms) | hard / TRL | satisfied |")
    print("|---|---|---|---|---|---|---|---|")
    curve = []
    for n in args.sizes:
        rewards, values, pairs = group(n, min(4 * n, args.max_pairs), generator)
        ids = torch.zeros(n, dtype=torch.long)
        r0 = rewards - rewards.mean()
        trl = fastest(lambda: (rewards - rewards.mean()) / (rewards.std() + 1e-4), args.repeats)  # noqa: B023
        staged = fastest(lambda: staged_advantages(rewards, values, ids), args.repeats)  # noqa: B023
        soft = fastest(lambda: sae_project(r0, pairs, delta=DELTA, mode="soft"), args.repeats)  # noqa: B023
        hard = fastest(lambda: sae_project(r0, pairs, delta=DELTA, mode="hard"), args.repeats)  # noqa: B023
        satisfied = constraint_satisfaction(sae_project(r0, pairs, delta=DELTA, mode="hard"), pairs, DELTA)
        print(f"| {n} | {len(pairs)} | {trl * 1e3:.3f} | {staged * 1e3:.3f} | {soft * 1e3:.2f} | {hard * 1e3:.2f} | "
              f"{hard / trl:.0f}x | {satisfied:.2f} |")  # fmt: skip
        curve.append((n, trl, staged, soft, hard))
    if args.png:
        plot(curve, args.png)


def plot(curve: list[tuple], path: str) -> None:
    """Milliseconds per group against the group size N, log-log: a slope of 1 is linear growth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes, *series = zip(*curve, strict=True)
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for times, label in zip(series, ["TRL group norm", "staged", "SAE soft", "SAE hard"], strict=True):
        ax.plot(sizes, [t * 1e3 for t in times], "o-", label=label)
    ax.set(xscale="log", yscale="log", xlabel="rows in the group (N; pairs 4N, at most 1000)", ylabel="ms per group")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
