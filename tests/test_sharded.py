"""Sharded parameters: ProRL's resets and the curriculum under FSDP2 and DeepSpeed ZeRO-3, and the shipped accelerate
configs.

One `accelerate launch` of 2 CPU processes (gloo) per backend runs this module's `main()`: it trains 4 steps with ProRL
resets of the reference and the optimizer (every 2 steps, so applied before step 3) and a shrinking curriculum
budget, saves a checkpoint at step 4, resumes from it for a fifth step (which applies the reset requested at step 4),
trains a LoRA policy through a reference reset, and writes what it saw to JSON. The weights are compared whole,
gathered by torch's and DeepSpeed's own APIs, not by the code under test. benchmarks/gpu_check.sh runs the same
worker with ZeRO-3 on one GPU (`main(..., device="cuda")`, bf16).

accelerate 1.16 does not switch to FSDP on a CPU: `AcceleratorState` picks `DistributedType.FSDP` only from a
GPU-like distributed type (state.py: `elif self.distributed_type in [DistributedType.MULTI_GPU, ...]`), so
`accelerate launch` with an FSDP config on CPU silently trains with DDP. `_fsdp_on_cpu()` makes the process state
report MULTI_GPU before accelerate reads it; from there on, accelerate's and TRL's own FSDP2 code runs (`fully_shard`
on gloo, DTensor parameters, TRL's `prepare_fsdp` for the reference), and the worker checks that the parameters are
sharded. FSDP1 does not run on CPU (torch: "Inconsistent compute device and `device_id` on rank 0: cpu vs cpu:0"),
and ProRL's reference resets refuse it. DeepSpeed (0.19) runs ZeRO-3 on CPU as it is (its CPU accelerator, gloo).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "examples" / "accelerate"
# ZeRO-3 with every parameter partitioned (DeepSpeed keeps parameters under 1e5 elements whole by default: all of the
# tiny model's); bucket sizes small enough for its 32-wide layers. "auto" values come from the training arguments.
ZERO3_TEST_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 1024,
                          "stage3_prefetch_bucket_size": 1024},
}  # fmt: skip


def write_zero3_config(folder: Path) -> Path:
    """examples/accelerate/zero3.yaml with `ZERO3_TEST_CONFIG` as its DeepSpeed config; returns the YAML's path."""
    import yaml

    (folder / "zero3.json").write_text(json.dumps(ZERO3_TEST_CONFIG))
    config = yaml.safe_load((CONFIGS / "zero3.yaml").read_text())
    config["deepspeed_config"] = {"deepspeed_config_file": str(folder / "zero3.json"), "zero3_init_flag": True}
    (folder / "zero3.yaml").write_text(yaml.safe_dump(config))
    return folder / "zero3.yaml"


def _fsdp_on_cpu() -> None:
    """Make accelerate take its FSDP path on a CPU (see the module docstring): MULTI_CPU reads as MULTI_GPU."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    init = PartialState.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.MULTI_GPU

    PartialState.__init__ = __init__


def _whole(module, zero3: bool, as_registered: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter of `module`, whole, cloned (a collective: every process calls it).

    Under FSDP2: the sharded parameters, which are what persists (torch's state dict first puts them back in place of
    gathered ones: FSDP2 keeps a module's parameters gathered after a forward without backward when
    `reshard_after_forward` is false); or, `as_registered`, what the module holds now, touching nothing.
    """
    if zero3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {n: p.detach().clone() for n, p in module.named_parameters()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    if as_registered:
        return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for n, p in
                module.named_parameters()}  # fmt: skip
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    names = {n for n, _ in module.named_parameters()}
    return {n: v.clone() for n, v in state.items() if n in names}


def _is_sharded(param) -> bool:
    return type(param).__name__ == "DTensor" or hasattr(param, "ds_id")


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))[:5]
    return max(float((a[n].float() - b[n].float()).abs().max()) for n in a)


def _adapter_difference(weights: dict) -> float:
    """The largest difference between the LoRA adapter "default" (the policy's) and "ref"."""
    pairs = [(v, weights[n.replace(".default.", ".ref.")]) for n, v in weights.items() if ".default." in n]
    assert pairs
    return max(float((a.float() - b.float()).abs().max()) for a, b in pairs)


