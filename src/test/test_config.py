"""The config system: dict/YAML/JSON round trips, command-line overrides, errors, class registry."""

from __future__ import annotations

import builtins
import dataclasses
import datetime
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml

from olmolike.config import (
    CLASS_KEY,
    Config,
    StrEnum,
    lookup_registered_class,
    register_config_class,
)
from olmolike.exceptions import ConfigurationError, OLMoLikeError
from olmolike.train import (
    Callback,
    CheckpointerConfig,
    Duration,
    DurationUnit,
    LoadStrategy,
    StepSkipRange,
    TrainerConfig,
)
from olmolike.train.callbacks import ConsoleLoggerCallback

CONSOLE_LOGGER = "olmolike.train.callbacks.console_logger.ConsoleLoggerCallback"


@dataclass
class Inner(Config):
    size: int = 1
    note: str | None = None

    def validate(self) -> None:
        if self.size < 0:
            raise self._invalid("size", f"must be >= 0, got {self.size}")


@dataclass
class Everything(Config):
    """One field of every kind the converter handles."""

    name: str = "run"
    lr: float = 0.5
    steps: int = 3
    enabled: bool = False
    unit: DurationUnit = DurationUnit.steps
    path: Path = Path("/tmp/somewhere")
    timeout: datetime.timedelta = datetime.timedelta(seconds=90)
    pair: tuple[int, float] = (1, 2.0)
    sizes: tuple[int, ...] = (4, 5)
    tags: list[str] = field(default_factory=lambda: ["a", "b"])
    mode: Literal["fast", "slow"] = "fast"
    inner: Inner = field(default_factory=Inner)
    maybe: Inner | None = None
    table: dict[str, Inner] = field(default_factory=lambda: {"k": Inner(size=2)})
    label: str | None = None
    anything: Any = None
    _private: int = 7


@dataclass
class ExperimentConfig(Config):
    """A config holding a trainer config, as a training script would."""

    name: str = "exp"
    lr: float = 1e-4
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(save_folder="/tmp/save"))


@dataclass
class TaggedTrainerConfig(TrainerConfig):
    tag: str = "t"


def trainer(**kwargs: Any) -> TrainerConfig:
    return TrainerConfig(save_folder="/tmp/save", **kwargs)


def full_trainer() -> TrainerConfig:
    """A trainer config with every polymorphic and nested field set."""
    return trainer(
        load_strategy=LoadStrategy.always,
        device="cpu",
        max_duration=Duration.steps(100),
        hard_stop=Duration.tokens(1_000),
        callbacks={"log": ConsoleLoggerCallback(log_interval=3, metrics=["train/*"])},
        steps_to_skip=[StepSkipRange(2, 4), StepSkipRange(10, 11)],
        checkpointer=CheckpointerConfig(save_thread_count=2),
        async_bookkeeping=False,
    )


def config_error(fn: Any, *args: Any, **kwargs: Any) -> ConfigurationError:
    with pytest.raises(ConfigurationError) as info:
        fn(*args, **kwargs)
    return info.value


# -- StrEnum, Duration, StepSkipRange -------------------------------------------------------------


def test_str_enum_members_are_their_strings() -> None:
    assert DurationUnit.steps == "steps"
    assert LoadStrategy.if_available == "if_available"
    assert str(LoadStrategy.always) == "always"
    assert f"{DurationUnit.tokens}" == "tokens"
    assert isinstance(DurationUnit.epochs, str)
    assert {"steps": 1}[DurationUnit.steps] == 1
    assert DurationUnit("tokens") is DurationUnit.tokens
    assert issubclass(LoadStrategy, StrEnum)


def test_duration_constructors() -> None:
    assert Duration.steps(5) == Duration(value=5, unit=DurationUnit.steps)
    assert Duration.epochs(2) == Duration(value=2, unit=DurationUnit.epochs)
    assert Duration.tokens(7) == Duration(value=7, unit=DurationUnit.tokens)
    assert Duration.tokens(1_000_000).describe() == "1,000,000 tokens"
    # str() is OLMo-core's (the dataclass repr with the unit's value quoted)
    assert str(Duration.tokens(1_000_000)) == "Duration(value=1000000, unit='tokens')"
    assert repr(Duration.steps(5)) == "Duration(value=5, unit='steps')"


def test_chinchilla_tokens_is_20_per_param_rounded_down() -> None:
    assert Duration.chinchilla_tokens(1.0, model_params=1_000) == Duration.tokens(20_000)
    assert Duration.chinchilla_tokens(2.5, model_params=10) == Duration.tokens(500)
    # 0.03 * 20 * 3 = 1.8 tokens: rounded down to 1, as OLMo-core does
    assert Duration.chinchilla_tokens(0.03, model_params=3) == Duration.tokens(1)
    assert Duration.chinchilla_tokens(0.01, model_params=3) == Duration.tokens(0)
    assert Duration.chinchilla_tokens(0.29, model_params=100) == Duration.tokens(580)
    assert Duration.chinchilla_tokens(0.5, model_params=3) == Duration.tokens(30)
    with pytest.raises(ValueError):
        Duration.chinchilla_tokens(0, model_params=10)
    with pytest.raises(ValueError):
        Duration.chinchilla_tokens(1.0, model_params=0)


