"""Resume is exact: a run resumed from a checkpoint on a fresh trainer (`resume_from_checkpoint`) ends with the
uninterrupted run's parameters (`torch.equal`), per-step logs and extension state, same seed, on CPU.

Each case trains one configuration uninterrupted (it writes its checkpoints as it goes), then resumes a fresh
trainer from one of those checkpoints in another folder. A run interrupted at that step would have written the same
checkpoint (`test_plain_grpo_resumes_between_generations_after_an_epoch` checks it, file by file), and the same
`max_steps` keeps the learning-rate schedule. The checkpoints fall where resuming is hard: between two generations
(steps_per_generation > 1: TRL's generation buffer), after the first epoch (the sampler's permutation of a later
epoch), and after extension state has built up (refill draws, resets, stores, memories, branching draws).
"""

import copy
import math
import re

import torch
from safetensors.torch import load_file
from transformers import TrainerCallback
from trl.chat_template_utils import add_response_schema
from trl.trainer.utils import RepeatSampler

from trl_grpo_ext import (
    GRPOExtConfig,
    GRPOExtTrainer,
    ProRLResetCallback,
    SegmentGRPOTrainer,
    TreeOPOConfig,
    TreeOPOTrainer,
    get_reward,
)
from trl_grpo_ext.data.trees import SAMPLE_TREES
from trl_grpo_ext.rewards import completion_text
from trl_grpo_ext.testing import tiny_dataset
from trl_grpo_ext.trainer import GENERATION_FILE, STATE_FILE, _EpochSampler

from .conftest import make_config, varied_reward
from .test_hima import SCRIPTS, hima_trainer
from .test_segment_trainer import _script, calculator

# Logged values that measure time or summarise one `train()` call (the resumed call covers the last steps only).
UNTIMED = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss",
           "total_flos"}  # fmt: skip


class _StopAt(TrainerCallback):
    """Interrupts training after `step` and its checkpoint (as if the job were killed then)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def _train_and_resume(build, tmp_path, at: int):
    """`build(folder, callbacks) -> trainer`. The uninterrupted run, and a fresh trainer resumed from its checkpoint
    of step `at`."""
    full = build(tmp_path / "full", [])
    full.train()
    checkpoint = tmp_path / "full" / "out" / f"checkpoint-{at}"
    resumed = build(tmp_path / "resumed", [])
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == full.state.global_step == full.args.max_steps
    return full, resumed, checkpoint


def _same(a, b) -> bool:
    """Deep equality of state dicts: tensors bit for bit, NaN equal to NaN."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _step_logs(trainer) -> dict:
    return {log["step"]: {k: v for k, v in log.items() if k not in UNTIMED}
            for log in trainer.state.log_history if "loss" in log}  # fmt: skip


def _assert_resumed_exactly(full, resumed, checkpoint, extensions=()):
    ours, theirs = dict(resumed.model.named_parameters()), dict(full.model.named_parameters())
    assert ours.keys() == theirs.keys()
    unequal = [n for n in ours if not torch.equal(ours[n], theirs[n])]
    assert not unequal, f"{len(unequal)} parameters differ from the uninterrupted run's, e.g. {unequal[:3]}"
    saved = load_file(checkpoint / "model.safetensors")
    assert any(not torch.equal(ours[n], saved[n]) for n in saved), "the resumed run did not train"
    if full.ref_model is not None:  # the KL reference (ProRL resets it)
        refs = [dict(t.ref_model.named_parameters()) for t in (resumed, full)]
        assert all(torch.equal(refs[0][n], refs[1][n]) for n in refs[0])
    assert _same(_step_logs(resumed), _step_logs(full))  # rewards, losses, KL, every extension's metrics, per step
    for name in extensions:
        assert _same(_untimed(resumed.extension(name).state_dict()), _untimed(full.extension(name).state_dict())), name


def _untimed(state: dict) -> dict:
    """An extension's state without timings (the monitor keeps every logged series, `step_time` too)."""
    if "series" not in state:
        return state
    return {**state, "series": {k: v for k, v in state["series"].items() if k not in UNTIMED}}


# ---------------------------------------------------------------------------------------------- plain GRPO
def test_the_epoch_sampler_draws_trls_permutations_from_any_epoch():
    def sampler():
        return RepeatSampler(range(5), mini_repeat_count=2, batch_size=2, repeat_count=2, shuffle=True, seed=3)

    trl, ours = sampler(), _EpochSampler(sampler())
    passes = [list(trl) for _ in range(3)]  # TRL's: one seeded generator, a new permutation per pass
    assert passes[0] != passes[1] != passes[2]
    for epoch in range(3):
        ours.set_epoch(epoch)
        assert list(ours) == passes[epoch]
    resumed = _EpochSampler(sampler())  # a resumed run's new sampler, starting at epoch 2
    resumed.set_epoch(2)
    assert list(resumed) == passes[2] and len(resumed) == len(trl)


