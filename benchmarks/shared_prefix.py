"""What repeated shared prefixes cost in the loss's forward and backward, and what running each one once saves.

TRL's loss runs the model over `prompt_ids + completion_ids` of every row of a micro-batch, so the rows of a group
repeat their prompt, PTA's continuations their plan, ARPO's branches their parent's trajectory up to the branch
point. For one micro-batch of each kind, built from the addition task's prompts (through the model's chat template,
optionally lengthened by worked examples in the system message, `--prompt-tokens`) and random completion tokens of
random lengths (what the tokens are does not change the cost, their number does), the script prints:

- the share of the forward's real tokens that repeat another row's prefix, when each group's rows share a
  micro-batch (`shared_prefix_forward` keeps them together), and when TRL's shuffle cuts the generation batch
  (`--generation-rows` rows) into micro-batches (what the micro-batch could share without regrouping);
- the positions each forward computes: TRL's padded (B, L) batch against the packed (P, N) prefix tree;
- the best-of-`--repeats` time of the log-probs' forward + backward (`_get_per_token_logps_and_entropies`, TRL's and
  the shared-prefix one, on the same trainer and rows, alternating, after one untimed pass of each), and their
  ratio; also the ratio of the best CPU seconds of this process, which other jobs on a shared machine disturb less;
- the largest difference of the log-probs and of the gradients between the two paths, in the same run.

Run:
    python benchmarks/shared_prefix.py                     # SmolLM2-135M, task prompts, G=4, 8 rows: 1 min on 2 cores
    python benchmarks/shared_prefix.py --tiny              # the tiny random model: seconds, checks that it runs
    python benchmarks/shared_prefix.py --prompt-tokens 300 --group 8 --completion-tokens 64 --kinds grpo
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import tempfile
import time
from importlib.metadata import version

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch

KINDS = ("grpo", "pta", "arpo")
# A worked example for the system message: `--prompt-tokens` repeats it (other sums) until the prompt is that long.
EXAMPLE = "Example: what is {a} + {b}? The answer is {c}."


def build_trainer(tiny: bool, cache_dir: str, output_dir: str):
    """A `GRPOExtTrainer` with `shared_prefix_forward=True` on the tiny or the real model (nothing is trained)."""
    import transformers

    from trl_grpo_ext import GRPOExtConfig, GRPOExtTrainer
    from trl_grpo_ext.tasks import addition_dataset, last_integer_reward
    from trl_grpo_ext.testing import build_tiny_model, cpu_test_config_kwargs, real_model

    transformers.logging.set_verbosity_error()
    path = str(build_tiny_model(os.path.join(cache_dir, "tiny")) if tiny else real_model())
    args = GRPOExtConfig(output_dir=output_dir, per_device_train_batch_size=4, num_generations=4, beta=0.0,
                         shared_prefix_forward=True, **cpu_test_config_kwargs())  # fmt: skip
    return GRPOExtTrainer(path, [last_integer_reward], args, train_dataset=addition_dataset())


def prompt_ids(tokenizer, count: int, length: int | None, seed: int) -> list[list[int]]:
    """`count` addition prompts through the chat template; with `length`, worked examples fill the system message."""
    from trl_grpo_ext.tasks import QUESTION, addition_problems

    rng = random.Random(seed)
    prompts = []
    for a, b in addition_problems("train")[:count]:
        system, shots = [], []
        while True:
            messages = system + [{"role": "user", "content": QUESTION.format(a=a, b=b)}]
            ids = list(
                tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
            )
            if length is None or len(ids) >= length:
                break
            x, y = rng.randrange(10), rng.randrange(10)
            shots.append(EXAMPLE.format(a=x, b=y, c=x + y))
            system = [{"role": "system", "content": " ".join(shots)}]
        prompts.append(ids)
    return prompts


def rows_of(kind: str, prompts: list[list[int]], group: int, completion: int, vocab: int, eos: int, rng) -> list:
    """(prompt, completion) token lists of `len(prompts)` groups of `group` rows, shaped as `kind` shares them.

    grpo: independent completions. pta: `group // 2` plans of a quarter of the completion budget, each continued
    twice. arpo: half the rows are full rollouts; each other row branches off one of them at half its length (the
    first tool result) and continues on its own.
    """

    def tokens(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    def length():
        return rng.randint(completion // 2, completion)

    rows = []
    for prompt in prompts:
        if kind == "grpo":
            done = [tokens(length() - 1) + [eos] for _ in range(group)]
        elif kind == "pta":
            plan_length = max(1, completion // 4)
            plans = [tokens(plan_length) for _ in range(group // 2)]
            done = [plan + tokens(length() - plan_length - 1) + [eos] for plan in plans for _ in range(2)]
        elif kind == "arpo":
            roots = [tokens(length() - 1) + [eos] for _ in range(group // 2)]
            done = roots + [root[: len(root) // 2] + tokens(length() - len(root) // 2 - 1) + [eos] for root in roots]
        rows += [(prompt, ids) for ids in done]
    return rows


def batch(rows: list, pad: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """TRL's loss batch: prompts left-padded, completions right-padded, concatenated; and logits_to_keep."""
    prompt_width = max(len(p) for p, _ in rows)
    width = max(len(c) for _, c in rows)
    ids = torch.tensor([[pad] * (prompt_width - len(p)) + p + c + [pad] * (width - len(c)) for p, c in rows])
    mask = torch.tensor([[0] * (prompt_width - len(p)) + [1] * (len(p) + len(c)) + [0] * (width - len(c))
                         for p, c in rows])  # fmt: skip
    return ids, mask, width


