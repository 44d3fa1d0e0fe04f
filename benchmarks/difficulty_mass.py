"""NoRD's difficulty bias, measured: where does std scaling put the advantage mass across difficulty tiers?

NoRD (arXiv 2602.21172) trains with Dr. GRPO (A = r − mean, no division by the group's std) because std scaling
"inflates easy (low-variance) scenes and shrinks the hard ones". Here the policy (SmolLM2-135M-Instruct, untrained)
samples groups of 8 on prompts of difficulty tiers fixed in advance (2-term chain sums of 1-, 2- and 3-digit terms,
reasoning-gym), each row is scored by the task's verifier, and each tier's share of the batch's advantage mass
(Σ|A| over its groups, `trl_grpo_ext.methods.nord.difficulty_stats`, the diagnostic NoRD's trainer logs) is computed
with TRL's std-scaled advantages (`scale_rewards="group"`) and without (`"none"`). The difference of shares (scaled
minus unscaled) gets a 95% bootstrap interval over prompts (resampled within each tier).

    python benchmarks/difficulty_mass.py --out docs/results/lab/difficulty_mass
    python benchmarks/difficulty_mass.py --out /tmp/mass --smoke          # the tiny model, 2 prompts a tier
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import sample_groups

TIERS = {"1 digit": 1, "2 digits": 2, "3 digits": 3}  # easiest first
SCALES = ("group", "none")


def sample_rewards(model, tokenizer, rows, group_size: int, max_new_tokens: int, batch_prompts: int = 8) -> np.ndarray:
    """(prompts, group_size) verifier scores of sampled completions (temperature 1, as GRPO trains)."""
    rewards = []
    for start in range(0, len(rows["prompt"]), batch_prompts):
        chunk = {key: rows[key][start : start + batch_prompts] for key in ("prompt", "rg_task", "rg_index")}
        rewards.append(sample_groups(model, tokenizer, chunk, group_size, max_new_tokens)["rewards"].numpy())
    return np.concatenate(rewards).astype(float)


def shares(rewards: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """scale -> tier -> share of the advantage mass, from each tier's (prompts, G) rewards."""
    from trl_grpo_ext.methods.nord import difficulty_stats, group_advantages

    names = list(rewards)
    group_size = next(iter(rewards.values())).shape[1]
    labels = [name for name in names for _ in range(rewards[name].shape[0])]
    flat = torch.tensor(np.concatenate([rewards[name] for name in names]).reshape(-1), dtype=torch.float32)
    advantages = {scale: group_advantages(flat, group_size, scale) for scale in SCALES}
    return difficulty_stats(flat, group_size, labels, names, advantages)["mass"]


def summarise(rewards: dict[str, np.ndarray], n: int = 2000, seed: int = 0) -> dict:
    """Per tier: success rate, share of flat groups, mass share under each scale, and the difference (group − none)
    with its 95% interval over prompts resampled within tiers."""
    point = shares(rewards)
    rng = np.random.default_rng(seed)
    draws = {name: [] for name in rewards}
    for _ in range(n):
        resampled = {name: r[rng.integers(0, len(r), len(r))] for name, r in rewards.items()}
        found = shares(resampled)
        for name in rewards:
            draws[name].append(found["group"][name] - found["none"][name])
    tiers = {}
    for name, r in rewards.items():
        low, high = np.percentile(draws[name], [2.5, 97.5])
        flat = float(np.mean(r.max(1) == r.min(1)))
        tiers[name] = {"success": float(r.mean()), "flat_groups": flat, "share_scaled": point["group"][name],
                       "share_unscaled": point["none"][name],
                       "difference": {"value": point["group"][name] - point["none"][name], "low": float(low),
                                      "high": float(high)}}  # fmt: skip
    return tiers


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=32, help="training prompts per tier")
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="the tiny model, 2 prompts a tier")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_grpo_ext.tasks import RGTask
    from trl_grpo_ext.testing import build_tiny_model, real_model

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "result.json"
    if args.smoke:
        model_path, args.prompts = str(build_tiny_model(args.out / "tiny-model")), 2
    else:
        model_path = real_model()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    torch.manual_seed(args.seed)
    rewards, start = {}, time.perf_counter()
    for name, digits in TIERS.items():
        task_args = {"min_terms": 2, "max_terms": 2, "min_digits": digits, "max_digits": digits}
        rows = RGTask("chain_sum", task_args, heldout_size=1).dataset("train")[: args.prompts]
        rewards[name] = sample_rewards(model, tokenizer, rows, args.group_size, args.max_new_tokens)
        print(f"{name}: success {rewards[name].mean():.3f} over {args.prompts} prompts x {args.group_size} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    result = {"model": model_path, "task": "rg:chain_sum", "tiers": {n: {"min_terms": 2, "max_terms": 2,
              "min_digits": d, "max_digits": d} for n, d in TIERS.items()}, "prompts": args.prompts,
              "group_size": args.group_size, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
              "rewards": {n: r.tolist() for n, r in rewards.items()}, "summary": summarise(rewards)}  # fmt: skip
    path.write_text(json.dumps(result, indent=1))
    lines = ["| tier | success | flat groups | mass share, std-scaled | mass share, unscaled | scaled − unscaled [95% CI] |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, t in result["summary"].items():
        d = t["difference"]
        lines.append(f"| {name} | {t['success']:.3f} | {t['flat_groups']:.2f} | {t['share_scaled']:.3f} | "
                     f"{t['share_unscaled']:.3f} | {d['value']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] |")  # fmt: skip
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