def test_duration_due() -> None:
    steps = Duration.steps(10)
    assert not steps.due(step=9, tokens=10**9, epoch=99)
    assert steps.due(step=10, tokens=0, epoch=1)
    assert steps.due(step=11, tokens=0, epoch=1)

    tokens = Duration.tokens(1_000)
    assert not tokens.due(step=10**6, tokens=999, epoch=99)
    assert tokens.due(step=0, tokens=1_000, epoch=1)

    # epochs are 1-based: training of 2 epochs is done once the 3rd would start
    epochs = Duration.epochs(2)
    assert not epochs.due(step=10**6, tokens=10**9, epoch=1)
    assert not epochs.due(step=0, tokens=0, epoch=2)
    assert epochs.due(step=0, tokens=0, epoch=3)


def test_duration_rejects_negative_value() -> None:
    err = config_error(Duration, value=-1, unit=DurationUnit.steps)
    assert err.path == "value"
    assert "value" in str(err) and "-1" in str(err)
    assert Duration(value=0, unit=DurationUnit.steps).value == 0


def test_step_skip_range_contains() -> None:
    skip = StepSkipRange(start=2, stop=4)
    assert 1 not in skip
    assert 2 in skip
    assert 3 in skip
    assert 4 not in skip
    assert "3" not in skip
    assert 3.0 not in skip


@pytest.mark.parametrize(
    ("start", "stop", "path"), [(5, 5, "stop"), (5, 4, "stop"), (0, 3, "start"), (-1, 3, "start")]
)
def test_step_skip_range_rejects_impossible_ranges(start: int, stop: int, path: str) -> None:
    err = config_error(StepSkipRange, start=start, stop=stop)
    assert err.path == path
    assert str(err).startswith(f"{path}: ")


# -- as_dict --------------------------------------------------------------------------------------


def test_as_dict_defaults_recurse_without_class_names() -> None:
    d = Everything().as_dict()
    assert d["inner"] == {"size": 1, "note": None}
    assert d["table"] == {"k": {"size": 2, "note": None}}
    assert d["maybe"] is None
    assert d["unit"] is DurationUnit.steps  # not JSON-safe: values keep their types
    assert d["path"] == Path("/tmp/somewhere")
    assert d["timeout"] == datetime.timedelta(seconds=90)
    assert d["pair"] == (1, 2.0) and isinstance(d["pair"], tuple)
    assert d["_private"] == 7
    assert CLASS_KEY not in d and CLASS_KEY not in d["inner"]


def test_as_dict_exclude_none_applies_to_nested_configs() -> None:
    d = Everything().as_dict(exclude_none=True)
    assert "maybe" not in d and "label" not in d and "anything" not in d
    assert d["inner"] == {"size": 1}
    assert "name" in d


def test_as_dict_exclude_private_fields() -> None:
    assert "_private" not in Everything().as_dict(exclude_private_fields=True)
    assert "_private" in Everything().as_dict()


def test_as_dict_include_class_name_everywhere() -> None:
    cfg = full_trainer()
    d = cfg.as_dict(include_class_name=True)
    assert d[CLASS_KEY] == "olmolike.train.config.TrainerConfig"
    assert d["max_duration"][CLASS_KEY] == "olmolike.train.common.Duration"
    assert d["checkpointer"][CLASS_KEY] == "olmolike.train.checkpoint.CheckpointerConfig"
    assert d["callbacks"]["log"][CLASS_KEY] == CONSOLE_LOGGER
    assert [s[CLASS_KEY] for s in d["steps_to_skip"]] == ["olmolike.train.common.StepSkipRange"] * 2


def test_as_dict_json_safe() -> None:
    d = Everything(maybe=Inner(size=3)).as_dict(json_safe=True)
    assert d["unit"] == "steps" and type(d["unit"]) is str
    assert d["path"] == "/tmp/somewhere"
    assert d["timeout"] == 90.0
    assert d["pair"] == [1, 2.0]
    assert d["sizes"] == [4, 5]
    assert d["maybe"] == {"size": 3, "note": None}
    assert json.loads(json.dumps(d)) == d


def test_as_dict_json_safe_rejects_values_with_no_config_form() -> None:
    err = config_error(Everything(anything=object()).as_dict, json_safe=True)
    assert err.path == "Everything.anything"
    assert Everything(anything=object()).as_dict()["anything"] is not None


def test_as_dict_without_recursion_keeps_nested_objects() -> None:
    cfg = Everything(maybe=Inner(size=3))
    d = cfg.as_dict(recurse=False)
    assert d["inner"] is cfg.inner
    assert d["maybe"] is cfg.maybe
    assert d["table"] is cfg.table
    assert CLASS_KEY not in d
    assert set(d) == {f.name for f in dataclasses.fields(Everything)}
    flat = Everything().as_dict(
        recurse=False, exclude_none=True, exclude_private_fields=True, include_class_name=True
    )
    assert "maybe" not in flat and "_private" not in flat
    assert flat[CLASS_KEY] == f"{Everything.__module__}.Everything"