def _innermost(optimizer):
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def _zero3_without_shared_memory_kernels() -> None:
    """DeepSpeed's CPU accelerator compiles a shared-memory all-reduce on first use (about 100 s on 2 cores); without
    it DeepSpeed falls back to gloo, as it does on every platform but Linux ("let other platforms fall back to gloo",
    its op builder). The test runs on gloo, so CI needs no compiler and no op cache."""
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # `deepspeed.comm.torch` is torch


def main(out: Path, model_path: str, backend: str, device: str = "cpu") -> None:
    if backend == "fsdp2":
        _fsdp_on_cpu()
    else:
        _zero3_without_shared_memory_kernels()
    from peft import LoraConfig
    from transformers import PreTrainedTokenizerFast, TrainerCallback

    from tests.conftest import varied_reward
    from trl_grpo_ext import GRPOExtConfig, GRPOExtTrainer, ProRLResetCallback
    from trl_grpo_ext.testing import cpu_test_config_kwargs, tiny_dataset

    zero3 = backend == "zero3"
    rank = int(os.environ["RANK"])
    record: dict = {"rank": rank, "world_size": int(os.environ["WORLD_SIZE"]), "resets": []}
    # On a GPU (benchmarks/gpu_check.sh): bf16, as users train.
    on_gpu = {"bf16": True, "gradient_checkpointing": False, "report_to": "none", "logging_steps": 1,
              "disable_tqdm": True}  # fmt: skip
    device_kwargs = cpu_test_config_kwargs() if device == "cpu" else on_gpu

    class Probe(TrainerCallback):
        """Wraps the resets to look at the weights and the optimizer right before and after them."""

        def __init__(self):
            self.trainer, self.policy_at_reset = None, []

        def attach(self, trainer):
            self.trainer = trainer
            resets = trainer.extension("prorl")
            reset_reference, reset_optimizer = resets.reset_reference, resets.reset_optimizer_state

            def reference():
                policy, ref = self.policy_and_reference()
                before = _max_difference(
                    _whole(policy, zero3, as_registered=True), _whole(ref, zero3, as_registered=True)
                )
                record["resets"].append({"gathered_before": sorted({type(p).__name__ for p in ref.parameters()})})
                reset_reference()
                self.policy_at_reset.append(_whole(policy, zero3))
                after = _max_difference(self.policy_at_reset[-1], _whole(ref, zero3))
                record["resets"][-1].update(step=trainer.state.global_step, policy_minus_reference_before=before,
                                            policy_minus_reference_after=after)  # fmt: skip

            def optimizer():
                before = len(_innermost(trainer.optimizer).state)
                reset_optimizer()
                after = len(_innermost(trainer.optimizer).state)
                record["resets"][-1].update(optimizer_states_before=before, optimizer_states_after=after)

            resets.reset_reference, resets.reset_optimizer_state = reference, optimizer

        def policy_and_reference(self):
            unwrap = self.trainer.accelerator.unwrap_model
            return unwrap(self.trainer.model), unwrap(self.trainer.ref_model)

        def on_train_begin(self, args, state, control, **kwargs):
            policy, ref = self.policy_and_reference()
            param = dict(policy.named_parameters())["model.layers.0.mlp.up_proj.weight"]
            local = param.ds_tensor.numel() if zero3 else param.to_local().numel()
            record.setdefault("sharding", {"kind": type(param).__name__, "whole": param.ds_numel if zero3 else
                                           param.numel(), "local": local})  # fmt: skip
            if state.global_step > 0:  # resumed: the reference is the checkpoint's
                record["resumed_reference_minus_policy_at_reset"] = _max_difference(
                    _whole(ref, zero3), self.policy_at_reset[0]
                )

        def on_step_end(self, args, state, control, **kwargs):
            steps = [float(s["step"]) for s in _innermost(self.trainer.optimizer).state.values()]
            record.setdefault("adam_step", {})[state.global_step] = max(steps)

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)
    probe = Probe()

    def trainer(max_steps, callbacks, **kwargs):
        config = GRPOExtConfig(
            output_dir=str(out / "run"), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
            max_steps=max_steps, learning_rate=5e-2, lr_scheduler_type="constant", beta=0.1, seed=0,
            budget_start=8, budget_end=4, budget_decays=1, budget_total_steps=4, budget_caps_generation=True,
            **{**device_kwargs, "save_strategy": "steps", "save_steps": 4},
        )  # fmt: skip
        return GRPOExtTrainer(model=model_path, reward_funcs=varied_reward, args=config, processing_class=tokenizer,
                              train_dataset=tiny_dataset(16), callbacks=callbacks, **kwargs)  # fmt: skip

    first = trainer(4, [ProRLResetCallback(reset="both", every_n_steps=2), probe])
    record["distributed_type"] = str(first.accelerator.distributed_type)
    first.train()
    policy, _ = probe.policy_and_reference()
    record["policy_moved_after_reset"] = _max_difference(_whole(policy, zero3), probe.policy_at_reset[0])
    record["history"] = first.extension("prorl").history
    record["logs"] = first.state.log_history
    if rank == 0:
        saved = torch.load(out / "run" / "checkpoint-4" / "trl_grpo_ext_state.pt", weights_only=True)["prorl"]
        record["saved_reference_minus_policy_at_reset"] = _max_difference(saved["reference"], probe.policy_at_reset[0])

    second = trainer(5, [ProRLResetCallback(reset="both", every_n_steps=2), probe])
    second.train(resume_from_checkpoint=str(out / "run" / "checkpoint-4"))
    record["resumed_history"] = second.extension("prorl").history
    record["resumed_steps"] = second.state.global_step

    # LoRA: the "ref" adapter, made before the model was sharded, becomes a copy of the trained one at the reset.
    lora = trainer(3, [resets := ProRLResetCallback(reset="reference", every_n_steps=2)],
                   peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))  # fmt: skip
    reset_reference = resets.reset_reference

    def reference():
        policy = lora.accelerator.unwrap_model(lora.model)
        before = _adapter_difference(_whole(policy, zero3, as_registered=True))
        reset_reference()
        after = _adapter_difference(_whole(policy, zero3))
        ref = [p for n, p in policy.named_parameters() if ".ref." in n]
        record["lora_reset"] = {"step": lora.state.global_step, "before": before, "after": after,
                                "frozen": not any(p.requires_grad for p in ref),
                                "sharded": all(map(_is_sharded, ref))}  # fmt: skip

    resets.reset_reference = reference
    lora.train()
    record["lora_logs"] = lora.state.log_history
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    # Leave the process group before the interpreter exits: one CI run's rank aborted in the exit's teardown, after
    # its last trainer had finished ("terminate called without an active exception", gloo's threads).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _launch(tmp_path, tiny_model_path, backend: str, config: Path, *flags: str) -> list[dict]:
    out = tmp_path / backend
    out.mkdir()
    argv = [shutil.which("accelerate"), "launch", "--config_file", str(config), "--num_processes", "2",
            "--num_machines", "1", "--machine_rank", "0", "--mixed_precision", "no", "--main_process_port", "0",
            *flags, "-m", "tests.test_sharded", str(out), str(tiny_model_path), backend]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _check_resets_and_curriculum(
    ranks: list[dict], distributed_type: str, sharded_kind: str, kl_tolerance: float = 1e-6
) -> None:
    """What both backends must show. Under FSDP2 (`reshard_after_forward` false) the reference's parameters are still
    gathered from its last forward when the first reset comes (plain `Parameter`s, not DTensors): the reset must put
    the shards back before it copies. ZeRO-3's partitioned parameters are `Parameter`s as well."""
    for record in ranks:
        assert record["distributed_type"] == distributed_type
        # The parameters really are sharded: each process holds its part of a 64 x 32 weight.
        assert record["sharding"] == {"kind": sharded_kind, "whole": 2048, "local": 2048 // record["world_size"]}
        # Each reset (requested at the end of steps 2 and 4, applied before the next step's generation; the second in
        # the resumed run) made the whole reference equal to the whole policy, which had moved away from it, and
        # cleared the optimizer's state, which Adam then rebuilt: its step count goes 1, 2, (reset) 1, 2, (reset) 1.
        reset = {"reference": True, "optimizer": True, "reason": "every 2 steps"}
        assert record["history"] == [{"step": 2, **reset}]
        assert record["resumed_history"] == [{"step": 2, **reset}, {"step": 4, **reset}]
        assert [r["step"] for r in record["resets"]] == [2, 4]
        assert record["resets"][0]["gathered_before"] == ["Parameter"]
        for applied in record["resets"]:
            assert applied["policy_minus_reference_before"] > 1e-3 and applied["policy_minus_reference_after"] == 0.0
            assert applied["optimizer_states_before"] > 0 and applied["optimizer_states_after"] == 0
        assert record["adam_step"] == {"1": 1.0, "2": 2.0, "3": 1.0, "4": 2.0, "5": 1.0}
        # Training went on from there.
        assert record["policy_moved_after_reset"] > 1e-3
        logs = {log["step"]: log for log in record["logs"] if "kl" in log}
        assert logs[2]["kl"] > 1e-4 and logs[3]["kl"] == pytest.approx(0.0, abs=kl_tolerance) and logs[4]["kl"] > 0
        assert {s: logs[s]["prorl/resets"] for s in logs} == {1: 0, 2: 0, 3: 1, 4: 1}
        # The curriculum: budget 8 for steps 0-1, 4 for steps 2-3 (the log at step k shows step k - 1's), and
        # generation capped at it.
        assert {s: logs[s]["curriculum/budget"] for s in logs} == {1: 8, 2: 8, 3: 4, 4: 4}
        assert logs[3]["completions/max_length"] <= 4 and logs[4]["completions/max_length"] <= 4
        # Resumed from checkpoint-4: the reference of the first reset, read from the checkpoint into the shards.
        assert record["resumed_steps"] == 5 and record["resumed_reference_minus_policy_at_reset"] == 0.0
        # LoRA: the sharded "ref" adapter, frozen, became the trained adapter at the reset, and the KL went to 0.
        lora = record["lora_reset"]
        assert lora["step"] == 2 and lora["before"] > 1e-3 and lora["after"] == 0.0 and lora["frozen"]
        assert lora["sharded"]
        kl = {log["step"]: log["kl"] for log in record["lora_logs"] if "kl" in log}
        assert kl[2] > 1e-4 and kl[3] == pytest.approx(0.0, abs=kl_tolerance)
    # The checkpoint holds the whole reference: the policy at the reset.
    assert ranks[0]["saved_reference_minus_policy_at_reset"] == 0.0


def test_prorl_resets_and_curriculum_under_fsdp2_on_cpu(tmp_path, tiny_model_path):
    ranks = _launch(tmp_path, tiny_model_path, "fsdp2", CONFIGS / "fsdp2.yaml",
                    "--fsdp_cpu_ram_efficient_loading", "false", "--fsdp_sync_module_states", "false",
                    "--fsdp_reshard_after_forward", "false")  # fmt: skip
    _check_resets_and_curriculum(ranks, "DistributedType.FSDP", "DTensor")


def test_prorl_resets_and_curriculum_under_zero3_on_cpu(tmp_path, tiny_model_path):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.fail("DeepSpeed is not installed; `pip install deepspeed` (the `dev` extra) runs ZeRO-3 on CPU.")
    ranks = _launch(tmp_path, tiny_model_path, "zero3", write_zero3_config(tmp_path))
    _check_resets_and_curriculum(ranks, "DistributedType.DEEPSPEED", "Parameter")


# The shipped configs: (file, distributed type, ZeRO stage or FSDP version, machines).
SHIPPED = [
    ("multi_gpu.yaml", "MULTI_GPU", None, 1),
    ("zero2.yaml", "DEEPSPEED", 2, 1),
    ("zero3.yaml", "DEEPSPEED", 3, 1),
    ("fsdp2.yaml", "FSDP", 2, 1),
    ("multinode_zero3.yaml", "DEEPSPEED", 3, 2),
    ("multinode_fsdp2.yaml", "FSDP", 2, 2),
]


def test_accelerate_configs_load_with_accelerates_own_classes():
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(name for name, *_ in SHIPPED)
    readme = (CONFIGS / "README.md").read_text()
    flags = {action.dest for action in launch_command_parser()._actions}
    for name, distributed_type, level, machines in SHIPPED:
        config = load_config_from_file(str(CONFIGS / name))  # unknown top-level keys raise here
        assert isinstance(config, ClusterConfig) and config.distributed_type.value == distributed_type, name
        assert config.num_machines == machines and config.mixed_precision == "bf16", name
        # The nested sections are free dicts to accelerate: each key must be a flag of `accelerate launch`.
        assert set(config.fsdp_config) | set(config.deepspeed_config) <= flags, name
        args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(CONFIGS / name),
                                                                                 "train.py"]))  # fmt: skip
        kinds = (args.use_deepspeed, args.use_fsdp, args.multi_gpu)
        assert kinds == tuple(distributed_type == k for k in ("DEEPSPEED", "FSDP", "MULTI_GPU")), name
        if distributed_type == "DEEPSPEED":
            assert int(args.zero_stage) == level, name
        if distributed_type == "FSDP":
            assert int(args.fsdp_version) == level, name
        if machines > 1:  # every process of every machine; rank 0's address
            assert args.num_processes % machines == 0 and args.main_process_ip and args.machine_rank == 0, name
        assert f"]({name})" in readme, f"examples/accelerate/README.md does not link {name}"


