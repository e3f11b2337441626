"""The documentation site (``make docs``): a strict Sphinx build whose API reference holds every
public name.

The public names are derived, not listed: every name in the ``__all__`` of the documented
packages and of each of their public modules, plus every field of each public dataclass. A new
name missing from the site, or without a docstring, fails here.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any

import preloaded_python
import pytest
from testutils import patient

pytest.importorskip("sphinx")
pytest.importorskip("myst_parser")
pytest.importorskip("furo")

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
# The packages the reference must cover (docs/conf.py's olmolike_api_packages may add more).
PACKAGES = [
    "olmolike.train",
    "olmolike.nn",
    "olmolike.data",
    "olmolike.distributed",
    "olmolike.optim",
    "olmolike.config",
    "olmolike.exceptions",
]


def _public_modules(package: str) -> Iterator[ModuleType]:
    root = importlib.import_module(package)
    yield root
    for info in pkgutil.walk_packages(getattr(root, "__path__", []), package + "."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            yield importlib.import_module(info.name)


def _public_names() -> dict[str, Any]:
    """Dotted path -> object, for every name in a public module's ``__all__``."""
    return {
        f"{module.__name__}.{name}": getattr(module, name)
        for package in PACKAGES
        for module in _public_modules(package)
        for name in getattr(module, "__all__", ())
    }


def _is_code(obj: Any) -> bool:
    return inspect.isclass(obj) or isinstance(obj, FunctionType)


def _identity(path: str, obj: Any) -> object:
    scalar = isinstance(obj, (int, float, str, bytes, bool, tuple, frozenset, type(None)))
    return path if scalar else id(obj)


def _read_inventory(path: Path) -> dict[str, str]:
    """``objects.inv``: full name -> role (``py:class``, ...). Four text lines, then zlib."""
    data = path.read_bytes()
    body = data.split(b"\n", 4)[4]
    names = {}
    for line in zlib.decompress(body).decode().splitlines():
        name, role = line.split(" ", 2)[:2]
        names[name] = role
    return names


def _build_site(out: Path) -> Path:
    """The site, built as `make docs` builds it: warnings are errors."""
    # Sphinx imports olmolike (autodoc): the stand-in has it, and torch, imported already.
    cmd = [*preloaded_python.command(), "-m", "sphinx", "-W", "--keep-going", "-q", "-E", "-b"]
    cmd += ["html"]
    cmd += ["-d", str(out / "doctrees"), str(DOCS), str(out / "html")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=patient(240), check=False
    )
    assert result.returncode == 0, f"the strict docs build failed:\n{result.stderr[-6000:]}"
    return out / "html"


def _check_guides(site: Path) -> None:
    for guide in DOCS.glob("**/*.md"):
        page = site / guide.relative_to(DOCS).with_suffix(".html")
        assert page.is_file(), f"{guide.name} has no page in the site"


def _check_public_names(inventory: dict[str, str]) -> dict[object, set[str]]:
    """Every public name is in the site; returns the names each object is known by."""
    public = _public_names()
    # Every name an object is known by: where it is exported, and where a class or function
    # is defined. The site documents an object once, under one of them. Equal scalars may be
    # one object by accident (small ints, interned strings): each of their paths counts alone.
    known_as: dict[object, set[str]] = {}
    for path, obj in public.items():
        names = known_as.setdefault(_identity(path, obj), set())
        names.add(path)
        if _is_code(obj):
            names.add(f"{obj.__module__}.{obj.__qualname__}")
    missing = [
        path
        for path, obj in public.items()
        if not known_as[_identity(path, obj)] & inventory.keys()
    ]
    assert not missing, f"public names missing from the API reference: {missing}"
    return known_as


def _check_fields(inventory: dict[str, str], known_as: dict[object, set[str]]) -> int:
    """Every field of every public dataclass is in the site; returns how many there are."""
    documented = 0
    for obj in {id(o): o for o in _public_names().values() if _is_code(o)}.values():
        if not (inspect.isclass(obj) and dataclasses.is_dataclass(obj)):
            continue
        for field in dataclasses.fields(obj):
            if field.name.startswith("_"):
                continue
            owner = next(c for c in obj.__mro__ if field.name in vars(c).get("__annotations__", {}))
            # Documented with the class that declares it; with the class itself if that one
            # is private (the evaluators' _PeriodicEvaluation).
            pages = known_as.get(id(owner)) or known_as[id(obj)]
            assert any(f"{page}.{field.name}" in inventory for page in pages), (
                f"config field {obj.__qualname__}.{field.name} is missing from the reference"
            )
            documented += 1
    return documented


