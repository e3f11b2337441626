"""Metrics to a Comet experiment (online, or offline to a local archive)."""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...distributed.utils import get_rank
from ...exceptions import ConfigurationError
from .callback import Callback
from .notifications import NotificationSetting

__all__ = ["COMET_API_KEY_ENV_VAR", "CometCallback", "CometNotificationSetting"]

log = logging.getLogger(__name__)

COMET_API_KEY_ENV_VAR = "COMET_API_KEY"


CometNotificationSetting = NotificationSetting
"""Which events send a Comet notification (online experiments only); OLMo-core's name."""


@dataclass
class CometCallback(Callback, name="comet"):
    """Logs every metric to a Comet experiment at its step, from rank 0.

    Online (the default) it needs ``$COMET_API_KEY``, and a tag from ``cancel_tags`` added to
    the experiment on Comet's site stops the run (checked every ``cancel_check_interval``
    steps). With ``offline=True`` nothing leaves the machine: the experiment is written as a
    zip archive to ``offline_directory`` (default ``{work_dir}/comet``), to upload later with
    ``comet upload``. Needs the ``comet_ml`` package.
    """

    enabled: bool = True
    """``False`` turns the callback off while keeping it in the config (an override can turn it back
    on)."""
    name: str | None = None
    """The experiment's name on Comet; default: Comet's own."""
    project: str | None = None
    """The Comet project the experiment goes to; default: Comet's default project
    (``$COMET_PROJECT_NAME``)."""
    workspace: str | None = None
    """The Comet workspace (user or team); default: the API key's own."""
    tags: list[str] | None = None
    """Tags added to the experiment when it starts."""
    config: dict[str, Any] | None = None
    """Parameters shown with the experiment (e.g. the run's config as plain values)."""
    cancel_tags: list[str] | None = field(
        default_factory=lambda: ["cancel", "canceled", "cancelled"]
    )
    """Tags that stop the run gracefully when added to the experiment on Comet's site (checked every
    ``cancel_check_interval`` steps, online only); ``None`` or empty turns the check off."""
    cancel_check_interval: int | None = None
    """Steps between tag lookups; default the trainer's ``cancel_check_interval``."""
    notifications: NotificationSetting = NotificationSetting.none
    """Which events (start, end, failure) Comet's notification system is told about: ``all``,
    ``end_only``, ``failure_only`` or ``none``."""
    failure_tag: str = "failed"
    """Added to the experiment when the run fails."""
    auto_resume: bool = False
    """Continue the experiment of the checkpoint a run resumes from (same ``name``)."""
    offline: bool = False
    """Write the experiment to a local archive (``offline_directory``) instead of sending it; upload
    it later with ``comet upload``."""
    offline_directory: str | None = None
    """Where an offline experiment's archive goes; default ``{work_dir}/comet``."""

    _exp: Any = field(default=None, init=False, repr=False)
    _exp_key: str | None = field(default=None, init=False, repr=False)

    @property
    def _active(self) -> bool:
        return self.enabled and get_rank() == 0

    @property
    def exp(self) -> Any:
        """The ``comet_ml`` experiment (rank 0, once training started)."""
        return self._exp

    def post_attach(self) -> None:
        if not self._active:
            return
        _comet()  # a missing package fails when the trainer is built, not mid-run
        if not self.offline and COMET_API_KEY_ENV_VAR not in os.environ:
            raise ConfigurationError(
                f"an online experiment needs ${COMET_API_KEY_ENV_VAR}; set it, or offline=True",
                path="offline",
            )

    def state_dict(self) -> dict[str, Any]:
        return {"experiment_key": self._exp_key, "name": self.name}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.auto_resume and state_dict.get("name") == self.name:
            self._exp_key = state_dict.get("experiment_key")

    def pre_train(self) -> None:
        if not self._active:
            return
        os.environ.setdefault("COMET_DISABLE_AUTO_LOGGING", "1")
        comet = _comet()
        common = {"project_name": self.project, "workspace": self.workspace}
        if self.offline:
            folder = Path(self.offline_directory or self.trainer.work_dir / "comet")
            folder.mkdir(parents=True, exist_ok=True)
            self._exp = comet.OfflineExperiment(offline_directory=str(folder), **common)
        elif self.auto_resume and self._exp_key is not None:
            self._exp = comet.ExistingExperiment(previous_experiment=self._exp_key)
        else:
            self._exp = comet.Experiment(api_key=os.environ[COMET_API_KEY_ENV_VAR], **common)
        if self.name is not None:
            self._exp.set_name(self.name)
        if self.tags:
            self._exp.add_tags(list(self.tags))
        if self.config is not None:
            self._exp.log_parameters(self.config)
        self._exp_key = self._exp.get_key()
        self._notify("started", NotificationSetting.all)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self._exp is not None:
            self._exp.log_metrics(metrics, step=step)

    def post_step(self) -> None:
        if self._exp is None or self.offline or not self.cancel_tags:
            return
        interval = self.cancel_check_interval or self.trainer.cancel_check_interval
        if self.step % interval == 0:
            self.trainer.run_bookkeeping_op(
                self._check_tags, op_name="comet_tags", allow_multiple=False, distributed=False
            )

    def _check_tags(self) -> None:
        try:
            tags = _comet().API().get_experiment_by_key(self._exp_key).get_tags()
        except Exception as e:  # the API is best-effort: a failed lookup never stops training
            log.warning("Could not read the Comet experiment's tags: %s", e)
            return
        wanted = {t.lower() for t in self.cancel_tags or ()}
        if found := sorted(wanted & {t.lower() for t in tags}):
            self.trainer.cancel_run(f"the Comet experiment has the tag {found[0]!r}")

    def post_train(self) -> None:
        self._notify("completed successfully", NotificationSetting.end_only)
        self._end()

    def on_error(self, exc: BaseException) -> None:
        if self._exp is None:
            return
        self._exp.add_tag(self.failure_tag)
        self._notify(
            f"failed with {type(exc).__name__}",
            NotificationSetting.end_only,
            NotificationSetting.failure_only,
        )
        self._end()

    def close(self) -> None:
        self._end()

    def _notify(self, status: str, *settings: NotificationSetting) -> None:
        if self._exp is not None and not self.offline and self.notifications.reports(*settings):
            self._exp.send_notification(f"Experiment {self._exp.get_name()}", status=status)

    def _end(self) -> None:
        exp, self._exp = self._exp, None
        if exp is not None:
            exp.end()


def _comet() -> Any:
    try:
        return importlib.import_module("comet_ml")
    except ImportError:
        raise ConfigurationError(
            "needs the comet_ml package: pip install comet_ml", path="callbacks.comet"
        ) from None
