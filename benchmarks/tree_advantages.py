"""Cost of the tree advantages (issue 4): `tree_token_advantages` and `hard_advantages` grow linearly in B·T.

For each size B·T (default 1e4, 1e5, 1e6 tokens) it builds one random batch of B rows in groups of G: inside a group
each row branches off an earlier row at a random position (copying its tokens up to there, random tokens after), rows
have random lengths (right padding), and the node ids are the group's token-level prefix tree
(`shared_prefix_node_ids`, every token its own node: the most nodes a batch of that size can have). Then it times

- `tree_token_advantages(leaf, node_ids)`, the estimator's core;
- `hard_advantages(rewards, G, node_ids)`, the whole "hard" mode (group advantages + tree means);
- `shared_prefix_node_ids(ids, mask, G)`, for reference: it compares row pairs, O(B·G·T), not O(B·T).

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
import time

import torch

from trl_grpo_ext.advantages import hard_advantages, shared_prefix_node_ids, tree_token_advantages

# Hyperparameters (all overridable on the command line).
ROWS = 64  # B
NUM_GENERATIONS = 8  # G
SIZES = (10_000, 100_000, 1_000_000)  # B·T
REPEATS = 11
THREADS = 1  # torch threads: on a shared machine, OpenMP threads waiting on each other swamp the measurement
SEED = 0


def random_tree_batch(rows: int, length: int, num_generations: int, generator: torch.Generator):
    """(B, T) token ids and mask of a random branching tree per group, right-padded."""
    ids = torch.randint(0, 50_000, (rows, length), generator=generator)  # (B, T)
    for row in range(rows):
        first = row - row % num_generations
        if row > first:  # branch off an earlier row of the group at a random position
            parent = int(torch.randint(first, row, (1,), generator=generator))
            branch = int(torch.randint(0, length, (1,), generator=generator))
            ids[row, :branch] = ids[parent, :branch]
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=generator)  # (B,)
    mask = (torch.arange(length) < lengths.unsqueeze(1)).long()  # (B, T)
    return ids, mask


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
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(SEED)
    threads = torch.get_num_threads()
    print(f"B={args.rows} rows, G={args.num_generations}, torch {torch.__version__}, {threads} threads")
    header = f"{'B·T':>9} {'T':>6} {'nodes':>8} | {'µs/1k tok: tree':>16} {'hard':>8} {'prefix ids':>11} |"
    print(header + f" {'ratio to previous size: tree':>29} {'hard':>6} {'prefix ids':>11}")
    previous = None
    for size in args.sizes:
        length = max(1, round(size / args.rows))
        tokens = args.rows * length
        ids, mask = random_tree_batch(args.rows, length, args.num_generations, generator)
        node_ids = shared_prefix_node_ids(ids, mask, args.num_generations)
        rewards = torch.rand(args.rows, generator=generator)
        leaf = torch.randn(args.rows, generator=generator)
        seconds = (
            best_seconds(lambda: tree_token_advantages(leaf, node_ids), args.repeats),
            best_seconds(lambda: hard_advantages(rewards, args.num_generations, node_ids), args.repeats),
            best_seconds(lambda: shared_prefix_node_ids(ids, mask, args.num_generations), args.repeats),
        )
        per_1k = [s / tokens * 1e3 * 1e6 for s in seconds]
        nodes = int(torch.unique(node_ids[node_ids >= 0]).numel())
        line = f"{tokens:>9} {length:>6} {nodes:>8} | {per_1k[0]:>16.2f} {per_1k[1]:>8.2f} {per_1k[2]:>11.2f} |"
        if previous is not None:
            ratios = [now / before for now, before in zip(seconds, previous)]
            line += f" {ratios[0]:>29.1f} {ratios[1]:>6.1f} {ratios[2]:>11.1f}"
        print(line)
        previous = seconds


if __name__ == "__main__":
    main()
