"""Reward functions from installed packages: the ``olmolike.rewards`` entry-point group.

A config file names reward functions but never imports code. ``olmolike train`` has no script
to register them, so it takes them from installed code: a package offers a function by
declaring it in its ``pyproject.toml``::

    [project.entry-points."olmolike.rewards"]
    exact_answer = "my_package.rewards:exact_answer"

Only the entry points a run names are loaded (imported), and only when a GRPO run is built:
another package's broken reward cannot stop a run that does not use it.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence
from typing import cast

from ....exceptions import ConfigurationError
from .rewards import RewardConfig, RewardFunction, RewardRegistry

__all__ = ["REWARD_ENTRY_POINT_GROUP", "load_entry_point_rewards", "reward_entry_points"]

REWARD_ENTRY_POINT_GROUP = "olmolike.rewards"


def reward_entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """The group's entry points by name, none of them loaded.

    Two installed packages offering different functions under one name is an error: which one
    ran would depend on the order of ``sys.path``.
    """
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for entry in importlib.metadata.entry_points(group=REWARD_ENTRY_POINT_GROUP):
        other = found.get(entry.name)
        if other is not None and other.value != entry.value:
            raise ConfigurationError(
                f"two installed packages offer the reward function {entry.name!r} "
                f"({_origin(other)} and {_origin(entry)}); uninstall one or rename its entry point"
            )
        found[entry.name] = entry
    return found


def load_entry_point_rewards(
    rewards: Sequence[RewardConfig], registry: RewardRegistry | None = None
) -> RewardRegistry:
    """A registry holding the reward functions ``rewards`` name (``registry``'s, if given, or
    else loaded from the ``olmolike.rewards`` entry points).

    A name found nowhere is an error at ``rewards[i].name`` listing every registered name and
    how to register one.
    """
    registry = RewardRegistry() if registry is None else registry
    available = reward_entry_points()
    for i, reward in enumerate(rewards):
        if reward.name in registry.names:
            continue
        entry = available.get(reward.name)
        if entry is None:
            known = ", ".join(sorted({*available, *registry.names})) or "none"
            raise ConfigurationError(
                f"unknown reward function {reward.name!r}; registered: {known}. Register it "
                f'under [project.entry-points."{REWARD_ENTRY_POINT_GROUP}"] in your package\'s '
                f'pyproject.toml ({reward.name} = "your_package.module:function") and reinstall '
                "the package, or call RewardRegistry.register in a training script",
                path=f"rewards[{i}].name",
            )
        registry.register(reward.name, _load(entry, path=f"rewards[{i}].name"))
    return registry


def _load(entry: importlib.metadata.EntryPoint, path: str) -> RewardFunction:
    try:
        fn = entry.load()
    except Exception as e:
        raise ConfigurationError(
            f"the reward function {entry.name!r} ({_origin(entry)}) failed to load: "
            f"{type(e).__name__}: {e}; fix or reinstall that package",
            path=path,
        ) from e
    if not callable(fn):
        raise ConfigurationError(
            f"the reward function {entry.name!r} ({_origin(entry)}) is a "
            f"{type(fn).__name__}, not a callable; point the entry point at a function",
            path=path,
        )
    return cast(RewardFunction, fn)


def _origin(entry: importlib.metadata.EntryPoint) -> str:
    dist = entry.dist.name if entry.dist is not None else "an unknown package"
    return f"{entry.value} from {dist}"
