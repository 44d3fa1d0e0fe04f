"""Does each method make a real model better? Each runs against plain GRPO on the same task, model, seed and steps.

The model is SmolLM2-135M-Instruct (offline, `trl_grpo_ext.testing.real_model`), the task the built-in single-digit
addition (`trl_grpo_ext.tasks`: 40 training problems, 60 held-out ones never trained on), the rewards its correctness
(last integer = the sum) plus 0.5 x brevity. Every run logs greedy held-out accuracy every `--eval-every` steps and
the completion tokens it generated, and the numbers each method exists for:

- curriculum: mean completion length against the budget (24 -> 8 tokens, the cap following it), with the paper's
  triangular length reward (`curriculum`) or with the task's brevity reward kept (`curriculum_cap`);
- dynamic_sampling: the share of groups kept (zero-variance groups removed), accuracy per generated token;
- prorl: KL to the reference and accuracy across reference resets (every 10 steps);
- pta: after a cold start on plan-formatted answers (for both PTA and its GRPO baseline), plans closed and the
  tokens generated against sampling every row independently;
- segments: ARPO branching with the calculator tool after a tool-format cold start (both arms), the tool-call rate;
- bicc: rows conditioned on an opposite answer in mixed groups, the rows added and the wall time against GRPO's;
- rcc: the reward-confidence-corrected baseline, the size of its correction;
- drafts: self-refinement (solve and refine batches alternate, the policy's own drafts); drafts_mismatched: wrong
  drafts of other problems written by the frozen start model, Dr. GRPO in both arms. Draft tokens count as
  generated; held-out questions are asked bare (no draft), as the papers test; drafts_no_brevity: self-refinement
  with both arms on correctness alone;
- nord: the text-only driving task (`trl_grpo_ext.tasks.driving_task_dataset`: past positions, speed and the cars in
  the prompt, 4 waypoints as the answer, the `trajectory` reward), NoRD's Dr. GRPO (no std division) against GRPO
  (std-normalised), both with the difficulty-bias diagnostic, after a cold start of 8 SFT steps on 64 scenes of
  another seed (SmolLM2 alone rarely writes 4 waypoints when sampling); held-out = greedy driving score on 48
  unseen scenes;
- hima: the toy hierarchy (`hima_hierarchy: toy`: a router, a calculator agent with the tool, a QA agent), VR-GRPO
  with 2 alternatives per node after a 6-step routing / tool-call cold start, against GRPO on the policy alone from
  SmolLM2 itself (the cold start costs direct answering); 48 tokens a call in both; both evaluated by TRL's
  evaluation, one sampled answer per held-out problem (the whole system's for HiMA), the rows each agent trained;
- tree_opo: groups of 4 prefixes of the shipped scripted-teacher trees (`trl_grpo_ext.data.trees.SAMPLE_TREES`, one
  per training problem) at mixed depths, staged advantages; the variance of the advantages against GRPO's.

A tool-calling policy is evaluated with TRL's evaluation (the tool loop runs; one sampled completion a held-out
problem) instead of greedy decoding without tools.

Each method's goal is GRPO's final held-out accuracy in fewer generated tokens, or a higher one on the same budget;
the summary says which, or neither. Results: `<out>/<method>.json` and `<out>/<method>.png` (accuracy against steps
and against generated tokens, the method's own metric beside), and one table printed at the end (docs/results.md).

Run (about 5 to 12 minutes per method and baseline on 2 CPU cores; segments about 35, its tool evaluation is slow):
    python benchmarks/learning.py --methods dynamic_sampling curriculum curriculum_cap prorl pta segments tree_opo bicc rcc \
        drafts drafts_mismatched
    python benchmarks/learning.py --methods curriculum --steps 20 --eval-every 5 --out /tmp/learning
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer, TrainerCallback

from trl_grpo_ext import (
    DraftGRPOConfig,
    DraftGRPOTrainer,
    GRPOExtConfig,
    GRPOExtTrainer,
    HiMAConfig,
    HiMATrainer,
    NoRDConfig,
    NoRDTrainer,
    ProRLResetCallback,
    PTAGRPOConfig,
    PTAGRPOTrainer,
    RewardHackingMonitor,
    SegmentGRPOTrainer,
    TreeOPOConfig,
    TreeOPOTrainer,
)
from trl_grpo_ext.data.driving import driving_sft_dataset
from trl_grpo_ext.data.pta import DEFAULT_SYSTEM as PLAN_SYSTEM
from trl_grpo_ext.data.pta import pta_sft_dataset
from trl_grpo_ext.data.trees import SAMPLE_TREES, questions_dataset
from trl_grpo_ext.tasks import (
    DRIVING_HELDOUT_SIZE,
    TASK_REWARD_WEIGHTS,
    TASK_REWARDS,
    HeldoutAccuracy,
    HeldoutDrivingScore,
    addition_dataset,
    addition_problems,
    driving_task_dataset,
)
from trl_grpo_ext.testing import CPU_KWARGS, real_model
from trl_grpo_ext.tools import calculator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save_figure, step_tokens

# ---- the shared budget: every arm of a comparison trains these steps on the same batches ----
BASE = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=24, learning_rate=3e-5, beta=0.0,
            logging_steps=1, save_strategy="no", report_to="none", seed=0, disable_tqdm=True, **CPU_KWARGS)  # fmt: skip
TOOL_SYSTEM = "Use the calculator tool to add the numbers, then answer with just the number."


class Trace(TrainerCallback):
    """Per step: completion tokens generated and the logged metrics.

    PTA counts each plan once; ARPO's branches do not count the prefix they share with their parent (the tokens
    `arpo/generated_tokens_saved` says were not generated again).
    """

    def __init__(self):
        self.steps: list[dict] = []
        self.tokens = 0.0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "reward" not in logs:
            return
        rows = args.per_device_train_batch_size * args.steps_per_generation
        self.tokens += step_tokens(logs, rows)
        self.steps.append({"step": state.global_step, "generated_tokens": self.tokens, **logs})


def cold_start(model: str, tokenizer, out: Path, rows, steps: int) -> str:
    """A short SFT so that the model writes the method's format (plans, or tool calls); both arms start from it."""
    from trl import SFTConfig, SFTTrainer

    trainer = SFTTrainer(model=model, train_dataset=rows, processing_class=tokenizer,
                         args=SFTConfig(output_dir=str(out), max_steps=steps, learning_rate=5e-5, logging_steps=10,
                                        per_device_train_batch_size=8, report_to="none", save_strategy="no",
                                        disable_tqdm=True, **CPU_KWARGS))  # fmt: skip
    trainer.train()
    trainer.save_model(str(out))
    return str(out)


