"""Reward functions for GRPO: registered by name in the training script, chosen by name in
the config, combined with weights.

A config never imports code (it could name any callable): the script registers the functions
it trusts in a :class:`RewardRegistry`, and the config's :class:`RewardConfig` entries pick
among them by name.

A reward function is called once per batch of completions, as
``fn(prompts=[...], completions=[...], **fields)``, where each of ``fields`` is the list of
that field's values from the prompt records (for example ``answer``), aligned with the
completions. It returns one finite number per completion. It may accept ``**kwargs`` to ignore
the fields it does not use.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ....config import Config
from ....exceptions import ConfigurationError, OLMoLikeError

__all__ = [
    "RewardConfig",
    "RewardFunction",
    "RewardFunctionError",
    "RewardRegistry",
    "RewardScores",
    "score_completions",
]

log = logging.getLogger(__name__)

RewardFunction = Callable[..., Sequence[float]]


class RewardFunctionError(OLMoLikeError):
    """A reward function raised, returned the wrong number of values, or a non-finite one."""


class RewardRegistry:
    """The reward functions a training script offers, by name."""

    def __init__(self) -> None:
        self._functions: dict[str, RewardFunction] = {}

    def register(self, name: str, fn: RewardFunction) -> RewardFunction:
        """Offer ``fn`` under ``name``; returns ``fn``. A name can be registered once."""
        if not name or not name.strip():
            raise ConfigurationError("a reward function needs a non-empty name")
        if name in self._functions:
            raise ConfigurationError(
                f"a reward function named {name!r} is already registered; pick another name"
            )
        self._functions[name] = fn
        return fn

    def reward(self, name: str) -> Callable[[RewardFunction], RewardFunction]:
        """Decorator form of :meth:`register`: ``@registry.reward("exact_answer")``."""
        return lambda fn: self.register(name, fn)

    def get(self, name: str) -> RewardFunction:
        try:
            return self._functions[name]
        except KeyError:
            known = ", ".join(sorted(self._functions)) or "none registered"
            raise ConfigurationError(
                f"unknown reward function {name!r}; the training script registers: {known}. "
                "Register it with RewardRegistry.register(name, fn) or fix the name",
                path="rewards",
            ) from None

    def check(self, rewards: Sequence[RewardConfig]) -> None:
        """Fail early (at build time) if ``rewards`` is empty or names an unknown function."""
        if not rewards:
            raise ConfigurationError("name at least one reward function", path="rewards")
        for i, reward in enumerate(rewards):
            try:
                self.get(reward.name)
            except ConfigurationError as e:
                raise ConfigurationError(e.reason, path=f"rewards[{i}].name") from None

    @property
    def names(self) -> list[str]:
        return sorted(self._functions)


@dataclass
class RewardConfig(Config):
    """One reward function of the total reward, by name, with its weight."""

    name: str
    """The name the training script registered the function under."""
    weight: float = 1.0
    """Its weight in the total reward (a weighted sum), so that, e.g., a format bonus does not
    drown the correctness reward. 0 computes and logs it without training on it."""

    def validate(self) -> None:
        if not self.name:
            raise self._invalid("name", "must name a registered reward function")
        if not math.isfinite(self.weight):
            raise self._invalid("weight", f"must be a finite number, got {self.weight}")


@dataclass
class RewardScores:
    """Rewards of N completions."""

    total: Tensor
    """(N,) the weighted sum, float32."""
    per_function: dict[str, Tensor]
    """Each function's (N,) rewards, unweighted, by name (for the metrics)."""


def score_completions(
    registry: RewardRegistry,
    rewards: Sequence[RewardConfig],
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: Mapping[str, Sequence[Any]] | None = None,
) -> RewardScores:
    """Call every configured reward function on the completions and weight their results.

    Raises :class:`RewardFunctionError` naming the function if it raises, returns a number of
    values other than one per completion, or returns NaN or an infinity: a silently dropped
    or zeroed reward would bias the advantages of its whole group.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    fields = dict(fields or {})
    for key, values in fields.items():
        if key in ("prompts", "completions"):
            raise ConfigurationError(
                f"a prompt field named {key!r} would shadow the reward functions' own "
                "argument; rename the field in the prompt data"
            )
        if len(values) != len(completions):
            raise ValueError(f"field {key!r} has {len(values)} values for {len(completions)}")
    total = torch.zeros(len(completions), dtype=torch.float32)
    per_function: dict[str, Tensor] = {}
    for reward in rewards:
        scores = _call(registry.get(reward.name), reward.name, prompts, completions, fields)
        per_function[reward.name] = scores
        total += reward.weight * scores
    return RewardScores(total, per_function)


def _call(
    fn: RewardFunction,
    name: str,
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: dict[str, Sequence[Any]],
) -> Tensor:
    try:
        raw = fn(prompts=list(prompts), completions=list(completions), **fields)
        values = torch.as_tensor([float(v) for v in raw], dtype=torch.float32)
    except Exception as e:
        raise RewardFunctionError(
            f"reward function {name!r} raised {type(e).__name__}: {e}; fix the function (it "
            "must return one number per completion)"
        ) from e
    if values.shape != (len(completions),):
        raise RewardFunctionError(
            f"reward function {name!r} returned {values.numel()} values for "
            f"{len(completions)} completions; return one number per completion"
        )
    bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
    if bad:
        raise RewardFunctionError(
            f"reward function {name!r} returned a non-finite value ({float(values[bad[0]])}) "
            f"for completion {bad[0]} ({len(bad)} in all) of prompt {prompts[bad[0]]!r}; "
            "return a finite number, e.g. 0.0 for a completion it cannot score"
        )
    return values
