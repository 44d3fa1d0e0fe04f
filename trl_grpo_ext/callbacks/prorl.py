"""ProRL's reference and optimizer resets (arXiv 2505.24864; v2: arXiv 2507.12507).

Prolonged RL drifts: the KL term to a stale reference comes to dominate the loss, and validation stalls. ProRL
hard-resets the reference policy to the current policy and re-initialises the optimizer state when that happens
(v1); its v2 resets only the reference, on a schedule or on a KL spike.
"""

from __future__ import annotations

import math

from transformers import TrainerCallback

RESETS = ("both", "reference", "optimizer")


class ProRLResetCallback(TrainerCallback):
    """Reset the reference policy and/or the optimizer state when a trigger fires.

    Triggers (any combination; at least one): `every_n_steps`; `patience` evaluations without improvement of
    `metric` (by more than `min_delta`); the logged mean KL above `kl_threshold`. A fired trigger requests the reset,
    and the trainer applies it at the next generation batch. Counters survive `resume_from_checkpoint`.

    Logs `prorl/resets` (resets applied so far) and `prorl/steps_since_reset`.

    Presets: `ProRLResetCallback.v1(...)` resets both when validation stalls; `ProRLResetCallback.v2(...)` resets the
    reference every N steps (200-500 in the paper) or on a KL spike, keeping the optimizer.

    >>> callback = ProRLResetCallback.v2(every_n_steps=300)
    >>> callback.reset, callback.every_n_steps
    ('reference', 300)
    """

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
        self.trainer = None
        self.best: float | None = None
        self.bad_evaluations = 0

    @classmethod
    def v1(cls, patience: int = 3, metric: str = "eval_reward", **kwargs) -> ProRLResetCallback:
        """ProRL v1: reset reference and optimizer when `metric` has not improved for `patience` evaluations."""
        return cls(reset="both", patience=patience, metric=metric, **kwargs)

    @classmethod
    def v2(cls, every_n_steps: int = 300, kl_threshold: float | None = None, **kwargs) -> ProRLResetCallback:
        """ProRL v2: reset the reference only, every `every_n_steps` steps or when the KL exceeds `kl_threshold`."""
        return cls(reset="reference", every_n_steps=every_n_steps, kl_threshold=kl_threshold, **kwargs)

    def attach(self, trainer) -> ProRLResetCallback:
        if self.reset != "optimizer" and trainer.beta == 0.0:
            raise ValueError(
                f"ProRLResetCallback(reset={self.reset!r}) resets the reference policy, but beta=0.0 keeps none; set "
                "beta > 0 (a small KL penalty, e.g. 1e-4), or reset='optimizer'."
            )
        if self.kl_threshold is not None and trainer.beta == 0.0:
            raise ValueError("ProRLResetCallback(kl_threshold=...) watches the KL, which is logged only when beta > 0.")
        if self.patience is not None and trainer.args.eval_strategy == "no":
            raise ValueError(
                f"ProRLResetCallback(patience={self.patience}) watches {self.metric!r} at evaluations, but "
                "eval_strategy='no'; set eval_strategy='steps' with eval_steps and an eval_dataset."
            )
        self.trainer = trainer
        return self

    # Triggers.
    def _request(self, reason: str) -> None:
        if self.trainer.reset_pending:
            return
        self.trainer.request_reset(reference=self.reset != "optimizer", optimizer=self.reset != "reference",
                                   reason=reason)  # fmt: skip

    def _last_reset_step(self) -> int:
        history = self.trainer.reset_history
        return history[-1]["step"] if history else 0

    def on_step_end(self, args, state, control, **kwargs):
        if self.every_n_steps is not None and state.global_step - self._last_reset_step() >= self.every_n_steps:
            self._request(f"every {self.every_n_steps} steps")
        self.trainer.log_metric("prorl/resets", len(self.trainer.reset_history))
        self.trainer.log_metric("prorl/steps_since_reset", state.global_step - self._last_reset_step())

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

    # Checkpoints (saved and restored by the trainer).
    def state_dict(self) -> dict:
        return {"best": self.best, "bad_evaluations": self.bad_evaluations}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.bad_evaluations = state["best"], state["bad_evaluations"]