def test_plain_grpo_resumes_between_generations_after_an_epoch(tiny_model_path, tokenizer, tmp_path):
    # 2 prompts, one per generation (4 rows, trained over 2 steps): 4 steps per epoch. Resumed after step 5, between
    # the two steps of epoch 1's first generation: the resumed run trains its second slice, then generates epoch 1's
    # second prompt (from the sampler's second permutation) at step 7.
    def build(folder, callbacks):
        args = make_config(folder, per_device_train_batch_size=2, steps_per_generation=2, max_steps=7,
                           save_strategy="steps", save_steps=5)  # fmt: skip
        return GRPOExtTrainer(model=str(tiny_model_path), reward_funcs=varied_reward, args=args,
                              train_dataset=tiny_dataset(2), processing_class=tokenizer, callbacks=callbacks)  # fmt: skip

    full, resumed, checkpoint = _train_and_resume(build, tmp_path, at=5)
    assert (checkpoint / GENERATION_FILE.format(0)).is_file()  # TRL's buffer: the slice step 6 trains on
    assert not (checkpoint / STATE_FILE).exists()  # no extension, no extension state
    _assert_resumed_exactly(full, resumed, checkpoint)
    assert resumed._step == full._step == 7
    # A run interrupted after step 5 writes the checkpoint the uninterrupted run wrote: weights, optimizer, scheduler,
    # RNG states and generation buffer, byte for byte (trainer_state.json differs in its logged timings only).
    build(tmp_path / "part", [_StopAt(5)]).train()
    interrupted = tmp_path / "part" / "out" / "checkpoint-5"
    files = sorted(f.name for f in checkpoint.iterdir() if f.suffix in (".safetensors", ".pt", ".pth"))
    assert files == sorted(f.name for f in interrupted.iterdir() if f.suffix in (".safetensors", ".pt", ".pth"))
    assert len(files) == 5 and all((checkpoint / f).read_bytes() == (interrupted / f).read_bytes() for f in files)


# ---------------------------------------------------------------------------------------------- extensions
def right_for_large_sums(completions, solution, **kwargs):
    """Correctness stand-in: every answer to a sum of 11 or more is right (1.0: those groups have zero variance), else
    the text's length parity decides: some groups drop and refill, the others mix right and wrong answers."""
    return [1.0 if int(s) >= 11 else float(len(completion_text(c)) % 2) for c, s in zip(completions, solution,
                                                                                       strict=True)]  # fmt: skip


right_for_large_sums.correctness = True


def test_curriculum_prorl_dynamic_sampling_bicc_nord_and_the_monitor_resume_exactly(tiny_model_path, tokenizer,
                                                                                     tmp_path):  # fmt: skip
    # One group per step; resumed after step 2, when ProRL has reset once (its reference is in the checkpoint) and
    # asked for the next reset, dynamic sampling has drawn a refill, BiCC has drawn pairs, and the monitor has a history.
    names = ["curriculum", "dynamic_sampling", "difficulty", "bicc", "monitor", "prorl"]

    def build(folder, callbacks):
        args = make_config(folder, per_device_train_batch_size=4, max_steps=4, save_strategy="steps", save_steps=2,
                           beta=0.1, budget_start=8, budget_end=4, budget_decays=2, budget_caps_generation=True,
                           dynamic_sampling=True, dynamic_sampling_max_rounds=1, bicc=True, difficulty_diagnostic=True,
                           monitor=True)  # fmt: skip
        prorl = ProRLResetCallback(reset="both", every_n_steps=1)
        return GRPOExtTrainer(model=str(tiny_model_path), reward_funcs=right_for_large_sums, args=args,
                              train_dataset=tiny_dataset(16), processing_class=tokenizer,
                              callbacks=[prorl, *callbacks])  # fmt: skip

    full, resumed, checkpoint = _train_and_resume(build, tmp_path, at=2)
    assert sorted(e.name for e in full.extensions) == sorted(names)
    saved = torch.load(checkpoint / STATE_FILE, weights_only=True)
    assert saved["prorl"]["pending"] and saved["prorl"]["reference"] and saved["dynamic_sampling"]["generator"].numel()
    _assert_resumed_exactly(full, resumed, checkpoint, names)
    # What the resumed steps did: the budget's next decays, a refill (the sampler's prompt of step 4 sums to 11),
    # BiCC's rows, and the pending reset then one more.
    logs = _step_logs(full)
    assert [logs[s]["curriculum/budget"] for s in (3, 4)] == [6, 4]
    assert logs[4]["dynamic_sampling/refill_rounds"] == 1
    assert all(logs[s]["bicc/rows_added"] > 0 for s in (3, 4))
    assert [r["step"] for r in resumed.extension("prorl").history] == [1, 2, 3]


