"""What a HiMA step costs against a GRPO step on the real model, per step and per generated token.

Each arm trains SmolLM2-135M-Instruct (offline, `trl_grpo_ext.testing.real_model`) on the built-in addition task with
the same seed, batch (8 training rows, groups of 4), completion cap (24 tokens) and steps, in a process of its own:

- `grpo`: GRPOExtTrainer, the task's rewards: 8 completions generated per step;
- `hima`: HiMATrainer on the toy hierarchy (router, calculator agent, QA agent), G = 2 alternatives per node: per
  question one reference system trajectory, then 4 alternatives (2 node slots x 2) and the calls that finish them;
- `grpo_lora` / `hima_adapters`: the same two with LoRA (r 8 on q/v); HiMA with one adapter per agent (generation
  split by adapter, PEFT's mixed-adapter forward in the loss).

HiMA generates a different number of tokens than GRPO for the same 8 training rows (its references and finishes
are generated but not trained), so the script prints the ratio of median step times and the ratio of seconds per
generated token (TRL's `step_time`: generation, scoring, forward and backward), each against its GRPO arm from the
same run. The arms alternate over `--rounds` rounds, and the first step of every run is dropped.

Run:
    python benchmarks/hima_cost.py                        # 1 round x 6 steps per arm
    python benchmarks/hima_cost.py --rounds 2 --steps 8 --out-json /tmp/hima_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

ARMS = {"grpo": "grpo", "hima": "grpo", "grpo_lora": "grpo_lora", "hima_adapters": "grpo_lora"}  # arm -> baseline


def run_arm(arm: str, steps: int, out_dir: str) -> dict:
    import transformers
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback

    from trl_grpo_ext import GRPOExtConfig, GRPOExtTrainer, HiMAConfig, HiMATrainer
    from trl_grpo_ext.tasks import TASK_REWARD_WEIGHTS, TASK_REWARDS, addition_dataset
    from trl_grpo_ext.testing import CPU_KWARGS, real_model

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    model = real_model()
    common = dict(output_dir=out_dir, per_device_train_batch_size=8, num_generations=4, max_completion_length=24,
                  learning_rate=3e-5, beta=0.0, max_steps=steps, logging_steps=1, save_strategy="no",
                  report_to="none", seed=0, disable_tqdm=True, **CPU_KWARGS)  # fmt: skip
    lora = (
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
        if "lora" in arm or "adapters" in arm
        else None
    )
    kwargs = dict(train_dataset=addition_dataset("train", repeats=10), processing_class=AutoTokenizer.from_pretrained(model),
                  peft_config=lora)  # fmt: skip
    if arm.startswith("hima"):
        config = HiMAConfig(hima_hierarchy="toy", hima_alternatives=2, hima_agent_adapters=arm == "hima_adapters",
                            **common)  # fmt: skip
        trainer = HiMATrainer(model, reward_funcs=["last_integer", "hima_format", "hima_efficiency"], args=config,
                              **kwargs)  # fmt: skip
    else:
        config = GRPOExtConfig(reward_weights=TASK_REWARD_WEIGHTS, **common)
        trainer = GRPOExtTrainer(model, reward_funcs=TASK_REWARDS, args=config, **kwargs)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "step_time" in log][1:]
    if arm.startswith("hima"):
        tokens = [log["hima/generated_tokens"] for log in logs]
    else:
        tokens = [log["completions/mean_length"] * 8 for log in logs]
    return {"arm": arm, "step_times": [log["step_time"] for log in logs], "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (the first one is dropped)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out-json", help="write the numbers to this JSON file")
    parser.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)  # one arm, in a child process
    args = parser.parse_args(argv)
    if args.arm:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(run_arm(args.arm, args.steps, tmp)))
        return 0
    results = {arm: {"step_times": [], "tokens": []} for arm in ARMS}
    for r in range(args.rounds):
        for arm in list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]:
            done = subprocess.run([sys.executable, __file__, "--arm", arm, "--steps", str(args.steps)],
                                  capture_output=True, text=True, check=True)  # fmt: skip
            result = json.loads(done.stdout.strip().splitlines()[-1])
            for key in ("step_times", "tokens"):
                results[arm][key] += result[key]
            print(f"round {r} {arm:<14} median {statistics.median(result['step_times']):6.2f} s/step, "
                  f"{statistics.mean(result['tokens']):6.0f} generated tokens/step", file=sys.stderr)  # fmt: skip
    summary = {}
    for arm, r in results.items():
        time_, tokens = statistics.median(r["step_times"]), statistics.mean(r["tokens"])
        summary[arm] = {"median_step_time_s": time_, "generated_tokens_per_step": tokens,
                        "ms_per_generated_token": 1000 * sum(r["step_times"]) / sum(r["tokens"])}  # fmt: skip
    print(
        f"\n{'arm':<15}{'tokens/step':>12}{'median s/step':>15}{'step ratio':>12}{'ms/token':>10}{'token ratio':>13}"
    )
    for arm, s in summary.items():
        base = summary[ARMS[arm]]
        s["step_ratio"] = s["median_step_time_s"] / base["median_step_time_s"]
        s["per_token_ratio"] = s["ms_per_generated_token"] / base["ms_per_generated_token"]
        print(f"{arm:<15}{s['generated_tokens_per_step']:>12.0f}{s['median_step_time_s']:>15.2f}{s['step_ratio']:>12.2f}"
              f"{s['ms_per_generated_token']:>10.1f}{s['per_token_ratio']:>13.2f}")  # fmt: skip
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump({"settings": vars(args), "summary": summary, "runs": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
