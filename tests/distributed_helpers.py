"""Helpers that training subprocesses import by dotted path (`--advantage_estimator tests.distributed_helpers...`),
and the driver of tests/test_distributed.py (`python -m tests.distributed_helpers`, under `accelerate launch`)."""

import copy
import gc
import hashlib
import itertools
import json
import os
import re
import sys
from pathlib import Path

from trl_grpo_ext.advantages import group_advantages
from trl_grpo_ext.extension import Extension

RECORD_DIR_ENV = "TRL_GRPO_EXT_RECORD_DIR"


def record_advantages(batch):
    """GRPO's group advantages from the gathered rewards, recorded per process for the test to compare.

    Writes `<$TRL_GRPO_EXT_RECORD_DIR>/rank<r>-step<s>.json`: its row slice and its rows' prompts, the rewards of all N
    rows as this process saw them, the advantages of all rows it computed, and its own rows' advantages (returned to
    the trainer) and TRL's.
    """
    advantages = group_advantages(batch.rewards, batch.num_generations)  # (N,) over all processes
    local = batch.local(advantages)  # (B,)
    rank = int(os.environ.get("RANK", "0"))
    record = {
        "rank": rank,
        "num_generations": batch.num_generations,
        "rows": [batch.process_slice.start, batch.process_slice.stop],
        "prompts": batch.prompts,
        "rewards": batch.rewards.tolist(),
        "all_advantages": advantages.tolist(),
        "local_advantages": local.tolist(),
        "trl_local_advantages": batch.advantages.tolist(),
    }
    path = Path(os.environ[RECORD_DIR_ENV]) / f"rank{rank}-step{batch.step}.json"
    path.write_text(json.dumps(record))
    return local


# ---------------------------------------------------------------------------------------------------------------------
# The driver of tests/test_distributed.py: every named trainer, one after the other, in one launch.
#
#   accelerate launch --multi_gpu --num_processes 2 -m tests.distributed_helpers OUT MODEL_DIR   (records)
#   run(name, ..., replay=[rank 0's record, rank 1's])                          (one process, in the test)
#
# Each run trains `STEPS` steps, with groups of `GROUP` rows (whole on a process, or split between the processes where
# the method allows it). With two processes, TRL's generation (`GRPOTrainer._generate_single_turn`) is recorded call
# by call (scripted for the tool-calling and the multi-agent runs); the one-process run asks the same backend for each
# of its rows and gets what the two processes generated for that prompt, so both runs score the same completions.
# Every scored batch's group maths (rewards, advantages, dropped and added rows, tree owners, notes) is recorded by an
# extension that runs last.
STEPS = 2
GROUP = 4


def parity_reward(completions, solution, **kwargs):
    """0 for problems with an even answer (a group of those never varies: dynamic sampling drops it), else the length
    of the text mod 2: the groups of the others usually hold both values."""
    from trl_grpo_ext.rewards import completion_text

    return [0.0 if int(s) % 2 == 0 else float(len(completion_text(c)) % 2) for c, s in zip(completions, solution,
                                                                                               strict=True)]  # fmt: skip


parity_reward.correctness = True  # what dynamic sampling filters on


def coin_reward(completions, **kwargs):
    """1 when the text has an odd length, else 0: "correct" for BiCC's pairs and the drafts' scores."""
    from trl_grpo_ext.rewards import completion_text

    return [float(len(completion_text(c)) % 2) for c in completions]


def varied_reward(completions, **kwargs):
    """The length of the text, mod 7, scaled: varies within most groups of a random model."""
    from trl_grpo_ext.rewards import completion_text

    return [(len(completion_text(c)) % 7) / 7 for c in completions]


def _settings(**overrides) -> dict:
    from trl_grpo_ext.testing import cpu_test_config_kwargs

    return {"num_generations": GROUP, "max_completion_length": 8, "max_steps": STEPS, "learning_rate": 1e-2,
            "seed": 0, **cpu_test_config_kwargs(), **overrides}  # fmt: skip


# name -> (the `--trainer` it stands for, rows per process of two (6: groups split between the processes), whether
# the one-process run replays it). Dynamic sampling's refills draw fresh prompts per process: not replayable.
RUNS = {
    "grpo_ext": ("grpo_ext", 6, True),
    "curriculum": ("curriculum", 6, True),
    "prorl": ("prorl", 6, True),
    "dynamic_sampling": ("grpo_ext", 8, False),
    "pta": ("pta", 8, True),
    "segment": ("segment", 4, True),
    "tree_opo": ("tree_opo", 8, True),
    "bicc": ("bicc", 8, True),
    "drafts": ("drafts", 8, True),
    "nord": ("nord", 6, True),
    "hima": ("hima", 8, True),
}


