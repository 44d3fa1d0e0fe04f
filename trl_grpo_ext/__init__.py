"""trl_grpo_ext: the newest RL methods for LLMs as drop-in extensions of TRL's GRPOTrainer.

`import trl_grpo_ext` is cheap: the public names below are imported on first use (PEP 562), and that first use
imports the whole package at once, as an eager import would (the methods, rewards and estimators register then), so
that the command line answers `--help` and typos at once and a user pays for torch and TRL only when they are used.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Library chatter that is not the user's concern, quietened before any of these libraries is imported:
# bitsandbytes asks the Hub for an optional CPU kernel at import and warns when it cannot have it (our CPU path does not
# use it), and `kernels` warns that it skips a trust check offline. Real errors of both still show.
for _name in ("bitsandbytes.backends.cpu.ops", "kernels._internals.hf_hub"):
    logging.getLogger(_name).setLevel(logging.ERROR)

# public name -> the module that defines it
_EXPORTS = {
    "GRPOExtConfig": "config",
    "BiCCGRPOConfig": "config",
    "DraftGRPOConfig": "config",
    "HiMAConfig": "config",
    "NoRDConfig": "config",
    "ProRLConfig": "config",
    "PTAGRPOConfig": "config",
    "TreeOPOConfig": "config",
    "GRPOExtTrainer": "trainer",
    "BiCCGRPOTrainer": "trainers",
    "CurriculumGRPOTrainer": "trainers",
    "DraftGRPOTrainer": "trainers",
    "HiMATrainer": "trainers",
    "NoRDTrainer": "trainers",
    "ProRLTrainer": "trainers",
    "PTAGRPOTrainer": "trainers",
    "SegmentGRPOTrainer": "trainers",
    "TreeOPOTrainer": "trainers",
    "TokenBudgetCurriculum": "methods.curriculum",
    "Agent": "methods.hima",
    "Hierarchy": "methods.hima",
    "MemoryStore": "methods.hima",
    "load_hierarchy": "methods.hima",
    "RewardHackingMonitor": "methods.monitor",
    "DifficultyBiasDiagnostic": "methods.nord",
    "ProRLResetCallback": "methods.prorl",
    "PlanValueReward": "methods.pta",
    "Extension": "extension",
    "Method": "extension",
    "TrainerInputs": "extension",
    "get_method": "extension",
    "list_methods": "extension",
    "register_method": "extension",
    "Rollout": "rollout",
    "RolloutPlan": "rollout",
    "RolloutBatch": "batch",
    "get_reward": "rewards",
    "list_rewards": "rewards",
    "register_reward": "rewards",
    "RewardFunctionError": "rewards.guard",
    "get_advantage": "advantages",
    "list_advantages": "advantages",
    "register_advantage": "advantages",
}

if TYPE_CHECKING:  # what static tools see; at run time `__getattr__` below imports these
    from .advantages import get_advantage, list_advantages, register_advantage
    from .batch import RolloutBatch
    from .config import (
        BiCCGRPOConfig,
        DraftGRPOConfig,
        GRPOExtConfig,
        HiMAConfig,
        NoRDConfig,
        ProRLConfig,
        PTAGRPOConfig,
        TreeOPOConfig,
    )
    from .extension import Extension, Method, TrainerInputs, get_method, list_methods, register_method
    from .methods.curriculum import TokenBudgetCurriculum
    from .methods.hima import Agent, Hierarchy, MemoryStore, load_hierarchy
    from .methods.monitor import RewardHackingMonitor
    from .methods.nord import DifficultyBiasDiagnostic
    from .methods.prorl import ProRLResetCallback
    from .methods.pta import PlanValueReward
    from .rewards import get_reward, list_rewards, register_reward
    from .rewards.guard import RewardFunctionError
    from .rollout import Rollout, RolloutPlan
    from .trainer import GRPOExtTrainer
    from .trainers import (
        BiCCGRPOTrainer,
        CurriculumGRPOTrainer,
        DraftGRPOTrainer,
        HiMATrainer,
        NoRDTrainer,
        ProRLTrainer,
        PTAGRPOTrainer,
        SegmentGRPOTrainer,
        TreeOPOTrainer,
    )

__all__ = [
    "GRPOExtConfig",
    "GRPOExtTrainer",
    "CurriculumGRPOTrainer",
    "TokenBudgetCurriculum",
    "ProRLConfig",
    "ProRLTrainer",
    "ProRLResetCallback",
    "PTAGRPOConfig",
    "PTAGRPOTrainer",
    "PlanValueReward",
    "SegmentGRPOTrainer",
    "TreeOPOConfig",
    "TreeOPOTrainer",
    "BiCCGRPOConfig",
    "BiCCGRPOTrainer",
    "DraftGRPOConfig",
    "DraftGRPOTrainer",
    "RewardHackingMonitor",
    "NoRDConfig",
    "NoRDTrainer",
    "DifficultyBiasDiagnostic",
    "HiMAConfig",
    "HiMATrainer",
    "Hierarchy",
    "Agent",
    "MemoryStore",
    "load_hierarchy",
    "Extension",
    "TrainerInputs",
    "Method",
    "register_method",
    "get_method",
    "list_methods",
    "Rollout",
    "RolloutPlan",
    "RolloutBatch",
    "register_reward",
    "get_reward",
    "list_rewards",
    "RewardFunctionError",
    "register_advantage",
    "get_advantage",
    "list_advantages",
    "__version__",
]


def load_builtins() -> None:
    """Import every module that registers a built-in: the methods, their rewards, the built-in task's rewards
    (`last_integer`, `brevity`) and the estimators. The registries call this before they answer."""
    for module in ("tasks", "advantages", "methods", "trainers"):
        importlib.import_module(f"{__name__}.{module}")


def __getattr__(name: str):
    if name in _EXPORTS:
        load_builtins()
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a submodule: `trl_grpo_ext.testing`
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
