"""Dataclass configs that round-trip through dicts, YAML, JSON and command-line overrides.

Every config is a ``@dataclass`` subclass of :class:`Config`. Values coming from a file or the
command line are checked against the field's type annotation and converted where the
conversion is lossless (``"1e-3"`` -> ``0.001`` for a float field, ``"steps"`` -> an enum member).
A mistake raises :class:`~olmolike.exceptions.ConfigurationError` naming the dotted path of the
field, so ``--trainer.max_duraton.value=5`` fails with the list of valid keys instead of being
silently ignored.

Polymorphic fields (e.g. a dict of callbacks) carry a ``_CLASS_`` key. It is resolved through an
explicit registry of classes that were imported and registered by the program itself: a config
file can name a registered class, but never import one. (OLMo-core's ``Config.from_dict``
imports whatever module a ``_CLASS_`` names; olmolike keeps the same key and the same
``module.ClassName`` spelling but only resolves names the program has registered.)
"""

from __future__ import annotations

import copy as copy_module
import dataclasses
import datetime
import enum
import functools
import json
import logging
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import fsspec
import torch
import yaml

from .config_dict import (
    _BASES_NEEDING_CLASS,
    _REGISTRY,
    CLASS_KEY,
    TYPE_KEY,
    DictOptions,
    _is_subclass,
    apply_to_configs,
    class_keys,
    init_fields,
    keep_field,
    lookup_registered_class,
    own_names,
    register_config_class,
    registered_name,
    require_class_name,
    to_plain,
    with_prefix,
)
from .exceptions import ConfigurationError

__all__ = [
    "CLASS_KEY",
    "Config",
    "DType",
    "StrEnum",
    "lookup_registered_class",
    "register_config_class",
    "registered_name",
    "require_class_name",
]

log = logging.getLogger(__name__)


C = TypeVar("C", bound="Config")


class StrEnum(str, enum.Enum):
    """A string-valued enum (``enum.StrEnum`` exists only from Python 3.11).

    Members compare equal to their values, so ``LoadStrategy.always == "always"``, which makes
    command-line overrides and YAML files need no special syntax.
    """

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return repr(self.value)


