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
    """Writes ``config`` as JSON to ``{save_folder}/{fname}`` when training starts (rank 0).

    Tools that read checkpoints (``olmolike generate``, the Hugging Face export) find the model
    config there. A resumed run whose config changed keeps the previous file as
    ``config-before-step{N}.json``, so every checkpoint's settings stay on record.
    """

    config: dict[str, Any] | None = None
    """The experiment config as plain values, e.g. ``experiment.as_config_dict()``."""
    fname: str = "config.json"

    priority = 5

    def validate(self) -> None:
        if not self.fname or "/" in self.fname:
            raise ConfigurationError(f"must be a plain file name, got {self.fname!r}", path="fname")

    def pre_train(self) -> None:
        if self.config is None or get_rank() != 0:
            return
        text = json.dumps(self.config, indent=2, sort_keys=True) + "\n"
        folder = self.trainer.save_folder
        path = io.join_path(folder, self.fname)
        if io.exists(path):
            previous = io.read_bytes(path).decode()
            if previous == text:
                return
            stem = self.fname.rsplit(".", 1)[0]
            backup = f"{stem}-before-step{self.step}.json"
            io.write_file(folder, backup, previous, overwrite=True)
            log.info("The config changed since the last run; the old one is kept as %s", backup)
        io.write_file(folder, self.fname, text, overwrite=True)
