"""Learning-rate schedules: exact values, phase boundaries, errors, and config round trips."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch

from olmolike.config import Config
from olmolike.exceptions import ConfigurationError
from olmolike.optim import (
    SGDR,
    WSD,
    ConstantWithWarmup,
    CosWithWarmup,
    DecayShape,
    LinearWithWarmup,
    Scheduler,
    SchedulerUnits,
)

LR = 2.0


@dataclass
class _Parent(Config):
    """A config holding a scheduler the way a train module config does."""

    scheduler: Scheduler
    name: str = "run"


def lrs(scheduler: Scheduler, t_max: int | None, points: range | list[int]) -> list[float]:
    return [scheduler.get_lr(LR, current, t_max) for current in points]


def test_constant_with_warmup_values() -> None:
    scheduler = ConstantWithWarmup(warmup=10)
    assert lrs(scheduler, None, [0, 5, 10, 11, 10**9]) == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert lrs(scheduler, 100, [100, 1000]) == [2.0, 2.0]


def test_warmup_starts_at_warmup_min_lr() -> None:
    scheduler = ConstantWithWarmup(warmup=10, warmup_min_lr=0.2)
    assert lrs(scheduler, None, [0, 5, 10]) == pytest.approx([0.2, 1.1, 2.0])


def test_zero_warmup_starts_at_initial_lr() -> None:
    assert CosWithWarmup(warmup=0).get_lr(LR, 0, 100) == LR


def test_linear_with_warmup_values() -> None:
    scheduler = LinearWithWarmup(warmup=10, alpha_f=0.1)
    values = lrs(scheduler, 110, [0, 5, 10, 60, 110, 111, 5000])
    assert values == pytest.approx([0.0, 1.0, 2.0, 1.1, 0.2, 0.2, 0.2])


def test_cos_with_warmup_values() -> None:
    scheduler = CosWithWarmup(warmup=10, alpha_f=0.1)
    values = lrs(scheduler, 110, [0, 5, 10, 35, 60, 110, 10**6])
    quarter = 0.2 + 1.8 * (1 + math.cos(math.pi / 4)) / 2
    assert values == pytest.approx([0.0, 1.0, 2.0, quarter, 1.1, 0.2, 0.2])


def test_warmup_fraction_is_a_fraction_of_t_max() -> None:
    scheduler = CosWithWarmup(warmup_fraction=0.1, alpha_f=0.0)
    assert lrs(scheduler, 200, [0, 10, 20, 200]) == pytest.approx([0.0, 1.0, 2.0, 0.0])


@pytest.mark.parametrize(
    ("shape", "middle"),
    [
        (DecayShape.linear, 1.0),
        (DecayShape.cosine, 1.0),
        (DecayShape.sqrt, 2.0 - 2.0 * math.sqrt(0.5)),
    ],
)
def test_wsd_values(shape: DecayShape, middle: float) -> None:
    scheduler = WSD(warmup=10, decay=20, decay_fraction=None, decay_shape=shape)
    values = lrs(scheduler, 100, [0, 5, 10, 50, 80, 90, 100, 150])
    assert values == pytest.approx([0.0, 1.0, 2.0, 2.0, 2.0, middle, 0.0, 0.0])


def test_wsd_decay_fraction_and_alpha_f() -> None:
    by_fraction = WSD(warmup=0, decay_fraction=0.25, alpha_f=0.5)
    by_length = WSD(warmup=0, decay=50, decay_fraction=None, alpha_f=0.5)
    points = list(range(0, 201, 10))
    assert lrs(by_fraction, 200, points) == pytest.approx(lrs(by_length, 200, points))
    assert lrs(by_fraction, 200, [150, 175, 200]) == pytest.approx([2.0, 1.5, 1.0])


def test_sgdr_restarts_with_doubling_cycles() -> None:
    scheduler = SGDR(warmup=5, cycle_length=10, cycle_mult=2.0, alpha_f=0.1)
    assert scheduler.get_lr(LR, 5, None) == LR
    for restart in [15, 35, 75, 155]:
        assert scheduler.get_lr(LR, restart, None) == pytest.approx(LR)
        assert scheduler.get_lr(LR, restart - 1, None) < 0.5
    # Cycle 1 covers [15, 35): its midpoint is halfway between initial_lr and the floor.
    assert scheduler.get_lr(LR, 25, None) == pytest.approx(1.1)
    assert lrs(scheduler, None, [0, 1]) == pytest.approx([0.0, 0.4])


def test_sgdr_equal_cycles_repeat() -> None:
    scheduler = SGDR(warmup=0, cycle_length=8)
    first = lrs(scheduler, None, range(8))
    assert lrs(scheduler, None, range(800, 808)) == pytest.approx(first)


def test_sgdr_boundaries_stay_exact_over_many_cycles() -> None:
    # Cycle starts come from a logarithm; rounding must not move a restart by one step.
    scheduler = SGDR(warmup=0, cycle_length=7, cycle_mult=3.0, alpha_f=0.0)
    for index in range(1, 18):
        start = 7 * (3**index - 1) // 2
        assert scheduler.get_lr(LR, start, None) == LR
        assert scheduler.get_lr(LR, start - 1, None) < 0.1 * LR


def test_sgdr_holds_its_value_after_t_max() -> None:
    scheduler = SGDR(warmup=0, cycle_length=10)
    assert scheduler.get_lr(LR, 1000, 25) == scheduler.get_lr(LR, 25, 25)


DECAYING = [
    LinearWithWarmup(warmup_fraction=0.1, alpha_f=0.1),
    CosWithWarmup(warmup_fraction=0.1, alpha_f=0.1),
    WSD(warmup_fraction=0.1, decay_fraction=0.3, decay_shape=DecayShape.linear),
    WSD(warmup_fraction=0.1, decay_fraction=0.3, decay_shape=DecayShape.cosine),
    WSD(warmup_fraction=0.1, decay_fraction=0.3, decay_shape=DecayShape.sqrt),
]


@pytest.mark.parametrize("scheduler", DECAYING, ids=repr)
def test_warmup_rises_then_lr_never_increases(scheduler: Scheduler) -> None:
    values = lrs(scheduler, 1000, range(1001))
    steps = [b - a for a, b in itertools.pairwise(values)]
    assert all(step > 0 for step in steps[:100])
    assert all(step <= 0 for step in steps[100:])
    assert values[100] == LR


@pytest.mark.parametrize(
    "scheduler", [*DECAYING, ConstantWithWarmup(warmup_fraction=0.1)], ids=repr
)
def test_no_jumps_at_phase_boundaries(scheduler: Scheduler) -> None:
    # Over a long run one step moves the LR very little, unless a phase boundary jumps.
    t_max = 10_000_000
    for boundary in (t_max // 10, t_max * 7 // 10, t_max):
        before, at, after = lrs(scheduler, t_max, [boundary - 1, boundary, boundary + 1])
        assert abs(at - before) < 1e-3 * LR and abs(after - at) < 1e-3 * LR


def test_tokens_units() -> None:
    scheduler = CosWithWarmup(units=SchedulerUnits.tokens, warmup=1_000_000, alpha_f=0.0)
    t_max = 101_000_000
    assert lrs(scheduler, t_max, [500_000, 1_000_000, 51_000_000, t_max]) == pytest.approx(
        [1.0, 2.0, 1.0, 0.0]
    )
    assert scheduler.in_units(steps=10, tokens=40_960) == 40_960
    assert CosWithWarmup(warmup=1).in_units(steps=10, tokens=40_960) == 10
    assert scheduler.in_units(steps=None, tokens=None) is None


def test_set_lr_scales_each_group_from_its_initial_lr() -> None:
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    optim = torch.optim.SGD(
        [{"params": [params[0]], "initial_lr": 1.0}, {"params": [params[1]], "initial_lr": 0.1}],
        lr=1.0,
    )
    LinearWithWarmup(warmup=10, alpha_f=0.0).set_lr(optim, 60, 110)
    assert [g["lr"] for g in optim.param_groups] == pytest.approx([0.5, 0.05])
    assert [g["initial_lr"] for g in optim.param_groups] == [1.0, 0.1]


def test_set_lr_without_initial_lr_explains_the_fix() -> None:
    optim = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    with pytest.raises(ConfigurationError, match=r"initial_lr.*OptimConfig"):
        ConstantWithWarmup(warmup=0).set_lr(optim, 1, None)


@pytest.mark.parametrize(
    "scheduler",
    [
        LinearWithWarmup(warmup=10),
        CosWithWarmup(warmup=10),
        WSD(warmup=10),
        ConstantWithWarmup(warmup_fraction=0.1),
        SGDR(warmup_fraction=0.1, cycle_length=10),
    ],
    ids=repr,
)
def test_missing_t_max_names_the_scheduler_and_max_duration(scheduler: Scheduler) -> None:
    with pytest.raises(ConfigurationError) as info:
        scheduler.get_lr(LR, 5, None)
    message = str(info.value)
    assert type(scheduler).__name__ in message and "max_duration" in message
    assert "known ahead of time" in message


def test_constant_and_sgdr_do_not_need_t_max() -> None:
    assert ConstantWithWarmup(warmup=2).get_lr(LR, 5, None) == LR
    assert SGDR(warmup=0, cycle_length=4).get_lr(LR, 8, None) == LR


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: CosWithWarmup(), "warmup"),
        (lambda: CosWithWarmup(warmup=5, warmup_fraction=0.1), "warmup"),
        (lambda: CosWithWarmup(warmup=-1), "warmup"),
        (lambda: CosWithWarmup(warmup_fraction=1.5), "warmup_fraction"),
        (lambda: CosWithWarmup(warmup=1, warmup_min_lr=-1.0), "warmup_min_lr"),
        (lambda: CosWithWarmup(warmup=1, alpha_f=1.5), "alpha_f"),
        (lambda: LinearWithWarmup(warmup=1, alpha_f=-0.1), "alpha_f"),
        (lambda: WSD(warmup=1, alpha_f=2.0), "alpha_f"),
        (lambda: SGDR(warmup=1, cycle_length=4, alpha_f=-1.0), "alpha_f"),
        (lambda: WSD(warmup=1, decay=10), "decay"),
        (lambda: WSD(warmup=1, decay_fraction=None), "decay"),
        (lambda: WSD(warmup=1, decay=0, decay_fraction=None), "decay"),
        (lambda: WSD(warmup=1, decay_fraction=0.0), "decay_fraction"),
        (lambda: SGDR(warmup=1, cycle_length=0), "cycle_length"),
        (lambda: SGDR(warmup=1, cycle_length=4, cycle_mult=0.5), "cycle_mult"),
    ],
)
def test_invalid_configs_fail_at_construction(make: object, field: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        make()  # type: ignore[operator]
    assert info.value.path == field


def test_both_or_neither_warmup_explains_the_choice() -> None:
    with pytest.raises(ConfigurationError, match="exactly one of warmup"):
        LinearWithWarmup()


def test_wsd_with_decay_and_default_fraction_explains_the_fix() -> None:
    with pytest.raises(ConfigurationError, match="decay_fraction=None"):
        WSD(warmup=0, decay=100)


def test_decay_longer_than_training_fails_at_get_lr() -> None:
    scheduler = WSD(warmup=10, decay=100, decay_fraction=None)
    assert scheduler.get_lr(LR, 50, 200) == LR
    # Even at step 0, during warmup, so that a check before training starts catches it.
    for current in (0, 50):
        with pytest.raises(ConfigurationError, match="smaller decay"):
            scheduler.get_lr(LR, current, 100)


def test_warmup_longer_than_training_fails_at_get_lr() -> None:
    with pytest.raises(ConfigurationError, match="shorter warmup"):
        CosWithWarmup(warmup=500).get_lr(LR, 1, 100)


def test_negative_progress_is_rejected() -> None:
    with pytest.raises(ValueError, match="current"):
        ConstantWithWarmup(warmup=1).get_lr(LR, -1, None)


def test_round_trip_through_a_parent_config() -> None:
    parent = _Parent(WSD(units=SchedulerUnits.tokens, warmup=1000, decay_shape=DecayShape.sqrt))
    data = parent.as_config_dict()
    assert data["scheduler"]["_CLASS_"] == "olmolike.optim.scheduler.WSD"
    assert data["scheduler"]["units"] == "tokens"
    assert _Parent.from_dict(data) == parent
    merged = parent.merge(["--scheduler.warmup=10", "--scheduler.decay_shape=cosine"])
    assert merged.scheduler == WSD(
        units=SchedulerUnits.tokens, warmup=10, decay_shape=DecayShape.cosine
    )
    assert parent.scheduler.warmup == 1000


def test_sgdr_round_trip_keeps_its_keyword_only_cycle_length() -> None:
    parent = _Parent(SGDR(warmup=0, cycle_length=12, cycle_mult=2.0))
    assert _Parent.from_dict(parent.as_config_dict()) == parent
    with pytest.raises(ConfigurationError, match="cycle_length"):
        _Parent.from_dict({"scheduler": {"_CLASS_": "SGDR", "warmup": 0}})


def test_short_class_names_and_missing_class_name() -> None:
    built = _Parent.from_dict({"scheduler": {"_CLASS_": "CosWithWarmup", "warmup": 5}})
    assert built.scheduler == CosWithWarmup(warmup=5)
    with pytest.raises(ConfigurationError, match=r"_CLASS_.*CosWithWarmup"):
        _Parent.from_dict({"scheduler": {"warmup": 5}})
