"""ProRL's reference and optimizer resets (arXiv 2505.24864; v2: arXiv 2507.12507), and its stop penalty.

Prolonged RL drifts: the KL term to a stale reference comes to dominate the loss, and validation stalls. ProRL
hard-resets the reference policy to the current policy and re-initialises the optimizer state when that happens
(v1); its v2 resets only the reference, on a schedule or on a KL spike. The recipe's other parts (decoupled clip,
small KL, temperature 1.2, 16 rollouts, constant lr, dapo loss, dynamic sampling) are `ProRLConfig`'s defaults.
"""

from __future__ import annotations

import logging
import math

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import TrainerCallback

from ..extension import Extension, Method, TrainerInputs, register_method
from ..rewards import register_reward

logger = logging.getLogger(__name__)

RESETS = ("both", "reference", "optimizer")


class ProRLResetCallback(Extension, TrainerCallback):
    """Reset the reference policy and/or the optimizer state when a trigger fires.

    Triggers (any combination; at least one): `every_n_steps`; `patience` evaluations without improvement of
    `metric` (by more than `min_delta`); the logged mean KL above `kl_threshold`. A fired trigger requests the reset,
    and it is applied at the start of the next generation batch, so a batch is never generated under one reference
    and scored against another. History, counters and the reset reference survive `resume_from_checkpoint`.

    What a reset does: full fine-tuning overwrites the reference model with the policy's weights; LoRA (4-bit bases
    included) makes the adapter "ref", which TRL uses as the reference when present, a frozen copy of the trained
    adapter (the adapter is made when the trainer is built, a copy of the initial one); an optimizer reset clears
    Adam's moments and step counts. Under FSDP2 and DeepSpeed ZeRO-3 the same happens shard by shard.

    Logs `prorl/resets` (resets applied so far) and `prorl/steps_since_reset`. After training, `history` lists the
    applied resets (`trainer.extension("prorl").history`).

    Presets: `ProRLResetCallback.v1(...)` resets both when validation stalls; `ProRLResetCallback.v2(...)` resets the
    reference every N steps (200-500 in the paper) or on a KL spike, keeping the optimizer.

    >>> callback = ProRLResetCallback.v2(every_n_steps=300)
    >>> callback.reset, callback.every_n_steps
    ('reference', 300)
    """

    name = "prorl"

    def __init__(
        self,
        reset: str = "both",
        every_n_steps: int | None = None,
        patience: int | None = None,
        metric: str = "eval_reward",
        greater_is_better: bool = True,
        min_delta: float = 0.0,
        kl_threshold: float | None = None,
    ):
        if reset not in RESETS:
            raise ValueError(f"reset={reset!r} is not one of {RESETS}.")
        for name, value in (("every_n_steps", every_n_steps), ("patience", patience)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a whole number >= 1, or None to switch it off.")
        if kl_threshold is not None and not kl_threshold > 0:
            raise ValueError(f"kl_threshold={kl_threshold!r} must be > 0, or None to switch it off.")
        if every_n_steps is None and patience is None and kl_threshold is None:
            raise ValueError(
                "ProRLResetCallback has no trigger: set every_n_steps, patience (with evaluation) or kl_threshold."
            )
        self.reset, self.every_n_steps, self.patience = reset, every_n_steps, patience
        self.metric, self.greater_is_better, self.min_delta = metric, greater_is_better, min_delta
        self.kl_threshold = kl_threshold
        self.best: float | None = None
        self.bad_evaluations = 0
        self.history: list[dict] = []  # applied resets: step, reference, optimizer, reason
        self.pending: dict | None = None

    @classmethod
    def v1(cls, patience: int = 3, metric: str = "eval_reward", **kwargs) -> ProRLResetCallback:
        """ProRL v1: reset reference and optimizer when `metric` has not improved for `patience` evaluations."""
        return cls(reset="both", patience=patience, metric=metric, **kwargs)

    @classmethod
    def v2(cls, every_n_steps: int = 300, kl_threshold: float | None = None, **kwargs) -> ProRLResetCallback:
        """ProRL v2: reset the reference only, every `every_n_steps` steps or when the KL exceeds `kl_threshold`."""
        return cls(reset="reference", every_n_steps=every_n_steps, kl_threshold=kl_threshold, **kwargs)

    def check(self, inputs: TrainerInputs) -> None:
        args = inputs.args
        beta = getattr(args, "beta", 0.0)
        if self.reset != "optimizer" and beta == 0.0:
            raise ValueError(
                f"ProRLResetCallback(reset={self.reset!r}) resets the reference policy, but beta=0.0 keeps none; set "
                "beta > 0 (a small KL penalty, e.g. 1e-4), or reset='optimizer'."
            )
        if self.kl_threshold is not None and beta == 0.0:
            raise ValueError(
                "ProRLResetCallback(kl_threshold=...) watches the KL, which is logged only when beta > 0."
            )
        if self.patience is not None and str(getattr(args, "eval_strategy", "no")) in ("no", "IntervalStrategy.NO"):
            raise ValueError(
                f"ProRLResetCallback(patience={self.patience}) watches {self.metric!r} at evaluations, but "
                "eval_strategy='no'; set eval_strategy='steps' with eval_steps and an eval_dataset."
            )

    # ---- requests and their application
    def request(self, reference: bool = True, optimizer: bool = False, reason: str = "") -> None:
        """Ask for a reset at the next generation batch; requests made before then merge."""
        if reference and self.trainer.beta == 0.0:
            raise ValueError("a reference reset was requested, but beta=0.0: TRL then keeps no reference policy.")
        pending = self.pending or {"reference": False, "optimizer": False, "reasons": []}
        pending["reference"] |= reference
        pending["optimizer"] |= optimizer
        pending["reasons"].append(reason)
        self.pending = pending

    def before_batch(self, mode: str) -> None:
        if mode != "train" or self.pending is None:
            return
        pending, self.pending = self.pending, None
        if pending["reference"]:
            self.reset_reference()
        if pending["optimizer"]:
            self.reset_optimizer_state()
        record = {
            "step": self.trainer.state.global_step,
            "reference": pending["reference"],
            "optimizer": pending["optimizer"],
            "reason": "; ".join(r for r in pending["reasons"] if r),
        }
        self.history.append(record)
        logger.info(f"reset at step {record['step']}: {record}")

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if self.reset == "optimizer":
            return
        plugin = trainer.accelerator.state.fsdp_plugin if trainer.is_fsdp_enabled else None
        if plugin is not None and plugin.fsdp_version != 2:
            raise ValueError(
                f"ProRLResetCallback(reset={self.reset!r}) copies the policy into the reference, which it does on "
                f"FSDP2's sharded parameters, but the accelerate config has fsdp_version: {plugin.fsdp_version}; set "
                "fsdp_version: 2 (examples/accelerate/fsdp2.yaml), or reset='optimizer'."
            )
        model = trainer.accelerator.unwrap_model(trainer.model)
        if _is_peft(model) and "ref" not in model.peft_config:
            self._add_reference_adapter(model)

    def _add_reference_adapter(self, model) -> None:
        # A sharded model cannot take new parameters, so the "ref" adapter is made here, before the trainer prepares
        # the model, as TRL's GRPOTrainer.__init__ makes it for a PeftModel it is given: `model.add_adapter("ref",
        # default_config)`, then `ref_param.data.copy_(param.data)` for each ".default." parameter.
        active = model.active_adapter
        if any(_is_sharded(p) for n, p in model.named_parameters() if f".{active}." in n):
            raise RuntimeError(
                "ProRLResetCallback needs a frozen 'ref' adapter, which cannot be added to a model that is already "
                "sharded (FSDP, ZeRO-3): pass the callback when the trainer is built (callbacks=[...])."
            )
        # Its initial weights are overwritten at once: drawing them must not shift the global RNG, which sampling and
        # shuffling use (PEFT makes the new layers on the CPU, then moves them to the base layer's device).
        with torch.random.fork_rng(devices=[]):
            model.add_adapter("ref", model.peft_config[active])
        _copy_parameters([(source, target) for _, source, target in self._reference_pairs()], zero3=False)
        for _, _, target in self._reference_pairs():
            target.requires_grad_(False)

    def _reference_pairs(self) -> list[tuple[str, torch.nn.Parameter, torch.nn.Parameter]]:
        """(reference name, policy parameter, reference parameter): the active adapter's and the "ref" adapter's
        under LoRA, else the policy's and the reference model's, in order (the reference model is built from the
        policy's path or config, so the two name the same parameters)."""
        trainer = self.trainer
        model = trainer.accelerator.unwrap_model(trainer.model)
        if _is_peft(model):
            # TRL's reference under LoRA: `use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else
            # None)` (GRPOTrainer._generate_and_score_completions).
            active, pairs = model.active_adapter, []
            for name, param in model.named_parameters():
                if f".{active}." in name:
                    ref_name = name.replace(f".{active}.", ".ref.")
                    pairs.append((ref_name, param, model.get_parameter(ref_name)))
            return pairs
        if trainer.ref_model is None:
            raise ValueError("this trainer has no reference policy to reset (beta=0.0?).")
        ref = trainer.accelerator.unwrap_model(trainer.ref_model)
        policy, reference = list(model.named_parameters()), list(ref.named_parameters())
        if [n for n, _ in policy] != [n for n, _ in reference]:
            raise RuntimeError(
                f"the reference model's parameters ({len(reference)}) are not the policy's ({len(policy)}), name for "
                "name: ProRL copies the policy into TRL's reference, which TRL builds from the policy's path."
            )
        return [(name, source, target) for (name, source), (_, target) in zip(policy, reference, strict=True)]

    def _resharded(self) -> None:
        # With `reshard_after_forward: false`, FSDP2 keeps a module's parameters gathered after a forward that no
        # backward follows (TRL's reference computing its log-probs), registered as plain tensors in place of the
        # DTensor shards; a copy into them fails ("aten.copy_.default got mixed torch.Tensor and DTensor") and would
        # not reach the shards. `FSDPModule.reshard()` (not recursive) puts the shards back first.
        for module in (self.trainer.model, self.trainer.ref_model):
            for sub in module.modules() if module is not None else ():
                if isinstance(sub, FSDPModule):
                    sub.reshard()

    def reset_reference(self) -> None:
        """Make the reference policy a frozen copy of the current policy, now.

        Works on whole parameters, FSDP2 shards (each process copies its own shard: TRL's `prepare_fsdp` shards the
        reference like the policy) and ZeRO-3 partitions (gathered one pair at a time).
        """
        self._resharded()
        pairs = [(source, target) for _, source, target in self._reference_pairs()]
        _copy_parameters(pairs, zero3=_is_zero3(self.trainer))

    def reset_optimizer_state(self) -> None:
        """Clear the optimizer's state (Adam moments and step counts); it is rebuilt at the next optimizer step.

        The state lives in the innermost optimizer: accelerate wraps the trainer's (`AcceleratedOptimizer.optimizer`,
        `DeepSpeedOptimizerWrapper.optimizer`), and DeepSpeed's ZeRO optimizers wrap the torch one that steps their
        fp32 partitions (`.optimizer`; their `state` property is that optimizer's).
        """
        optimizer = self.trainer.optimizer
        while hasattr(optimizer, "optimizer"):
            if getattr(optimizer, "swap_optimizer", False):
                raise NotImplementedError(
                    "optimizer resets with ZeRO-3's NVMe optimizer offload (offload_optimizer.device: nvme) are not "
                    "supported: the state lives in swap files; offload to 'cpu' or reset='reference'."
                )
            optimizer = optimizer.optimizer
        if optimizer is None:
            return
        optimizer.state.clear()
        for group in optimizer.param_groups:
            # DeepSpeed's FusedAdam counts steps per group and starts a new state from it ("state['step'] =
            # group.get('step', 0)"): without this its bias correction would not restart.
            group.pop("step", None)

    def reference_tensors(self) -> dict[str, torch.Tensor]:
        """The reference policy's weights (the "ref" adapter under LoRA), whole, on the CPU of the main process.

        Under FSDP and ZeRO-3 every process must call it (each weight is gathered in turn); the others get {}.
        """
        self._resharded()
        zero3, keep = _is_zero3(self.trainer), self.trainer.accelerator.is_main_process
        tensors = {name: _full_cpu(target, zero3, keep) for name, _, target in self._reference_pairs()}
        return tensors if keep else {}

    def load_reference_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load `reference_tensors()`'s result (read by every process) into the reference, shard by shard."""
        self._resharded()
        targets = {name: target for name, _, target in self._reference_pairs()}
        if tensors.keys() != targets.keys():
            raise ValueError(
                f"the checkpoint's ProRL reference has {len(tensors)} weights, this trainer's reference "
                f"{len(targets)}; missing: {sorted(targets.keys() - tensors.keys())[:3]}, unexpected: "
                f"{sorted(tensors.keys() - targets.keys())[:3]}. Resume with the model and LoRA settings it was "
                "saved with."
            )
        zero3 = _is_zero3(self.trainer)
        for name, target in targets.items():
            _load_full(target, tensors[name], zero3)

    # ---- triggers
    def _request(self, reason: str) -> None:
        if self.pending is None:
            self.request(reference=self.reset != "optimizer", optimizer=self.reset != "reference", reason=reason)

    def _last_reset_step(self) -> int:
        return self.history[-1]["step"] if self.history else 0

    def on_step_end(self, args, state, control, **kwargs):
        if self.every_n_steps is not None and state.global_step - self._last_reset_step() >= self.every_n_steps:
            self._request(f"every {self.every_n_steps} steps")
        self.log("resets", len(self.history), mode="train")
        self.log("steps_since_reset", state.global_step - self._last_reset_step(), mode="train")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.patience is None or not metrics or self.metric not in metrics:
            return
        value = float(metrics[self.metric])
        sign = 1.0 if self.greater_is_better else -1.0
        if self.best is None or math.isnan(self.best) or sign * (value - self.best) > self.min_delta:
            self.best, self.bad_evaluations = value, 0
            return
        self.bad_evaluations += 1
        if self.bad_evaluations >= self.patience:
            self._request(f"{self.metric} did not improve on {self.best:.4g} for {self.patience} evaluations")
            self.bad_evaluations = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.kl_threshold is not None and logs and logs.get("kl", 0.0) > self.kl_threshold:
            self._request(f"kl {logs['kl']:.4g} > {self.kl_threshold}")

    # ---- checkpoints
    def state_dict(self) -> dict:
        state = {"history": self.history, "pending": self.pending, "best": self.best,
                 "bad_evaluations": self.bad_evaluations}  # fmt: skip
        if any(r["reference"] for r in self.history):
            state["reference"] = self.reference_tensors()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.history, self.pending = list(state["history"]), state["pending"]
        self.best, self.bad_evaluations = state["best"], state["bad_evaluations"]
        if "reference" in state:
            self.load_reference_tensors(state["reference"])


def _is_peft(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _is_zero3(trainer) -> bool:
    # TRL's `prepare_deepspeed` keeps stage 3 for the reference ("If ZeRO-3 is used, we shard both the active and
    # reference model"); at stages 0-2 both hold whole parameters.
    return trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3


def _is_sharded(param: torch.Tensor) -> bool:
    return isinstance(param, DTensor) or hasattr(param, "ds_id")


@torch.no_grad()
def _copy_parameters(pairs: list[tuple[torch.Tensor, torch.Tensor]], zero3: bool) -> None:
    """Copy each (source, target) parameter pair in place: whole tensors, FSDP2 DTensors, or ZeRO-3 partitions."""
    if not zero3:
        # Whole tensors, or FSDP2 DTensors sharded alike: TRL's `prepare_fsdp` shards the reference with the policy's
        # plugin settings and mesh (`fully_shard(model, **fsdp2_kwargs)`, `"mesh": mesh[...] if mesh is not None else
        # None`), and FSDP2 shards every parameter on dim 0 whatever module it is wrapped with, so DTensor's copy_
        # copies each process's own shard.
        for source, target in pairs:
            target.copy_(source)
        return
    import deepspeed

    # TRL's SyncRefModelCallback.sync_target_model gathers both whole models at once ("with
    # deepspeed.zero.GatheredParameters(list(model.parameters()) + list(target_model.parameters()), modifier_rank=0):
    # if deepspeed.comm.get_rank() == 0: ..."), twice the model on every device; one pair at a time gathers two
    # parameters. On leaving, rank 0's values are partitioned back to every process.
    for source, target in pairs:
        with deepspeed.zero.GatheredParameters([source, target], modifier_rank=0):
            if deepspeed.comm.get_rank() == 0:
                target.copy_(source)


@torch.no_grad()
def _full_cpu(param: torch.Tensor, zero3: bool, keep: bool) -> torch.Tensor | None:
    """The whole parameter, copied to the CPU where `keep`; every process must call it for a sharded parameter."""
    if zero3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.detach().to("cpu", copy=True) if keep else None
    if isinstance(param, DTensor):
        full = param.full_tensor()  # an all-gather: a collective
        return full.to("cpu", copy=True) if keep else None
    return param.detach().to("cpu", copy=True) if keep else None


@torch.no_grad()
def _load_full(param: torch.Tensor, value: torch.Tensor, zero3: bool) -> None:
    """Copy a whole `value`, which every process holds, into `param`, whole or sharded."""
    if zero3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if deepspeed.comm.get_rank() == 0:
                param.copy_(value)
    elif isinstance(param, DTensor):
        # src_data_rank=None: each process cuts its own shard out of its copy, no communication.
        value = value.to(device=param.device, dtype=param.dtype)
        param.copy_(distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None))
    else:
        param.copy_(value)


class StopPenalty:
    """`penalty` for a completion whose last token is not a stop token (it hit the length cap), else 0.0.

    ProRL's "penalise responses that never stop". `eos_token_ids` defaults to the trainer's stop tokens (TRL's
    `eos_token_ids`), handed over by our trainers; pass them yourself to use this reward in plain TRL.

    >>> StopPenalty(penalty=-1.0, eos_token_ids=[2])(completion_ids=[[5, 2], [5, 6]])
    [0.0, -1.0]
    """

    def __init__(self, penalty: float = -1.0, eos_token_ids: list[int] | None = None):
        if float(penalty) > 0:
            raise ValueError(f"stop_penalty: penalty={penalty} must be <= 0 (it is a penalty); e.g. -1.0.")
        self.penalty = float(penalty)
        self.eos_token_ids = eos_token_ids
        self.__name__ = "stop_penalty"

    def __call__(self, completion_ids, **kwargs) -> list[float]:
        if self.eos_token_ids is None:
            raise ValueError("stop_penalty needs eos_token_ids: pass them, or use it in a trl_grpo_ext trainer.")
        stops = set(self.eos_token_ids)
        return [0.0 if ids and ids[-1] in stops else self.penalty for ids in completion_ids]


register_reward("stop_penalty", StopPenalty, factory=True)
register_method(Method(name="prorl", title="ProRL (Prolonged Reinforcement Learning)", arxiv="2505.24864",
                       trainer="ProRLTrainer", config="ProRLConfig"))  # fmt: skip
