"""Learning-rate schedules as pure functions of training progress.

A schedule holds no state: the learning rate at any point is computed from ``current`` (steps
or tokens done so far) and ``t_max`` (the length of training in the same unit). Resuming from
a checkpoint therefore needs nothing beyond the trainer's own counters, and exact resume holds
by construction. ``get_lr`` runs once per parameter group per step, so it is plain float math.

Every schedule here warms up linearly from ``warmup_min_lr`` to the group's ``initial_lr`` and
holds its final value after ``t_max``.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar, overload

import torch

from ..config import Config, StrEnum, register_config_class, require_class_name
from ..exceptions import ConfigurationError

__all__ = [
    "SGDR",
    "WSD",
    "ConstantWithWarmup",
    "CosWithWarmup",
    "DecayShape",
    "LinearWithWarmup",
    "Scheduler",
    "SchedulerUnits",
    "WarmupScheduler",
]


class SchedulerUnits(StrEnum):
    """What ``current``, ``t_max`` and the lengths in a schedule count."""

    steps = "steps"
    tokens = "tokens"


class DecayShape(StrEnum):
    """How a decay goes from ``initial_lr`` to its final value (:class:`WSD`'s choice;
    :class:`LinearWithWarmup` and :class:`CosWithWarmup` are fixed to one)."""

    linear = "linear"
    cosine = "cosine"
    sqrt = "sqrt"
    """``1 - sqrt(progress)``: drops fast at first, then flattens (the "1-sqrt" cooldown)."""


@dataclass
class Scheduler(Config, abc.ABC):
    """Base class for learning-rate schedules."""

    units: SchedulerUnits = SchedulerUnits.steps
    """Whether the caller passes steps or tokens as ``current`` and ``t_max``."""

    @abc.abstractmethod
    def get_lr(self, initial_lr: float, current: int, t_max: int | None) -> float:
        """The learning rate after ``current`` units of a run that lasts ``t_max`` units."""

    def set_lr(self, optim: torch.optim.Optimizer, current: int, t_max: int | None) -> None:
        """Set every group's ``lr`` from its ``initial_lr`` (stored by ``OptimConfig.build``)."""
        for index, group in enumerate(optim.param_groups):
            if "initial_lr" not in group:
                raise ConfigurationError(
                    f"optimizer parameter group {index} has no 'initial_lr'; build the optimizer "
                    "with an OptimConfig, or set group['initial_lr'] to the peak learning rate"
                )
            group["lr"] = self.get_lr(group["initial_lr"], current, t_max)

    @overload
    def in_units(self, *, steps: int, tokens: int) -> int: ...

    @overload
    def in_units(self, *, steps: int | None, tokens: int | None) -> int | None: ...

    def in_units(self, *, steps: int | None, tokens: int | None) -> int | None:
        """Of a step count and a token count, the one this schedule is measured in."""
        return steps if self.units == SchedulerUnits.steps else tokens