class DType(StrEnum):
    """A floating-point dtype by name, for config fields (``--x.param_dtype=bfloat16``)."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"

    def as_pt(self) -> torch.dtype:
        return {
            DType.float32: torch.float32,
            DType.bfloat16: torch.bfloat16,
            DType.float16: torch.float16,
        }[self]


@dataclasses.dataclass
class Config:
    """Base class for configuration dataclasses.

    Subclasses override :meth:`validate` to reject impossible values; it runs on construction
    and again whenever a config is rebuilt (``from_dict``, ``merge``) or built into an object.
    """

    CLASS_NAME_FIELD: ClassVar[str] = CLASS_KEY
    """The key that names a value's class in dicts and files (``"_CLASS_"``)."""

    _IGNORE_FIELDS: ClassVar[tuple[str, ...]] = ()
    """Keys that :meth:`from_dict` drops for this class instead of rejecting them: fields that
    were removed, so that files written by older versions still load."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # The class exists because the program defined or imported it, so naming it in a file
        # never runs new code. Re-definition (a reloaded module) replaces the old entry.
        for name in own_names(cls):
            _REGISTRY[name] = cls

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigurationError` (use :meth:`_invalid`) if a value is impossible."""

    def _invalid(self, field: str, reason: str) -> ConfigurationError:
        return ConfigurationError(reason, path=field)

    # -- serialization ---------------------------------------------------------------------

    def as_dict(
        self,
        *,
        exclude_none: bool = False,
        exclude_private_fields: bool = False,
        exclude: Collection[str] | None = None,
        include_class_name: bool = False,
        include_registered_name: bool = False,
        json_safe: bool = False,
        recurse: bool = True,
    ) -> dict[str, Any]:
        """Convert to a dict.

        :param exclude: field names left out, at every level of nesting.
        :param include_class_name: add ``_CLASS_: module.ClassName`` to every dataclass.
        :param include_registered_name: add ``type: short_name`` to every value whose class is
            registered under a short name (e.g. ``type: console_logger`` for a callback).
        :param json_safe: enums become their values, paths strings, durations seconds, tuples
            and sets lists; anything else that is not plain data is an error.
        :param recurse: ``False`` leaves nested configs as objects.
        """
        options = DictOptions(
            exclude_none=exclude_none,
            exclude_private_fields=exclude_private_fields,
            exclude=frozenset(exclude or ()),
            include_class_name=include_class_name,
            include_registered_name=include_registered_name,
            json_safe=json_safe,
        )
        if not recurse:
            return class_keys(self, options) | {
                f.name: getattr(self, f.name)
                for f in init_fields(type(self))
                if keep_field(f, getattr(self, f.name), options)
            }
        out = to_plain(self, options, type(self).__name__)
        assert isinstance(out, dict)
        return out

    def as_config_dict(self) -> dict[str, Any]:
        """A JSON/YAML-safe dict with ``_CLASS_`` names, which :meth:`from_dict` rebuilds exactly.

        Like OLMo-core it leaves out ``None`` values, but only where ``None`` is the field's
        default, so that the dict still rebuilds the same config.
        """
        options = DictOptions(
            exclude_private_fields=True,
            include_class_name=True,
            include_registered_name=True,
            json_safe=True,
            exclude_default_none=True,
        )
        out = to_plain(self, options, type(self).__name__)
        assert isinstance(out, dict)
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.as_config_dict(), sort_keys=False)

    def to_json(self) -> str:
        return json.dumps(self.as_config_dict(), indent=2)

    @classmethod
    def from_dict(
        cls: type[C],
        data: Mapping[str, Any],
        overrides: Sequence[str] | None = None,
        *,
        path: str = "",
    ) -> C:
        """Build from a (possibly nested) mapping, checking keys and types on the way.

        :param overrides: dotted overrides applied to ``data`` first (see :meth:`merge`);
            ``data`` itself is not modified.
        """
        if overrides:
            data = _apply_overrides(copy_module.deepcopy(dict(data)), overrides)
        built = _coerce(data, cls, path)
        assert isinstance(built, cls)
        return built

    @classmethod
    def from_file(cls: type[C], path: str | Path, overrides: Sequence[str] | None = None) -> C:
        """Load a ``.yaml``/``.yml`` or ``.json`` file, chosen by its extension."""
        name = str(path)
        if name.endswith((".yaml", ".yml")):
            return cls.from_yaml(path, overrides)
        if name.endswith(".json"):
            return cls.from_json(path, overrides)
        raise ConfigurationError(
            f"cannot tell the format of {name!r}: config files end in .yaml, .yml or .json"
        )

    @classmethod
    def from_yaml(cls: type[C], path: str | Path, overrides: Sequence[str] | None = None) -> C:
        """Load a YAML file (local or any fsspec URL), then apply dotted ``overrides``."""
        return cls._from_file(path, overrides or (), yaml.safe_load, yaml.YAMLError, "YAML")

    @classmethod
    def from_json(cls: type[C], path: str | Path, overrides: Sequence[str] | None = None) -> C:
        """Load a JSON file (local or any fsspec URL), then apply dotted ``overrides``."""
        return cls._from_file(path, overrides or (), json.load, json.JSONDecodeError, "JSON")

    @classmethod
    def _from_file(
        cls: type[C],
        path: str | Path,
        overrides: Sequence[str],
        parse: Callable[[Any], Any],
        parse_error: type[Exception],
        kind: str,
    ) -> C:
        with fsspec.open(str(path), "r", encoding="utf-8") as f:
            try:
                data = parse(f)
            except parse_error as e:
                raise ConfigurationError(f"{path} is not valid {kind}: {e}") from None
        return cls._from_file_data(data, path).merge(overrides)

    @classmethod
    def _from_file_data(cls: type[C], data: Any, source: str | Path) -> C:
        if not isinstance(data, Mapping):
            raise ConfigurationError(f"{source} must hold a mapping at the top level")
        return cls.from_dict(data)

    def replace(self: C, **changes: Any) -> C:
        """A copy with some fields changed (validated like any construction)."""
        return dataclasses.replace(self, **changes)

    def copy(self: C, deep: bool = True) -> C:
        """A copy of this config; ``deep=False`` shares nested values with the original."""
        return copy_module.deepcopy(self) if deep else copy_module.copy(self)

    def apply(self, func: Callable[[Config], None]) -> None:
        """Call ``func`` on this config and on every config nested in it (in fields, lists,
        tuples, sets and dict values), parents before children."""
        apply_to_configs(self, func, Config)

    def merge(self: C, dotlist: Sequence[str], prefix: str | None = None, strict: bool = True) -> C:
        """Return a copy with dotted overrides applied.

        Each item is ``[--]dotted.key=value``; the value is parsed with ``yaml.safe_load`` (so
        ``true``, ``5``, ``[1, 2]`` and ``{value: 5, unit: steps}`` all work), and a bare
        ``--dotted.key`` means ``true``. Booleans are ``true``/``false`` only: ``yes``, ``on``
        and the like are refused by a bool field, and ``--key value`` (no ``=``) is an error.
        String fields receive the raw text, so ``--name=on`` stays the string ``"on"``.

        :param prefix: use only the items whose key starts with ``prefix.``, without it (one
            command line can then hold overrides for several configs).
        :param strict: ``False`` skips items whose first key is not a field of this config
            instead of rejecting them; keys below a field are still checked.
        """
        items = list(dotlist)
        for previous, item in zip([None, *items], items, strict=False):
            _check_separated_value(previous, item)
        if prefix is not None:
            items = with_prefix(items, prefix)
        if not strict:
            names = {f.name for f in init_fields(type(self))}
            items = [i for i in items if _parse_override(i)[0][0] in names]
        if not items:
            return self
        data = self.as_dict(include_class_name=True)
        return type(self).from_dict(_apply_overrides(data, items))