def shuffled_share(rows: list, micro: int, pad: int, seed: int) -> float:
    """The repeated share of real tokens when the rows are shuffled (TRL) and cut into micro-batches of `micro`."""
    from trl_grpo_ext.shared_prefix import prefix_tree

    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    real = once = 0
    for start in range(0, len(rows) - micro + 1, micro):
        ids, mask, keep = batch([rows[i] for i in order[start : start + micro]], pad)
        tree = prefix_tree(ids, mask, keep)
        real, once = real + tree.row_tokens, once + tree.tokens
    return 1 - once / real


def forward_backward(trainer, ids, mask, keep, shared: bool):
    """One log-probs forward + backward through the trainer's seam: its wall and CPU seconds, log-probs, gradients."""
    model = trainer.model
    trainer.args.shared_prefix_forward = shared
    model.zero_grad(set_to_none=True)
    weights = torch.linspace(-1.0, 1.0, keep)  # a loss that reads every completion column, with both signs
    start, cpu = time.perf_counter(), time.process_time()
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, compute_entropy=True)
    ((logps * weights).sum() + entropies.sum() * 1e-3).backward()
    seconds = (time.perf_counter() - start, time.process_time() - cpu)
    return seconds, logps.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def measure(trainer, kind: str, rows: list, micro: int, repeats: int, pad: int, seed: int) -> dict:
    """Token counts, best-of-`repeats` times (plain and shared, alternating) and differences for one micro-batch.

    A first, untimed pass of each path warms allocators and kernels up and gives the differences.
    """
    from trl_grpo_ext.shared_prefix import prefix_tree

    ids, mask, keep = batch(rows[:micro], pad)
    tree = prefix_tree(ids, mask, keep)
    _, plain_logps, plain_grads = forward_backward(trainer, ids, mask, keep, shared=False)
    _, shared_logps, shared_grads = forward_backward(trainer, ids, mask, keep, shared=True)
    plain_times, shared_times = [], []
    for r in range(repeats):
        for shared in (False, True) if r % 2 == 0 else (True, False):
            seconds, _, _ = forward_backward(trainer, ids, mask, keep, shared)
            (shared_times if shared else plain_times).append(seconds)
    grad_diff = max((plain_grads[n] - g).abs().max().item() for n, g in shared_grads.items())
    grad_scale = max(g.abs().max().item() for g in plain_grads.values())
    return {
        "kind": kind,
        "rows": micro,
        "prompt": int(mask[:, : ids.size(1) - keep].sum(1).float().mean()),
        "completion": int(mask[:, ids.size(1) - keep :].sum(1).float().mean()),
        "positions": ids.numel(),
        "real": tree.row_tokens,
        "once": tree.tokens,
        "packed": tree.input_ids.numel(),
        "shuffled_share": shuffled_share(rows, micro, pad, seed),
        "plain": min(t[0] for t in plain_times),
        "shared": min(t[0] for t in shared_times),
        "plain_cpu": min(t[1] for t in plain_times),
        "shared_cpu": min(t[1] for t in shared_times),
        "logp_diff": (plain_logps - shared_logps).abs().max().item(),
        "grad_diff": grad_diff / grad_scale,
    }


