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
import enum
import json
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import fsspec
import torch
import yaml

from .config_coerce import (
    apply_overrides,
    check_choice,
    check_choice_fields,
    check_separated_value,
    choice_fields,
    coerce,
    parse_override,
)
from .config_dict import (
    _REGISTRY,
    CLASS_KEY,
    DictOptions,
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
    "CheckedChoices",
    "Config",
    "DType",
    "StrEnum",
    "check_choice",
    "check_choice_fields",
    "lookup_registered_class",
    "register_config_class",
    "registered_name",
    "require_class_name",
]


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

    @classmethod
    def _missing_(cls, value: object) -> Any:
        # An alias (a second name bound to a member, such as TRL's name for a loss) is found by
        # its name, so ``DPOLossType("sigmoid_norm")`` works like ``DPOLossType.sigmoid_norm``.
        return cls.__members__.get(value) if isinstance(value, str) else None


class CheckedChoices:
    """A dataclass mixin: every assignment to a field typed with an enum or a ``Literal`` (the
    constructor's included) converts a name to its member, and refuses a name that is none of
    them with a :class:`ConfigurationError` listing the valid ones.

    Without it a misspelt or foreign name (``loss_type="sigmoid_nrom"``) is stored as is and,
    compared with each member in turn, silently takes whatever branch comes last.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        tp = choice_fields(type(self)).get(name)
        if tp is not None:
            value = check_choice(value, tp, name)
        super().__setattr__(name, value)


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
class Config(CheckedChoices):
    """Base class for configuration dataclasses.

    Subclasses override :meth:`validate` to reject impossible values; it runs on construction
    and again whenever a config is rebuilt (``from_dict``, ``merge``) or built into an object.
    Enum-valued fields are checked on every assignment (see :class:`CheckedChoices`).
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
            data = apply_overrides(copy_module.deepcopy(dict(data)), overrides)
        built = coerce(data, cls, path)
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
            check_separated_value(previous, item)
        if prefix is not None:
            items = with_prefix(items, prefix)
        if not strict:
            names = {f.name for f in init_fields(type(self))}
            items = [i for i in items if parse_override(i)[0][0] in names]
        if not items:
            return self
        data = self.as_dict(include_class_name=True)
        return type(self).from_dict(apply_overrides(data, items))
