"""Train checkpoints: saving, loading, retention and the save folder's lease, in one package.

What each module holds (see ``docs/contributing-layers.md``, "The checkpoint stack"):

* :mod:`.checkpointer`: the :class:`Checkpointer` (and its config): what lasts across saves
  (threads, staging buffers, the lease) and the one save function, sync or in the background;
* :mod:`.save`: one save's commit protocol (staging folder, uploads, marker last);
* :mod:`.load`: one load (checks, DCP read, trainer state, what a failed load tells);
* :mod:`.lease`: one writer per save folder;
* :mod:`.run`: a training run's loading: resuming with fallback, the files added to every
  checkpoint, giving the save folder up.

Removal (marker first, files in the background) is the on-disk format's
(:func:`~olmolike.distributed.checkpoint_format.purge`); which checkpoints go once a save is
complete is the :class:`~olmolike.train.callbacks.CheckpointerCallback`'s rule.

The package sits on :mod:`olmolike.distributed` (DCP input/output, the on-disk format) and
imports nothing else of :mod:`olmolike.train`.
"""

from ...config import register_config_class
from ...distributed.checkpoint_format import MARKER, CheckpointMetadata
from .checkpointer import Checkpointer, CheckpointerConfig
from .save import check_extra_file_name

# Config files name the class by its public path, as they did before this was a package: it
# stays the name written, and an older file's name still loads.
CheckpointerConfig.__module__ = __name__
register_config_class(CheckpointerConfig)

__all__ = [
    "MARKER",
    "CheckpointMetadata",
    "Checkpointer",
    "CheckpointerConfig",
    "check_extra_file_name",
]