def build(name: str, model: str, tokenizer, output_dir: str, processes: int):
    """The trainer of run `name`, for `processes` processes (rows per process scale so that batches are alike)."""
    import trl_grpo_ext as ext
    from trl_grpo_ext.methods.prorl import ProRLResetCallback
    from trl_grpo_ext.methods.pta import PlanValueReward
    from trl_grpo_ext.testing import tiny_dataset
    from trl_grpo_ext.tools import calculator

    rows = RUNS[name][1] * 2 // processes
    args = _settings(output_dir=output_dir, per_device_train_batch_size=rows)
    common = {"processing_class": tokenizer, "extensions": [Recorder()]}
    data = tiny_dataset(16)
    if name == "grpo_ext":
        return ext.GRPOExtTrainer(model, [varied_reward], ext.GRPOExtConfig(**args), train_dataset=data, **common)
    if name == "curriculum":  # budget 8 at step 0, 4 at step 1
        config = ext.GRPOExtConfig(**args, budget_start=8, budget_end=4, budget_decays=1, budget_total_steps=2)
        return ext.CurriculumGRPOTrainer(model, [varied_reward, "budget_length"], config, train_dataset=data, **common)
    if name == "prorl":  # dynamic sampling (drop only) on parity_reward; a reference reset after step 1
        config = ext.ProRLConfig(**args)
        return ext.ProRLTrainer(model, [parity_reward], config, train_dataset=data,
                                callbacks=[ProRLResetCallback.v2(every_n_steps=1)], **common)  # fmt: skip
    if name == "dynamic_sampling":
        config = ext.GRPOExtConfig(**args, dynamic_sampling=True, dynamic_sampling_max_rounds=1)
        return ext.GRPOExtTrainer(model, [parity_reward], config, train_dataset=data, **common)
    if name == "pta":
        config = ext.PTAGRPOConfig(**args, num_plans=2, continuations_per_plan=2, plan_max_tokens=4)
        rewards = [varied_reward, PlanValueReward(varied_reward)]
        return ext.PTAGRPOTrainer(model, rewards, config, train_dataset=data, **common)
    if name == "segment":  # ARPO's branches after tool results, hard credit on the shared tokens
        from trl.chat_template_utils import add_response_schema

        config = ext.GRPOExtConfig(**{**args, "max_completion_length": 64}, segment_by="tool_calls",
                                   segment_advantage="hard", arpo=True, arpo_initial_rollouts=2)  # fmt: skip
        common["processing_class"] = add_response_schema(copy.deepcopy(tokenizer))
        return ext.SegmentGRPOTrainer(model, ["contains_solution"], config, tools=[calculator],
                                      train_dataset=data.map(lambda row: {"solution": "12"}), **common)  # fmt: skip
    if name == "tree_opo":
        from trl_grpo_ext.data.trees import SAMPLE_TREES

        config = ext.TreeOPOConfig(**args, prefix_trees=SAMPLE_TREES)
        return ext.TreeOPOTrainer(model, ["last_integer"], config, **common)
    if name == "bicc":  # with the reward-confidence-corrected baseline (a reference is built at beta 0)
        config = ext.BiCCGRPOConfig(**args, bicc_reward="coin_reward", advantage_estimator="rcc")
        return ext.BiCCGRPOTrainer(model, [coin_reward], config, train_dataset=data, **common)
    if name == "drafts":  # self-refinement: batch 1 solves, batch 2 refines (a fresh draft, earlier answers)
        config = ext.DraftGRPOConfig(**args, draft_reward="coin_reward", draft_max_new_tokens=4)
        return ext.DraftGRPOTrainer(model, [coin_reward], config, train_dataset=data, **common)
    if name == "nord":
        config = ext.NoRDConfig(**args)
        return ext.NoRDTrainer(model, [varied_reward], config, train_dataset=data, **common)
    if name == "hima":
        config = ext.HiMAConfig(**{**args, "max_completion_length": 24}, hima_alternatives=2)
        return ext.HiMATrainer(model, ["last_integer", "hima_format", "hima_efficiency"], config, hierarchy="toy",
                               train_dataset=data, **common)  # fmt: skip
    raise KeyError(f"no run {name!r}; runs: {', '.join(RUNS)}")


