"""OLMo-core's Config surface: overrides in from_dict, merge options, apply/copy, from_file,
nested plain dataclasses, sets, registered names, and the None-dropping config dict."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from olmolike.config import CLASS_KEY, Config, StrEnum
from olmolike.exceptions import ConfigurationError
from olmolike.train import Duration, DurationUnit, TrainerConfig
from olmolike.train.callbacks import ConsoleLoggerCallback


@dataclass
class Point:
    """A plain dataclass (not a Config) nested in a config."""

    x: int
    y: int
    _hidden: int = 0


@dataclass
class Shape(Config):
    corner: Point
    name: str
    tags: set[str] = field(default_factory=set)
    width: int | None = None
    height: int | None = 7


@dataclass
class Pair(Config):
    left: Shape
    right: Shape | None = None


def shape(**kw: object) -> Shape:
    return Shape(corner=Point(x=1, y=2), name="s", **kw)  # type: ignore[arg-type]


def test_class_name_field_is_the_class_key() -> None:
    assert Config.CLASS_NAME_FIELD == CLASS_KEY == "_CLASS_"


def test_nested_plain_dataclass_round_trips_and_merges() -> None:
    s = shape()
    data = s.as_dict()
    assert data["corner"] == {"x": 1, "y": 2, "_hidden": 0}
    assert Shape.from_dict(data) == s
    assert isinstance(Shape.from_dict(data).corner, Point)
    moved = Shape.from_dict(data, overrides=["corner.x=0"])
    assert moved.corner.x == 0
    assert data["corner"]["x"] == 1, "from_dict(overrides=) must not modify the input"
    assert moved.merge(["--corner.y=-1"]).corner == Point(x=0, y=-1)
    assert s.as_dict(recurse=False) == {
        "corner": s.corner,
        "name": "s",
        "tags": set(),
        "width": None,
        "height": 7,
    }


def test_class_names_are_module_dot_class_name_even_for_local_classes() -> None:
    @dataclass
    class Local(Config):
        inner: Point
        z: str

    cfg = Local(inner=Point(x=1, y=2), z="z")
    assert cfg.as_config_dict() == {
        CLASS_KEY: f"{__name__}.Local",
        "z": "z",
        "inner": {CLASS_KEY: f"{__name__}.Point", "x": 1, "y": 2},
    }
    assert Local.from_dict(cfg.as_config_dict()) == cfg


def test_sets_are_written_as_sorted_lists_and_read_back_as_sets() -> None:
    s = shape(tags={"b", "a"})
    data = s.as_config_dict()
    assert data["tags"] == ["a", "b"]
    assert json.loads(json.dumps(data)) == data
    assert Shape.from_dict(data).tags == {"a", "b"}
    assert s.as_dict()["tags"] == {"a", "b"}  # not json_safe: stays a set


def test_as_config_dict_drops_none_only_where_none_is_the_default() -> None:
    s = shape(height=None)
    data = s.as_config_dict()
    assert "width" not in data  # default None: dropped, as OLMo-core does
    assert data["height"] is None  # default 7: kept, or the dict would rebuild height=7
    assert Shape.from_dict(data) == s
    assert "right" not in Pair(left=s).as_config_dict()


def test_as_dict_exclude_applies_at_every_level() -> None:
    p = Pair(left=shape(), right=shape())
    data = p.as_dict(exclude={"name", "right"})
    assert "right" not in data
    assert "name" not in data["left"]
    assert p.as_dict(exclude=["x"], recurse=True)["left"]["corner"] == {"y": 2, "_hidden": 0}


def test_include_registered_name_and_type_key_on_load() -> None:
    cfg = TrainerConfig(save_folder="/s", callbacks={"log": ConsoleLoggerCallback(log_interval=3)})
    assert "type" not in cfg.as_dict(include_class_name=True)["callbacks"]["log"]
    data = cfg.as_dict(include_registered_name=True)
    assert data["callbacks"]["log"]["type"] == "console_logger"
    assert "type" not in data  # TrainerConfig has no short name
    assert cfg.as_config_dict()["callbacks"]["log"]["type"] == "console_logger"
    assert TrainerConfig.from_dict(cfg.as_config_dict()) == cfg
    # ``type`` alone picks the registered class, as in OLMo-core files.
    built = TrainerConfig.from_dict(
        {"save_folder": "/s", "callbacks": {"log": {"type": "console_logger", "log_interval": 4}}}
    )
    assert built.callbacks["log"] == ConsoleLoggerCallback(log_interval=4)
    with pytest.raises(ConfigurationError, match="unknown class 'nope'"):
        TrainerConfig.from_dict({"save_folder": "/s", "callbacks": {"c": {"type": "nope"}}})


def test_merge_non_strict_skips_unknown_top_level_keys() -> None:
    s = shape()
    merged = s.merge(["--name=b", "--corner.x=0", "--baz.booz=0"], strict=False)
    assert (merged.name, merged.corner.x) == ("b", 0)
    with pytest.raises(ConfigurationError, match="baz"):
        s.merge(["--baz.booz=0"])
    with pytest.raises(ConfigurationError, match=r"corner\.nope"):
        s.merge(["--corner.nope=1"], strict=False)  # below a known field: still checked


def test_merge_with_prefix_uses_only_that_prefix() -> None:
    s = shape()
    merged = s.merge(["--shape.name=b", "shape.corner.x=0", "--other.name=c"], prefix="shape")
    assert (merged.name, merged.corner.x) == ("b", 0)
    assert s.merge(["--other.name=c"], prefix="shape") == s


def test_apply_visits_every_nested_config() -> None:
    p = Pair(left=shape(), right=shape())
    seen: list[str] = []
    p.apply(lambda c: seen.append(type(c).__name__))
    assert seen == ["Pair", "Shape", "Shape"]

    def widen(c: Config) -> None:
        if isinstance(c, Shape):
            c.width = 3

    p.apply(widen)
    assert p.left.width == p.right.width == 3  # type: ignore[union-attr]
    durations: list[Duration] = []
    TrainerConfig(save_folder="/s", hard_stop=Duration.steps(3)).apply(
        lambda c: durations.append(c) if isinstance(c, Duration) else None
    )
    assert [d.unit for d in durations] == [DurationUnit.epochs, DurationUnit.steps]


def test_copy_deep_and_shallow() -> None:
    s = shape(tags={"a"})
    deep, shallow = s.copy(), s.copy(deep=False)
    assert deep == s and shallow == s
    assert deep.corner is not s.corner
    assert shallow.corner is s.corner
    deep.corner.x = 9
    assert s.corner.x == 1


def test_from_file_picks_the_format_by_extension(tmp_path: Path) -> None:
    s = shape(tags={"t"})
    (tmp_path / "c.yaml").write_text(s.to_yaml())
    (tmp_path / "c.yml").write_text(s.to_yaml())
    (tmp_path / "c.json").write_text(s.to_json())
    for name in ("c.yaml", "c.yml", "c.json"):
        assert Shape.from_file(tmp_path / name) == s
        assert Shape.from_file(str(tmp_path / name), overrides=["name=x"]).name == "x"
    (tmp_path / "c.toml").write_text("")
    with pytest.raises(ConfigurationError, match=r"\.yaml, \.yml or \.json"):
        Shape.from_file(tmp_path / "c.toml")


def test_ignore_fields_let_old_files_load() -> None:
    @dataclass
    class Renamed(Config):
        _IGNORE_FIELDS = ("old_knob",)
        knob: int = 1

    assert Renamed.from_dict({"knob": 2, "old_knob": 5}) == Renamed(knob=2)
    with pytest.raises(ConfigurationError, match="other"):
        Renamed.from_dict({"other": 5})


def test_class_names_never_import_code() -> None:
    module = "xml.dom.pulldom"  # importable, not imported by olmolike
    sys.modules.pop(module, None)
    with pytest.raises(ConfigurationError, match="config files cannot import code"):
        TrainerConfig.from_dict(
            {"save_folder": "/s", "callbacks": {"x": {CLASS_KEY: f"{module}.PullDOM"}}}
        )
    assert module not in sys.modules


def test_str_enum_repr_is_its_quoted_value() -> None:
    class Color(StrEnum):
        red = "red"

    assert repr(Color.red) == "'red'"
    assert str(Color.red) == "red"
