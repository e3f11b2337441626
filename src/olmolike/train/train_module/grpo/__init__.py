"""GRPO building blocks: reward functions by name, rollouts, group advantages, the loss."""

from .loss import (
    AdvantageStats,
    GRPOLossConfig,
    GRPOLossStats,
    LossAggregation,
    group_advantages,
    grpo_loss,
    token_entropy,
)
from .rewards import (
    RewardConfig,
    RewardFunction,
    RewardFunctionError,
    RewardRegistry,
    RewardScores,
    score_completions,
)
from .rollout import Rollout, SamplingConfig, completion_logps, rollout

__all__ = [
    "AdvantageStats",
    "GRPOLossConfig",
    "GRPOLossStats",
    "LossAggregation",
    "RewardConfig",
    "RewardFunction",
    "RewardFunctionError",
    "RewardRegistry",
    "RewardScores",
    "Rollout",
    "SamplingConfig",
    "completion_logps",
    "group_advantages",
    "grpo_loss",
    "rollout",
    "score_completions",
    "token_entropy",
]
