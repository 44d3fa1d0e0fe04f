"""What BiCC's conditioned rows and RCC's reference forward cost per step, against plain GRPO, on the real model.

Each arm trains SmolLM2-135M-Instruct (offline, `trl_grpo_ext.testing.real_model`) on the built-in addition task with
the same seed, batch (8 rows, groups of 4), rewards and steps, in a process of its own, so that its peak resident
memory (`ru_maxrss`) is its own. Arms: `grpo` (GRPOExtTrainer, defaults), `bicc` (bicc=True: up to 8 more rows per
step in the loss, no extra generation), `rcc` (advantage_estimator="rcc" at beta=0: a frozen reference and two
no-grad forwards per generation batch). The arms alternate over `--rounds` rounds (A,B,C then C,B,A), the first step
of every run is dropped, and the ratio of the median step times (TRL's `step_time`: generation, scoring, forward and
backward) is printed against GRPO's from the same run, with the peak memory ratio.

On a GPU run the same script: peak memory is then `torch.cuda.max_memory_allocated`.

Run:
    python benchmarks/bicc_cost.py                       # 2 rounds x 6 steps per arm
    python benchmarks/bicc_cost.py --rounds 3 --steps 10 --out-json /tmp/bicc_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

ARMS = {"grpo": {}, "bicc": {"bicc": True, "bicc_reward": "last_integer"}, "rcc": {"advantage_estimator": "rcc"}}


def run_arm(arm: str, steps: int, out_dir: str) -> dict:
    import torch
    import transformers
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback

    from trl_grpo_ext import GRPOExtConfig, GRPOExtTrainer
    from trl_grpo_ext.tasks import TASK_REWARD_WEIGHTS, TASK_REWARDS, addition_dataset
    from trl_grpo_ext.testing import CPU_KWARGS, real_model

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    model = real_model()
    config = GRPOExtConfig(output_dir=out_dir, per_device_train_batch_size=8, num_generations=4,
                           max_completion_length=24, learning_rate=3e-5, beta=0.0, max_steps=steps, logging_steps=1,
                           save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
                           reward_weights=TASK_REWARD_WEIGHTS, **CPU_KWARGS, **ARMS[arm])  # fmt: skip
    trainer = GRPOExtTrainer(model=model, reward_funcs=TASK_REWARDS, args=config,
                             train_dataset=addition_dataset("train", repeats=10),
                             processing_class=AutoTokenizer.from_pretrained(model))  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    logs = trainer.state.log_history
    times = [log["step_time"] for log in logs if "step_time" in log][1:]
    rows = [8 + log.get("bicc/rows_added", 0) + log.get("added_rows/filler", 0) for log in logs if "reward" in log]
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"arm": arm, "step_times": times, "peak_mib": peak, "rows_per_step": statistics.mean(rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (the first one is dropped)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out-json", help="write the numbers to this JSON file")
    parser.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)  # one arm, in a child process
    args = parser.parse_args(argv)
    if args.arm:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(run_arm(args.arm, args.steps, tmp)))
        return 0
    results = {arm: {"step_times": [], "peak_mib": [], "rows_per_step": []} for arm in ARMS}
    for r in range(args.rounds):
        for arm in list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]:
            done = subprocess.run([sys.executable, __file__, "--arm", arm, "--steps", str(args.steps)],
                                  capture_output=True, text=True, check=True)  # fmt: skip
            result = json.loads(done.stdout.strip().splitlines()[-1])
            for key in ("step_times",):
                results[arm][key] += result[key]
            results[arm]["peak_mib"].append(result["peak_mib"])
            results[arm]["rows_per_step"].append(result["rows_per_step"])
            median = statistics.median(result["step_times"])
            print(
                f"round {r} {arm:<5} median {median:6.2f} s/step, peak {result['peak_mib']:7.0f} MiB", file=sys.stderr
            )
    base = results["grpo"]
    base_time, base_peak = statistics.median(base["step_times"]), max(base["peak_mib"])
    print(f"\n{'arm':<6}{'rows/step':>10}{'median s/step':>15}{'time ratio':>12}{'peak MiB':>10}{'peak ratio':>12}")
    summary = {}
    for arm, r in results.items():
        time_, peak = statistics.median(r["step_times"]), max(r["peak_mib"])
        rows = statistics.mean(r["rows_per_step"])
        summary[arm] = {"rows_per_step": rows, "median_step_time_s": time_, "time_ratio": time_ / base_time,
                        "peak_mib": peak, "peak_ratio": peak / base_peak}  # fmt: skip
        print(f"{arm:<6}{rows:>10.1f}{time_:>15.2f}{time_ / base_time:>12.2f}{peak:>10.0f}{peak / base_peak:>12.2f}")
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump({"settings": vars(args), "summary": summary, "runs": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
