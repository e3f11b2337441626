"""The API reference: every name in the ``__all__`` of every public module, with its docstring.

``.. autopackage:: olmolike.train`` writes one section per public module of the package (the
package itself first, then its modules; subpackages have their own page), each an
``automodule`` limited to the module's ``__all__``. A class or function exported by several
modules is documented once, where it is first exported (``olmolike.train.Trainer``, not also
``olmolike.train.trainer.Trainer``); the other modules link to it. A public class or function
without a docstring of its own is a warning, so the strict build (``make docs``) fails on it;
so is a field of a public dataclass without one.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import inspect
import pkgutil
import sys
from collections.abc import Iterator
from types import FunctionType, ModuleType
from typing import Any

from docutils import nodes
from docutils.nodes import Element
from docutils.statemachine import StringList
from sphinx import addnodes
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

log = logging.getLogger(__name__)

# Equal values of these types may be the same object by accident (small ints, interned
# strings): such constants are documented in every module that exports them.
_SHARED_BY_ACCIDENT = (int, float, str, bytes, bool, tuple, frozenset, type(None))


def public_modules(package: str) -> Iterator[ModuleType]:
    """``package`` and every module below it whose dotted name has no ``_``-prefixed part."""
    root = importlib.import_module(package)
    yield root
    for info in pkgutil.walk_packages(getattr(root, "__path__", []), package + "."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            yield importlib.import_module(info.name)


def _home_paths(packages: list[str]) -> tuple[dict[int, str], dict[str, str]]:
    """Where each exported object is documented, by identity and by each of its other names.

    Shallow modules first, so an object gets the shortest path it is exported under. The
    aliases map every other path of the object (each module exporting it, and where it is
    defined) to that home, so a reference to ``olmolike.nn.generation.sample`` or to
    ``sample`` inside ``olmolike.nn.generation`` lands on ``olmolike.nn.sample``.
    """
    modules = sorted(
        (m for p in packages for m in public_modules(p)),
        key=lambda m: (m.__name__.count("."), m.__name__),
    )
    homes: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for module in modules:
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if isinstance(obj, _SHARED_BY_ACCIDENT):
                continue
            home = homes.setdefault(id(obj), f"{module.__name__}.{name}")
            aliases[f"{module.__name__}.{name}"] = home
            if hasattr(obj, "__qualname__") and hasattr(obj, "__module__"):
                aliases.setdefault(f"{obj.__module__}.{obj.__qualname__}", home)
    return homes, aliases


_PLAN: dict[tuple[str, ...], tuple[dict[int, str], dict[str, str]]] = {}


def _plan(packages: list[str]) -> tuple[dict[int, str], dict[str, str]]:
    key = tuple(packages)
    if key not in _PLAN:
        _PLAN[key] = _home_paths(packages)
    return _PLAN[key]


def _role(obj: Any) -> str:
    if inspect.isclass(obj):
        return "exc" if issubclass(obj, BaseException) else "class"
    return "func" if isinstance(obj, FunctionType) else "data"


def _public_bases(cls: Any, homes: dict[int, str]) -> str | None:
    """For a class with a private olmolike base (``_PeriodicEvaluation``): the names of its
    other bases, whose members stay on their own pages; else None."""
    if not inspect.isclass(cls):
        return None
    bases = cls.__mro__[1:]
    private = [b for b in bases if b.__module__.startswith("olmolike") and id(b) not in homes]
    if not private:
        return None
    return ", ".join(b.__name__ for b in bases if b not in private)


def _module_section(module: ModuleType, homes: dict[int, str], title: bool) -> list[str]:
    names = list(getattr(module, "__all__", ()))

    def home(name: str) -> str:
        return homes.get(id(getattr(module, name)), f"{module.__name__}.{name}")

    own = [n for n in names if home(n) == f"{module.__name__}.{n}"]
    code = [n for n in own if _role(getattr(module, n)) != "data"]
    with_private_bases = [n for n in code if _public_bases(getattr(module, n), homes) is not None]
    code = [n for n in code if n not in with_private_bases]
    elsewhere = [n for n in names if n not in own]
    lines = [module.__name__, "-" * len(module.__name__), ""] if title else []
    lines.append(f".. automodule:: {module.__name__}")
    if module.__name__ in homes.values():
        # A function named like its module (grpo.rollout): the function keeps the target.
        lines.append("   :no-index:")
    if code:
        lines += [f"   :members: {', '.join(code)}", "   :undoc-members:", "   :show-inheritance:"]
    lines.append("")
    # A class that inherits members (a config's fields) from a private base shows them itself.
    for name in with_private_bases:
        public_bases = _public_bases(getattr(module, name), homes)
        lines += [f".. autoclass:: {module.__name__}.{name}", "   :members:", "   :undoc-members:"]
        lines += ["   :show-inheritance:", f"   :inherited-members: {public_bases}", ""]
    # Constants and type aliases one by one: automodule skips data without a doc comment, and
    # data imported from another module, even when __all__ names it.
    for name in own:
        value = getattr(module, name)
        if _role(value) == "data":
            lines.append(f".. autodata:: {module.__name__}.{name}")
            if not isinstance(value, _SHARED_BY_ACCIDENT):
                lines.append("   :no-value:")  # a registry or a table: its repr is no doc
            lines.append("")
    if elsewhere:
        links = ", ".join(
            f":py:{_role(getattr(module, n))}:`~{homes[id(getattr(module, n))]}`" for n in elsewhere
        )
        lines += [f"Also exported here: {links}.", ""]
    return lines


class AutoPackage(SphinxDirective):
    """``.. autopackage:: PACKAGE``: the package's public names, then each public module's."""

    required_arguments = 1

    def run(self) -> list[Any]:
        package = self.arguments[0]
        homes, _ = _plan(self.config.olmolike_api_packages)
        root = importlib.import_module(package)
        lines = _module_section(root, homes, title=False)
        for info in pkgutil.iter_modules(getattr(root, "__path__", []), package + "."):
            if not info.ispkg and not info.name.rsplit(".", 1)[1].startswith("_"):
                module = importlib.import_module(info.name)
                lines += _module_section(module, homes, title=True)
        source = self.state_machine.get_source(self.lineno)
        self.state_machine.insert_input(StringList(lines, source), source)
        return []


def has_own_docstring(obj: Any) -> bool:
    """Whether ``obj`` has a docstring written for it: not inherited, and for a dataclass not
    the ``Name(field: type = default, ...)`` line that ``@dataclass`` makes up when none is."""
    doc = (obj.__doc__ or "").strip()
    if inspect.isclass(obj) and hasattr(obj, "__dataclass_fields__"):
        return bool(doc) and not doc.startswith(f"{obj.__name__}(")
    return bool(doc)


def defining_module(cls: type) -> str:
    """The module whose source defines ``cls``: its ``__module__``, unless that was changed to
    a public path (``CheckpointerConfig``'s is its package's, for the name config files
    write), in which case the file of one of its own methods says where the source is."""
    from sphinx.pycode import ModuleAnalyzer

    if cls.__qualname__ in ModuleAnalyzer.for_module(cls.__module__).find_tags():
        return cls.__module__
    for value in vars(cls).values():
        function = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        function = function.fget if isinstance(function, property) else function
        filename = getattr(getattr(function, "__code__", None), "co_filename", "")
        for name, module in list(sys.modules.items()):
            if filename and getattr(module, "__file__", None) == filename:
                return name
    return cls.__module__


def attribute_docs(cls: type) -> dict[str, list[str]]:
    """The attribute docstrings of ``cls``'s own body, by attribute name, read from the
    source of the module that defines it."""
    from sphinx.pycode import ModuleAnalyzer

    docs = ModuleAnalyzer.for_module(defining_module(cls)).find_attr_docs()
    return {name: list(lines) for (owner, name), lines in docs.items() if owner == cls.__qualname__}


def _analyze_moved_classes(app: Sphinx) -> None:
    """Give the analyzer of a class's ``__module__`` the attribute docstrings (and source
    order) of the module that defines it, where the two differ: autodoc looks up an
    attribute's docstring by ``__module__``, and would show the fields bare."""
    from sphinx.pycode import ModuleAnalyzer

    for module in {m for p in app.config.olmolike_api_packages for m in public_modules(p)}:
        for name in getattr(module, "__all__", ()):
            cls = getattr(module, name)
            if not inspect.isclass(cls) or defining_module(cls) == cls.__module__:
                continue
            stated = ModuleAnalyzer.for_module(cls.__module__)
            stated.analyze()
            real = ModuleAnalyzer.for_module(defining_module(cls))
            real.analyze()
            prefix = f"{cls.__qualname__}."
            stated.attr_docs.update(
                {k: v for k, v in real.attr_docs.items() if k[0] == cls.__qualname__}
            )
            start = len(stated.tagorder)
            stated.tagorder.update(
                {k: start + i for k, i in real.tagorder.items() if k.startswith(prefix)}
            )


