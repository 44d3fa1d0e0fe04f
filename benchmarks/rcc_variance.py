"""RCC's claim, measured directly: does reward-confidence correction lower the variance of the policy gradient?

The paper (arXiv 2603.13134) reports 25-37% lower gradient variance with RCC. Here the same prompts are sampled again
and again from one policy, and on each sampling the policy gradient of the token-level loss,
g = -(1/T) Σ_i A_i ∇ Σ_t log π(o_it | q_i) (T the batch's completion tokens, TRL's on-policy gradient at ratio 1), is
computed with three advantages of the same completions:

- `dr_grpo`: r_i − mean(r) per group (the baseline RCC corrects; same scale as RCC),
- `rcc`: r_i − (mean(r) + 2·Cov(r, δ)), δ_i the sequence log-ratio to the reference (`trl_grpo_ext.advantages.rcc`),
- `grpo`: (r_i − mean(r)) / std(r) per group (TRL's default).

The policies are checkpoints of one plain-GRPO run of the lab's chain-sum experiment (its seed 0, the same command as
`benchmarks/lab.py chain_sum`, with checkpoints kept); the reference is the initial model, as RCC builds it at beta 0.
At step 0 the policy is the reference, δ = 0 and RCC is `dr_grpo` exactly: the check that the measure is sound.

Each gradient (134.5M numbers) is kept as a count sketch of 2^20 signed buckets, which preserves squared norms and
inner products up to a relative error of about 0.1%. Per checkpoint and estimator: the trace of the gradient's
covariance over samplings, V = Σ_r ||g_r − ḡ||² / (R − 1), and the noise-to-signal ratio V / ||ḡ||² (||ḡ||² less its
bias V/R). The ratios rcc/dr_grpo and rcc/grpo get a 95% bootstrap interval over samplings (paired: the estimators
share every sampling). One JSON per checkpoint, `step<N>.json`, written as it finishes; a rerun skips those done.

    python benchmarks/rcc_variance.py --out lab/rcc --steps 0 --repeats 4     # the start (the check)
    python benchmarks/rcc_variance.py --out lab/rcc --steps 15 30            # train, then measure
    python benchmarks/rcc_variance.py --out /tmp/rcc --smoke                       # tiny model, 2 samplings
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lab
from common import sample_groups

ESTIMATORS = ("grpo", "dr_grpo", "rcc")
SKETCH = 2**20


class CountSketch:
    """A fixed random linear map of a model's gradient to `size` numbers: each coordinate is added, with a random
    sign, to one random bucket. Squared norms and inner products are preserved in expectation."""

    def __init__(self, params: list[torch.Tensor], size: int = SKETCH, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.size = size
        self.buckets = [torch.randint(0, size, (p.numel(),), generator=generator, dtype=torch.int64) for p in params]
        self.signs = [torch.randint(0, 2, (p.numel(),), generator=generator, dtype=torch.int8) for p in params]

    def __call__(self, grads) -> torch.Tensor:
        out = torch.zeros(self.size, dtype=torch.float64)
        for grad, buckets, signs in zip(grads, self.buckets, self.signs, strict=True):
            values = grad.detach().reshape(-1).double()
            out.index_add_(0, buckets, torch.where(signs.bool(), values, -values))
        return out


def advantages(rewards: torch.Tensor, log_ratio: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """The three estimators' (N,) advantages of one sampling, from the package's own functions."""
    from trl_grpo_ext.advantages.group import normalise
    from trl_grpo_ext.advantages.rcc import rcc_advantages

    groups = torch.arange(rewards.numel()) // group_size
    return {"grpo": normalise(rewards, group_size, "group"), "dr_grpo": normalise(rewards, group_size, "none"),
            "rcc": rcc_advantages(rewards, log_ratio, groups)}  # fmt: skip


def token_log_probs(model, input_ids, attention_mask, prompt_length: int) -> torch.Tensor:
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, prompt_length - 1 : -1].float()
    return torch.gather(logits.log_softmax(-1), 2, input_ids[:, prompt_length:, None]).squeeze(2)


def measure(policy, reference, tokenizer, rows, group_size: int, repeats: int, max_new_tokens: int, seed: int,
            say) -> dict:  # fmt: skip
    """The gradient sketches of every estimator over `repeats` samplings of `rows` (each prompt `group_size` times)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    sketch = CountSketch(params)
    sketches = {name: [] for name in ESTIMATORS}
    stats = {"reward": [], "mixed_groups": [], "log_ratio_abs": [], "baseline_shift_abs": [], "tokens": []}
    torch.manual_seed(seed)
    start = time.perf_counter()
    for repeat in range(repeats):
        policy.eval()
        sampled = sample_groups(policy, tokenizer, rows, group_size, max_new_tokens)
        out, prompt_length, mask = sampled["sequences"], sampled["prompt_length"], sampled["completion_mask"]
        attention, rewards = sampled["attention_mask"], sampled["rewards"].reshape(-1)
        # A flat group (every reward equal) has advantage 0 under all three estimators (its covariance is 0 too), so
        # only the varied groups' rows are run through the models: the same gradients, a fraction of the compute.
        # One group at a time (the estimators are per group; the gradient, and its sketch, is a sum over groups):
        # the activations of 8 rows, not of the batch.
        grouped = rewards.view(-1, group_size)
        varied_groups = (grouped.max(1).values > grouped.min(1).values).nonzero().squeeze(1).tolist()
        total = mask.sum()  # the loss's normaliser: every completion token of the batch, as TRL's
        summed = {name: torch.zeros(sketch.size, dtype=torch.float64) for name in ESTIMATORS}
        log_ratios, shifts = [], []
        for group in varied_groups:
            rows_in = torch.arange(group * group_size, (group + 1) * group_size)
            with torch.no_grad():
                reference_logps = token_log_probs(reference, out[rows_in], attention[rows_in], prompt_length)
            policy.train()
            logps = token_log_probs(policy, out[rows_in], attention[rows_in], prompt_length)
            sequence = (logps * mask[rows_in]).sum(1)  # (group_size,) with grad
            log_ratio = ((logps.detach() - reference_logps) * mask[rows_in]).sum(1)
            found = advantages(rewards[rows_in], log_ratio, group_size)
            for i, name in enumerate(ESTIMATORS):
                loss = -(found[name] * sequence).sum() / total
                grads = torch.autograd.grad(loss, params, retain_graph=i < len(ESTIMATORS) - 1)
                summed[name] += sketch(grads)
            log_ratios.append(log_ratio)
            shifts.append((found["dr_grpo"] - found["rcc"]).abs().sum().item())
        for name in ESTIMATORS:
            sketches[name].append(summed[name])
        stats["reward"].append(rewards.mean().item())
        stats["mixed_groups"].append(len(varied_groups) / grouped.size(0))
        stats["log_ratio_abs"].append(torch.cat(log_ratios).abs().mean().item() if log_ratios else 0.0)
        stats["baseline_shift_abs"].append(sum(shifts) / len(rewards))  # per row of the batch (flat rows: 0)
        stats["tokens"].append(total.item())
        say(f"  sampling {repeat + 1}/{repeats}: reward {rewards.mean():.3f}, mixed groups "
            f"{stats['mixed_groups'][-1]:.2f}, mean |δ| {stats['log_ratio_abs'][-1]:.3f} "
            f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
    return {"sketches": {name: torch.stack(s).numpy() for name, s in sketches.items()}, "stats": stats}


def variance(gram: np.ndarray, pick: np.ndarray | None = None) -> tuple[float, float]:
    """(trace of the covariance over samplings, noise-to-signal ratio) of R gradient sketches, from their Gram matrix
    (R x R inner products), for the samplings `pick` (with repeats; default all once)."""
    pick = np.arange(len(gram)) if pick is None else pick
    repeats = len(pick)
    sub = gram[np.ix_(pick, pick)]
    mean_norm = sub.sum() / repeats**2  # ||ḡ||²
    trace = float((np.trace(sub) - repeats * mean_norm) / (repeats - 1))
    signal = float(mean_norm) - trace / repeats  # unbiased ||E g||²
    return trace, trace / signal if signal > 0 else float("inf")


def summarise(sketches: dict[str, np.ndarray], n: int = 2000, seed: int = 0) -> dict:
    """Each estimator's variance and noise-to-signal ratio, and RCC's ratios to the others with 95% bootstrap
    intervals over samplings (the same resampled samplings for every estimator)."""
    grams = {name: s @ s.T for name, s in sketches.items()}
    result = {name: dict(zip(("variance", "noise_to_signal"), variance(g), strict=True)) for name, g in grams.items()}
    repeats = next(iter(grams.values())).shape[0]
    rng = np.random.default_rng(seed)
    draws = {f"rcc/{other}": {"variance": [], "noise_to_signal": []} for other in ("dr_grpo", "grpo")}
    for _ in range(n):
        pick = rng.integers(0, repeats, repeats)
        found = {name: variance(g, pick) for name, g in grams.items()}
        for other in ("dr_grpo", "grpo"):
            for j, key in enumerate(("variance", "noise_to_signal")):
                base = found[other][j]
                draws[f"rcc/{other}"][key].append(found["rcc"][j] / base if base > 0 else float("nan"))
    for pair, measures in draws.items():
        other = pair.split("/")[1]
        result[pair] = {}
        for key, values in measures.items():
            base = result[other][key]
            point = result["rcc"][key] / base if base > 0 else float("nan")
            low, high = np.nanpercentile(values, [2.5, 97.5]) if not np.isnan(values).all() else (np.nan, np.nan)
            result[pair][key] = {"ratio": point, "low": float(low), "high": float(high)}
    return result


def train_checkpoints(out: Path, steps: list[int], say) -> Path:
    """The lab's plain-GRPO chain-sum run, seed 0, with a checkpoint every `steps[1]` steps (weights only)."""
    experiment = {**lab.EXPERIMENTS["chain_sum"], "name": "chain_sum", "steps": max(steps)}
    run = out / "run"
    if all((run / f"checkpoint-{s}").is_dir() for s in steps if s):
        return run
    every = min(s for s in steps if s)
    argv = lab.train_argv(experiment, lab.BASELINE, 0, None, "cpu", run, None)
    where = argv.index("--save_strategy")
    argv[where : where + 2] = ["--save_strategy", "steps", "--save_steps", str(every), "--save_only_model", "true"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    say(f"training the policy checkpoints: trl-grpo-ext {' '.join(argv)}")
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "log.txt", "w") as log:
        subprocess.run([sys.executable, "-m", "trl_grpo_ext", *argv], stdout=log, stderr=subprocess.STDOUT, env=env,
                       check=True)  # fmt: skip
    return run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, nargs="+", default=[0, 15, 30], help="checkpoints to measure")
    parser.add_argument("--prompts", type=int, default=16, help="training prompts per sampling")
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=16, help="samplings per checkpoint")
    parser.add_argument("--max_new_tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="the tiny model, 2 samplings, no training")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_grpo_ext.tasks import RGTask
    from trl_grpo_ext.testing import build_tiny_model, real_model

    def say(text: str) -> None:
        print(text, flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    task = RGTask("chain_sum", dict(lab.CHAIN_SUM))
    rows = task.dataset("train")[: args.prompts]
    if args.smoke:
        initial, args.steps, args.repeats = str(build_tiny_model(args.out / "tiny-model")), [0], 2
    else:
        initial = real_model()
    checkpoints = None if args.smoke or args.steps == [0] else train_checkpoints(args.out, args.steps, say)
    tokenizer = AutoTokenizer.from_pretrained(initial)
    reference = AutoModelForCausalLM.from_pretrained(initial, torch_dtype=torch.float32).eval()
    for step in args.steps:
        path = args.out / f"step{step}.json"
        if path.exists():
            say(f"step {step}: done before ({path})")
            continue
        say(f"step {step}: {args.repeats} samplings of {args.prompts} prompts x {args.group_size}")
        source = initial if step == 0 else str(checkpoints / f"checkpoint-{step}")
        policy = AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.float32)
        found = measure(policy, reference, tokenizer, rows, args.group_size, args.repeats, args.max_new_tokens,
                        seed=1000 + step, say=say)  # fmt: skip
        result = {"step": step, "policy": source, "reference": initial, "task": task.task, "task_args": task.args,
                  "prompts": args.prompts, "group_size": args.group_size, "repeats": args.repeats,
                  "max_new_tokens": args.max_new_tokens, "sketch_size": SKETCH,
                  "stats": {k: float(np.mean(v)) for k, v in found["stats"].items()},
                  "per_sampling": found["stats"], **summarise(found["sketches"])}  # fmt: skip
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(path)
        pair = result["rcc/dr_grpo"]["variance"]
        say(f"step {step}: variance rcc/dr_grpo {pair['ratio']:.3f} [{pair['low']:.3f}, {pair['high']:.3f}]; {path}")
    report(args.out)


def report(out: Path) -> None:
    """`report.md`: per checkpoint, each estimator's variance and noise-to-signal ratio, and RCC's ratios."""
    lines = ["| step | mixed groups | mean abs δ | variance rcc / dr_grpo | variance rcc / grpo | noise-to-signal rcc / "
             "dr_grpo | noise-to-signal rcc / grpo |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for path in sorted(out.glob("step*.json"), key=lambda p: int(p.stem[4:])):
        r = json.loads(path.read_text())

        def cell(pair, key, r=r):
            c = r[pair][key]
            return f"{c['ratio']:.3f} [{c['low']:.3f}, {c['high']:.3f}]"

        lines.append(f"| {r['step']} | {r['stats']['mixed_groups']:.2f} | {r['stats']['log_ratio_abs']:.3f} | "
                     f"{cell('rcc/dr_grpo', 'variance')} | {cell('rcc/grpo', 'variance')} | "
                     f"{cell('rcc/dr_grpo', 'noise_to_signal')} | {cell('rcc/grpo', 'noise_to_signal')} |")  # fmt: skip
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
