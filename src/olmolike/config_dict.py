"""Class names for config files: the registry of classes a ``_CLASS_`` may name, and
configs to plain dicts (``Config.as_dict``) carrying those names.

Kept apart from :mod:`olmolike.config` (which reads dicts back) so each stays readable;
everything here is re-exported there.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import enum
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .exceptions import ConfigurationError

__all__ = [
    "CLASS_KEY",
    "TYPE_KEY",
    "DictOptions",
    "lookup_registered_class",
    "register_config_class",
    "registered_name",
    "require_class_name",
    "to_plain",
]

CLASS_KEY = "_CLASS_"
TYPE_KEY = "type"
"""OLMo-core's key for a registered short name (``include_registered_name``)."""


_REGISTRY: dict[str, type] = {}
_BASES_NEEDING_CLASS: set[type] = set()


def register_config_class(cls: type, *aliases: str) -> None:
    """Allow ``cls`` to be named by ``_CLASS_`` in a config file.

    It is registered under its qualified name (``module.QualName``) and any ``aliases``.
    It is also reachable as ``module.QualName`` when that differs (a class nested in another).
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"only dataclasses can be registered as config classes, not {cls!r}")
    for name in own_names(cls):
        _REGISTRY[name] = cls
    for alias in aliases:
        existing = _REGISTRY.get(alias)
        if existing is not None and registered_name(existing) != registered_name(cls):
            raise ValueError(f"config class alias {alias!r} is already registered to {existing!r}")
        _REGISTRY[alias] = cls


def require_class_name(base: type) -> None:
    """Values of a field typed ``base`` must name their class with ``_CLASS_``.

    For a base class that does nothing by itself (e.g. ``Callback``): without this, a missing
    ``_CLASS_`` would silently build the inert base instead of failing.
    """
    _BASES_NEEDING_CLASS.add(base)


def lookup_registered_class(name: str, base: type, path: str = "") -> type:
    """Resolve a ``_CLASS_`` name to a registered class that is a subclass of ``base``."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ConfigurationError(_unknown_class(name, base), path=path)
    if not _is_subclass(cls, base):
        raise ConfigurationError(f"class {name!r} is not a {base.__name__}", path=path)
    return cls


def _unknown_class(name: str, base: type) -> str:
    """One line: the public classes whose names are closest to ``name``, else all of them by
    their shortest names (private helpers and module paths would bury the answer)."""
    names: dict[type, list[str]] = {}
    for key, cls in _REGISTRY.items():
        public = not any(part.startswith("_") for part in key.split("."))
        if cls is not base and _is_subclass(cls, base) and public:
            names.setdefault(cls, []).append(key)
    shortest = {cls: min(keys, key=len) for cls, keys in names.items()}

    def spelling(text: str) -> str:  # "ProgressCallback" and "progress" alike
        return text.rsplit(".", 1)[-1].lower().removesuffix(base.__name__.lower())

    spellings = {spelling(k): c for c, keys in names.items() for k in [*keys, c.__name__]}
    wanted = spelling(name)
    matches = difflib.get_close_matches(wanted, spellings, n=3, cutoff=0.6)
    matches += sorted(k for k in spellings if wanted and k.startswith(wanted))
    close = list(dict.fromkeys(spellings[m] for m in matches))[:3]
    if close:
        guesses = " or ".join(f"{shortest[c]!r} ({c.__name__})" for c in close)
        return f"unknown class {name!r}; did you mean {guesses}?"
    known = ", ".join(sorted(shortest.values())) or "(none)"
    return (
        f"unknown class {name!r}; registered {base.__name__} classes are: {known}. Import the "
        "module that defines it before loading the config (config files cannot import code)."
    )


def _is_subclass(cls: Any, base: Any) -> bool:
    return isinstance(cls, type) and isinstance(base, type) and issubclass(cls, base)


def registered_name(cls: type) -> str:
    """The ``_CLASS_`` value written for ``cls``: ``module.ClassName``, as OLMo-core writes it."""
    return f"{cls.__module__}.{cls.__name__}"


def own_names(cls: type) -> set[str]:
    """Every name a config file may use for ``cls`` itself."""
    names = {registered_name(cls), f"{cls.__module__}.{cls.__qualname__}"}
    # Its own short name only: a subclass inherits its parent's attribute until it sets its
    # own, and must not take the parent's name (ListCheckpointerCallback once took
    # "checkpointer" from CheckpointerCallback).
    short = vars(cls).get("registered_name")
    if isinstance(short, str):
        names.add(short)
    return names


def init_fields(cls: type) -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(cls) if f.init)


def with_prefix(items: list[str], prefix: str) -> list[str]:
    head = prefix.strip(".") + "."
    out = []
    for item in items:
        dashes = item[: len(item) - len(item.lstrip("-"))]
        text = item[len(dashes) :]
        if text.startswith(head):
            out.append(dashes + text[len(head) :])
    return out


def apply_to_configs(value: Any, func: Callable[[Any], None], config_type: type) -> None:
    if isinstance(value, config_type):
        func(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            apply_to_configs(getattr(value, f.name), func, config_type)
    elif isinstance(value, Mapping):
        for item in value.values():
            apply_to_configs(item, func, config_type)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            apply_to_configs(item, func, config_type)


@dataclasses.dataclass(frozen=True)
class DictOptions:
    exclude_none: bool = False
    exclude_private_fields: bool = False
    exclude: frozenset[str] = frozenset()
    include_class_name: bool = False
    include_registered_name: bool = False
    json_safe: bool = False
    exclude_default_none: bool = False
    """Leave out ``None`` values only where ``None`` is the default (they rebuild the same)."""


def keep_field(f: dataclasses.Field, value: Any, options: DictOptions) -> bool:
    if f.name in options.exclude:
        return False
    if value is None and (
        options.exclude_none or (options.exclude_default_none and f.default is None)
    ):
        return False
    return not (options.exclude_private_fields and f.name.startswith("_"))


def class_keys(value: Any, options: DictOptions) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if options.include_class_name:
        out[CLASS_KEY] = registered_name(type(value))
    short = getattr(type(value), "registered_name", None)
    if options.include_registered_name and isinstance(short, str):
        out[TYPE_KEY] = short
    return out


def to_plain(value: Any, options: DictOptions, path: str) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = class_keys(value, options)
        for f in init_fields(type(value)):
            item = getattr(value, f.name)
            if keep_field(f, item, options):
                out[f.name] = to_plain(item, options, f"{path}.{f.name}")
        return out
    if isinstance(value, Mapping):
        return {k: to_plain(v, options, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [to_plain(v, options, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if options.json_safe or isinstance(value, list) else tuple(items)
    if isinstance(value, (set, frozenset)):
        if not options.json_safe:
            return type(value)(to_plain(v, options, path) for v in value)
        # A set has no order of its own: sort where possible, so files are reproducible.
        members = [to_plain(v, options, path) for v in value]
        try:
            return sorted(members)
        except TypeError:
            return members
    if not options.json_safe:
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ConfigurationError(
        f"a {type(value).__name__} cannot be written to a config file; give it a Config form "
        "(a dataclass of plain values) that builds the object",
        path=path,
    )