def _apply_overrides(data: dict[str, Any], items: Sequence[str]) -> dict[str, Any]:
    for item in items:
        keys, value = _parse_override(item)
        _set_in(data, keys, value)
    return data


# -- conversion from plain data ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _CliValue:
    """An override from the command line: the raw text and its YAML parse."""

    raw: str
    parsed: Any


def _check_separated_value(previous: str | None, item: str) -> None:
    """``--model.n_layers 4`` (a space for ``=``) is named as such, not as an unknown key 4."""
    if "=" in item or item.startswith("-") or re.fullmatch(r"[A-Za-z_][\w.]*", item):
        return  # an override, or a bare key (``save_overwrite``: true)
    if previous is not None and "=" not in previous:
        key = previous.lstrip("-")
        raise ConfigurationError(
            f"got {previous!r} then {item!r}; overrides take '=': write --{key}={item}", path=key
        )
    raise ConfigurationError(f"{item!r} is not an override; expected --dotted.key=value")


def _parse_override(item: str) -> tuple[list[str], Any]:
    text = item.lstrip("-")
    if not text:
        raise ConfigurationError(f"empty override {item!r}; expected --dotted.key=value")
    key, sep, raw = text.partition("=")
    if not sep:
        return key.split("."), True
    try:
        parsed = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        # Not YAML (e.g. ``@run`` or ``a: b: c``) but still fine for a string field, which takes
        # the raw text; any other field rejects the text with its path when it is coerced.
        parsed = raw
    if isinstance(parsed, bool) and raw.strip().lower() not in ("true", "false"):
        # YAML 1.1 reads yes/no/on/off/y/n as booleans; on a command line only true/false are,
        # so ``--no_checkpoints=yes`` is refused by a bool field rather than silently taken.
        parsed = raw
    return key.split("."), _CliValue(raw, parsed)