@dataclass
class WarmupScheduler(Scheduler):
    """A linear warmup followed by the subclass's schedule (:meth:`_after_warmup`)."""

    warmup: int | None = None
    """Length of the warmup in ``units``; give this or ``warmup_fraction`` (``0``: none)."""

    warmup_fraction: float | None = None
    """Length of the warmup as a fraction of ``t_max``; give this or ``warmup``."""

    warmup_min_lr: float = 0.0
    """The learning rate at the start of the warmup."""

    needs_t_max: ClassVar[bool] = True
    """Whether the schedule itself (not only ``warmup_fraction``) depends on ``t_max``."""

    def validate(self) -> None:
        if (self.warmup is None) == (self.warmup_fraction is None):
            raise self._invalid(
                "warmup",
                "set exactly one of warmup (in units) or warmup_fraction (of t_max); "
                "warmup=0 means no warmup",
            )
        if self.warmup is not None and self.warmup < 0:
            raise self._invalid("warmup", f"must be >= 0, got {self.warmup}")
        if self.warmup_fraction is not None and not 0 <= self.warmup_fraction <= 1:
            raise self._invalid("warmup_fraction", f"must be in [0, 1], got {self.warmup_fraction}")
        if not self.warmup_min_lr >= 0:
            raise self._invalid("warmup_min_lr", f"must be >= 0, got {self.warmup_min_lr}")

    def get_lr(self, initial_lr: float, current: int, t_max: int | None) -> float:
        if current < 0:
            raise ValueError(f"current must be >= 0, got {current}")
        if t_max is None:
            if self.needs_t_max or self.warmup is None:
                raise self._no_t_max()
        elif t_max <= 0:
            raise ValueError(f"t_max must be > 0, got {t_max}")
        warmup = self._warmup_length(t_max)
        if t_max is not None:
            # Checked at every point, so that one call before the first step catches a
            # schedule that cannot fit in the run, instead of failing part-way through it.
            self._check_fits(warmup, t_max)
            current = min(current, t_max)
        if current < warmup:
            return self.warmup_min_lr + (initial_lr - self.warmup_min_lr) * current / warmup
        return self._after_warmup(initial_lr, current, warmup, t_max)

    @abc.abstractmethod
    def _after_warmup(
        self, initial_lr: float, current: float, warmup: float, t_max: int | None
    ) -> float:
        """The learning rate once ``current >= warmup`` (``current`` is at most ``t_max``)."""

    def _check_fits(self, warmup: float, t_max: int) -> None:
        """Raise :class:`ConfigurationError` if the phases do not fit in ``t_max`` units."""

    def _warmup_length(self, t_max: int | None) -> float:
        if self.warmup is not None:
            warmup: float = self.warmup
        else:
            assert self.warmup_fraction is not None and t_max is not None
            warmup = self.warmup_fraction * t_max
        if t_max is not None and warmup > t_max:
            raise ConfigurationError(
                f"warmup ({warmup:g} {self.units}) is longer than t_max ({t_max} {self.units}), "
                "the length of training; use a shorter warmup",
                path="warmup",
            )
        return warmup

    def _no_t_max(self) -> ConfigurationError:
        what = "this schedule" if self.needs_t_max else "warmup_fraction"
        return ConfigurationError(
            f"{type(self).__name__}: {what} needs t_max, the length of training in "
            f"{self.units}. Set the trainer's max_duration in steps or tokens (not epochs) so "
            "that it is known ahead of time"
            + ("" if self.needs_t_max else ", or give warmup instead of warmup_fraction"),
        )


def _check_alpha_f(config: WarmupScheduler, alpha_f: float) -> None:
    if not 0 <= alpha_f <= 1:
        raise config._invalid("alpha_f", f"must be in [0, 1], got {alpha_f}")


def _cosine(initial_lr: float, final_lr: float, progress: float) -> float:
    return final_lr + (initial_lr - final_lr) * (1 + math.cos(math.pi * progress)) / 2


def _shaped(shape: DecayShape, initial_lr: float, final_lr: float, progress: float) -> float:
    """The learning rate ``progress`` (0 to 1) of the way from ``initial_lr`` to ``final_lr``."""
    if shape == DecayShape.cosine:
        return _cosine(initial_lr, final_lr, progress)
    if shape == DecayShape.sqrt:
        progress = math.sqrt(progress)
    return initial_lr - (initial_lr - final_lr) * progress


def _decay_progress(current: float, start: float, t_max: float) -> float:
    span = t_max - start
    return 1.0 if span <= 0 else (current - start) / span


@dataclass
class ConstantWithWarmup(WarmupScheduler):
    """Warm up, then hold ``initial_lr``. Needs ``t_max`` only for ``warmup_fraction``."""

    needs_t_max: ClassVar[bool] = False

    def _after_warmup(
        self, initial_lr: float, current: float, warmup: float, t_max: int | None
    ) -> float:
        return initial_lr


@dataclass
class _DecayToFraction(WarmupScheduler):
    """Warm up, then decay over the rest of training to ``alpha_f * initial_lr`` at ``t_max``,
    in the subclass's :attr:`shape`."""

    shape: ClassVar[DecayShape]
    alpha_f: float = 0.1
    """The final learning rate as a fraction of ``initial_lr``."""

    def validate(self) -> None:
        super().validate()
        _check_alpha_f(self, self.alpha_f)

    def _after_warmup(
        self, initial_lr: float, current: float, warmup: float, t_max: int | None
    ) -> float:
        assert t_max is not None
        progress = _decay_progress(current, warmup, t_max)
        return _shaped(self.shape, initial_lr, self.alpha_f * initial_lr, progress)


@dataclass
class LinearWithWarmup(_DecayToFraction):
    """Warm up, then decay linearly to ``alpha_f * initial_lr`` at ``t_max``."""

    shape: ClassVar[DecayShape] = DecayShape.linear


@dataclass
class CosWithWarmup(_DecayToFraction):
    """Warm up, then follow half a cosine down to ``alpha_f * initial_lr`` at ``t_max``."""

    shape: ClassVar[DecayShape] = DecayShape.cosine


