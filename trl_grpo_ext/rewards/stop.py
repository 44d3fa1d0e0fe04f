"""Stop-properly penalty (ProRL, arXiv 2505.24864): penalise completions that never emit an end-of-sequence token."""

from __future__ import annotations


class StopPenalty:
    """`penalty` for a completion whose last token is not a stop token (it hit the length cap), else 0.0.

    `eos_token_ids` defaults to the trainer's stop tokens (TRL's `eos_token_ids`: the tokenizer's EOS plus the
    generation config's), handed over by our trainers; pass them yourself to use this reward in plain TRL.

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
