"""Cost of the rollout tree's credit: `token_owners` and `tree_token_advantages` grow linearly in B·T.

For each size B·T (default 1e4, 1e5, 1e6 tokens) it builds one random tree per group of G rows: inside a group each
row branches off an earlier row at a random position (it repeats the parent's tokens up to there), rows have random
lengths (right padding), and every token is its own node (the most nodes a batch of that size can have). Then it times

- `token_owners(parents, shared, lengths, T)`, the record's tree as per-token owners (one pass per tree level);
- `tree_token_advantages(leaf, node_ids)`, the "hard" credit (a token's mean over the rows that share it).

and prints the fastest of `--repeats` runs (as `timeit` advises: the figure least disturbed by other processes on a
shared machine) in µs per 1k tokens, and each size's time over the previous size's: a ratio near the size ratio (10)
is linear growth. `torch.unique` sorts, so the strict bound is O(B·T log B·T); the log
factor is what the ratio shows above 10.

Run:
    python benchmarks/tree_advantages.py                    # about 10 s on one core
    python benchmarks/tree_advantages.py --threads 0 --repeats 21 --sizes 1e4 1e5 1e6 1e7
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from trl_grpo_ext.advantages import tree_token_advantages
from trl_grpo_ext.rollout import token_owners

# Hyperparameters (all overridable on the command line).
ROWS = 64  # B
NUM_GENERATIONS = 8  # G
SIZES = (10_000, 100_000, 1_000_000)  # B·T
REPEATS = 11
THREADS = 1  # torch threads: on a shared machine, OpenMP threads waiting on each other swamp the measurement
SEED = 0


def random_tree(rows: int, length: int, num_generations: int, generator: torch.Generator):
    """Parents, shared prefix lengths and lengths of a random branching tree per group (each row's shared prefix
    fits in its parent)."""
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=generator).tolist()
    parents, shared = [-1] * rows, [0] * rows
    for row in range(rows):
        first = row - row % num_generations
        if row > first:  # branch off an earlier row of the group at a random position
            parents[row] = int(torch.randint(first, row, (1,), generator=generator))
            shared[row] = int(
                torch.randint(0, min(lengths[row], lengths[parents[row]]) + 1, (1,), generator=generator)
            )
    return parents, shared, lengths


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--num-generations", type=int, default=NUM_GENERATIONS)
    parser.add_argument("--sizes", type=float, nargs="+", default=SIZES, help="B·T values, e.g. 1e4 1e5 1e6")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--threads", type=int, default=THREADS, help="torch threads; 0 keeps torch's default")
    parser.add_argument("--png", help="also plot µs per 1k tokens against B·T into this PNG file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(SEED)
    threads = torch.get_num_threads()
    print(f"B={args.rows} rows, G={args.num_generations}, torch {torch.__version__}, {threads} threads")
    print(
        f"{'B·T':>9} {'T':>6} {'nodes':>8} | {'µs/1k tok: owners':>18} {'tree':>8} | {'ratio: owners':>14} {'tree':>6}"
    )
    previous, curve = None, []
    for size in args.sizes:
        length = max(1, round(size / args.rows))
        tokens = args.rows * length
        parents, shared, lengths = random_tree(args.rows, length, args.num_generations, generator)
        owners = token_owners(parents, shared, lengths, length)
        node_ids = torch.where(owners >= 0, owners * length + torch.arange(length), -1)
        leaf = torch.randn(args.rows, generator=generator)
        seconds = (
            best_seconds(functools.partial(token_owners, parents, shared, lengths, length), args.repeats),
            best_seconds(functools.partial(tree_token_advantages, leaf, node_ids), args.repeats),
        )
        per_1k = [s / tokens * 1e3 * 1e6 for s in seconds]
        nodes = int(torch.unique(node_ids[node_ids >= 0]).numel())
        line = f"{tokens:>9} {length:>6} {nodes:>8} | {per_1k[0]:>18.2f} {per_1k[1]:>8.2f} |"
        if previous is not None:
            ratios = [now / before for now, before in zip(seconds, previous, strict=False)]
            line += f" {ratios[0]:>14.1f} {ratios[1]:>6.1f}"
        print(line)
        previous = seconds
        curve.append((tokens, *per_1k))
    if args.png:
        plot(
            curve, args.png, f"B={args.rows}, G={args.num_generations}, {threads} thread(s), torch {torch.__version__}"
        )


def plot(curve: list[tuple], path: str, title: str) -> None:
    """µs per 1k tokens against B·T (log x): a flat line is linear growth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens, owners, tree = zip(*curve, strict=True)
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ax.plot(tokens, owners, "o-", label="token_owners")
    ax.plot(tokens, tree, "s-", label="tree_token_advantages")
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set(xlabel="tokens per step (B·T)", ylabel="µs per 1k tokens", title=title)
    ax.title.set_fontsize(9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
