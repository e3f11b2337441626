"""Turning plain data (parsed YAML/JSON, command-line overrides) into typed configs.

:func:`coerce` checks a value against a type annotation and converts it where the conversion
is lossless; :func:`apply_overrides` applies ``key.path=value`` items to a plain dict. Both
raise :class:`~olmolike.exceptions.ConfigurationError` naming the dotted path of the field.
:mod:`olmolike.config` builds :class:`~olmolike.config.Config` objects with them.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import yaml

from .config_dict import (
    _BASES_NEEDING_CLASS,
    _REGISTRY,
    CLASS_KEY,
    TYPE_KEY,
    _is_subclass,
    init_fields,
    lookup_registered_class,
    own_names,
)
from .exceptions import ConfigurationError

__all__ = [
    "apply_overrides",
    "check_choice",
    "check_choice_fields",
    "check_separated_value",
    "choice_fields",
    "choice_names",
    "coerce",
    "parse_override",
]


def apply_overrides(data: dict[str, Any], items: Sequence[str]) -> dict[str, Any]:
    for item in items:
        keys, value = parse_override(item)
        _set_in(data, keys, value)
    return data


# -- conversion from plain data ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _CliValue:
    """An override from the command line: the raw text and its YAML parse."""

    raw: str
    parsed: Any


def check_separated_value(previous: str | None, item: str) -> None:
    """``--model.n_layers 4`` (a space for ``=``) is named as such, not as an unknown key 4."""
    if "=" in item or item.startswith("-") or re.fullmatch(r"[A-Za-z_][\w.]*", item):
        return  # an override, or a bare key (``save_overwrite``: true)
    if previous is not None and "=" not in previous:
        key = previous.lstrip("-")
        raise ConfigurationError(
            f"got {previous!r} then {item!r}; overrides take '=': write --{key}={item}", path=key
        )
    raise ConfigurationError(f"{item!r} is not an override; expected --dotted.key=value")


def parse_override(item: str) -> tuple[list[str], Any]:
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
    if keys[-1] == CLASS_KEY and isinstance(parsed, str):
        _keep_fields_of(node, parsed)
    if isinstance(last, dict) and isinstance(parsed, Mapping):
        if isinstance(parsed.get(CLASS_KEY), str):
            _keep_fields_of(last, parsed[CLASS_KEY])
        last.update(parsed)
    else:
        node[keys[-1]] = value


def _keep_fields_of(section: dict[str, Any], class_name: str) -> None:
    """An override that changes a section's ``_CLASS_`` (``--train_module._CLASS_=dpo``, or
    names one where the section named none) keeps only the keys the new class has too: the old
    class's own would be unknown keys."""
    old, new = _REGISTRY.get(str(section.get(CLASS_KEY))), _REGISTRY.get(class_name)
    if new is None or old is new or not dataclasses.is_dataclass(new):
        return
    names = {f.name for f in init_fields(new)}
    for key in [k for k in section if k not in names and k != CLASS_KEY]:
        del section[key]


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(value: Any, tp: Any, path: str) -> Any:
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
        valid = ", ".join(choice_names(tp))
        raise ConfigurationError(f"{value!r} is not valid; choose one of: {valid}", path=path)
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
    named = _member_named(value, options, path)
    if named is not None:
        return coerce(value, named, path)
    errors = []
    for option in options:
        if option is type(None):
            continue
        try:
            return coerce(value, option, path)
        except ConfigurationError as e:
            errors.append(e)
    if len(errors) == 1:
        raise errors[0]
    names = " or ".join(_type_name(o) for o in options)
    raise ConfigurationError(f"expected {names}, got {value!r}", path=path)


def _member_named(value: Any, options: tuple[Any, ...], path: str) -> type | None:
    """The config class of a union that a mapping's ``_CLASS_`` names (or derives from).

    Trying every member instead would bury the chosen class's own mistake (a misspelt key)
    under "expected A or B"; a name that fits no member is an error listing the members.
    """
    name = value.get(CLASS_KEY) if isinstance(value, Mapping) else None
    members = [o for o in options if isinstance(o, type) and dataclasses.is_dataclass(o)]
    if not isinstance(name, str) or not members:
        return None
    for member in members:
        if name in own_names(member):
            return member
    cls = _REGISTRY.get(name)
    for member in members:
        if cls is not None and _is_subclass(cls, member):
            return member
    names = ", ".join(
        min([k for k, c in _REGISTRY.items() if c is m] or own_names(m), key=len) for m in members
    )
    raise ConfigurationError(f"{CLASS_KEY} {name!r} is none of: {names}", path=path)


