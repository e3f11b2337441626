"""Save the experiment's config next to its checkpoints, so a checkpoint explains itself."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from ... import io
from ...distributed.utils import get_rank
from ...exceptions import ConfigurationError
from .callback import Callback

__all__ = ["ConfigSaverCallback"]

log = logging.getLogger(__name__)


@dataclass
class ConfigSaverCallback(Callback, name="config_saver"):
    """Saves ``config`` as JSON in every checkpoint folder and in the save folder (rank 0).

    Each checkpoint holds ``{fname}``, written before its completion marker, so a checkpoint
    copied on its own still says how it was trained; tools that read checkpoints
    (``olmolike generate``, ``olmolike export-hf``) look there first. The copy in the save
    folder, written when training starts, describes the run as a whole. A resumed run whose config changed keeps the previous file as
    ``config-before-step{N}.json``, so every checkpoint's settings stay on record. An existing
    backup for step N is kept: it means an earlier run also resumed at step N and saved no
    checkpoint since (it would not resume at N again otherwise), so the backup holds the config
    of the checkpoints up to N, while the config being replaced made none.
    """

    config: dict[str, Any] | None = None
    """The experiment config as plain values, e.g. ``experiment.as_config_dict()``."""
    fname: str = "config.json"
    """The file name of the config, in the save folder and in each checkpoint folder."""

    priority = 5

    def validate(self) -> None:
        if not self.fname or "/" in self.fname or self.fname in (".", ".."):
            raise ConfigurationError(
                f"must be a plain file name such as 'config.json', got {self.fname!r}",
                path="fname",
            )
        if self.config is not None:
            # Here, not at pre_train: there only rank 0 writes, and it would fail alone mid-start.
            try:
                self._text()
            except (TypeError, ValueError) as e:
                raise ConfigurationError(
                    f"must hold plain JSON values (dicts, lists, strings, numbers, booleans, "
                    f"null), e.g. from as_config_dict(); {e}",
                    path="config",
                ) from None

    def _text(self) -> str:
        return json.dumps(self.config, indent=2, sort_keys=True) + "\n"

    def post_attach(self) -> None:
        if self.config is not None:
            self.trainer.add_checkpoint_file(self.fname, self._text())

    def pre_train(self) -> None:
        if self.config is None or get_rank() != 0:
            return
        text = self._text()
        folder = self.trainer.save_folder
        path = io.join_path(folder, self.fname)
        if io.exists(path):
            previous = io.read_bytes(path).decode()
            if previous == text:
                return
            stem = self.fname.rsplit(".", 1)[0]
            backup = f"{stem}-before-step{self.step}.json"
            if io.exists(io.join_path(folder, backup)):
                log.info(
                    "The config changed since the last run, which saved no checkpoint; %s keeps "
                    "the config of the checkpoints up to step %d",
                    backup,
                    self.step,
                )
            else:
                io.write_file(folder, backup, previous)
                log.info("The config changed since the last run; the old one is kept as %s", backup)
        io.write_file(folder, self.fname, text, overwrite=True)
