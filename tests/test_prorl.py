"""ProRL: reference and optimizer resets (full fine-tuning, LoRA), resume, triggers, stop penalty, recipe."""

from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig
from transformers import BitsAndBytesConfig, TrainerCallback

from trl_grpo_ext import GRPOExtTrainer, ProRLConfig, ProRLResetCallback, ProRLTrainer, TrainerInputs, get_reward
from trl_grpo_ext.testing import cpu_test_config_kwargs, tiny_dataset

from .conftest import make_config, varied_reward


def _trainer(tiny_model_path, tokenizer, tmp_path, callback, peft=False, four_bit=False, **overrides):
    overrides = {"beta": 0.1, "max_steps": 4, **overrides}
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32) if four_bit else None
    return GRPOExtTrainer(
        model=str(tiny_model_path),
        reward_funcs=varied_reward,
        args=make_config(tmp_path, **overrides),
        train_dataset=tiny_dataset(16),
        processing_class=tokenizer,
        callbacks=[callback] if callback else None,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if peft else None,
        quantization_config=quantization,
    )


def _logged(trainer, key):
    return {log["step"]: log[key] for log in trainer.state.log_history if key in log}


@pytest.mark.parametrize("peft, four_bit", [(False, False), (True, False), (True, True)], ids=["full", "lora", "4bit"])
def test_kl_is_zero_right_after_a_reference_reset(tiny_model_path, tokenizer, tmp_path, peft, four_bit):
    callback = ProRLResetCallback(reset="reference", every_n_steps=2)
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, callback, peft=peft, four_bit=four_bit,
                       learning_rate=5e-2)  # fmt: skip
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    trainer.train()
    kl = _logged(trainer, "kl")
    # Step 2 ends 2 steps after the start: a reset is requested and applied before step 3's generation.
    assert kl[2] > 1e-4, "the policy must have moved away from the reference for this test to mean anything"
    assert kl[3] == pytest.approx(0.0, abs=1e-6)
    assert kl[4] > kl[3]
    assert trainer.extension("prorl").history == [
        {"step": 2, "reference": True, "optimizer": False, "reason": "every 2 steps"}
    ]
    assert _logged(trainer, "prorl/resets") == {1: 0, 2: 0, 3: 1, 4: 1}
    assert _logged(trainer, "prorl/steps_since_reset") == {1: 1, 2: 2, 3: 1, 4: 2}
    if peft:
        after = dict(trainer.model.named_parameters())
        assert all(torch.equal(base_before[n], after[n]) for n in base_before if n in after), "a base weight moved"
        ref = [n for n in after if ".ref." in n]
        assert ref and not any(after[n].requires_grad for n in ref)


def test_lora_reference_adapter_is_a_frozen_copy_at_the_reset(tiny_model_path, tokenizer, tmp_path):
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, None, peft=True, max_steps=2, learning_rate=5e-2)
    trainer.train()
    trainer.add_callback(resets := ProRLResetCallback(reset="reference", every_n_steps=100))
    resets.reset_reference()
    params = dict(trainer.model.named_parameters())
    policy = {n: p for n, p in params.items() if ".default." in n}
    assert policy
    for name, value in policy.items():
        ref = params[name.replace(".default.", ".ref.")]
        assert torch.equal(ref, value) and not ref.requires_grad and ref.data_ptr() != value.data_ptr()
    # TRL's reference forward now uses the "ref" adapter: training moves "default", not "ref".
    snapshot = {n: p.detach().clone() for n, p in params.items() if ".ref." in n}
    trainer.args.max_steps = 4
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(snapshot[n], after[n]) for n in snapshot)