def test_optimizer_reset_reaches_the_optimizer_inside_deepspeeds():
    """accelerate wraps the trainer's optimizer and a ZeRO optimizer wraps the torch one: the state is the innermost's.

    DeepSpeed's FusedAdam (its GPU optimizer) also counts steps per parameter group and starts a new state from that
    count, so the count goes too. The stand-ins are the two wrappers' `optimizer` attributes, nothing more.
    """
    from types import SimpleNamespace

    from trl_grpo_ext import ProRLResetCallback

    param = torch.nn.Parameter(torch.ones(2))
    adam = torch.optim.Adam([param])
    param.grad = torch.ones(2)
    adam.step()
    adam.param_groups[0]["step"] = 1  # what FusedAdam keeps
    zero = SimpleNamespace(optimizer=adam, swap_optimizer=False)
    resets = ProRLResetCallback(reset="optimizer", every_n_steps=1)
    resets.trainer = SimpleNamespace(optimizer=SimpleNamespace(optimizer=zero))
    assert len(adam.state) == 1
    resets.reset_optimizer_state()
    assert len(adam.state) == 0 and "step" not in adam.param_groups[0]
    zero.swap_optimizer = True  # ZeRO-3's NVMe offload keeps the state in swap files
    with pytest.raises(NotImplementedError, match="offload_optimizer.device: nvme"):
        resets.reset_optimizer_state()