@pytest.mark.slow
def test_the_strict_build_passes_with_every_guide_public_name_and_config_field(
    tmp_path: Path,
) -> None:
    # One test, not several sharing a fixture: under pytest-xdist each worker would build.
    site = _build_site(tmp_path)
    _check_guides(site)
    inventory = _read_inventory(site / "objects.inv")
    known_as = _check_public_names(inventory)
    assert _check_fields(inventory, known_as) > 100  # the walk found the configs
    empty_bases = [p.name for p in site.glob("**/*.html") if "<p>Bases:</p>" in p.read_text()]
    assert not empty_bases, f"pages with an empty 'Bases:' line: {empty_bases}"


def test_every_public_class_and_function_has_a_docstring() -> None:
    """Also a warning (an error) in the strict build; here without building."""
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        from olmolike_api import has_own_docstring
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    undocumented = sorted(
        path
        for path, obj in _public_names().items()
        if _is_code(obj) and not has_own_docstring(obj)
    )
    assert not undocumented, f"public names without a docstring: {undocumented}"


def test_every_field_of_a_public_dataclass_has_a_docstring() -> None:
    """Also a warning (an error) in the strict build; here without building: the attribute
    docstrings as Sphinx's analyzer reads them from the source."""
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        from olmolike_api import attribute_docs
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    bare = set()
    for obj in {id(o): o for o in _public_names().values() if _is_code(o)}.values():
        if not (inspect.isclass(obj) and dataclasses.is_dataclass(obj)):
            continue
        for field in dataclasses.fields(obj):
            if field.name.startswith("_"):
                continue
            owner = next(c for c in obj.__mro__ if field.name in vars(c).get("__annotations__", {}))
            if not any(line.strip() for line in attribute_docs(owner).get(field.name, [])):
                bare.add(f"{owner.__module__}.{owner.__qualname__}.{field.name}")
    assert not bare, f"fields without a docstring: {sorted(bare)}"


_FAKE_CONF = """
import sys
sys.path[:0] = [{ext!r}, {pkg!r}]
extensions = ["sphinx.ext.autodoc", "myst_parser", "olmolike_api"]
olmolike_api_packages = ["fakepkg"]
nitpicky = True
"""
_FAKE_INIT = '''"""A package for the build's own checks."""
from .mod import Settings, helper
__all__ = ["Settings", "helper"]
'''
_FAKE_MOD = '''"""Its module."""
from dataclasses import dataclass
__all__ = ["Settings", "helper"]

@dataclass
class Settings:
    """Settings; see :func:`helper` and :func:`fakepkg.mod.helper` (both the re-export)."""
    size: int = 1
    {field_doc}

def helper() -> None:
    {doc}
'''


_FINE = '"""Fine: uses :class:`Settings`."""'
_FIELD_DOC = '"""How many, in items."""'


@pytest.mark.slow
@pytest.mark.parametrize(
    ("doc", "field_doc", "error"),
    [
        (_FINE, _FIELD_DOC, None),
        ("pass", _FIELD_DOC, "fakepkg.helper has no docstring"),
        ('"""Uses :class:`Setings`."""', _FIELD_DOC, "reference target not found: Setings"),
        (_FINE, "", "fakepkg.Settings.size has no docstring"),
    ],
    ids=["clean", "missing-docstring", "broken-reference", "bare-field"],
)
def test_the_strict_build_fails_on_a_missing_docstring_or_a_broken_reference(
    tmp_path: Path, doc: str, field_doc: str, error: str | None
) -> None:
    """The mechanism on a package of its own, so the check is seen failing (and fast)."""
    pkg = tmp_path / "src" / "fakepkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(_FAKE_INIT)
    (pkg / "mod.py").write_text(_FAKE_MOD.format(doc=doc, field_doc=field_doc))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "conf.py").write_text(_FAKE_CONF.format(ext=str(DOCS / "_ext"), pkg=str(pkg.parent)))
    (docs / "index.rst").write_text("fakepkg\n=======\n\n.. autopackage:: fakepkg\n")
    cmd = [*preloaded_python.command(), "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
    result = subprocess.run(
        [*cmd, str(docs), str(tmp_path / "html")],
        capture_output=True,
        text=True,
        timeout=patient(120),
        check=False,
    )
    if error is None:
        assert result.returncode == 0, result.stderr
        # Settings is a plain dataclass: no "Bases: object", and no empty "Bases:" either.
        assert "Bases:" not in (tmp_path / "html" / "index.html").read_text()
    else:
        assert result.returncode != 0 and error in result.stderr, result.stderr
