"""Every logged metric to a JSON-lines file beside the checkpoints, one line per step."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ... import io
from ...distributed.utils import get_rank
from ...exceptions import ConfigurationError
from .save_folder_output import _SaveFolderOutput

__all__ = ["MetricSaverCallback", "read_metrics_file"]

log = logging.getLogger(__name__)


def read_metrics_file(text: str) -> list[dict[str, Any]]:
    """Parse the lines of a metrics file, skipping a torn last line.

    A process killed mid-write can leave half a line at the end; that step is lost either way,
    and refusing to read the rest would lose every other step too.
    """
    records = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
            log.warning("Ignoring a torn last line in a metrics file: %r", line[:80])
    return records


@dataclass
class MetricSaverCallback(_SaveFolderOutput, name="metric_saver"):
    """Appends each step's metrics to ``{save_folder}/{fname}`` as one JSON line (rank 0).

    Each line is ``{"step": int, "tokens": int, "time": unix_seconds, "metrics": {...}}``,
    flushed once per ``metrics_collect_interval`` (when the trainer hands over that interval's
    metrics) and at every checkpoint, so the file is readable (``olmolike plot``) while training
    runs without a write system call per step, which on a shared file system can cost more than
    a small step. A resumed run first drops the lines of steps after the checkpoint it resumed
    from (they are about to be trained again) and then appends, so no step appears twice. Steps
    whose metrics were not yet logged when that checkpoint was saved (metrics arrive once per
    ``metrics_collect_interval``) are missing from the file.

    For a remote save folder the file is written in ``work_dir`` and copied to the save folder
    whenever a checkpoint is saved and when training ends.
    """

    fname: str = "metrics.jsonl"
    """File name inside the save folder."""

    _file: IO[str] | None = field(default=None, init=False, repr=False)
    _tokens: dict[int, int] = field(default_factory=dict, init=False, repr=False)

    priority = -1  # after evaluators and other producers of a step's metrics

    def validate(self) -> None:
        if not self.fname or "/" in self.fname or self.fname in (".", ".."):
            raise ConfigurationError(
                f"must be a plain file name such as 'metrics.jsonl', got {self.fname!r}",
                path="fname",
            )

    @property
    def path(self) -> Path:
        """The local file being appended to (in ``work_dir`` when the save folder is remote)."""
        return self._local_path()

    def _output_name(self) -> str:
        return self.fname

    def _flush(self) -> bool:
        if self._file is not None:
            self._file.flush()
        return self._file is not None

    def pre_train(self) -> None:
        if get_rank() != 0:
            return
        path = self.path
        remote_copy = io.join_path(self.trainer.save_folder, self.fname)
        if self._remote and io.exists(remote_copy):
            # The save folder's copy is the one that matches its checkpoints.
            text = io.read_bytes(remote_copy).decode()
        else:
            text = path.read_text() if path.is_file() else ""
        self._truncate(path, text, keep_through=self.trainer.global_step)
        # Open for the whole run (close() closes it): reopening per line would cost a syscall
        # pair per step for nothing.
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def _truncate(self, path: Path, text: str, keep_through: int) -> None:
        """Rewrite ``path`` atomically with only the lines of steps up to ``keep_through``."""
        records = read_metrics_file(text)
        kept = [r for r in records if r["step"] <= keep_through]
        dropped = len(records) - len(kept)
        if dropped:
            log.info(
                "%s: dropping %d line(s) after step %d, which this run trains again",
                path,
                dropped,
                keep_through,
            )
        lines = "".join(json.dumps(r) + "\n" for r in kept)
        io.write_file(path.parent, path.name, lines, overwrite=True)

    def post_step(self) -> None:
        if self._file is not None:
            # Metrics arrive later than their step; its token count is taken now.
            self._tokens[self.step] = self.trainer.global_train_tokens_seen

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self._file is None:
            return
        tokens = self._tokens.pop(step, self.trainer.global_train_tokens_seen)
        for old in [s for s in self._tokens if s < step]:
            del self._tokens[old]
        record = {
            "step": step,
            "tokens": tokens,
            "time": time.time(),
            "metrics": {name: float(value) for name, value in metrics.items()},
        }
        self._file.write(json.dumps(record) + "\n")

    def on_error(self, exc: BaseException) -> None:
        # Lines past the last checkpoint are harmless: a resumed run drops them.
        self._persist()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
