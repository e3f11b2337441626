"""A ``_CLASS_`` name picks exactly its own class, and a wrong one gets a short suggestion."""

from __future__ import annotations

import pytest

import olmolike.train.callbacks as callbacks
from olmolike.exceptions import ConfigurationError
from olmolike.train import TrainerConfig


def built(name: str, **fields: object) -> object:
    callback = {"_CLASS_": name, **fields}
    config = TrainerConfig.from_dict({"save_folder": "x", "callbacks": {"c": callback}})
    return config.callbacks["c"]


def test_a_subclass_never_takes_its_parents_short_name() -> None:
    # ListCheckpointerCallback subclasses CheckpointerCallback; "checkpointer" built it.
    assert type(built("checkpointer")) is callbacks.CheckpointerCallback
    listed = built("list_checkpointer", save_steps=[10])
    assert type(listed) is callbacks.ListCheckpointerCallback


@pytest.mark.parametrize(
    ("typo", "suggested"),
    [
        ("progres", "did you mean 'progress' (ProgressCallback)?"),
        ("ProgressCallbak", "did you mean 'progress' (ProgressCallback)?"),
        ("wand", "did you mean 'wandb' (WandBCallback)?"),
    ],
)
def test_a_misspelt_class_gets_the_closest_public_names(typo: str, suggested: str) -> None:
    with pytest.raises(ConfigurationError) as error:
        built(typo)
    message = str(error.value)
    # Other tests register callbacks of their own: they may be offered too, after ours.
    assert message.startswith(f"callbacks.c: unknown class {typo!r}; {suggested[:-1]}")


def test_without_a_close_name_the_public_names_are_listed_short() -> None:
    with pytest.raises(ConfigurationError) as error:
        built("zzzz")
    message = str(error.value)
    assert "progress" in message and "speed_monitor" in message
    assert "_Periodic" not in message  # private helpers are not offered
    assert "callback.Callback" not in message  # nor the base class itself
