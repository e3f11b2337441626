"""The trainer is one class that owns its components: no mixin restating its fields."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path

import olmolike.train
from olmolike.train import Trainer

TRAIN_DIR = Path(olmolike.train.__file__).parent


def test_trainer_has_no_base_class() -> None:
    assert Trainer.__bases__ == (object,)


def test_the_former_mixin_modules_are_gone() -> None:
    for name in ("trainer_io", "trainer_eval", "trainer_hooks"):
        assert importlib.util.find_spec(f"olmolike.train.{name}") is None, name


def test_no_class_under_train_restates_the_trainers_fields() -> None:
    """A class annotating several of the trainer's private fields is a mixin in disguise (one
    shared name may be a coincidence; a component gets explicit inputs, not private fields)."""
    fields = {f.name for f in dataclasses.fields(Trainer)}
    offenders = []
    for path in TRAIN_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef) or node.name == "Trainer":
                continue
            annotated = {
                stmt.target.id
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            }
            private = {name for name in annotated & fields if name.startswith("_")}
            if len(private) >= 2:
                offenders.append(f"{path.name}:{node.name} restates {sorted(private)}")
    assert not offenders, offenders