@dataclass
class WSD(WarmupScheduler):
    """Warmup-stable-decay: warm up, hold ``initial_lr``, then decay over the final stretch.

    The decay lasts ``decay`` units or ``decay_fraction`` of ``t_max`` (exactly one is set;
    pass ``decay_fraction=None`` when giving ``decay``).
    """

    decay: int | None = None
    """Length of the decay in ``units``."""

    decay_fraction: float | None = 0.1
    """Length of the decay as a fraction of ``t_max``."""

    decay_shape: DecayShape = DecayShape.linear
    """How the decay falls from ``initial_lr`` to its final value: ``linear``, ``cosine`` or
    ``sqrt`` (``1 - sqrt(progress)``)."""
    alpha_f: float = 0.0
    """The final learning rate as a fraction of ``initial_lr``."""

    def validate(self) -> None:
        super().validate()
        _check_alpha_f(self, self.alpha_f)
        if (self.decay is None) == (self.decay_fraction is None):
            raise self._invalid(
                "decay",
                "set exactly one of decay (in units) or decay_fraction (of t_max); to use "
                "decay, also pass decay_fraction=None (--scheduler.decay_fraction=null)",
            )
        if self.decay is not None and self.decay <= 0:
            raise self._invalid("decay", f"must be > 0, got {self.decay}")
        if self.decay_fraction is not None and not 0 < self.decay_fraction <= 1:
            raise self._invalid("decay_fraction", f"must be in (0, 1], got {self.decay_fraction}")

    def _decay_length(self, t_max: int) -> float:
        if self.decay is not None:
            return self.decay
        assert self.decay_fraction is not None
        return self.decay_fraction * t_max

    def _check_fits(self, warmup: float, t_max: int) -> None:
        decay = self._decay_length(t_max)
        if warmup + decay > t_max:
            raise ConfigurationError(
                f"warmup ({warmup:g}) plus decay ({decay:g}) is longer than t_max ({t_max} "
                f"{self.units}), the length of training; use a smaller decay or decay_fraction",
                path="decay",
            )

    def _after_warmup(
        self, initial_lr: float, current: float, warmup: float, t_max: int | None
    ) -> float:
        assert t_max is not None
        decay = self._decay_length(t_max)
        start = t_max - decay
        if current < start:
            return initial_lr
        progress = (current - start) / decay
        return _shaped(self.decay_shape, initial_lr, self.alpha_f * initial_lr, progress)


@dataclass
class SGDR(WarmupScheduler):
    """Cosine annealing with warm restarts (Loshchilov & Hutter, 2017), after a warmup.

    Cycle ``i`` lasts ``cycle_length * cycle_mult**i`` units; each starts at ``initial_lr`` and
    follows half a cosine towards ``alpha_f * initial_lr``. Needs ``t_max`` only for
    ``warmup_fraction``.
    """

    cycle_length: int = dataclasses.field(kw_only=True)
    """Length of the first cycle in ``units``."""

    cycle_mult: float = 1.0
    """Each cycle is this many times longer than the previous one."""

    alpha_f: float = 0.1
    """The lowest learning rate in each cycle as a fraction of ``initial_lr``."""

    needs_t_max: ClassVar[bool] = False

    def validate(self) -> None:
        super().validate()
        _check_alpha_f(self, self.alpha_f)
        if self.cycle_length <= 0:
            raise self._invalid("cycle_length", f"must be > 0, got {self.cycle_length}")
        if not self.cycle_mult >= 1:
            raise self._invalid("cycle_mult", f"must be >= 1, got {self.cycle_mult}")

    def _after_warmup(
        self, initial_lr: float, current: float, warmup: float, t_max: int | None
    ) -> float:
        offset, length = self._position_in_cycle(current - warmup)
        return _cosine(initial_lr, self.alpha_f * initial_lr, offset / length)

    def _position_in_cycle(self, elapsed: float) -> tuple[float, float]:
        """``(offset into the current cycle, its length)`` in closed form: O(1) at any step."""
        first, mult = self.cycle_length, self.cycle_mult
        if mult == 1:
            return elapsed % first, first
        index = math.floor(math.log1p(elapsed * (mult - 1) / first) / math.log(mult))
        start = first * (mult**index - 1) / (mult - 1)
        # The logarithm can land a hair on the wrong side of a cycle boundary.
        if start > elapsed:
            index -= 1
        elif start + first * mult**index <= elapsed:
            index += 1
        start = first * (mult**index - 1) / (mult - 1)
        return elapsed - start, first * mult**index


# Short names for ``_CLASS_`` in config files and overrides (``--scheduler._CLASS_=WSD``).
for _scheduler in (ConstantWithWarmup, LinearWithWarmup, CosWithWarmup, WSD, SGDR):
    register_config_class(_scheduler, _scheduler.__name__)
require_class_name(Scheduler)
