"""A name that is none of an option's choices is an error where it enters, never a silent branch.

Every enum- or ``Literal``-typed field of every config, callback and the trainer is found by
walking olmolike's modules, so a field added later is covered without editing this file; and
every public function with such a parameter must be listed below, with a call that passes a
wrong name. Before this check ``DPOTrainModuleConfig(loss_type="typo_xyz")`` computed sigmoid
DPO and ``GRPOLossConfig(aggregation="bnpo")`` the per-sequence mean (now TRL's bnpo).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import pkgutil
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import olmolike
from olmolike.config import CheckedChoices
from olmolike.config_coerce import choice_fields, choice_names
from olmolike.exceptions import ConfigurationError

BAD = "typo_xyz"


def _modules() -> list[Any]:
    return [
        importlib.import_module(m.name)
        for m in pkgutil.walk_packages(olmolike.__path__, "olmolike.")
        if m.name != "olmolike.__main__"
    ]


MODULES = _modules()


def _defined_here(module: Any) -> Iterator[Any]:
    for obj in vars(module).values():
        if getattr(obj, "__module__", None) == module.__name__:
            yield obj


def _has_choice(tp: Any) -> bool:
    if typing.get_origin(tp) is typing.Literal:
        return True
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return True
    return any(_has_choice(a) for a in typing.get_args(tp))


def _choice_of(tp: Any) -> Any:
    """The enum or ``Literal`` inside ``tp`` (``DType | None`` -> ``DType``)."""
    if typing.get_origin(tp) is typing.Literal or (
        isinstance(tp, type) and issubclass(tp, enum.Enum)
    ):
        return tp
    return next(_choice_of(a) for a in typing.get_args(tp) if _has_choice(a))


def _dataclasses() -> list[type]:
    found = {
        obj
        for module in MODULES
        for obj in _defined_here(module)
        if isinstance(obj, type) and dataclasses.is_dataclass(obj)
    }
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")


CHECKED_ONCE = {"olmolike.train.trainer.Trainer"}
"""Classes that check their choice fields in ``__post_init__`` (the trainer has no base class)."""


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _checks_on_assignment(cls: type) -> bool:
    return issubclass(cls, CheckedChoices)


CHECKED = [c for c in _dataclasses() if _checks_on_assignment(c) or _qualname(c) in CHECKED_ONCE]
CONCRETE = [c for c in CHECKED if not inspect.isabstract(c)]  # abstract ones: their subclasses
CHECKED_FIELDS = [
    pytest.param(cls, name, tp, id=f"{cls.__qualname__}.{name}")
    for cls in CONCRETE
    for name, tp in typing.get_type_hints(cls).items()
    if name in {f.name for f in dataclasses.fields(cls) if f.init} and _has_choice(tp)
]

INTERNAL = {
    "olmolike.train.metric_buffer.CollectedMetrics": "built by MetricBuffer from checked values",
    "olmolike.plan.memory.Layout": "frozen (no CheckedChoices): __post_init__ checks it",
}
"""Dataclasses with an enum-typed field that users never build: their values were checked
where they came in."""


def test_the_walk_finds_the_fields_of_the_issue() -> None:
    ids = {p.id for p in CHECKED_FIELDS}
    assert {
        "DPOTrainModuleConfig.loss_type",
        "GRPOLossConfig.aggregation",
        "Trainer.load_strategy",
        "TrainerConfig.load_strategy",
        "EarlyStoppingCallback.mode",
        "DataParallelConfig.param_dtype",
    } <= ids
    assert len(ids) >= 25


def test_every_dataclass_with_a_choice_field_checks_it() -> None:
    unchecked = [_qualname(c) for c in _dataclasses() if c not in CHECKED and choice_fields(c)]
    assert sorted(unchecked) == sorted(INTERNAL), (
        "a dataclass with an enum-typed field neither checks it (derive from Config, Callback "
        "or CheckedChoices) nor is listed in INTERNAL with the reason its values are safe"
    )


@pytest.mark.parametrize("cls", CHECKED, ids=lambda c: c.__qualname__)
def test_checked_classes_resolve_their_annotations(cls: type) -> None:
    # choice_fields skips a field whose annotation cannot be resolved: none may be.
    assert typing.get_type_hints(cls)
    assert not cls.__dataclass_params__.frozen  # type: ignore[attr-defined]


def _assign(cls: type, name: str, value: Any) -> Any:
    """An instance with ``name`` set to ``value`` the way the constructor sets it."""
    obj = object.__new__(cls)
    if _checks_on_assignment(cls):
        setattr(obj, name, value)  # as the dataclass __init__ does, and any later assignment
    else:
        for f in dataclasses.fields(cls):
            object.__setattr__(obj, f.name, f.default)
        object.__setattr__(obj, name, value)
        cls.__post_init__(obj)  # type: ignore[attr-defined]  # checks them first of all
    return obj


@pytest.mark.parametrize(("cls", "name", "tp"), CHECKED_FIELDS)
def test_a_wrong_name_is_refused_with_the_valid_names(cls: type, name: str, tp: Any) -> None:
    with pytest.raises(ConfigurationError) as err:
        _assign(cls, name, BAD)
    assert err.value.path == name
    for valid in choice_names(_choice_of(tp)):
        assert valid in err.value.reason


@pytest.mark.parametrize(
    ("cls", "name", "tp"), [p for p in CHECKED_FIELDS if _checks_on_assignment(p.values[0])]
)
def test_a_valid_name_becomes_the_member(cls: type, name: str, tp: Any) -> None:
    choice = _choice_of(tp)
    if typing.get_origin(choice) is typing.Literal:
        value = typing.get_args(choice)[0]
        assert getattr(_assign(cls, name, value), name) == value
    else:
        member = next(iter(choice))
        assert getattr(_assign(cls, name, str(member.value)), name) is member


# -- the cases of the issue, through each way in ---------------------------------------------


def test_dpo_config_refuses_an_unknown_loss_type() -> None:
    from olmolike.train.train_module.dpo import DPOTrainModuleConfig

    with pytest.raises(ConfigurationError, match="loss_type: 'typo_xyz' is not a valid DPOLoss"):
        DPOTrainModuleConfig(rank_microbatch_size=8, loss_type=BAD)  # type: ignore[arg-type]
    config = DPOTrainModuleConfig(rank_microbatch_size=8)
    with pytest.raises(ConfigurationError, match="choose one of: sigmoid"):
        config.loss_type = BAD  # type: ignore[assignment]
    with pytest.raises(ConfigurationError, match="loss_type"):
        config.merge([f"--loss_type={BAD}"])


@pytest.mark.parametrize(
    ("name", "member"),
    [("bnpo", "bnpo"), ("dapo", "dapo"), ("dr_grpo", "dr_grpo"), ("grpo", "sequence")],
)
def test_grpo_config_takes_trl_aggregation_names_as_their_own(name: str, member: str) -> None:
    from olmolike.train.train_module.grpo.loss import GRPOLossConfig, LossAggregation

    assert GRPOLossConfig(aggregation=name).aggregation is LossAggregation(member)  # type: ignore[arg-type]
    assert GRPOLossConfig.from_dict({"aggregation": name}).aggregation is LossAggregation(member)
    with pytest.raises(ConfigurationError, match="choose one of: token, sequence, bnpo, dapo"):
        GRPOLossConfig(aggregation="drgrpo")  # type: ignore[arg-type]


def test_a_nested_field_is_named_by_its_path() -> None:
    from olmolike.train.config import TrainerConfig

    with pytest.raises(ConfigurationError) as err:
        TrainerConfig.from_dict({"save_folder": "x", "hard_stop": {"value": 1, "unit": "stepz"}})
    assert err.value.path == "hard_stop.unit"
    assert "choose one of: steps, epochs, tokens" in err.value.reason


# -- functions ---------------------------------------------------------------------------------


def _dpo() -> None:
    from olmolike.nn.functional import dpo_loss

    x = torch.zeros(2)
    dpo_loss(x, x, x, x, beta=0.1, loss_type=BAD)  # type: ignore[arg-type]


def _check_label_smoothing() -> None:
    from olmolike.nn.functional import check_label_smoothing

    check_label_smoothing(BAD, 0.1)  # type: ignore[arg-type]


def _cross_entropy() -> None:
    from olmolike.nn.functional import cross_entropy_loss

    cross_entropy_loss(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), reduction=BAD)  # type: ignore[arg-type]


def _prepare_sft(tmp_path: Path) -> None:
    from olmolike.data.sft import prepare_sft_data

    prepare_sft_data([], tmp_path, sequence_length=8, packing=BAD)  # type: ignore[arg-type]


def _prepare_sft_overlong(tmp_path: Path) -> None:
    from olmolike.data.sft import prepare_sft_data

    prepare_sft_data([], tmp_path, sequence_length=8, overlong=BAD)  # type: ignore[arg-type]


def _setup_logging() -> None:
    from olmolike.utils import setup_logging

    setup_logging(BAD)


def _prepare_training_environment() -> None:
    from olmolike.train import prepare_training_environment

    prepare_training_environment(backend=None, log_filter_type=BAD)  # type: ignore[arg-type]


def _checkpoints_to_remove() -> None:
    from olmolike.train.callbacks.checkpointer import checkpoints_to_remove

    checkpoints_to_remove(BAD, [(5, "step5", False)], save_interval=None)  # type: ignore[arg-type]


def _record_reduce_type() -> None:
    from olmolike.train.metric_buffer import MetricBuffer

    MetricBuffer().record(1, "loss", 1.0, reduce_type=BAD)  # type: ignore[arg-type]


def _record_merge_strategy() -> None:
    from olmolike.train.metric_buffer import MetricBuffer

    # Checked on the first record of a step too, not only when a duplicate needs merging.
    MetricBuffer().record(1, "loss", 1.0, merge_strategy=BAD)  # type: ignore[arg-type]


def _group_advantages() -> None:
    from olmolike.train.train_module.grpo import group_advantages

    group_advantages(torch.zeros(4), 2, scale=BAD)  # type: ignore[arg-type]


def _reduce_metrics() -> None:
    from olmolike.train.utils import reduce_metrics

    reduce_metrics({1: {"loss": torch.tensor(1.0)}}, {"loss": BAD}, torch.device("cpu"))  # type: ignore[dict-item]


FUNCTIONS: dict[str, tuple[Callable[..., None], str]] = {
    "olmolike.nn.functional.dpo_loss": (_dpo, "loss_type"),
    "olmolike.nn.functional.cross_entropy_loss": (_cross_entropy, "reduction"),
    "olmolike.nn.functional.check_label_smoothing": (_check_label_smoothing, "loss_type"),
    "olmolike.data.sft.prepare_sft_data": (_prepare_sft, "packing"),
    "olmolike.data.sft.prepare_sft_data/overlong": (_prepare_sft_overlong, "overlong"),
    "olmolike.utils.setup_logging": (_setup_logging, "log_filter_type"),
    "olmolike.train.prepare_training_environment": (
        _prepare_training_environment,
        "log_filter_type",
    ),
    "olmolike.train.callbacks.checkpointer.checkpoints_to_remove": (
        _checkpoints_to_remove,
        "strategy",
    ),
    "olmolike.train.metric_buffer.MetricBuffer.record": (_record_reduce_type, "reduce_type"),
    "olmolike.train.metric_buffer.MetricBuffer.record/merge": (
        _record_merge_strategy,
        "merge_strategy",
    ),
    "olmolike.train.utils.reduce_metrics": (_reduce_metrics, "reduce_type"),
    "olmolike.train.train_module.grpo.loss.group_advantages": (_group_advantages, "scale"),
}
DELEGATING = {
    "olmolike.train.trainer.Trainer.record_metric": "MetricBuffer.record",
    "olmolike.train.trainer.Trainer.record_ce_loss": "MetricBuffer.record",
    "olmolike.train.train_module.train_module.TrainModule.record_metric": "MetricBuffer.record",
    "olmolike.train.train_module.train_module.TrainModule.record_ce_loss": "MetricBuffer.record",
    "olmolike.train.train_module.train_module.TrainModule.record_loss": "its record_metric",
    "olmolike.train.utils.check_metrics_consistent": "compares the names only",
    "olmolike.train.callbacks.notifications.NotificationSetting.reports": "compares members of "
    "checked config fields",
}
"""Public functions that hand their enum-typed arguments to a checked function unread."""


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_functions_refuse_a_wrong_name(name: str, tmp_path: Path) -> None:
    call, parameter = FUNCTIONS[name]
    args = [tmp_path] if "tmp_path" in inspect.signature(call).parameters else []
    with pytest.raises(ConfigurationError) as err:
        call(*args)
    assert err.value.path == parameter
    assert "choose one of:" in err.value.reason


def _public_functions() -> Iterator[tuple[str, Any]]:
    for module in MODULES:
        for obj in _defined_here(module):
            if inspect.isfunction(obj) and not obj.__name__.startswith("_"):
                yield f"{module.__name__}.{obj.__name__}", obj
            elif inspect.isclass(obj) and not obj.__name__.startswith("_"):
                for attr, member in vars(obj).items():
                    fn = getattr(member, "__func__", member)
                    if inspect.isfunction(fn) and not attr.startswith("_"):
                        yield f"{module.__name__}.{obj.__qualname__}.{attr}", fn


def _hints(fn: Any) -> dict[str, Any]:
    """The annotations of ``fn`` that resolve (some name ``TYPE_CHECKING``-only classes, or a
    class of a module olmolike imports only when it is used: torch's pipelining)."""
    namespace = vars(inspect.getmodule(fn))
    out = {}
    for key, annotation in fn.__annotations__.items():
        try:
            out[key] = eval(annotation, namespace) if isinstance(annotation, str) else annotation
        except (NameError, AttributeError):
            continue
    return out


def test_every_public_function_with_a_choice_parameter_is_covered() -> None:
    found = set()
    for name, fn in _public_functions():
        if any(_has_choice(tp) for key, tp in _hints(fn).items() if key != "return"):
            found.add(name)
    covered = {n.split("/")[0] for n in FUNCTIONS} | set(DELEGATING)
    assert found == covered, (
        "a public function takes an enum-valued argument: check it with check_choice and add "
        "a call with a wrong name to FUNCTIONS (or, if it only passes it on, to DELEGATING)"
    )