def test_tree_opo_and_drafts_resume_exactly(tiny_model_path, tokenizer, tmp_path):
    # Tree-OPO draws each group's prefixes from (seed, step, process, group, question): nothing to save, and a resumed
    # run draws the same ones. Drafts keep a store, a batch count and the generator that picks refine groups.
    def build(folder, callbacks):
        args = make_config(folder, TreeOPOConfig, prefix_trees=SAMPLE_TREES, max_steps=4, save_strategy="steps",
                           save_steps=2, draft_source="self", draft_mode="mix", draft_ratio=0.5)  # fmt: skip
        return TreeOPOTrainer(model=str(tiny_model_path), reward_funcs="last_integer", args=args,
                              processing_class=tokenizer, callbacks=callbacks)  # fmt: skip

    full, resumed, checkpoint = _train_and_resume(build, tmp_path, at=2)
    _assert_resumed_exactly(full, resumed, checkpoint, ["treeopo", "drafts"])
    assert full.extension("treeopo").state_dict() == {}
    logs = _step_logs(full)
    assert {logs[s]["drafts/refine_fraction"] for s in (1, 2, 3, 4)} == {0.0, 1.0}  # drawn, not alternated
    assert resumed.extension("drafts").batches == 4 and len(resumed.extension("drafts").store.pool()) > 0


def test_hima_memory_resumes_exactly(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    def build(folder, callbacks):
        trainer = hima_trainer(tiny_model_path, tokenizer, folder, max_steps=3, save_strategy="steps", save_steps=2)
        _stateless_agents(monkeypatch, trainer, SCRIPTS)
        return trainer

    full, resumed, checkpoint = _train_and_resume(build, tmp_path, at=2)
    _assert_resumed_exactly(full, resumed, checkpoint, ["hima"])
    saved = torch.load(checkpoint / STATE_FILE, weights_only=True)["hima"]["memories"]["qa"]
    final = full.extension("hima").memories["qa"].state_dict()
    assert saved["entries"] and saved["history"] != final["history"]  # the memory changed after the checkpoint


def _stateless_agents(monkeypatch, trainer, scripts):
    """Each agent call writes one of its `scripts` (A, B and SUM filled from the question), picked by the step and the
    call's row: a fresh trainer at the same step writes what the uninterrupted one writes."""
    tokenizer = trainer.processing_class
    roles = {a.name: a.role for a in trainer.extension("hima").hierarchy.agents}
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate_stage(prompts, plan, *, num_generations, max_new_tokens=None, stop=(), rows=None):
        out = []
        for row, messages in enumerate(prompts):
            agent = next(name for name, role in roles.items() if messages[0]["content"].startswith(role))
            a, b = map(int, re.findall(r"\d+", messages[-1]["content"])[:2])
            text = scripts[agent][(trainer.state.global_step + row) % len(scripts[agent])]
            text = text.replace("SUM", str(a + b)).replace("A", str(a)).replace("B", str(b))
            out.append(tokenizer.encode(text, add_special_tokens=False) + [end])
        return out, None

    monkeypatch.setattr(trainer, "generate_stage", generate_stage)


def test_arpo_branching_resumes_exactly(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    # Each branch point is taken with probability 1/2 (arpo_alpha): the resumed run must continue ARPO's generator.
    tool_tokenizer = add_response_schema(copy.deepcopy(tokenizer))
    _script(monkeypatch, tool_tokenizer)

    def build(folder, callbacks):
        args = make_config(folder, GRPOExtConfig, max_completion_length=96, max_steps=2, save_strategy="steps",
                           save_steps=1, segment_by="tool_calls", arpo=True,
                           arpo_initial_rollouts=2, arpo_alpha=0.5, arpo_beta=0.0)  # fmt: skip
        return SegmentGRPOTrainer(model=str(tiny_model_path), reward_funcs=[get_reward("contains_solution")],
                                  args=args, train_dataset=tiny_dataset(8).map(lambda r: {"solution": "12"}),
                                  processing_class=tool_tokenizer, tools=[calculator], callbacks=callbacks)  # fmt: skip

    full, resumed, checkpoint = _train_and_resume(build, tmp_path, at=1)
    _assert_resumed_exactly(full, resumed, checkpoint, ["arpo"])
    # Every step gets the same scripted trajectories, so only the draws tell the steps apart: a resumed run that
    # restarted ARPO's generator would repeat step 1's branches at step 2.
    logs = _step_logs(full)
    assert logs[1]["arpo/branches"] != logs[2]["arpo/branches"]