def _require_docstring(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """Warn about a public class or function without a docstring of its own.

    Methods and attributes are not checked; a class whose docstring would be inherited from
    its base still warns: that text describes the base.
    """
    if what not in ("class", "exception", "function"):
        return
    if not has_own_docstring(obj):
        log.warning(
            "%s has no docstring: every public class and function needs one (add it, or "
            "drop the name from its module's __all__)",
            name,
            type="olmolike",
            subtype="docstring",
        )


def _require_field_docstring(
    app: Sphinx, domain: str, objtype: str, contentnode: addnodes.desc_content
) -> None:
    """Warn about a field of a public dataclass (a config's) without a docstring of its own:
    the reference would list it bare, and the field is what a user sets.

    Checked on the rendered entry, not on autodoc's docstring event: autodoc emits none for
    an attribute without a docstring.
    """
    if domain != "py" or objtype != "attribute" or contentnode.astext().strip():
        return
    signature = contentnode.parent[0]
    module, fullname = signature.get("module") or "", signature.get("fullname") or ""
    owner_path, _, field = f"{module}.{fullname}".rpartition(".")
    owner = _object_at(owner_path)
    is_field = dataclasses.is_dataclass(owner) and field in {
        f.name
        for f in dataclasses.fields(owner)  # not a ClassVar
    }
    if inspect.isclass(owner) and is_field:
        log.warning(
            "%s.%s has no docstring: every field of a public dataclass needs one, saying what "
            "it does and its unit (a string on the line after the field)",
            owner_path,
            field,
            type="olmolike",
            subtype="docstring",
            location=signature,
        )


def _object_at(path: str) -> Any:
    """The object a dotted path names, looked up from an imported module; ``None`` if none."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        obj: Any = sys.modules.get(".".join(parts[:split]))
        if obj is None:
            continue
        for attr in parts[split:]:
            obj = getattr(obj, attr, None)
        return obj
    return None


def _drop_type_docstring(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """A constant without a doc comment would show its type's docstring (``dict``'s for a
    registry): show none instead."""
    doc = getattr(obj, "__doc__", None)
    if what in ("data", "attribute") and lines and isinstance(doc, str):

        def words(text: list[str]) -> list[str]:
            return [line.strip() for line in text if line.strip()]

        if words(lines) == words(doc.splitlines()):
            lines.clear()


def _plain_dataclass_signature(
    app: Sphinx,
    what: str,
    name: str,
    obj: Any,
    options: Any,
    signature: str | None,
    return_annotation: str | None,
) -> tuple[str, str | None] | None:
    """Configs get no constructor signature: their fields are listed right below, each with
    its type, default and docstring, which reads better than one 30-argument line. Enums get
    none either: their members are listed, and ``(value)`` says nothing."""
    if what == "class" and (hasattr(obj, "__dataclass_fields__") or issubclass(obj, enum.Enum)):
        return "", return_annotation
    return None


def _import_path(path: str) -> bool:
    """Whether ``path`` names a real object: a module already imported (by olmolike: nothing
    is imported here), then its attributes."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        obj: Any = sys.modules.get(".".join(parts[:split]))
        if obj is None:
            continue
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@functools.cache
def _bound_in_olmolike(path: str) -> bool:
    """Whether some olmolike module binds ``path``'s first name to an object that has the rest:
    an annotation written against an import (``nn.Module``, ``Future``) that autodoc could
    not qualify."""
    first, _, rest = path.partition(".")
    for name, module in list(sys.modules.items()):
        if name.startswith("olmolike") and module is not None and hasattr(module, first):
            obj: Any = getattr(module, first)
            try:
                for attr in filter(None, rest.split(".")):
                    obj = getattr(obj, attr)
            except AttributeError:
                continue
            return True
    return False


