"""trl_grpo_ext: the newest RL methods for LLMs as drop-in extensions of TRL's GRPOTrainer."""

from .advantages import get_advantage, list_advantages, register_advantage
from .batch import RolloutBatch
from .callbacks import ProRLResetCallback
from .config import GRPOExtConfig, ProRLConfig, PTAGRPOConfig
from .curriculum import TokenBudgetCurriculum
from .rewards import get_reward, list_rewards, register_reward
from .trainer import GRPOExtTrainer
from .trainers import CurriculumGRPOTrainer, ProRLTrainer, PTAGRPOTrainer, SegmentGRPOTrainer

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
    "SegmentGRPOTrainer",
    "RolloutBatch",
    "register_reward",
    "get_reward",
    "list_rewards",
    "register_advantage",
    "get_advantage",
    "list_advantages",
    "__version__",
]
