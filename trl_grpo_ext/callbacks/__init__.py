"""Training callbacks that act on a trl_grpo_ext trainer (they are handed the trainer through `attach`)."""

from .prorl import ProRLResetCallback

__all__ = ["ProRLResetCallback"]