def _set_in(data: dict[str, Any], keys: list[str], value: Any) -> None:
    node = data
    for i, key in enumerate(keys[:-1]):
        child = node.get(key)
        if isinstance(child, _CliValue):
            # An earlier override set the whole field (``--hard_stop={...}``): refine its value.
            child = node[key] = child.parsed
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            raise ConfigurationError(
                f"is a {type(child).__name__}, it has no field {keys[i + 1]!r}",
                path=".".join(keys[: i + 1]),
            )
        node = child
    last = node.get(keys[-1])
    parsed = value.parsed if isinstance(value, _CliValue) else value
    if isinstance(last, dict) and isinstance(parsed, Mapping):
        last.update(parsed)
    else:
        node[keys[-1]] = value


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp``, converting losslessly where needed."""
    if isinstance(value, _CliValue):
        value = value.raw if _accepts_raw_string(tp, value.parsed) else value.parsed
    if tp is Any or tp is object:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, typing.get_args(tp), path)
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigurationError(f"must be one of {typing.get_args(tp)}, got {value!r}", path=path)
    if origin in (list, Sequence, tuple, dict, Mapping, set, frozenset, AbstractSet):
        return _coerce_container(value, tp, origin, path)
    if tp is type(None):
        if value is None:
            return None
        raise ConfigurationError(f"must be null, got {value!r}", path=path)
    if isinstance(tp, type):
        return _coerce_class(value, tp, path)
    return value


def _accepts_raw_string(tp: Any, parsed: Any) -> bool:
    if tp is str:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        # ``null`` unsets an optional string field: there would be no other way to do so.
        return str in args and not (parsed is None and type(None) in args)
    return False


def _coerce_union(value: Any, options: tuple[Any, ...], path: str) -> Any:
    if value is None and type(None) in options:
        return None
    errors = []
    for option in options:
        if option is type(None):
            continue
        try:
            return _coerce(value, option, path)
        except ConfigurationError as e:
            errors.append(e)
    if len(errors) == 1:
        raise errors[0]
    names = " or ".join(_type_name(o) for o in options)
    raise ConfigurationError(f"expected {names}, got {value!r}", path=path)


def _coerce_container(value: Any, tp: Any, origin: Any, path: str) -> Any:
    args = typing.get_args(tp)
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigurationError(f"expected a mapping, got {value!r}", path=path)
        key_tp, val_tp = args or (Any, Any)
        return {
            _coerce(k, key_tp, path): _coerce(v, val_tp, _join(path, str(k)))
            for k, v in value.items()
        }
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise ConfigurationError(f"expected a list, got {value!r}", path=path)
    if origin in (set, frozenset, AbstractSet):
        item_tp = args[0] if args else Any
        members = {_coerce(v, item_tp, path) for v in value}
        return frozenset(members) if origin is frozenset else members
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(args) != len(value):
            raise ConfigurationError(f"expected {len(args)} items, got {len(value)}", path=path)
        return tuple(_coerce(v, t, _join(path, i)) for i, (v, t) in enumerate(zip(value, args)))
    item_tp = args[0] if args else Any
    items = [_coerce(v, item_tp, _join(path, i)) for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


def _coerce_class(value: Any, tp: type, path: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _coerce_dataclass(value, tp, path)
    if issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        try:
            return tp(value)
        except ValueError:
            valid = ", ".join(str(m.value) for m in tp)
            raise ConfigurationError(
                f"{value!r} is not a valid {tp.__name__}; choose one of: {valid}", path=path
            ) from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigurationError(f"expected true or false, got {value!r}", path=path)
    if tp is int:
        return _coerce_number(value, int, path)
    if tp is float:
        return _coerce_number(value, float, path)
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float, Path)) and not isinstance(value, bool):
            return str(value)
        raise ConfigurationError(f"expected a string, got {value!r}", path=path)
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise ConfigurationError(f"expected a path, got {value!r}", path=path)
    if tp is datetime.timedelta:
        if isinstance(value, datetime.timedelta):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return datetime.timedelta(seconds=value)
        raise ConfigurationError(f"expected a number of seconds, got {value!r}", path=path)
    if isinstance(value, tp):
        return value
    raise ConfigurationError(f"expected a {tp.__name__}, got {value!r}", path=path)


def _coerce_number(value: Any, tp: type, path: str) -> Any:
    if isinstance(value, bool):
        raise ConfigurationError(f"expected a number, got {value!r}", path=path)
    if tp is float and isinstance(value, (int, float)):
        return float(value)
    if tp is int and isinstance(value, int):
        return value
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return tp(value)
        except ValueError:
            pass
    raise ConfigurationError(
        f"expected {'an integer' if tp is int else 'a number'}, got {value!r}", path=path
    )


def _coerce_dataclass(value: Any, tp: type, path: str) -> Any:
    if isinstance(value, tp):
        return value
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"expected a {tp.__name__} mapping, got {value!r}", path=path)
    data = dict(value)
    class_name = data.pop(CLASS_KEY, None)
    if class_name is not None:
        # Coerced like a string field: the raw text of an override, and a list is an error.
        class_name = _coerce(class_name, str, _join(path, CLASS_KEY))
    if class_name is None and data.get(TYPE_KEY) is None and tp in _BASES_NEEDING_CLASS:
        known = sorted(k for k, v in _REGISTRY.items() if _is_subclass(v, tp) and v is not tp)
        raise ConfigurationError(
            f"needs a {CLASS_KEY} key naming the {tp.__name__} to build, one of: {', '.join(known)}",
            path=path,
        )
    type_name = data.get(TYPE_KEY)
    tp_fields = {f.name for f in init_fields(tp)}
    if class_name is None and isinstance(type_name, str) and TYPE_KEY not in tp_fields:
        class_name = type_name  # OLMo-core's registered short name, e.g. ``type: wandb``
    cls = tp if class_name is None else _resolve_class(class_name, tp, path)
    fields = {f.name: f for f in init_fields(cls)}
    if TYPE_KEY not in fields:
        data.pop(TYPE_KEY, None)
    for name in getattr(cls, "_IGNORE_FIELDS", ()):
        data.pop(name, None)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigurationError(
            f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"valid keys of {cls.__name__} are: {', '.join(fields)}",
            # A single unknown key is named by its full path, e.g. ``max_duration.valu``.
            path=_join(path, unknown[0]) if len(unknown) == 1 else path,
        )
    missing = [
        name
        for name, f in fields.items()
        if name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigurationError(
            f"missing required key{'s' if len(missing) > 1 else ''}: {', '.join(missing)}",
            path=path,
        )
    hints = _type_hints(cls)
    kwargs = {name: _coerce(v, hints[name], _join(path, name)) for name, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigurationError as e:
        raise e.under(path) from None
    except TypeError as e:
        raise ConfigurationError(f"cannot build {cls.__name__}: {e}", path=path) from None


def _resolve_class(name: str, tp: type, path: str) -> type:
    """The class a ``_CLASS_`` name picks for a field declared as ``tp``.

    The declared class itself needs no registration (so a plain nested dataclass rebuilds);
    any other class must be registered and a subclass of ``tp``.
    """
    if name in own_names(tp):
        return tp
    return lookup_registered_class(name, tp, path)