def plan_rows():
    from datasets import Dataset

    problems = addition_problems("train")
    return pta_sft_dataset(Dataset.from_dict({
        "question": [f"What is {a} + {b}? Answer with just the number." for a, b in problems] * 4,
        "plan": ["Add the two numbers."] * len(problems) * 4,
        "reasoning": [f"{a} + {b} = {a + b}" for a, b in problems] * 4,
        "answer": [str(a + b) for a, b in problems] * 4,
    }))  # fmt: skip


def hima_rows():
    """Cold-start rows of the toy hierarchy: the router's prompt -> a route to calc, calc's -> a calculator call."""
    from datasets import Dataset

    from trl_grpo_ext.methods.hima import HiMA

    hima = HiMA("toy")
    prompts, completions = [], []
    for a, b in addition_problems("train"):
        question = f"What is {a} + {b}? Answer with just the number."
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} + {b}"}})
        for agent, text in (("router", "<route>calc</route>"), ("calc", f"<tool_call>{call}</tool_call>")):
            prompts.append(hima._messages(agent, question))
            completions.append([{"role": "assistant", "content": text}])
    return Dataset.from_dict({"prompt": prompts, "completion": completions})


def tool_rows():
    from datasets import Dataset
    from transformers.utils import get_json_schema

    prompts, completions = [], []
    for a, b in addition_problems("train") * 4:
        call = {"name": "calculator", "arguments": {"expression": f"{a} + {b}"}}
        prompts.append([{"role": "system", "content": TOOL_SYSTEM},
                        {"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}])  # fmt: skip
        completions.append(
            [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}]
        )
    return Dataset.from_dict({"prompt": prompts, "completion": completions,
                              "tools": [[get_json_schema(calculator)]] * len(prompts)})  # fmt: skip


def arms(method: str, model: str, tokenizer, out: Path, steps: int):
    """(model, baseline spec, method spec); a spec is (trainer class, config class, overrides, extra kwargs)."""
    rewards = {"reward_funcs": TASK_REWARDS}
    grpo = (GRPOExtTrainer, GRPOExtConfig, {"reward_weights": TASK_REWARD_WEIGHTS}, rewards)
    if method == "dynamic_sampling":
        return model, grpo, (GRPOExtTrainer, GRPOExtConfig, {**grpo[2], "dynamic_sampling": True}, rewards)
    if method == "curriculum":
        curriculum = {"budget_start": 24, "budget_end": 8, "budget_decays": 2, "budget_caps_generation": True,
                      "reward_weights": TASK_REWARD_WEIGHTS}  # fmt: skip
        return model, grpo, (GRPOExtTrainer, GRPOExtConfig, curriculum,
                             {"reward_funcs": ["last_integer", "budget_length"]})  # fmt: skip
    if method == "curriculum_cap":  # the budget as the generation cap only, the task's own rewards kept
        cap = {"budget_start": 24, "budget_end": 8, "budget_decays": 2, "budget_caps_generation": True,
               "reward_weights": TASK_REWARD_WEIGHTS}  # fmt: skip
        return model, grpo, (GRPOExtTrainer, GRPOExtConfig, cap, rewards)
    if method == "prorl":
        kl = {"beta": 0.04, "reward_weights": TASK_REWARD_WEIGHTS}
        resets = {"callbacks": [ProRLResetCallback(reset="reference", every_n_steps=10)], **rewards}
        return model, (GRPOExtTrainer, GRPOExtConfig, kl, rewards), (GRPOExtTrainer, GRPOExtConfig, kl, resets)
    if method == "pta":
        model = cold_start(model, tokenizer, out / "plan-cold-start", plan_rows(), steps=40)
        plans = {"max_completion_length": 48, "system": PLAN_SYSTEM}
        pta = {**plans, "num_plans": 2, "continuations_per_plan": 2, "plan_max_tokens": 16,
               "pta_outcome_reward": "last_integer"}  # fmt: skip
        fmt = "tag_format:tags=plan,think,answer"  # GRPO gets PTA's outcome and format rewards (not the plan value)
        return model, (GRPOExtTrainer, GRPOExtConfig, plans, {"reward_funcs": ["last_integer", fmt]}), (
            PTAGRPOTrainer, PTAGRPOConfig, pta, {"reward_funcs": None})  # fmt: skip
    if method == "segments":
        model = cold_start(model, tokenizer, out / "tool-cold-start", tool_rows(), steps=40)
        tools = {"max_completion_length": 64, "system": TOOL_SYSTEM}
        arpo = {**tools, "segment_by": "tool_calls", "segment_advantage": "hard", "arpo": True}
        extra = {"reward_funcs": ["last_integer"], "tools": [calculator]}
        return model, (GRPOExtTrainer, GRPOExtConfig, tools, extra), (SegmentGRPOTrainer, GRPOExtConfig, arpo, extra)
    if method == "tree_opo":  # the trees' questions are the 40 training problems: the same rows as GRPO's
        trees = {"prefix_trees": SAMPLE_TREES, "reward_weights": TASK_REWARD_WEIGHTS}
        return model, grpo, (TreeOPOTrainer, TreeOPOConfig, trees, {**rewards, "train_dataset": "trees"})
    if method == "bicc":  # the same rewards; correct = the task's correctness reward
        bicc = {**grpo[2], "bicc": True, "bicc_reward": "last_integer"}
        return model, grpo, (GRPOExtTrainer, GRPOExtConfig, bicc, rewards)
    if method == "rcc":  # the same rewards; the baseline corrected by Cov(r, log-ratio to the start model)
        return model, grpo, (GRPOExtTrainer, GRPOExtConfig, {**grpo[2], "advantage_estimator": "rcc"}, rewards)
    if method == "drafts":  # self-refinement: solve and refine batches alternate; held-out questions show no draft
        drafts = {**grpo[2], "draft_source": "self", "draft_mode": "alternate", "draft_reward": "last_integer",
                  "draft_max_new_tokens": 24}  # fmt: skip
        return model, grpo, (DraftGRPOTrainer, DraftGRPOConfig, drafts, rewards)
    if method == "drafts_no_brevity":  # the same, both arms on correctness alone (the brevity bonus left out)
        plain = ({"reward_funcs": ["last_integer"]}, {"draft_source": "self", "draft_mode": "alternate",
                 "draft_reward": "last_integer", "draft_max_new_tokens": 24})  # fmt: skip
        return model, (GRPOExtTrainer, GRPOExtConfig, {}, plain[0]), (DraftGRPOTrainer, DraftGRPOConfig, plain[1],
                                                                      plain[0])  # fmt: skip
    if method == "drafts_mismatched":  # wrong drafts of other problems by the frozen start model; Dr. GRPO both arms
        dr = {**grpo[2], "loss_type": "dr_grpo"}
        mismatched = {**dr, "draft_source": "model", "draft_model": model, "draft_num": 2, "draft_mode": "refine",
                      "draft_match": "mismatched", "draft_keep": "wrong", "draft_reward": "last_integer",
                      "draft_max_new_tokens": 24, "draft_temperature": 1.0}  # fmt: skip
        return model, (GRPOExtTrainer, GRPOExtConfig, dr, rewards), (DraftGRPOTrainer, DraftGRPOConfig, mismatched,
                                                                     rewards)  # fmt: skip
    if method == "nord":  # the driving task; GRPO scales by the group's std, NoRD (Dr. GRPO) does not
        model = cold_start(model, tokenizer, out / "driving-cold-start", driving_sft_dataset(64), steps=8)
        driving = {"task": "driving", "max_completion_length": 48, "difficulty_diagnostic": True}
        extra = {"reward_funcs": ["trajectory"]}
        return model, (GRPOExtTrainer, GRPOExtConfig, driving, extra), (NoRDTrainer, NoRDConfig, driving, extra)
    if method == "hima":  # the toy hierarchy (router -> calculator agent / QA agent) against the policy alone
        # Both arms are scored on held-out problems by TRL's evaluation (one sampled answer a problem): the system
        # for HiMA (the router's call, the agent it routes to, the tool), the policy's single answer for GRPO.
        # GRPO trains the policy alone from SmolLM2 itself (the cold start below teaches the hierarchy's formats
        # only, and costs direct answering); both arms get 48 tokens a call (a calculator call is about 30).
        sampled = {"sampled_eval": True, "reward_weights": TASK_REWARD_WEIGHTS, "max_completion_length": 48}
        # SmolLM2 alone never writes a route: a short cold start (both arms start from it) shows the router
        # `<route>calc</route>` and the calculator agent a tool call on the training problems, few enough steps
        # that routing is still partial and left for RL to learn.
        start = cold_start(model, tokenizer, out / "hima-cold-start", hima_rows(), steps=6)
        hima = {"sampled_eval": True, "hima_hierarchy": "toy", "hima_alternatives": 2, "max_completion_length": 48}
        return model, (GRPOExtTrainer, GRPOExtConfig, sampled, rewards), (
            HiMATrainer, HiMAConfig, hima, {"reward_funcs": ["last_integer", "hima_format", "hima_efficiency"],
                                            "model": start})  # fmt: skip
    raise SystemExit(f"unknown method {method!r}")


def run(name: str, model: str, tokenizer, spec, steps: int, eval_every: int, out: Path) -> dict:
    trainer_cls, config_cls, overrides, extra = spec
    overrides, extra = dict(overrides), dict(extra)
    model = extra.pop("model", model)  # an arm that starts from its own model (HiMA's cold start)
    system = overrides.pop("system", None)
    driving = overrides.pop("task", None) == "driving"
    tools = "tools" in extra or overrides.pop("sampled_eval", False)  # evaluated by TRL's evaluation (sampled)
    length = overrides.get("max_completion_length", 24)
    heldout = (HeldoutDrivingScore(every=eval_every, max_new_tokens=length) if driving
               else HeldoutAccuracy(every=eval_every, max_new_tokens=length, system=system))  # fmt: skip
    trace = Trace()
    if tools:  # a tool-calling policy is evaluated with the tool loop: TRL's evaluation, one sample a problem
        overrides.update(eval_strategy="steps", eval_steps=eval_every, eval_on_start=True, num_generations_eval=1,
                         per_device_eval_batch_size=20)  # fmt: skip
        extra["eval_dataset"] = addition_dataset("heldout", system=system)
    args = config_cls(output_dir=str(out / name), max_steps=steps, **{**BASE, **overrides})
    callbacks = [*extra.pop("callbacks", []), trace, *([] if tools else [heldout])]
    rewards = extra.pop("reward_funcs")
    if extra.pop("train_dataset", None) == "trees":
        dataset = questions_dataset(overrides["prefix_trees"])
        dataset = dataset.select([i % len(dataset) for i in range(10 * len(dataset))])  # as GRPO's: 10 passes
    elif driving:
        dataset = driving_task_dataset("train")
    else:
        dataset = addition_dataset("train", repeats=10, system=system)
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                          callbacks=callbacks, reward_funcs=rewards, **extra)  # fmt: skip
    start = time.perf_counter()
    trainer.train()  # tools: eval_on_start gives the step-0 point (an evaluate() before train() is lost: train resets
    # the trainer state and its log history)
    if tools:
        key = "eval_rewards/last_integer_reward/mean"
        if not any(log["step"] == trainer.state.global_step and key in log for log in trainer.state.log_history):
            trainer.evaluate()  # the last step is not a multiple of eval_every: one more point at the end
        heldout.history = [(log["step"], log[key]) for log in trainer.state.log_history if key in log]
    result = {"name": name, "seconds": time.perf_counter() - start, "heldout": heldout.history, "steps": trace.steps}
    # The reward-hacking monitor over the run's logs, as it would have run live (docs/monitor.md)
    monitor = RewardHackingMonitor(correctness="trajectory" if driving else "last_integer")
    monitor.replay(trace.steps, reward_weights=args.reward_weights, reward_names=trainer.reward_func_names)
    result["monitor"] = [f"step {f.step}: {f.detector}: {f.evidence}" for f in monitor.findings if f.kind == "warning"]
    if "prorl" in {e.name for e in trainer.extensions}:
        result["resets"] = trainer.extension("prorl").history
    print(f"{name}: held-out {heldout.history[0][1]:.3f} -> {heldout.history[-1][1]:.3f} in {result['seconds']:.0f} s, "
          f"{trace.tokens:.0f} generated tokens; {len(result['monitor'])} monitor warning(s)", flush=True)  # fmt: skip
    return result


def own_metric(method: str, runs: dict) -> str:
    """The number the method exists for, both arms side by side."""
    last = {k: r["steps"][-1] for k, r in runs.items()}
    mean = {k: sum(s.get("completions/mean_length", 0) for s in r["steps"]) / len(r["steps"]) for k, r in runs.items()}
    if method.startswith("curriculum"):
        return (f"mean completion length {mean['grpo']:.1f} (GRPO) vs {mean[method]:.1f} tokens; final budget "
                f"{last[method].get('curriculum/budget', float('nan')):.0f}")  # fmt: skip
    if method == "dynamic_sampling":
        kept = [s["dynamic_sampling/kept_fraction"] for s in runs[method]["steps"]]
        return f"groups kept {sum(kept) / len(kept):.2f} on average (zero-variance groups removed)"
    if method == "prorl":
        kl = {k: [round(s.get("kl", 0.0), 4) for s in r["steps"]] for k, r in runs.items()}
        return f"KL at steps 10/11/20/21: GRPO {[kl['grpo'][i] for i in (9, 10, 19, 20) if i < len(kl['grpo'])]}, ProRL {[kl[method][i] for i in (9, 10, 19, 20) if i < len(kl[method])]}"
    if method == "pta":
        steps = runs[method]["steps"]
        closed = sum(s["pta/plans_closed"] for s in steps) / len(steps)
        saved = sum(s["pta/tokens_saved_fraction"] for s in steps) / len(steps)
        return f"plans closed {closed:.2f}; tokens saved against independent sampling {saved:.2f}"
    if method == "tree_opo":
        var = {
            k: sum(s.get("treeopo/advantage_var", 0) for s in r["steps"]) / len(r["steps"]) for k, r in runs.items()
        }
        std = sum(s.get("reward_std", 0) for s in runs["grpo"]["steps"]) / len(runs["grpo"]["steps"])
        steps = runs[method]["steps"]
        depth = sum(s["treeopo/prefix_depth"] for s in steps) / len(steps)
        return (f"advantage variance {var[method]:.3f} (GRPO's std-normalised advantages: about 1 where a group "
                f"varies; its mean reward std {std:.3f}); mean prefix depth {depth:.2f}")  # fmt: skip
    if method == "segments":
        rate = {
            k: sum(s.get("tools/call_frequency", 0) for s in r["steps"]) / len(r["steps"]) for k, r in runs.items()
        }
        return f"tool calls per completion {rate['grpo']:.2f} (GRPO) vs {rate[method]:.2f}"
    if method == "bicc":
        steps = runs[method]["steps"]
        added = sum(s.get("bicc/rows_added", 0) for s in steps) / len(steps)
        mixed = sum(s.get("bicc/mixed_groups", 0) for s in steps) / len(steps)
        seconds = runs[method]["seconds"] / runs["grpo"]["seconds"]
        return (f"mixed groups {mixed:.2f}, conditioned rows added {added:.1f} per step (to 8 sampled); "
                f"wall time {seconds:.2f}x GRPO's")  # fmt: skip
    if method.startswith("drafts"):
        steps = [s for s in runs[method]["steps"] if s.get("drafts/refine_fraction", 0) > 0]
        mean = {k: sum(s.get(f"drafts/{k}", 0) for s in steps) / max(len(steps), 1)
                for k in ("refine_accuracy", "draft_accuracy", "improvement_rate", "copy_rate", "missing")}  # fmt: skip
        solve = [s["drafts/solve_accuracy"] for s in runs[method]["steps"] if "drafts/solve_accuracy" in s]
        return (f"refine steps {len(steps)}; train accuracy refining {mean['refine_accuracy']:.2f} (drafts shown "
                f"{mean['draft_accuracy']:.2f} right), solving {sum(solve) / max(len(solve), 1):.2f}; improvement "
                f"rate {mean['improvement_rate']:.2f}, copy rate {mean['copy_rate']:.2f}, groups without a draft "
                f"{mean['missing']:.2f}")  # fmt: skip
    if method == "nord":

        def mass(run_, key):
            values = [s[key] for s in run_["steps"] if key in s]
            return sum(values) / max(len(values), 1)

        parts = [f"{k}: advantage mass on hard / easy groups {mass(r, 'difficulty/mass_hard'):.2f} / "
                 f"{mass(r, 'difficulty/mass_easy'):.2f} (groups {mass(r, 'difficulty/groups_hard'):.2f} / "
                 f"{mass(r, 'difficulty/groups_easy'):.2f}), malformed {mass(r, 'trajectory/malformed'):.1f} per step, "
                 f"collisions {mass(r, 'trajectory/collision_rate'):.2f}" for k, r in runs.items()]  # fmt: skip
        return "; ".join(parts)
    if method == "hima":
        steps = runs[method]["steps"]

        def avg(key):
            return sum(s.get(key, 0) for s in steps) / len(steps)

        rows = ", ".join(f"{a} {avg(f'hima/rows_{a}'):.2f}" for a in ("router", "calc", "qa"))
        return (f"calls per system {avg('hima/calls'):.2f}, bad routes {avg('hima/bad_routes'):.2f}; trained rows "
                f"by agent: {rows}; node groups kept {avg('hima/selected_groups'):.1f} of "
                f"{avg('hima/node_groups'):.1f}; wall time {runs[method]['seconds'] / runs['grpo']['seconds']:.2f}x "
                "GRPO's")  # fmt: skip
    if method == "rcc":
        steps = runs[method]["steps"]
        shift = sum(s.get("rcc/baseline_shift", 0) for s in steps) / len(steps)
        ratio = sum(abs(s.get("rcc/log_ratio", 0)) for s in steps) / len(steps)
        return f"mean |2 Cov(r, delta)| {shift:.3f} per group; mean |log-ratio to the reference| {ratio:.2f}"
    return ""


def verdict(runs: dict, method: str) -> str:
    """Which goal the method met; a difference of one held-out problem is read as noise."""
    base, ours = runs["grpo"], runs[method]
    final_base, final_ours = base["heldout"][-1][1], ours["heldout"][-1][1]
    noise = 1.5 / (DRIVING_HELDOUT_SIZE if method == "nord" else len(addition_problems("heldout")))
    what, unit = ("driving score", "scene") if method == "nord" else ("accuracy", "problem")
    fewer = ours["steps"][-1]["generated_tokens"] < base["steps"][-1]["generated_tokens"]
    if final_ours > final_base + noise:
        return f"higher held-out {what} on the same budget" + (", in fewer generated tokens" if fewer else "")
    if final_ours >= final_base - noise and fewer:
        return f"GRPO's {what} (within one held-out {unit}) in fewer generated tokens"
    if final_ours < final_base - noise:
        return f"lower held-out {what} than GRPO"
    return f"neither (within one held-out {unit} of GRPO, no fewer tokens)"


def plot(method: str, runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (steps_ax, tokens_ax) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, run_ in runs.items():
        tokens = {s["step"]: s["generated_tokens"] for s in run_["steps"]}
        points = run_["heldout"]
        steps_ax.plot([s for s, _ in points], [a for _, a in points], marker="o", label=name)
        tokens_ax.plot([tokens.get(s, 0) for s, _ in points], [a for _, a in points], marker="o", label=name)
    what = "driving score" if method == "nord" else "accuracy"
    how = "one sample each" if method in ("hima", "segments") else "greedy"  # TRL's evaluation: one sampled answer
    steps_ax.set(xlabel="step", ylabel=f"held-out {what} ({how})", title=f"{method} vs GRPO")
    tokens_ax.set(xlabel="completion tokens generated", title=f"{what} per generated token")
    save_figure(fig, (steps_ax, tokens_ax), path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--methods",
        nargs="+",
        default=[
            "dynamic_sampling",
            "curriculum",
            "curriculum_cap",
            "prorl",
            "pta",
            "segments",
            "tree_opo",
            "bicc",
            "rcc",
            "drafts",
            "drafts_mismatched",
            "nord",
            "hima",
        ],
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=6)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = real_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    table, baselines = [], {}
    for method in args.methods:
        start_model, baseline, spec = arms(method, model, tokenizer, out, args.steps)
        # one GRPO run serves every method with the same baseline (same start model, trainer, settings, rewards)
        key = repr((start_model, baseline))
        if key not in baselines:
            baselines[key] = run(f"{method}-grpo", start_model, tokenizer, baseline, args.steps, args.eval_every, out)
        runs = {"grpo": baselines[key],
                method: run(f"{method}-{method}", start_model, tokenizer, spec, args.steps, args.eval_every, out)}  # fmt: skip
        summary = {"method": method, "verdict": verdict(runs, method), "own_metric": own_metric(method, runs),
                   "heldout": {k: (r["heldout"][0][1], r["heldout"][-1][1]) for k, r in runs.items()},
                   "generated_tokens": {k: r["steps"][-1]["generated_tokens"] for k, r in runs.items()}}  # fmt: skip
        (out / f"{method}.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1, default=str))
        plot(method, runs, out / f"{method}.png")
        table.append(summary)
        print(json.dumps(summary), flush=True)
    print(
        "\n| method | GRPO held-out (start -> end) | method held-out | GRPO tokens | method tokens | result | own metric |"
    )
    print("|---|---|---|---|---|---|---|")
    for s in table:
        g, m = s["heldout"]["grpo"], s["heldout"][s["method"]]
        tokens = s["generated_tokens"]
        print(f"| {s['method']} | {g[0]:.3f} -> {g[1]:.3f} | {m[0]:.3f} -> {m[1]:.3f} | {tokens['grpo']:.0f} | "
              f"{tokens[s['method']]:.0f} | {s['verdict']} | {s['own_metric']} |")  # fmt: skip


if __name__ == "__main__":
    main()
