"""Metrics to Weights & Biases, and canceling a run by tagging it there."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...distributed.utils import get_rank
from ...exceptions import ConfigurationError
from ..bookkeeping import DaemonThreadPool
from .callback import Callback

__all__ = ["WandBCallback"]

log = logging.getLogger(__name__)

MODES = ("online", "offline", "disabled")

FINISH_TIMEOUT_S = 120.0
"""How long the end of a run waits for W&B to take the last metrics before finishing anyway."""


def _wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise ConfigurationError(
            "WandBCallback needs the 'wandb' package; install it with: "
            "pip install 'olmolike[wandb]' (or remove the callback)",
            path="wandb",
        ) from None
    return wandb


@dataclass
class WandBCallback(Callback, name="wandb"):
    """Logs every metric to a W&B run at its step (rank 0), and stops the run when tagged.

    Every ``cancel_check_interval`` steps rank 0 looks up the run's tags; if ``cancel_tag`` is
    among them it asks the trainer to stop (all ranks agree at the trainer's next cancel check,
    and the final checkpoint is saved as on any graceful stop). So a run can be stopped from the
    W&B page without access to the cluster. Offline runs cannot be tagged remotely; their files
    go to ``{dir or work_dir}/wandb`` and can be uploaded later with ``wandb sync``.

    A resumed run continues the same W&B run: its id is kept in the checkpoints.

    The training loop never waits for W&B: ``run.log`` (a round trip to W&B's service process,
    measured ~0.6 ms per step even offline) and tag lookups (requests to the W&B API) run on
    background threads, logs in step order. A tag seen by a lookup cancels the run at the next
    lookup step; a lookup still running then is not repeated. A failed ``run.log`` is raised
    in the training loop when the next metrics are logged (after the last step: logged as an
    error when the W&B run is finished).
    """

    enabled: bool = True
    project: str | None = None
    entity: str | None = None
    run_name: str | None = None
    """The run's display name (W&B's ``name``)."""
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    notes: str | None = None
    config: dict[str, Any] | None = None
    """The experiment config as plain values, shown on the run's page."""
    mode: str = "online"
    """``online``, ``offline`` (no network; sync later) or ``disabled``."""
    dir: str | None = None
    """Local folder for W&B's files; default: the trainer's ``work_dir``."""
    cancel_tag: str | None = "cancel"
    """Tag that stops the run; ``None`` turns the check off."""
    cancel_check_interval: int = 10
    """Steps between tag lookups (each is a request to the W&B API)."""

    _run: Any = field(default=None, init=False, repr=False)
    _run_id: str | None = field(default=None, init=False, repr=False)
    _log_thread: DaemonThreadPool | None = field(default=None, init=False, repr=False)
    _last_log: Future[None] | None = field(default=None, init=False, repr=False)
    _log_error: BaseException | None = field(default=None, init=False, repr=False)
    _tag_thread: DaemonThreadPool | None = field(default=None, init=False, repr=False)
    _tag_lookup: Future[list[str]] | None = field(default=None, init=False, repr=False)

    priority = -1  # after evaluators and other producers of a step's metrics

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ConfigurationError(f"must be one of {MODES}, got {self.mode!r}", path="mode")
        if self.cancel_check_interval < 1:
            raise ConfigurationError(
                f"must be >= 1, got {self.cancel_check_interval}", path="cancel_check_interval"
            )
        if self.cancel_tag == "":
            raise ConfigurationError(
                "must be a tag name, or None to turn tag-based canceling off", path="cancel_tag"
            )

    @property
    def _active(self) -> bool:
        return self.enabled and self.mode != "disabled" and get_rank() == 0

    def post_attach(self) -> None:
        if self._active:
            _wandb()  # a missing package fails at build time, not mid-run

    def pre_train(self) -> None:
        if not self._active:
            return
        folder = Path(self.dir) if self.dir else self.trainer.work_dir
        folder.mkdir(parents=True, exist_ok=True)
        self._run = _wandb().init(
            project=self.project,
            entity=self.entity,
            name=self.run_name,
            group=self.group,
            tags=list(self.tags),
            notes=self.notes,
            config=self.config,
            mode=self.mode,
            dir=str(folder),
            id=self._run_id,
            resume="allow" if self._run_id else None,
        )
        self._run_id = self._run.id
        self._log_thread = DaemonThreadPool(1, "wandb-log")
        log.info("W&B run %s (%s), files in %s", self._run.id, self.mode, self._run.dir)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self._run is None or self._log_thread is None:
            return
        if self._log_error is not None:
            raise self._log_error  # a W&B failure surfaces here, in the training loop
        values = {name: float(value) for name, value in metrics.items()}
        self._last_log = self._log_thread.submit(self._log, self._run, values, step)

    def _log(self, run: Any, values: dict[str, float], step: int) -> None:
        if self._log_error is not None:
            return  # W&B already failed: later steps would only fail again
        try:
            run.log(values, step=step)
        except BaseException as e:
            self._log_error = e

    def post_step(self) -> None:
        if self._run is None or self.cancel_tag is None:
            return
        if self.step % self.cancel_check_interval != 0:
            return
        lookup = self._tag_lookup
        if lookup is not None and not lookup.done():
            return  # the API is slow: one lookup at a time
        if lookup is not None and self.cancel_tag in lookup.result():
            self._tag_lookup = None
            self.trainer.cancel_run(f"the W&B run has the tag {self.cancel_tag!r}")
            return
        if self._tag_thread is None:
            self._tag_thread = DaemonThreadPool(1, "wandb-tags")
        self._tag_lookup = self._tag_thread.submit(self.fetch_tags)

    def fetch_tags(self) -> list[str]:
        """The run's current tags. Offline runs cannot be tagged from outside: their own tags.

        A failed lookup (network, API) returns no tags: a W&B outage must not stop training.
        """
        if self.mode == "offline":
            return list(self.tags)
        try:
            api = _wandb().Api()
            return list(api.run(f"{self._run.entity}/{self._run.project}/{self._run.id}").tags)
        except Exception as e:
            log.warning("Could not read the W&B run's tags (%s); not canceling", e)
            return []

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self._run_id} if self._run_id else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._run_id = state_dict.get("run_id", self._run_id)

    def post_train(self) -> None:
        self._finish(exit_code=0)

    def on_error(self, exc: BaseException) -> None:
        self._finish(exit_code=1)

    def close(self) -> None:
        self._finish(exit_code=0)

    def _finish(self, exit_code: int) -> None:
        if self._run is None:
            return
        run, self._run = self._run, None
        if self._log_thread is not None:
            self._log_thread.shutdown(wait=False)  # runs what is queued, then stops
            try:
                if self._last_log is not None:
                    self._last_log.result(timeout=FINISH_TIMEOUT_S)
            except FutureTimeout:
                log.warning("W&B took over %.0f s to take the last metrics", FINISH_TIMEOUT_S)
            if self._log_error is not None:
                log.error("Logging metrics to W&B failed: %s", self._log_error)
        if self._tag_thread is not None:
            self._tag_thread.shutdown(wait=False)
        run.finish(exit_code=exit_code)