def _coerce_container(value: Any, tp: Any, origin: Any, path: str) -> Any:
    args = typing.get_args(tp)
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigurationError(f"expected a mapping, got {value!r}", path=path)
        key_tp, val_tp = args or (Any, Any)
        return {
            coerce(k, key_tp, path): coerce(v, val_tp, _join(path, str(k)))
            for k, v in value.items()
        }
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise ConfigurationError(f"expected a list, got {value!r}", path=path)
    if origin in (set, frozenset, AbstractSet):
        item_tp = args[0] if args else Any
        members = {coerce(v, item_tp, path) for v in value}
        return frozenset(members) if origin is frozenset else members
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(args) != len(value):
            raise ConfigurationError(f"expected {len(args)} items, got {len(value)}", path=path)
        return tuple(coerce(v, t, _join(path, i)) for i, (v, t) in enumerate(zip(value, args)))
    item_tp = args[0] if args else Any
    items = [coerce(v, item_tp, _join(path, i)) for i, v in enumerate(value)]
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
            valid = ", ".join(choice_names(tp))
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


def choice_names(tp: Any) -> list[str]:
    """The names a value of the enum or ``Literal`` type ``tp`` may take, for error messages:
    an enum's values, then its aliases (second names of a member, e.g. TRL's names)."""
    if typing.get_origin(tp) is typing.Literal:
        return [str(v) for v in typing.get_args(tp)]
    values = [str(m.value) for m in tp]
    return values + [n for n, m in tp.__members__.items() if m.name != n and n not in values]


def check_choice(value: Any, tp: Any, name: str) -> Any:
    """``value`` as a member of the enum (or ``Literal``, or ``Optional`` of either) ``tp``.

    For functions that take an enum-valued argument: a string that names no member raises
    :class:`ConfigurationError` listing the valid names, where comparing it with each member
    in turn would silently fall through to a default branch.
    """
    if type(value) is tp:
        return value  # the common case: a member, checked without a call
    return coerce(value, tp, name)


def check_choice_fields(obj: Any) -> None:
    """Check every enum- or ``Literal``-typed field of dataclass ``obj`` with
    :func:`check_choice`, once: for a class that cannot check each assignment (see
    :class:`~olmolike.config.CheckedChoices`)."""
    for name, tp in choice_fields(type(obj)).items():
        setattr(obj, name, check_choice(getattr(obj, name), tp, name))


def _choice_fields(cls: type) -> dict[str, Any]:
    try:
        hints = _type_hints(cls)
    except NameError:
        # An annotation names something imported only under ``TYPE_CHECKING``: no enum of
        # olmolike is, so keep the fields whose annotations resolve.
        return _resolvable_choice_fields(cls)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(cls)
        if f.init and f.name in hints and _has_choice(hints[f.name])
    }


choice_fields: Callable[[type], dict[str, Any]] = functools.cache(_choice_fields)
"""The fields of dataclass ``cls`` whose type involves an enum or a ``Literal``, with their
types: the fields :class:`~olmolike.config.CheckedChoices` checks on every assignment."""


def _resolvable_choice_fields(cls: type) -> dict[str, Any]:
    module = sys.modules.get(cls.__module__)
    namespace = dict(vars(module)) if module is not None else {}
    out = {}
    for f in dataclasses.fields(cls):
        try:
            # What ``typing.get_type_hints`` does, one field at a time.
            tp = eval(f.type, namespace) if isinstance(f.type, str) else f.type
        except NameError:
            continue
        if f.init and _has_choice(tp):
            out[f.name] = tp
    return out


def _has_choice(tp: Any) -> bool:
    if typing.get_origin(tp) is typing.Literal:
        return True
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return True
    return any(_has_choice(a) for a in typing.get_args(tp))


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
        class_name = coerce(class_name, str, _join(path, CLASS_KEY))
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
    kwargs = {name: coerce(v, hints[name], _join(path, name)) for name, v in data.items()}
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