class Recorder(Extension):
    """Runs last on every scored batch (refills excluded) and keeps its group maths, this process's rows in global
    terms: row indices count over all processes (`process_slice`)."""

    name = "record"
    order = 1000

    def __init__(self):
        self.batches = []

    def after_scoring(self, batch) -> None:
        if batch.mode != "train":
            return
        start, scored = batch.process_slice.start, batch.num_scored
        mask = batch.completion_mask.bool().cpu()
        advantages = batch.current_advantages.float().cpu()
        owners = None if batch.owners is None else batch.owners.cpu()
        if advantages.dim() == 2:  # per row, the advantage of each of its completion tokens
            advantages = [a[m].tolist() for a, m in zip(advantages, mask, strict=True)]
        record = {
            "step": batch.step,
            "rows": [start, batch.process_slice.stop],
            "prompts": [_text(p) for p in batch.prompts],
            "completion_ids": [ids[m].tolist() for ids, m in zip(batch.completion_ids.cpu(), mask, strict=True)],
            "rewards": batch.rewards.tolist(),
            "rewards_per_func": batch.rewards_per_func.tolist(),
            "trl_advantages": batch.advantages.tolist(),
            "advantages": advantages if isinstance(advantages, list) else advantages.tolist(),
            # per row and completion token: the global row that generated it (rows that share tokens: a tree)
            "owners": None if owners is None else [(o[m] + start).tolist() for o, m in zip(owners, mask, strict=True)],
            "dropped": None if batch.dropped is None else batch.dropped.tolist(),
            "added_from": [start + s for s in batch.added_from],
            "scored": scored,
            "notes": {key: _plain(values) for key, values in batch.notes.items()},
            "budget": batch.columns.get("budget"),
        }
        self.batches.append(record)


