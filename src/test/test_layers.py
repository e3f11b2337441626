"""The layering of docs/contributing-layers.md holds: lower rooms never import higher ones, and
no two packages import each other (directly or around a circle).

Imports are read from the source (AST), all of them: at module level, inside functions and
under ``TYPE_CHECKING``, since each is a dependency of the module even when it is not run at
import time.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from testutils import patient

import olmolike

PACKAGE_ROOT = Path(olmolike.__file__).parent

LOWER_ROOMS = ("distributed", "nn", "data", "optim", "io", "config", "config_dict", "exceptions")
"""Rooms below the trainer: none of them may import ``olmolike.train`` or anything above it."""
ABOVE_TRAIN = ("train", "plan", "inference", "cli", "cli_args", "cli_prepare", "plot", "__main__")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, *, runtime_only: bool = False) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every olmolike module that ``path`` imports, anywhere in it.

    ``runtime_only`` leaves out what only a type checker imports (``if TYPE_CHECKING:``), and
    reads ``from . import name`` as an import of the submodule ``name`` alone: the package is
    already being imported whenever one of its modules is.
    """
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), str(path))
    for node in _walk(tree, skip_type_checking=runtime_only):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            # ``from .. import io`` imports the module olmolike.io
            submodules = [f"{module}.{alias.name}" for alias in node.names]
            if runtime_only and all(_exists(m) for m in submodules):
                targets = submodules
            else:
                targets = [module, *submodules]
        else:
            continue
        for target in targets:
            if target.startswith("olmolike.") and _exists(target):
                yield node.lineno, target


def _walk(tree: ast.AST, *, skip_type_checking: bool) -> Iterator[ast.AST]:
    """Every node of ``tree``; without the bodies of ``if TYPE_CHECKING:`` when asked."""
    for node in ast.iter_child_nodes(tree):
        if (
            skip_type_checking
            and isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test)
        ):
            for child in node.orelse:  # the ``else:`` branch does run
                yield child
                yield from _walk(child, skip_type_checking=True)
            continue
        yield node
        yield from _walk(node, skip_type_checking=skip_type_checking)


def _exists(module: str) -> bool:
    relative = Path(*module.split(".")[1:])
    return (PACKAGE_ROOT / relative).with_suffix(".py").is_file() or (
        PACKAGE_ROOT / relative / "__init__.py"
    ).is_file()