class OptimizerProbe(TrainerCallback):
    def __init__(self):
        self.trainer, self.steps = None, {}

    def attach(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        optimizer = self.trainer.optimizer.optimizer
        self.steps[state.global_step] = max(float(s["step"]) for s in optimizer.state.values())


def test_optimizer_reset_empties_then_rebuilds_the_state(tiny_model_path, tokenizer, tmp_path):
    probe = OptimizerProbe()
    trainer = _trainer(tiny_model_path, tokenizer, tmp_path, ProRLResetCallback(reset="optimizer", every_n_steps=2),
                       beta=0.0)  # fmt: skip
    trainer.add_callback(probe)
    sizes = []
    resets = trainer.extension("prorl")
    original = resets.reset_optimizer_state

    def spy():
        original()
        sizes.append(len(trainer.optimizer.optimizer.state))

    resets.reset_optimizer_state = spy
    trainer.train()
    assert sizes == [0]  # empty right after the reset (applied at the start of step 3)...
    assert probe.steps == {1: 1.0, 2: 2.0, 3: 1.0, 4: 2.0}  # ...then rebuilt: Adam counts from 1 again


class ReferenceProbe(TrainerCallback):
    """Records the reference adapter when training (re)starts and at the end of each step."""

    def __init__(self):
        self.trainer, self.at_start, self.at_step = None, None, {}

    def attach(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.at_start = self.trainer.extension("prorl").reference_tensors()

    def on_step_end(self, args, state, control, **kwargs):
        self.at_step[state.global_step] = self.trainer.extension("prorl").reference_tensors()


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_resume_restores_resets_and_reference(tiny_model_path, tokenizer, tmp_path, peft):
    def run(folder, max_steps=6, resume=None):
        probe = ReferenceProbe()
        trainer = _trainer(
            tiny_model_path,
            tokenizer,
            folder,
            ProRLResetCallback(reset="both", every_n_steps=2),
            peft=peft,
            max_steps=max_steps,
            save_strategy="steps",
            save_steps=3,
            learning_rate=5e-2,
            lr_scheduler_type="constant",
        )  # fmt: skip (same lr whatever max_steps)
        trainer.add_callback(probe)
        trainer.train(resume_from_checkpoint=resume)
        return trainer, probe

    full, full_probe = run(tmp_path / "full")
    run(tmp_path / "part", max_steps=3)
    resumed, resumed_probe = run(tmp_path / "part", resume=str(tmp_path / "part" / "out" / "checkpoint-3"))
    # The same resets, at the same steps, as the uninterrupted run.
    assert [r["step"] for r in full.extension("prorl").history] == [2, 4]
    assert resumed.extension("prorl").history == full.extension("prorl").history
    # The resumed run starts from the reference the uninterrupted run had at step 3 (the policy of the reset at
    # step 2), not from the base model.
    expected = full_probe.at_step[3]
    assert expected and resumed_probe.at_start.keys() == expected.keys()
    for name in expected:
        assert torch.equal(resumed_probe.at_start[name], expected[name]), name
    # And the run's own second reset happened after the resume.
    assert any(not torch.equal(resumed_probe.at_step[6][name], expected[name]) for name in expected)
    # Every later step is the uninterrupted run's, bit for bit: rewards and KL, the reference, the policy.
    assert _logged(resumed, "reward") == _logged(full, "reward") and _logged(resumed, "kl") == _logged(full, "kl")
    for step in (4, 5, 6):
        assert all(torch.equal(resumed_probe.at_step[step][n], full_probe.at_step[step][n]) for n in expected), step
    ours, theirs = dict(resumed.model.named_parameters()), dict(full.model.named_parameters())
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in theirs)


def _stub(callback, beta=0.1, eval_strategy="steps"):
    """The callback with a stand-in trainer that records reset requests instead of applying them."""
    requests = []
    callback.trainer = SimpleNamespace(beta=beta, log_metric=lambda *a, **k: None)
    callback.request = lambda **kw: requests.append(kw)
    return callback, requests


def _inputs(beta=0.1, eval_strategy="steps"):
    return TrainerInputs(SimpleNamespace(beta=beta, eval_strategy=eval_strategy), None, None, None, None, None, None)


def test_eval_stall_and_kl_triggers():
    callback, requests = _stub(ProRLResetCallback.v1(patience=2))
    for value in [0.5, 0.6, 0.6, 0.55]:  # improves, improves, stalls once, stalls twice -> reset
        callback.on_evaluate(None, None, None, metrics={"eval_reward": value})
    assert requests == [{"reference": True, "optimizer": True, "reason": "eval_reward did not improve on 0.6 for 2 "
                                                                          "evaluations"}]  # fmt: skip
    assert (callback.best, callback.bad_evaluations) == (0.6, 0)

    callback, requests = _stub(ProRLResetCallback.v2(every_n_steps=1000, kl_threshold=0.05))
    callback.on_log(None, None, None, logs={"kl": 0.01})
    callback.on_log(None, None, None, logs={"kl": 0.08})
    assert requests == [{"reference": True, "optimizer": False, "reason": "kl 0.08 > 0.05"}]


def test_callback_errors_name_the_fix(tiny_model_path, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="no trigger"):
        ProRLResetCallback()
    with pytest.raises(ValueError, match="reset='all'"):
        ProRLResetCallback(reset="all", every_n_steps=2)
    with pytest.raises(ValueError, match="beta=0.0 keeps none; set beta > 0"):
        ProRLResetCallback.v2().check(_inputs(beta=0.0))
    with pytest.raises(ValueError, match="eval_strategy='no'"):
        ProRLResetCallback.v1().check(_inputs(eval_strategy="no"))
    # Before any model loads: the model path does not exist.
    with pytest.raises(ValueError, match="beta=0.0 keeps none"):
        _trainer(tmp_path / "no-model", tokenizer, tmp_path, ProRLResetCallback.v2(), beta=0.0)
    with pytest.raises(ValueError, match="two extensions are named 'prorl'"):
        GRPOExtTrainer(model=str(tiny_model_path), reward_funcs=varied_reward, args=make_config(tmp_path, beta=0.1),
                       train_dataset=tiny_dataset(4), processing_class=tokenizer,
                       callbacks=[ProRLResetCallback.v2(), ProRLResetCallback.v1()])  # fmt: skip


def test_stop_penalty_gets_the_trainers_stop_tokens(tiny_model_path, tokenizer, tmp_path):
    penalty = get_reward("stop_penalty", penalty=-0.5)
    GRPOExtTrainer(model=str(tiny_model_path), reward_funcs=[penalty], args=make_config(tmp_path),
                   train_dataset=tiny_dataset(4), processing_class=tokenizer)  # fmt: skip
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eos in penalty.eos_token_ids
    assert penalty(completion_ids=[[5, eos], [5, 6], []]) == [0.0, -0.5, -0.5]
    with pytest.raises(ValueError, match="penalty=1"):
        get_reward("stop_penalty", penalty=1)


def test_prorl_trainer_recipe_defaults_and_training(tiny_model_path, tokenizer, tmp_path):
    defaults = ProRLConfig(output_dir=str(tmp_path / "d"), **cpu_test_config_kwargs())
    assert (defaults.epsilon, defaults.epsilon_high, defaults.temperature, defaults.num_generations) == (
        0.2,
        0.4,
        1.2,
        16,
    )
    assert (defaults.learning_rate, defaults.loss_type, defaults.dynamic_sampling) == (2e-6, "dapo", True)
    assert defaults.lr_scheduler_type == "constant" and 0 < defaults.beta <= 1e-3
    args = ProRLConfig(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                       max_completion_length=8, max_steps=2, learning_rate=1e-2, **cpu_test_config_kwargs())  # fmt: skip
    trainer = ProRLTrainer(model=str(tiny_model_path), reward_funcs=[varied_reward, "stop_penalty"], args=args,
                           train_dataset=tiny_dataset(16), processing_class=tokenizer)  # fmt: skip
    resets = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, ProRLResetCallback)]
    assert len(resets) == 1 and resets[0].reset == "reference" and resets[0].every_n_steps == 300
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert "dynamic_sampling/kept_fraction" in trainer.state.log_history[0]
    assert "rewards/stop_penalty/mean" in trainer.state.log_history[0]
