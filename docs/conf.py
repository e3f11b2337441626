"""Sphinx configuration of the documentation site: `make docs` builds it into build/docs.

Sphinx rather than MkDocs: the docstrings use Sphinx roles (``:class:``, ``:meth:``,
``:param x:``), which autodoc renders and cross-links natively, and nitpicky mode turns every
reference that does not resolve into a warning (an error under ``-W``). The guides stay
Markdown, read by MyST. The build is offline: no intersphinx, and the theme (furo) ships its
assets in its wheel.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent / "src"))  # the checkout's sources, installed or not
os.environ.setdefault("OMP_NUM_THREADS", "1")  # autodoc imports torch; it computes nothing

# olmolike imports torch's pipelining only when it builds a schedule; the annotations that name
# its classes resolve (as plain text, like every torch name) against the imported module.
import torch.distributed.pipelining  # noqa: E402, F401

project = "olmolike"
copyright = "the olmolike authors"
author = "the olmolike authors"

extensions = [
    "sphinx.ext.autodoc",
    "myst_parser",
    "olmolike_api",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext"]

# The packages whose public names (each public module's __all__) make up the API reference.
olmolike_api_packages = [
    "olmolike.train",
    "olmolike.nn",
    "olmolike.data",
    "olmolike.distributed",
    "olmolike.optim",
    "olmolike.config",
    "olmolike.exceptions",
]

# MyST: the guides link each other as `file.md#heading-slug` (GitHub's slugs), so that they
# read the same on GitHub and on the site.
myst_heading_anchors = 6
myst_enable_extensions = ["colon_fence", "deflist"]

autodoc_member_order = "bysource"  # a config's fields in the order its class declares them
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False  # a method without its own docstring shows none
autoclass_content = "class"
python_use_unqualified_type_names = True
add_module_names = False  # the section names the module: "Trainer", not "olmolike.train.Trainer"

# Every cross-reference must resolve (olmolike_api also resolves aliases of re-exported names).
# One to a real object without a page here (torch, numpy, the standard library: no
# intersphinx offline) is plain text; one to nothing is an error under -W.
nitpicky = True

html_theme = "furo"
html_title = "olmolike"
html_static_path: list[str] = []
html_show_sourcelink = False
html_copy_source = False
html_theme_options = {
    "navigation_with_keys": True,
}