def room(module: str) -> str:
    """The room of a module: the package or module directly under ``olmolike``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


SOURCES = sorted(
    p for p in PACKAGE_ROOT.rglob("*.py") if p.parent != PACKAGE_ROOT or p.stem != "__init__"
)
"""Every module but ``olmolike/__init__.py`` (which imports nothing of olmolike)."""


def test_the_scan_sees_the_imports_it_must_judge() -> None:
    # The checks below pass vacuously if the scan finds nothing; it must find known edges.
    edges = {(module_name(p), m) for p in SOURCES for _, m in imported_modules(p)}
    assert (
        "olmolike.train.checkpoint.checkpointer",
        "olmolike.distributed.checkpoint_save",
    ) in edges
    assert ("olmolike.distributed.checkpoint", "olmolike.distributed.unshard") in edges
    assert ("olmolike.train.background_ops", "olmolike.threads") in edges  # a relative import


@pytest.mark.parametrize("lower", LOWER_ROOMS)
def test_lower_rooms_never_import_the_trainer_or_above(lower: str) -> None:
    offending = [
        f"{path.relative_to(PACKAGE_ROOT.parent)}:{line} imports {target}"
        for path in SOURCES
        if room(module_name(path)) == lower
        for line, target in imported_modules(path)
        if room(target) in ABOVE_TRAIN
    ]
    assert not offending, "\n".join(offending)


def test_no_import_circle_between_rooms() -> None:
    graph: dict[str, set[str]] = {}
    for path in SOURCES:
        source = module_name(path)
        for _, target in imported_modules(path):
            if room(target) != room(source):
                graph.setdefault(room(source), set()).add(room(target))
    circles = [c for c in _strongly_connected(graph) if len(c) > 1]
    assert not circles, f"rooms importing each other: {circles}"


CHECKPOINT_PACKAGE = "olmolike.train.checkpoint"

TRAINER_COMPONENTS = (
    "olmolike.train.step_results",
    "olmolike.train.background_ops",
    "olmolike.train.cancellation",
    "olmolike.train.metrics",
    "olmolike.train.metric_buffer",
    "olmolike.train.durations",
)
"""Modules the trainer builds its parts from: they get values and narrow objects, never the
trainer (nor the callbacks it drives)."""


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_checkpoint_package_imports_nothing_of_train_outside_itself() -> None:
    # It sits on distributed/ (DCP input/output, the on-disk format) and below everything
    # else of the trainer: the callbacks and the trainer use it, never the other way round.
    offending = [
        f"{path.relative_to(PACKAGE_ROOT.parent)}:{line} imports {target}"
        for path in SOURCES
        if _in_package(module_name(path), CHECKPOINT_PACKAGE)
        for line, target in imported_modules(path)
        if room(target) in ABOVE_TRAIN
        and not _in_package(target, CHECKPOINT_PACKAGE)
        and target != "olmolike.train"  # ``from ... import io`` names the package on the way
    ]
    assert not offending, "\n".join(offending)


def test_only_the_command_line_imports_the_planner() -> None:
    # The planner reads configs and is run by ``olmolike plan``; nothing that trains uses it.
    offending = [
        f"{path.relative_to(PACKAGE_ROOT.parent)}:{line} imports {target}"
        for path in SOURCES
        if room(module_name(path)) not in ("plan", "cli")
        for line, target in imported_modules(path)
        if room(target) == "plan"
    ]
    assert not offending, "\n".join(offending)


def test_moved_modules_import_under_their_old_names_with_a_warning() -> None:
    # Kept for one release: olmolike/__init__.py's MOVED_MODULES, no file in the old room.
    code = (
        "import warnings, importlib\n"
        "warnings.simplefilter('error')\n"
        "from olmolike import MOVED_MODULES\n"
        "for old, new in MOVED_MODULES.items():\n"
        "    try:\n"
        "        importlib.import_module(old)\n"
        "    except DeprecationWarning as w:\n"
        "        assert new in str(w), w\n"
        "    else:\n"
        "        raise AssertionError(f'{old} did not warn')\n"
        "warnings.simplefilter('ignore')\n"
        "for old, new in MOVED_MODULES.items():\n"
        "    assert importlib.import_module(old) is importlib.import_module(new), old\n"
        "from olmolike.train.memory_report import plan_report\n"
        "import olmolike.plan\n"
        "assert plan_report is olmolike.plan.plan_report\n"
        "print(len(MOVED_MODULES))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=patient(120)
    )
    assert out.returncode == 0 and out.stdout.strip() == "3", out.stderr
    for old in ("memory_plan", "activation_memory", "memory_report"):
        assert not (PACKAGE_ROOT / "train" / f"{old}.py").exists()


def test_trainer_components_import_neither_the_trainer_nor_callbacks() -> None:
    components = [*TRAINER_COMPONENTS, CHECKPOINT_PACKAGE]
    offending = [
        f"{path.relative_to(PACKAGE_ROOT.parent)}:{line} imports {target}"
        for path in SOURCES
        if any(_in_package(module_name(path), c) for c in components)
        for line, target in imported_modules(path)
        if _in_package(target, "olmolike.train.trainer")
        or _in_package(target, "olmolike.train.callbacks")
    ]
    assert not offending, "\n".join(offending)


TRAIN_MODULE_PACKAGE = "olmolike.train.train_module"


def test_train_modules_neither_import_nor_register_callbacks() -> None:
    # A train module owns what a step does; callbacks sit beside the loop and drive the trainer
    # from outside it. What a module needs at the start of a run (pretrained weights) it does
    # in its own TrainModule.on_fit_start, never by adding a callback to the trainer.
    offending = [
        f"{path.relative_to(PACKAGE_ROOT.parent)}:{line} imports {target}"
        for path in SOURCES
        if _in_package(module_name(path), TRAIN_MODULE_PACKAGE)
        for line, target in imported_modules(path)
        if _in_package(target, "olmolike.train.callbacks")
    ]
    for path in sorted((PACKAGE_ROOT / "train" / "train_module").rglob("*.py")):
        offending += [
            f"{path.relative_to(PACKAGE_ROOT.parent)}:{node.lineno} calls .{node.attr}()"
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Attribute) and node.attr == "add_callback"
        ]
    assert not offending, "\n".join(offending)


def test_save_completion_reaches_the_checkpointer_callback_only_through_its_hook() -> None:
    # One path (docs/contributing-layers.md, "The checkpoint stack"): StepResults.deliver_saves
    # fires post_checkpoint_saved; the callback polls no future of its own.
    source = (PACKAGE_ROOT / "train" / "callbacks" / "checkpointer.py").read_text()
    tree = ast.parse(source)
    polled = [
        f"checkpointer.py:{node.lineno} .{node.attr}()"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in ("done", "result", "exception")
    ]
    assert "concurrent.futures" not in source and not polled, polled


def test_callbacks_reach_no_private_trainer_member() -> None:
    # A callback uses the Trainer's public API, so that the Trainer's internals can change.
    offending = []
    for path in sorted((PACKAGE_ROOT / "train" / "callbacks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "trainer"
            ):
                offending.append(f"{path.name}:{node.lineno} trainer.{node.attr}")
    assert not offending, "\n".join(offending)


def test_no_runtime_import_circle_between_modules() -> None:
    # Between modules, not only rooms: two modules that import each other (even inside a
    # function, as data/prepare.py and data/sft.py once did) cannot be read or moved apart.
    graph: dict[str, set[str]] = {}
    for path in SOURCES:
        source = module_name(path)
        for _, target in imported_modules(path, runtime_only=True):
            if target != source:
                graph.setdefault(source, set()).add(target)
    circles = [c for c in _strongly_connected(graph) if len(c) > 1]
    assert not circles, f"modules importing each other at run time: {circles}"


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the groups of nodes that reach each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [g for g in _strongly_connected(graph) if len(g) > 1] == [["a", "b", "c"]]


def test_checkpoint_tools_load_without_the_trainer() -> None:
    # Offline tools (unsharding, reading checkpoint metadata) must not drag in the trainer.
    code = (
        "import olmolike.distributed.checkpoint as c\n"
        "assert c.unshard_checkpoint and c.UnshardStrategy\n"
    )
    assert _imported_after(code, "olmolike.train") == []


def test_pipelining_is_imported_only_when_a_pipeline_is_built() -> None:
    # torch.distributed.pipelining imports torch._dynamo (~1 CPU s): every CLI command and every
    # process that fails on its config before training would pay it at start-up.
    code = "import olmolike.train, olmolike.cli, olmolike.experiment, olmolike.plan\n"
    assert _imported_after(code, "torch.distributed.pipelining") == []


def _imported_after(code: str, prefix: str) -> list[str]:
    """The modules named ``prefix...`` that a fresh interpreter holds after running ``code``."""
    report = f"import sys; print([m for m in sorted(sys.modules) if m.startswith({prefix!r})])"
    out = subprocess.run(
        [sys.executable, "-c", code + report],
        capture_output=True,
        text=True,
        check=True,
        timeout=patient(120),
    )
    return ast.literal_eval(out.stdout.strip())