class Generations:
    """TRL's generation backend (`GRPOTrainer._generate_single_turn`), recorded call by call or replayed.

    Recording, each call's step, prompts and completions are kept (`calls`); `script(text, block)` (optional) writes
    the completion text of a row instead of the model. Replaying, a row gets the next completion that the recorded
    run generated for its prompt in the same step, process 0's first (a group split between the processes: one call
    on each). A prompt the recorded run never generated for is an error, and so is one that two processes generated
    for in several calls (which came first is unknown); `unused()` counts what was generated but never asked for
    (rows a process generated only to take part in a collective call).
    """

    def __init__(self, trainer, script=None, replay=None):
        self.trainer, self.script, self.calls = trainer, script, []
        self.replay = None
        if replay is not None:
            self.replay = {}
            for rank, calls in enumerate(replay):
                for index, call in enumerate(calls):
                    for prompt, completion in zip(call["prompts"], call["completions"], strict=True):
                        self.replay.setdefault((call["step"], tuple(prompt)), []).append((rank, index, completion))

    def unused(self) -> int:
        return sum(len(queue) for queue in (self.replay or {}).values())

    def __call__(self, original, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        prompts, step = [[int(i) for i in p] for p in prompt_ids], self.trainer.state.global_step
        logprobs = None
        if self.replay is not None:
            out = []
            for prompt in prompts:
                queue = self.replay.get((step, tuple(prompt)))
                text = self.trainer.processing_class.decode(prompt[-40:])
                if not queue:
                    raise AssertionError(f"replay: at step {step} the recorded run generated nothing for ...{text!r}")
                if len({rank for rank, _, _ in queue}) > 1 and len({(rank, index) for rank, index, _ in queue}) > 2:
                    raise AssertionError(f"replay: at step {step} two processes generated for ...{text!r} in several "
                                         "calls")  # fmt: skip
                out.append(queue.pop(0)[2])
        elif self.script is None:
            out, logprobs = original(self.trainer, prompt_ids, images, multimodal_fields, num_generations,
                                     has_tool_images=has_tool_images)  # fmt: skip
            out = [[int(i) for i in ids] for ids in out]
        else:
            tokenizer, cap = self.trainer.processing_class, self.trainer.generation_config.max_new_tokens
            eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
            texts = [self.script(tokenizer.decode(p), num_generations) for p in prompts]
            out = [(tokenizer.encode(t, add_special_tokens=False) + [eos])[:cap] for t in texts]
        self.calls.append({"step": step, "prompts": prompts, "completions": out})
        return out, logprobs


def arpo_script(rank: int):
    """A tool-calling policy: a calculator call, then an answer, 12 or 13."""
    answers = itertools.cycle(["<answer>12</answer>", "<answer>13</answer>", "<answer>13</answer>"])
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * 4"}}\n</tool_call>'

    def script(text: str, block: int) -> str:
        return call if "<tool_response>" not in text else next(answers)

    return script


def hima_script(rank: int):
    """The toy hierarchy's agents, scripted. The router's reference calls route on process 0 and do not on process 1,
    so the processes' systems take different numbers of calls; its alternatives route or not; the calculator agent's
    tool calls add or subtract; the QA agent answers right or wrong."""
    from trl_grpo_ext.methods.hima import toy_hierarchy

    roles = {agent.name: agent.role for agent in toy_hierarchy().agents}
    cycles = {"router": itertools.cycle(["<route>calc</route>", "no route", "<route>qa</route>"]),
              "calc": itertools.cycle(["A + B", "A - B", "A * B"]), "qa": itertools.cycle(["SUM", "0", "SUM"])}  # fmt: skip

    def script(text: str, block: int) -> str:
        agent = next(name for name, role in roles.items() if role in text)
        questions = re.findall(r"What is (\d+) \+ (\d+)", text)
        if not questions:  # a process with no call of its own takes part in the round's generation call
            return "nothing"
        a, b = (int(n) for n in questions[-1])
        if agent == "router":
            value = next(cycles["router"]) if block > 1 else ("<route>calc</route>" if rank == 0 else "no route")
        elif agent == "calc":
            expression = next(cycles["calc"]).replace("A", str(a)).replace("B", str(b))
            value = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'
        else:
            value = next(cycles["qa"]).replace("SUM", str(a + b))
        return value

    return script


SCRIPTS = {"segment": arpo_script, "hima": hima_script}


def run(name: str, model: str, tokenizer, output_dir: str, replay: list | None = None) -> dict:
    """Train run `name` for `STEPS` steps; its record: every scored batch, the generation calls, the logged metrics,
    the extensions' state (tensors as hashes). `replay`: the recorded run's per-rank records, to generate from."""
    import torch
    import trl
    from accelerate import PartialState

    state = PartialState()
    trainer = build(name, model, tokenizer, output_dir, state.num_processes)
    script = SCRIPTS[name](state.process_index) if name in SCRIPTS and replay is None else None
    generations = Generations(trainer, script, None if replay is None else [r["calls"] for r in replay])
    original = trl.GRPOTrainer._generate_single_turn

    def backend(self, *args, **kwargs):
        return generations(original, *args, **kwargs)

    trl.GRPOTrainer._generate_single_turn = backend
    gc.freeze()  # `Trainer.train` runs `gc.collect()` (accelerate's `free_memory`): not over what was there before
    try:
        trainer.train()
    finally:
        gc.unfreeze()
        trl.GRPOTrainer._generate_single_turn = original
    states = {e.name: _plain(e.state_dict()) for e in trainer.extensions if e.name != "record"}
    return {
        "name": name, "rank": state.process_index, "processes": state.num_processes,
        "batches": trainer.extension("record").batches, "calls": generations.calls, "unused": generations.unused(),
        "logs": [log for log in trainer.state.log_history if "loss" in log], "states": states,
        "params": _digest(torch.cat([p.detach().flatten().float() for p in trainer.model.parameters()])),
    }  # fmt: skip


def _text(prompt) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def _digest(tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def _plain(value):
    """`value` as JSON: tuples as lists, tensors as a hash of their bytes (equal state, equal hash)."""
    import torch

    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "sha256": _digest(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> None:
    """`python -m tests.distributed_helpers OUT MODEL_DIR [RUN ...]`: each run's record as OUT/<run>/rank<r>.json."""
    import time

    from accelerate import PartialState
    from transformers import PreTrainedTokenizerFast

    out, model, *names = argv if argv is not None else sys.argv[1:]
    rank = PartialState(cpu=True).process_index  # first: without `cpu`, accelerate sees no device to distribute over
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model)
    for name in names or list(RUNS):
        start = time.perf_counter()
        record = run(name, model, tokenizer, str(Path(out) / name / "out"))
        record["seconds"] = time.perf_counter() - start
        (Path(out) / name).mkdir(parents=True, exist_ok=True)
        (Path(out) / name / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