def table(results: list[dict]) -> list[str]:
    lines = ["| batch | rows | prompt tok | completion tok | real tokens | run once | repeated share | share, TRL's "
             "shuffle | positions plain → tree | plain s | shared s | speed-up | CPU-s speed-up | max Δ logp | "
             "max Δ grad (rel.) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        lines.append(
            f"| {r['kind']} | {r['rows']} | {r['prompt']} | {r['completion']} | {r['real']} | {r['once']} | "
            f"{1 - r['once'] / r['real']:.0%} | {r['shuffled_share']:.0%} | {r['positions']} → {r['packed']} | "
            f"{r['plain']:.2f} | {r['shared']:.2f} | {r['plain'] / r['shared']:.2f}x | "
            f"{r['plain_cpu'] / r['shared_cpu']:.2f}x | {r['logp_diff']:.1e} | "
            f"{r['grad_diff']:.1e} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny random model instead of SmolLM2-135M")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--group", type=int, default=4, help="rows per prompt (num_generations); even")
    parser.add_argument("--rows", type=int, default=8, help="rows per micro-batch (per_device_train_batch_size)")
    parser.add_argument("--generation-rows", type=int, default=32, help="rows TRL shuffles before cutting them")
    parser.add_argument("--prompt-tokens", type=int, help="lengthen prompts to this many tokens (worked examples)")
    parser.add_argument("--completion-tokens", type=int, default=32, help="the most tokens a completion has")
    parser.add_argument("--repeats", type=int, default=3, help="timed forward + backward passes per path (best of)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.group % 2 or args.generation_rows % args.group or args.rows > args.generation_rows:
        parser.error("--group must be even and divide --generation-rows, and --rows at most --generation-rows")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(args.tiny, tmp, os.path.join(tmp, "out"))
        tokenizer = trainer.processing_class
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        vocab = min(len(tokenizer), trainer.model.config.vocab_size)
        prompts = prompt_ids(tokenizer, args.generation_rows // args.group, args.prompt_tokens, args.seed)
        results = []
        for kind in args.kinds:
            rng = random.Random(args.seed)
            rows = rows_of(kind, prompts, args.group, args.completion_tokens, vocab, tokenizer.eos_token_id, rng)
            results.append(measure(trainer, kind, rows, args.rows, args.repeats, pad, args.seed))
            print(f"{kind}: plain {results[-1]['plain']:.2f} s, shared {results[-1]['shared']:.2f} s",
                  file=sys.stderr, flush=True)  # fmt: skip

    model = "tiny random Qwen2" if args.tiny else "SmolLM2-135M-Instruct"
    versions = ", ".join(f"{p} {version(p)}" for p in ("torch", "trl", "transformers"))
    lengths = f"{args.completion_tokens // 2}-{args.completion_tokens}"
    machine = f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads, {platform.machine()})"
    print(f"\n{model}, group {args.group}, {args.rows} rows a micro-batch, completions of {lengths} tokens, best of "
          f"{args.repeats}, {machine}, {versions}\n")  # fmt: skip
    print("\n".join(table(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
