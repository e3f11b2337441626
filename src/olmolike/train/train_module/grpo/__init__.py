"""GRPO: reward functions by name, rollouts, group advantages, the loss, the train module."""

from .loss import (
    AdvantageStats,
    GRPOLossConfig,
    GRPOLossStats,
    LossAggregation,
    RewardScaling,
    group_advantages,
    grpo_loss,
    token_entropy,
    update_denominators,
)
from .rewards import (
    RewardConfig,
    RewardFunction,
    RewardFunctionError,
    RewardRegistry,
    RewardScores,
    score_completions,
)
from .rollout import Rollout, SamplingConfig, check_prompt_lengths, completion_logps, rollout
from .train_module import GRPOTrainModule, GRPOTrainModuleConfig

__all__ = [
    "AdvantageStats",
    "GRPOLossConfig",
    "GRPOLossStats",
    "GRPOTrainModule",
    "GRPOTrainModuleConfig",
    "LossAggregation",
    "RewardConfig",
    "RewardFunction",
    "RewardFunctionError",
    "RewardRegistry",
    "RewardScaling",
    "RewardScores",
    "Rollout",
    "SamplingConfig",
    "check_prompt_lengths",
    "completion_logps",
    "group_advantages",
    "grpo_loss",
    "rollout",
    "score_completions",
    "token_entropy",
    "update_denominators",
]
