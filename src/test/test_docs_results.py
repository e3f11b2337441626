"""Figures in the guides come from the commands that make them.

``docs/grpo.md``'s results block is rendered from ``docs/results/grpo.json``, the
``accuracy.json`` of a full ``make grpo`` run, by the same code with which the demonstration
prints it (``src/examples/grpo/grpo_results.py``); ``make grpo-results`` reruns the
demonstration and rewrites both. Here: the guide shows the stored figures. That the
demonstration still writes and prints them is checked where it runs at a reduced size
(``test_example_grpo.py``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def grpo_results() -> ModuleType:
    path = REPO / "src" / "examples" / "grpo" / "grpo_results.py"
    spec = importlib.util.spec_from_file_location("grpo_results", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_grpo_guide_shows_the_stored_figures_of_make_grpo() -> None:
    results = grpo_results()
    assert results.main(["--check"]) == 0, "run make grpo-results"
    stored = json.loads(results.STORED.read_text())
    assert stored["steps"] == 300 and stored["warm_up_steps"] == 300  # the full size
    assert results.render(stored) in results.GUIDE.read_text()


def test_a_guide_that_differs_from_the_stored_figures_is_caught(tmp_path: Path) -> None:
    results = grpo_results()
    stored = json.loads(results.STORED.read_text())
    changed = {**stored, "grpo": stored["grpo"] + 0.01}
    guide = results.GUIDE.read_text()
    assert results.rewrite(guide, stored) == guide
    assert results.rewrite(guide, changed) != guide
