"""trl_grpo_ext: the newest RL methods for LLMs as drop-in extensions of TRL's GRPOTrainer."""

from . import tasks as tasks  # registers the built-in task's rewards (last_integer, brevity)
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

__version__ = "0.1.0"

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
