"""bitsandbytes' CPU layout for 4-bit weights: what it does to training, and what it buys generation.

On a CPU with AVX512-BF16, `Linear4bit` repacks its weight into a CPU-only layout on its first eval-mode forward
without grad (a generation). This script builds one NF4 layer twice, the layout allowed (what TRL's `GRPOTrainer`
gets after its first generation) and kept portable (what our trainers keep: `_disable_bnb_cpu_weight_repacking`),
runs the eval forward, then a training forward and backward, and prints whether the input got a gradient, and the
time of a one-token forward in each layout.

    python benchmarks/bnb_cpu_layout.py              # a 2048 x 2048 layer, 50 one-token forwards
"""

from __future__ import annotations

import argparse
import time

import torch


def layer(weight: torch.nn.Linear, packed: bool):
    from bitsandbytes.nn import Linear4bit

    q = Linear4bit(weight.in_features, weight.out_features, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    q.load_state_dict(weight.state_dict())
    q = q.to("cpu")  # quantizes
    q.support_avx512bf16_for_cpu = packed and q.support_avx512bf16_for_cpu
    return q


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    from bitsandbytes.functional import has_avx512bf16

    torch.manual_seed(0)
    weight = torch.nn.Linear(args.size, args.size, bias=False)
    x = torch.randn(4, args.size)
    print(f"AVX512-BF16 on this CPU: {has_avx512bf16()}")
    for packed in (True, False):
        q = layer(weight, packed)
        q.eval()
        with torch.no_grad():
            q(x)  # the generation: repacks when allowed
            start = time.perf_counter()
            for _ in range(args.repeats):
                q(x[:1])
            one_token = (time.perf_counter() - start) / args.repeats * 1e3
        q.train()
        inputs = x.clone().requires_grad_()
        q(inputs * 1.0).sum().backward()
        layout = "packed" if getattr(q.weight.quant_state, "packing_format_for_cpu", False) else "portable"
        grad = "None" if inputs.grad is None else f"mean |grad| {inputs.grad.abs().mean():.4f}"
        print(f"{'allowed' if packed else 'kept portable':<14} layout {layout:<8} one-token forward {one_token:.2f} ms  "
              f"input gradient after a training backward: {grad}")  # fmt: skip


if __name__ == "__main__":
    main()
