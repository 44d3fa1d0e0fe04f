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
    adapter; an optimizer reset clears Adam's moments and step counts.

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

    def reset_reference(self) -> None:
        """Make the reference policy a frozen copy of the current policy, now."""
        from peft import PeftModel

        trainer = self.trainer
        if trainer.is_fsdp_enabled or (
            trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3
        ):
            raise NotImplementedError("reference resets with sharded parameters (FSDP, ZeRO-3) are not supported yet.")
        model = trainer.accelerator.unwrap_model(trainer.model)
        if isinstance(model, PeftModel):
            active = model.active_adapter
            if "ref" not in model.peft_config:
                model.add_adapter("ref", model.peft_config[active])
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if f".{active}." in name:
                        model.get_parameter(name.replace(f".{active}.", ".ref.")).copy_(param)
            for name, param in model.named_parameters():
                if ".ref." in name:
                    param.requires_grad_(False)
        elif trainer.ref_model is not None:
            trainer.accelerator.unwrap_model(trainer.ref_model).load_state_dict(model.state_dict())
        else:
            raise ValueError("this trainer has no reference policy to reset (beta=0.0?).")

    def reset_optimizer_state(self) -> None:
        """Clear the optimizer's state (Adam moments and step counts); it is rebuilt at the next optimizer step."""
        optimizer = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)  # accelerate wraps it
        if optimizer is not None:
            optimizer.state.clear()

    def reference_tensors(self) -> dict[str, torch.Tensor]:
        """The reference policy's weights (the "ref" adapter under LoRA), on the CPU."""
        from peft import PeftModel

        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        if isinstance(model, PeftModel):
            return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if ".ref." in n}
        ref = self.trainer.accelerator.unwrap_model(self.trainer.ref_model)
        return {k: v.detach().cpu().clone() for k, v in ref.state_dict().items()}

    def load_reference_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        from peft import PeftModel

        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        if isinstance(model, PeftModel):
            if "ref" not in model.peft_config:
                model.add_adapter("ref", model.peft_config[model.active_adapter])
            with torch.no_grad():
                for name, value in tensors.items():
                    param = model.get_parameter(name)
                    param.copy_(value.to(param.device))
                    param.requires_grad_(False)
        else:
            self.trainer.accelerator.unwrap_model(self.trainer.ref_model).load_state_dict(tensors)

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
