"""How rollout trees grow: staged generation (plan → continuation), ARPO branching, and their pure helpers."""

from .branching import branch_probability, branch_token_advantages, choose_branches, resume_points
from .staged import truncate_at_tag

__all__ = ["truncate_at_tag", "resume_points", "branch_probability", "choose_branches", "branch_token_advantages"]
