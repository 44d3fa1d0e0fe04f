"""How rollout trees grow: staged generation (plan → continuation), and the pure helpers it needs."""

from .staged import truncate_at_tag

__all__ = ["truncate_at_tag"]
