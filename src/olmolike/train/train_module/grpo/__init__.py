"""GRPO building blocks: reward functions by name, group advantages, the clipped loss."""

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
    "group_advantages",
    "grpo_loss",
    "score_completions",
    "token_entropy",
]