# -- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        Everything(),
        Everything(
            name="on",
            unit=DurationUnit.tokens,
            pair=(-3, 0.25),
            sizes=(),
            maybe=Inner(size=0, note="n"),
            table={},
            label="123",
            anything={"x": [1, 2]},
        ),
        trainer(),
        full_trainer(),
        ExperimentConfig(),
    ],
    ids=["everything", "everything-changed", "trainer", "full-trainer", "experiment"],
)
def test_as_config_dict_round_trips_exactly(cfg: Config) -> None:
    data = cfg.as_config_dict()
    assert data[CLASS_KEY] == f"{type(cfg).__module__}.{type(cfg).__qualname__}"
    # JSON- and YAML-safe: plain types only
    assert json.loads(json.dumps(data)) == data
    assert yaml.safe_load(yaml.safe_dump(data)) == data
    rebuilt = type(cfg).from_dict(data)
    assert rebuilt == cfg
    assert type(rebuilt) is type(cfg)
    for f in dataclasses.fields(cfg):
        assert type(getattr(rebuilt, f.name)) is type(getattr(cfg, f.name)), f.name


def test_as_config_dict_leaves_out_private_fields() -> None:
    assert "_private" not in Everything().as_config_dict()
    assert Everything.from_dict(Everything(_private=1).as_config_dict())._private == 7


def test_round_trip_rebuilds_callbacks_and_skip_ranges() -> None:
    rebuilt = TrainerConfig.from_dict(full_trainer().as_config_dict())
    log = rebuilt.callbacks["log"]
    assert type(log) is ConsoleLoggerCallback
    assert (log.log_interval, log.metrics) == (3, ["train/*"])
    assert rebuilt.steps_to_skip == [StepSkipRange(2, 4), StepSkipRange(10, 11)]
    assert rebuilt.load_strategy is LoadStrategy.always
    assert rebuilt.hard_stop == Duration.tokens(1_000)


def test_to_yaml_and_to_json_parse_back() -> None:
    cfg = full_trainer()
    assert TrainerConfig.from_dict(yaml.safe_load(cfg.to_yaml())) == cfg
    assert TrainerConfig.from_dict(json.loads(cfg.to_json())) == cfg
    assert "load_strategy: always" in cfg.to_yaml()


def test_file_round_trip(tmp_path: Path) -> None:
    cfg = full_trainer()
    (tmp_path / "c.yaml").write_text(cfg.to_yaml())
    (tmp_path / "c.json").write_text(cfg.to_json())
    assert TrainerConfig.from_yaml(tmp_path / "c.yaml") == cfg
    assert TrainerConfig.from_json(str(tmp_path / "c.json")) == cfg