def _candidates(node: pending_xref) -> list[str]:
    """Full names the target may mean, innermost scope first, as Python would look it up:
    the current class, the current module, each package above it, then the name as given."""
    target = node["reftarget"].lstrip("~.")
    module, cls = node.get("py:module") or "", node.get("py:class")
    scopes = [f"{module}.{cls}"] if module and cls else []
    parts = module.split(".") if module else []
    scopes += [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    return [f"{scope}.{target}" for scope in scopes] + [target]


def _by_last_names(env: BuildEnvironment) -> dict[str, list[str]]:
    """Documented objects by each dotted tail of their names (``Checkpointer.load`` and
    ``load`` for ``olmolike.train.Checkpointer.load``), built once references are resolved."""
    index = getattr(env, "_olmolike_by_last_names", None)
    if index is None:
        index = {}
        for name, obj in env.get_domain("py").objects.items():
            if not obj.aliased:
                parts = name.split(".")
                for i in range(1, len(parts)):
                    index.setdefault(".".join(parts[i:]), []).append(name)
        env._olmolike_by_last_names = index  # type: ignore[attr-defined]
    return index


def _forget_index(app: Sphinx, env: BuildEnvironment) -> list[str]:
    env.__dict__.pop("_olmolike_by_last_names", None)
    return []


def _resolve_alias(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: Element
) -> Element | None:
    """Resolve a Python reference that Sphinx could not.

    Through the aliases of documented objects first; then by a unique documented object of
    that name; then, as plain text, when it names a real object with no page (the standard
    library, torch, a private helper, a TypeVar). What remains is a reference to nothing: a
    warning, an error under ``-W``.
    """
    if node.get("refdomain") != "py":
        return None
    _, aliases = _plan(app.config.olmolike_api_packages)
    domain = env.get_domain("py")
    candidates = _candidates(node)

    def resolve(name: str) -> Element | None:
        return domain.resolve_xref(
            env, node["refdoc"], app.builder, node["reftype"], name, node, contnode
        )

    for candidate in candidates:
        parts = candidate.split(".")
        for split in range(len(parts), 1, -1):
            home = aliases.get(".".join(parts[:split]))
            if home is not None and (ref := resolve(".".join([home, *parts[split:]]))):
                return ref
    target = candidates[-1]
    matches = _by_last_names(env).get(target, [])
    if len(matches) == 1 and (ref := resolve(matches[0])):
        return ref
    if any(_import_path(c) for c in candidates) or _bound_in_olmolike(target):
        return contnode
    return None


def _drop_object_base(app: Sphinx, name: str, obj: Any, options: Any, bases: list[Any]) -> None:
    """No "Bases: object" line on every plain class (:func:`_drop_empty_bases` then removes
    the "Bases:" line that autodoc still writes with no base in it)."""
    if bases == [object]:
        bases.clear()


def _drop_empty_bases(
    app: Sphinx, domain: str, objtype: str, contentnode: addnodes.desc_content
) -> None:
    """Remove the empty "Bases:" paragraph of a class whose only base is ``object``."""
    if domain != "py" or objtype not in ("class", "exception"):
        return
    for child in list(contentnode.children):
        if isinstance(child, nodes.paragraph) and child.astext().strip() == "Bases:":
            contentnode.remove(child)


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_config_value("olmolike_api_packages", [], "env")
    app.add_directive("autopackage", AutoPackage)
    app.connect("autodoc-process-docstring", _require_docstring)
    app.connect("autodoc-process-docstring", _drop_type_docstring)
    app.connect("object-description-transform", _require_field_docstring)
    app.connect("builder-inited", _analyze_moved_classes)
    app.connect("autodoc-process-signature", _plain_dataclass_signature)
    app.connect("missing-reference", _resolve_alias)
    app.connect("env-updated", _forget_index)
    app.connect("autodoc-process-bases", _drop_object_base)
    app.connect("object-description-transform", _drop_empty_bases)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