def test_lora_reference_adapter_is_made_at_setup_and_refused_on_fsdp1_or_a_sharded_model(tiny_model_path):
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trl_grpo_ext import ProRLResetCallback

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), LoraConfig(r=2))
    accelerator = SimpleNamespace(unwrap_model=lambda m: m, state=SimpleNamespace(fsdp_plugin=SimpleNamespace(
        fsdp_version=1)))  # fmt: skip
    trainer = SimpleNamespace(model=model, is_fsdp_enabled=True, accelerator=accelerator)
    with pytest.raises(ValueError, match="fsdp_version: 1.*set fsdp_version: 2"):
        ProRLResetCallback(reset="reference", every_n_steps=1).setup(trainer)
    ProRLResetCallback(reset="optimizer", every_n_steps=1).setup(trainer)  # the optimizer's state is not sharded

    # Unsharded, the "ref" adapter is made at once: a frozen copy of the policy's, drawn without shifting the RNG.
    trainer.is_fsdp_enabled = False
    rng = torch.get_rng_state()
    ProRLResetCallback(reset="both", every_n_steps=1).setup(trainer)
    assert torch.equal(torch.get_rng_state(), rng)
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n.replace(".default.", ".ref.")], p) and not params[n.replace(".default.", ".ref.")]
               .requires_grad for n, p in params.items() if ".default." in n)  # fmt: skip
    model.delete_adapter("ref")
    next(p for n, p in model.named_parameters() if ".default." in n).ds_id = 0  # how ZeRO-3 marks its parameters
    with pytest.raises(RuntimeError, match="already sharded.*when the trainer is built"):
        ProRLResetCallback(reset="both", every_n_steps=1).setup(trainer)
    assert "ref" not in model.peft_config


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