def test_files_take_overrides(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(full_trainer().to_yaml())
    (tmp_path / "c.json").write_text(full_trainer().to_json())
    overrides = ["--max_duration.value=7", "--callbacks.log.log_interval=9", "--no_evals"]
    for cfg in (
        TrainerConfig.from_yaml(tmp_path / "c.yaml", overrides),
        TrainerConfig.from_json(tmp_path / "c.json", overrides),
    ):
        assert cfg.max_duration == Duration.steps(7)
        assert cfg.callbacks["log"].log_interval == 9  # type: ignore[attr-defined]
        assert cfg.no_evals is True
        reset = cfg.replace(max_duration=Duration.steps(100), no_evals=False)
        reset.callbacks["log"].log_interval = 3  # type: ignore[attr-defined]
        assert reset == full_trainer()


def test_minimal_handwritten_yaml(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(
        "save_folder: /tmp/run\n"
        "max_duration: {value: 20, unit: steps}\n"
        "load_strategy: never\n"
        "callbacks:\n"
        "  log: {_CLASS_: console_logger, log_interval: 2}\n"
    )
    cfg = TrainerConfig.from_yaml(tmp_path / "c.yaml")
    assert cfg == TrainerConfig(
        save_folder="/tmp/run",
        max_duration=Duration.steps(20),
        load_strategy=LoadStrategy.never,
        callbacks={"log": ConsoleLoggerCallback(log_interval=2)},
    )


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("list.yaml", "- save_folder: /tmp/x\n"),
        ("scalar.yaml", "just a string\n"),
        ("empty.yaml", ""),
        ("list.json", '[{"save_folder": "/tmp/x"}]'),
        ("number.json", "5"),
    ],
)
def test_file_without_a_top_level_mapping_is_a_clear_error(
    tmp_path: Path, name: str, text: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    load = TrainerConfig.from_json if name.endswith(".json") else TrainerConfig.from_yaml
    err = config_error(load, path)
    assert str(path) in str(err)
    assert "mapping at the top level" in str(err)


@pytest.mark.parametrize(("name", "text"), [("bad.yaml", "a: [1\n"), ("bad.json", '{"a":')])
def test_file_with_bad_syntax_is_a_configuration_error(
    tmp_path: Path, name: str, text: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    load = TrainerConfig.from_json if name.endswith(".json") else TrainerConfig.from_yaml
    err = config_error(load, path)
    assert str(path) in str(err)
    assert ("YAML" if name.endswith(".yaml") else "JSON") in str(err)


# -- replace --------------------------------------------------------------------------------------


def test_replace_returns_a_validated_copy() -> None:
    cfg = trainer()
    new = cfg.replace(metrics_collect_interval=7, max_duration=Duration.steps(3))
    assert (new.metrics_collect_interval, new.max_duration) == (7, Duration.steps(3))
    assert (cfg.metrics_collect_interval, cfg.max_duration) == (5, Duration.epochs(1))
    assert type(new) is TrainerConfig
    err = config_error(cfg.replace, metrics_collect_interval=0)
    assert err.path == "metrics_collect_interval"
    assert cfg.metrics_collect_interval == 5


# -- merge: values --------------------------------------------------------------------------------


def test_merge_nested_dotted_keys() -> None:
    cfg = ExperimentConfig().merge(
        ["--trainer.max_duration.value=100", "--trainer.checkpointer.pre_download=true"]
    )
    assert cfg.trainer.max_duration == Duration.epochs(100)
    assert cfg.trainer.checkpointer.pre_download is True
    assert cfg.trainer.save_folder == "/tmp/save"


def test_merge_returns_a_copy() -> None:
    cfg = trainer()
    new = cfg.merge(["--max_duration.value=9", "--metrics_collect_interval=2"])
    assert cfg == trainer()
    assert cfg.max_duration == Duration.epochs(1)
    assert (new.max_duration.value, new.metrics_collect_interval) == (9, 2)
    assert cfg.merge([]) == cfg


def test_merge_bare_key_means_true() -> None:
    cfg = trainer().merge(["--no_evals", "--checkpointer.throttle_uploads", "save_overwrite"])
    assert cfg.no_evals is True
    assert cfg.checkpointer.throttle_uploads is True
    assert cfg.save_overwrite is True
    assert cfg.no_checkpoints is False


def test_merge_booleans_and_null() -> None:
    cfg = trainer(load_optim_state=True).merge(
        ["--no_checkpoints=true", "--load_optim_state=null", "--async_bookkeeping=false"]
    )
    assert cfg.no_checkpoints is True
    assert cfg.load_optim_state is None
    assert cfg.async_bookkeeping is False


def test_merge_last_override_wins() -> None:
    cfg = trainer().merge(["--max_duration.value=1", "--max_duration.value=2"])
    assert cfg.max_duration.value == 2


def test_merge_enum_fields_accept_their_string_values() -> None:
    cfg = trainer().merge(["--load_strategy=always", "--max_duration.unit=tokens"])
    assert cfg.load_strategy is LoadStrategy.always
    assert cfg.max_duration.unit is DurationUnit.tokens


def test_merge_float_fields_accept_exponent_notation() -> None:
    # YAML 1.1 reads "1e-3" as a string; a float field still gets 0.001
    cfg = ExperimentConfig().merge(["--lr=1e-3"])
    assert cfg.lr == 0.001 and type(cfg.lr) is float
    cfg = ExperimentConfig().merge(["--lr=2"])
    assert cfg.lr == 2.0 and type(cfg.lr) is float
    assert Everything().merge(["--lr=3E+2"]).lr == 300.0


def test_merge_int_fields_accept_integral_values_only() -> None:
    assert trainer().merge(["--cancel_check_interval=4.0"]).cancel_check_interval == 4
    err = config_error(trainer().merge, ["--cancel_check_interval=2.5"])
    assert err.path == "cancel_check_interval"


@pytest.mark.parametrize("text", ["on", "123", "1e-3", "null", "true", "[wip", "@run", "a: b: c"])
def test_merge_string_fields_get_the_raw_text(text: str) -> None:
    cfg = ExperimentConfig().merge([f"--name={text}", f"--trainer.save_folder={text}"])
    assert cfg.name == text
    assert cfg.trainer.save_folder == text


def test_merge_optional_string_fields_get_the_raw_text_but_null_unsets() -> None:
    cfg = trainer().merge(["--work_dir=on", "--load_path=123"])
    assert (cfg.work_dir, cfg.load_path) == ("on", "123")
    cfg = trainer(device="cpu", work_dir="/w").merge(["--device=null", "--work_dir=~"])
    assert cfg.device is None
    assert cfg.work_dir is None


def test_merge_empty_value_is_an_empty_string() -> None:
    assert Everything().merge(["--name="]).name == ""


def test_merge_whole_nested_dict() -> None:
    cfg = trainer().merge(["--max_duration={value: 5, unit: steps}"])
    assert cfg.max_duration == Duration.steps(5)
    # a partial mapping updates the existing config rather than replacing it
    cfg = trainer(max_duration=Duration.tokens(9)).merge(["--max_duration={value: 5}"])
    assert cfg.max_duration == Duration.tokens(5)


def test_merge_sub_field_of_a_none_field() -> None:
    cfg = trainer().merge(["--hard_stop.value=5", "--hard_stop.unit=steps"])
    assert cfg.hard_stop == Duration.steps(5)
    cfg = trainer().merge(["--hard_stop={value: 5, unit: tokens}", "--hard_stop.value=6"])
    assert cfg.hard_stop == Duration.tokens(6)
    err = config_error(trainer().merge, ["--hard_stop.value=5"])
    assert err.path == "hard_stop"
    assert "missing required key: unit" in str(err)


def test_merge_unsets_a_nested_config() -> None:
    cfg = trainer(hard_stop=Duration.steps(3)).merge(["--hard_stop=null"])
    assert cfg.hard_stop is None


def test_merge_lists() -> None:
    cfg = trainer().merge(["--steps_to_skip=[{start: 1, stop: 3}, {start: 10, stop: 12}]"])
    assert cfg.steps_to_skip == [StepSkipRange(1, 3), StepSkipRange(10, 12)]
    assert all(type(s) is StepSkipRange for s in cfg.steps_to_skip)
    assert Everything().merge(["--tags=[x, '1']"]).tags == ["x", "1"]
    # only a whole string field gets the raw text; inside a list YAML 1.1 reads ``on`` as true,
    # which a list[str] then rejects rather than turning it into "True"
    assert config_error(Everything().merge, ["--tags=[x, on]"]).path == "tags[1]"
    assert Everything().merge(["--sizes=[7, 8, 9]"]).sizes == (7, 8, 9)


def test_merge_fixed_length_tuples() -> None:
    cfg = Everything().merge(["--pair=[3, 4]"])
    assert cfg.pair == (3, 4.0)
    assert [type(x) for x in cfg.pair] == [int, float]
    err = config_error(Everything().merge, ["--pair=[1, 2, 3]"])
    assert err.path == "pair"
    err = config_error(Everything().merge, ["--pair=[x, 2]"])
    assert err.path == "pair[0]"


def test_merge_dict_of_configs() -> None:
    cfg = Everything().merge(["--table.k.size=4", "--table.new={size: 1, note: n}"])
    assert cfg.table == {"k": Inner(size=4), "new": Inner(size=1, note="n")}


def test_merge_keeps_polymorphic_classes() -> None:
    cfg = TaggedTrainerConfig(save_folder="/s", tag="x").merge(["--no_evals"])
    assert type(cfg) is TaggedTrainerConfig and cfg.tag == "x"
    assert TrainerConfig.from_dict(cfg.as_config_dict()) == cfg
    cfg = trainer(callbacks={"log": ConsoleLoggerCallback(log_interval=2)}).merge(["--no_evals"])
    assert cfg.callbacks == {"log": ConsoleLoggerCallback(log_interval=2)}
    assert type(cfg.callbacks["log"]) is ConsoleLoggerCallback


def test_merge_adds_callbacks() -> None:
    cfg = trainer().merge(["--callbacks={log: {_CLASS_: console_logger, log_interval: 3}}"])
    assert cfg.callbacks == {"log": ConsoleLoggerCallback(log_interval=3)}
    cfg = trainer().merge(
        [
            f"--callbacks.a._CLASS_={CONSOLE_LOGGER}",
            "--callbacks.a.log_interval=4",
            "--callbacks.b={_CLASS_: console_logger}",
            "--callbacks.b.metrics=[loss]",
        ]
    )
    assert cfg.callbacks == {
        "a": ConsoleLoggerCallback(log_interval=4),
        "b": ConsoleLoggerCallback(metrics=["loss"]),
    }


# -- merge and from_dict: errors ------------------------------------------------------------------


def test_configuration_error_is_a_value_error() -> None:
    err = config_error(trainer().merge, ["--max_duration.value=x"])
    assert isinstance(err, ValueError) and isinstance(err, OLMoLikeError)


def test_unknown_top_level_key_lists_valid_keys() -> None:
    err = config_error(trainer().merge, ["--max_duraton=5"])
    assert err.path == "max_duraton"
    assert "unknown key 'max_duraton'" in str(err)
    assert "valid keys of TrainerConfig are: save_folder, work_dir," in str(err)
    assert "max_duration" in err.reason and "steps_to_skip" in err.reason


def test_unknown_nested_key_is_named_by_its_full_path() -> None:
    err = config_error(trainer().merge, ["--max_duration.valu=5"])
    assert err.path == "max_duration.valu"
    assert str(err).startswith("max_duration.valu: unknown key 'valu'")
    assert "valid keys of Duration are: value, unit" in str(err)

    err = config_error(ExperimentConfig().merge, ["--trainer.max_duraton.value=5"])
    assert err.path == "trainer.max_duraton"
    assert str(err).startswith("trainer.max_duraton: ")
    assert "valid keys of TrainerConfig" in str(err)


def test_several_unknown_keys_are_all_named() -> None:
    err = config_error(TrainerConfig.from_dict, {"save_folder": "/s", "zz": 1, "aa": 2})
    assert err.path == ""
    assert "unknown keys 'aa', 'zz'" in str(err)
    err = config_error(
        ExperimentConfig.from_dict, {"trainer": {"save_folder": "/s", "a": 1, "b": 2}}
    )
    assert err.path == "trainer"


@pytest.mark.parametrize(
    ("override", "path", "words"),
    [
        ("--max_duration.value=abc", "max_duration.value", "expected an integer, got 'abc'"),
        ("--max_duration.value=true", "max_duration.value", "expected a number"),
        ("--max_duration.value=[1", "max_duration.value", "expected an integer"),
        ("--max_duration=5", "max_duration", "expected a Duration mapping"),
        ("--no_evals=maybe", "no_evals", "expected true or false"),
        ("--no_evals=1", "no_evals", "expected true or false"),
        ("--save_folder", "save_folder", "expected a string"),
        ("--steps_to_skip=5", "steps_to_skip", "expected a list"),
        ("--steps_to_skip=[{start: x, stop: 3}]", "steps_to_skip[0].start", "integer"),
        ("--callbacks=[1]", "callbacks", "expected a mapping"),
        ("--save_folder.x=1", "save_folder", "has no field 'x'"),
        ("--load_optim_state=yes please", "load_optim_state", "expected true or false"),
    ],
)
def test_wrong_types_name_the_dotted_path(override: str, path: str, words: str) -> None:
    err = config_error(trainer().merge, [override])
    assert err.path == path
    assert str(err).startswith(f"{path}: ")
    assert words in str(err)


def test_wrong_type_deep_in_a_wrapper_config() -> None:
    err = config_error(ExperimentConfig().merge, ["--trainer.max_duration.value=abc"])
    assert err.path == "trainer.max_duration.value"
    err = config_error(ExperimentConfig().merge, ["--trainer.steps_to_skip=[{start: 1, stop: 1}]"])
    assert err.path == "trainer.steps_to_skip[0].stop"


def test_other_type_errors() -> None:
    err = config_error(Everything().merge, ["--mode=medium"])
    assert err.path == "mode" and "fast" in str(err) and "slow" in str(err)
    err = config_error(Everything().merge, ["--timeout=soon"])
    assert err.path == "timeout"
    assert Everything().merge(["--timeout=2.5"]).timeout == datetime.timedelta(seconds=2.5)
    err = config_error(Everything().merge, ["--path=[1]"])
    assert err.path == "path"
    err = config_error(Everything().merge, ["--maybe=5"])
    assert err.path == "maybe"
    err = config_error(Everything.from_dict, [1, 2])
    assert "expected a Everything mapping" in str(err)


@pytest.mark.parametrize(
    ("override", "path"),
    [
        ("--metrics_collect_interval=0", "metrics_collect_interval"),
        ("--cancel_check_interval=-3", "cancel_check_interval"),
        ("--bookkeeping_soft_timeout=0", "bookkeeping_soft_timeout"),
        ("--save_folder=", "save_folder"),
        ("--max_duration.value=-1", "max_duration.value"),
        ("--hard_stop={value: -1, unit: steps}", "hard_stop.value"),
        ("--checkpointer.save_thread_count=0", "checkpointer.save_thread_count"),
        ("--steps_to_skip=[{start: 5, stop: 5}]", "steps_to_skip[0].stop"),
        ("--steps_to_skip=[{start: 1, stop: 2}, {start: 0, stop: 3}]", "steps_to_skip[1].start"),
        ("--device=notadevice", "device"),
    ],
)
def test_impossible_values_name_the_dotted_path(override: str, path: str) -> None:
    err = config_error(trainer().merge, [override])
    assert err.path == path
    assert str(err).startswith(f"{path}: ")


def test_impossible_values_on_construction() -> None:
    assert config_error(trainer, metrics_collect_interval=0).path == "metrics_collect_interval"
    err = config_error(trainer, device="notadevice")
    assert err.path == "device" and "notadevice" in str(err)
    assert trainer(device="cpu").device == "cpu"
    assert config_error(TrainerConfig, save_folder="").path == "save_folder"


def test_invalid_enum_value_lists_the_choices() -> None:
    err = config_error(trainer().merge, ["--load_strategy=sometimes"])
    assert err.path == "load_strategy"
    assert "'sometimes' is not a valid LoadStrategy" in str(err)
    assert "if_available, always, never" in str(err)
    err = config_error(trainer().merge, ["--max_duration.unit=days"])
    assert err.path == "max_duration.unit"
    assert "steps, epochs, tokens" in str(err)


def test_missing_required_key() -> None:
    err = config_error(TrainerConfig.from_dict, {})
    assert "missing required key: save_folder" in str(err)
    err = config_error(TrainerConfig.from_dict, {"save_folder": "/s", "max_duration": {}})
    assert err.path == "max_duration"
    assert "missing required keys: value, unit" in str(err)


def test_empty_override_is_rejected() -> None:
    assert "empty override" in str(config_error(trainer().merge, ["--"]))


def test_nested_error_paths_in_from_dict() -> None:
    data = {"trainer": {"save_folder": "/s", "callbacks": {"log": {"log_interval": "x"}}}}
    data["trainer"]["callbacks"]["log"][CLASS_KEY] = "console_logger"
    err = config_error(ExperimentConfig.from_dict, data)
    assert err.path == "trainer.callbacks.log.log_interval"


# -- TrainerConfig --------------------------------------------------------------------------------


def test_trainer_config_defaults_match_the_reference() -> None:
    with pytest.raises(TypeError):
        TrainerConfig()  # type: ignore[call-arg]
    cfg = TrainerConfig(save_folder="/tmp/save")
    expected = {
        "save_folder": "/tmp/save",
        "work_dir": None,
        "load_path": None,
        "load_strategy": LoadStrategy.if_available,
        "load_optim_state": None,
        "load_trainer_state": None,
        "checkpointer": CheckpointerConfig(),
        "device": None,
        "save_overwrite": False,
        "max_duration": Duration.epochs(1),
        "cancel_check_interval": 25,
        "hard_stop": None,
        "metrics_collect_interval": 5,
        "callbacks": {},
        "async_bookkeeping": None,
        "bookkeeping_soft_timeout": 30,
        "train_timeout_seconds": 300,
        "no_checkpoints": False,
        "no_evals": False,
        "steps_to_skip": None,
        "checkpoints_to_eval": None,
    }
    assert cfg.as_dict(recurse=False) == expected
    assert cfg.load_strategy == "if_available"
    # mutable defaults are not shared between instances
    assert cfg.callbacks is not TrainerConfig(save_folder="/x").callbacks
    assert cfg.max_duration is not TrainerConfig(save_folder="/x").max_duration


def test_add_callback_rejects_a_duplicate_name() -> None:
    cfg = trainer()
    first = ConsoleLoggerCallback(log_interval=1)
    cfg.add_callback("log", first)
    err = config_error(cfg.add_callback, "log", ConsoleLoggerCallback(log_interval=2))
    assert err.path == "callbacks"
    assert "'log'" in str(err)
    assert cfg.callbacks == {"log": first}
    cfg.add_callbacks({"other": ConsoleLoggerCallback()})
    assert list(cfg.callbacks) == ["log", "other"]


def test_with_callbacks_returns_a_new_config() -> None:
    original = trainer(callbacks={"a": ConsoleLoggerCallback()})
    one = original.with_callback("b", ConsoleLoggerCallback(log_interval=2))
    two = one.with_callbacks({"c": ConsoleLoggerCallback(), "d": ConsoleLoggerCallback()})
    assert list(original.callbacks) == ["a"]
    assert list(one.callbacks) == ["a", "b"]
    assert list(two.callbacks) == ["a", "b", "c", "d"]
    assert one is not original and one.callbacks is not original.callbacks
    with pytest.raises(ConfigurationError):
        one.with_callback("a", ConsoleLoggerCallback())
    assert list(one.callbacks) == ["a", "b"]


# -- polymorphic fields and the class registry ----------------------------------------------------


@pytest.mark.parametrize("name", ["console_logger", CONSOLE_LOGGER])
def test_callbacks_built_from_registered_names(name: str) -> None:
    cfg = TrainerConfig.from_dict(
        {"save_folder": "/s", "callbacks": {"log": {CLASS_KEY: name, "log_interval": 10}}}
    )
    assert type(cfg.callbacks["log"]) is ConsoleLoggerCallback
    assert cfg.callbacks["log"] == ConsoleLoggerCallback(log_interval=10)


def test_lookup_registered_class() -> None:
    assert lookup_registered_class("console_logger", Callback) is ConsoleLoggerCallback
    assert lookup_registered_class(CONSOLE_LOGGER, Callback) is ConsoleLoggerCallback
    assert lookup_registered_class("olmolike.train.common.Duration", Config) is Duration
    err = config_error(lookup_registered_class, "nope", Callback, "x.y")
    assert err.path == "x.y"
    assert "console_logger" in str(err)  # lists the registered Callback classes
    assert "Duration" not in str(err)


@pytest.mark.parametrize(
    "name",
    ["os.system", "subprocess.Popen", "builtins.eval", "builtins.exec", "os", "", "console"],
)
def test_unregistered_class_names_are_rejected(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []

    def record(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        raise AssertionError("called")

    monkeypatch.setattr(os, "system", record)
    monkeypatch.setattr(subprocess, "Popen", record)
    monkeypatch.setattr(builtins, "eval", record)
    monkeypatch.setattr(builtins, "exec", record)
    data = {
        "save_folder": "/s",
        "callbacks": {"evil": {CLASS_KEY: name, "args": "touch /tmp/pwned", "command": "id"}},
    }
    err = config_error(TrainerConfig.from_dict, data)
    assert err.path == "callbacks.evil"
    assert f"unknown class {name!r}" in str(err)
    assert calls == []
    err = config_error(TrainerConfig.from_dict, {CLASS_KEY: name, "save_folder": "/s"})
    assert err.path == ""
    assert calls == []


def _not_yet_imported_module() -> str:
    for name in ("ftplib", "smtplib", "imaplib", "poplib", "mailbox", "this"):
        if name not in sys.modules:
            return name
    pytest.skip("every candidate module is already imported")


def test_config_files_can_never_import_a_module(tmp_path: Path) -> None:
    module = _not_yet_imported_module()
    for name in (module, f"{module}.Anything", f"{module}:Anything"):
        path = tmp_path / "c.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "save_folder": "/s",
                    "max_duration": {CLASS_KEY: name, "value": 1, "unit": "steps"},
                    "callbacks": {"x": {CLASS_KEY: name}},
                }
            )
        )
        with pytest.raises(ConfigurationError, match="unknown class"):
            TrainerConfig.from_yaml(path)
        with pytest.raises(ConfigurationError, match="unknown class"):
            trainer().merge([f"--callbacks.x._CLASS_={name}"])
        with pytest.raises(ConfigurationError, match="unknown class"):
            trainer().merge([f"--callbacks={{x: {{_CLASS_: {name}}}}}"])
        assert module not in sys.modules


def test_registered_class_of_the_wrong_kind_is_rejected() -> None:
    duration = "olmolike.train.common.Duration"
    data = {"save_folder": "/s", "callbacks": {"c": {CLASS_KEY: duration, "value": 1}}}
    err = config_error(TrainerConfig.from_dict, data)
    assert err.path == "callbacks.c"
    assert "is not a Callback" in str(err)
    err = config_error(
        TrainerConfig.from_dict, {"save_folder": "/s", "max_duration": {CLASS_KEY: CONSOLE_LOGGER}}
    )
    assert err.path == "max_duration" and "is not a Duration" in str(err)
    err = config_error(TaggedTrainerConfig.from_dict, trainer().as_config_dict())
    assert "is not a TaggedTrainerConfig" in str(err)


def test_class_name_must_be_a_string() -> None:
    data = {"save_folder": "/s", "callbacks": {"c": {CLASS_KEY: ["console_logger"]}}}
    err = config_error(TrainerConfig.from_dict, data)
    assert err.path == "callbacks.c._CLASS_"


def test_subclass_selected_by_class_name() -> None:
    name = f"{TaggedTrainerConfig.__module__}.TaggedTrainerConfig"
    cfg = TrainerConfig.from_dict({CLASS_KEY: name, "save_folder": "/s", "tag": "z"})
    assert type(cfg) is TaggedTrainerConfig and cfg.tag == "z"
    err = config_error(TrainerConfig.from_dict, {"save_folder": "/s", "tag": "z"})
    assert err.path == "tag"


def test_register_config_class() -> None:
    class NotADataclass:
        pass

    with pytest.raises(TypeError):
        register_config_class(NotADataclass)

    @dataclass
    class Plain:
        x: int = 0

    register_config_class(Plain, "test_config_plain_alias")
    assert lookup_registered_class("test_config_plain_alias", Plain) is Plain
    register_config_class(Plain, "test_config_plain_alias")  # the same class again is fine

    @dataclass
    class Other:
        y: int = 0

    with pytest.raises(ValueError, match="already registered"):
        register_config_class(Other, "test_config_plain_alias")
    with pytest.raises(ValueError, match="already registered"):
        register_config_class(Other, "console_logger")
    assert lookup_registered_class("console_logger", Callback) is ConsoleLoggerCallback


def test_config_subclasses_register_themselves() -> None:
    @dataclass
    class Local(Config):
        n: int = 1

    name = f"{Local.__module__}.{Local.__qualname__}"
    assert lookup_registered_class(name, Config) is Local
    assert Local.from_dict({CLASS_KEY: name, "n": 2}) == Local(n=2)


def test_a_callback_without_class_name_is_an_error_not_an_inert_callback() -> None:
    from olmolike.train import TrainerConfig

    with pytest.raises(ConfigurationError, match=r"callbacks\.mine: needs a _CLASS_ key") as info:
        TrainerConfig.from_dict({"save_folder": "x", "callbacks": {"mine": {}}})
    assert "console_logger" in str(info.value)


def test_yaml_config_can_be_read_through_fsspec() -> None:
    import fsspec

    from olmolike.train import TrainerConfig

    with fsspec.open("memory://configs/run.yaml", "w") as f:
        f.write("save_folder: s3://bucket/run\nmax_duration: {value: 7, unit: steps}\n")
    config = TrainerConfig.from_yaml("memory://configs/run.yaml")
    assert config.max_duration.value == 7


@pytest.mark.parametrize("raw", ["yes", "no", "on", "off", "y", "1"])
def test_a_bool_override_takes_only_true_or_false(raw: str) -> None:
    from olmolike.train import TrainerConfig

    with pytest.raises(
        ConfigurationError, match=rf"^no_checkpoints: expected true or false.*{raw}"
    ):
        TrainerConfig(save_folder="x").merge([f"--no_checkpoints={raw}"])
    merged = TrainerConfig(save_folder="x").merge(["--no_checkpoints=True", "--save_overwrite"])
    assert merged.no_checkpoints is True and merged.save_overwrite is True


def test_an_override_with_a_space_for_equals_is_named() -> None:
    from olmolike.train import TrainerConfig

    with pytest.raises(
        ConfigurationError, match=r"^metrics_collect_interval: .*write --metrics_collect_interval=4"
    ):
        TrainerConfig(save_folder="x").merge(["--metrics_collect_interval", "4"])
    with pytest.raises(ConfigurationError, match=r"'4' is not an override"):
        TrainerConfig(save_folder="x").merge(["4"])


def test_max_duration_zero_is_a_config_error() -> None:
    from olmolike.train import TrainerConfig

    with pytest.raises(ConfigurationError, match=r"^max_duration\.value: must be >= 1"):
        TrainerConfig(save_folder="x").merge(["--max_duration.value=0"])


def test_a_negative_max_duration_names_the_bound_that_zero_also_fails() -> None:
    from olmolike.train import TrainerConfig

    with pytest.raises(ConfigurationError, match=r"^max_duration\.value: .*>= 1 for a max_dur"):
        TrainerConfig(save_folder="x").merge(["--max_duration.value=-5"])
