"""Run notifications posted to a Slack incoming webhook."""

from __future__ import annotations

import json
import logging
import os
import urllib.request
from dataclasses import dataclass

from ...distributed.utils import get_rank
from ...exceptions import ConfigurationError
from .callback import Callback
from .notifications import NotificationSetting

__all__ = ["SLACK_WEBHOOK_URL_ENV_VAR", "SlackNotificationSetting", "SlackNotifierCallback"]

log = logging.getLogger(__name__)

SLACK_WEBHOOK_URL_ENV_VAR = "SLACK_WEBHOOK_URL"
EXC_LINE_LIMIT = 30
"""Lines of an error message sent at most (Slack truncates long messages anyway)."""


SlackNotificationSetting = NotificationSetting
"""Which events are posted; OLMo-core's name."""


@dataclass
class SlackNotifierCallback(Callback, name="slack_notifier"):
    """Posts a message about the run to Slack (from rank 0), with its step, epoch and tokens.

    A failed post is logged and never stops training: a notification is not worth a run.
    """

    name: str | None = None
    """The run's name in the messages."""
    notifications: NotificationSetting = NotificationSetting.end_only
    """Which events post a message: ``all`` (start, checkpoints, epochs, end), ``end_only``
    (completed, canceled or failed), ``failure_only`` or ``none``."""
    enabled: bool = True
    """``False`` turns the callback off while keeping it in the config (an override can turn it back
    on)."""
    webhook_url: str | None = None
    """The webhook to post to; by default ``$SLACK_WEBHOOK_URL``. Keep it out of config files
    that are shared: anyone with the URL can post to the channel."""
    timeout: float = 10.0
    """Seconds a post may take before it is given up."""

    def _url(self) -> str | None:
        return self.webhook_url or os.environ.get(SLACK_WEBHOOK_URL_ENV_VAR)

    @property
    def _active(self) -> bool:
        return self.enabled and self.notifications != NotificationSetting.none and get_rank() == 0

    def post_attach(self) -> None:
        if self._active and not self._url():
            raise ConfigurationError(
                f"needs a webhook: set webhook_url or the environment variable "
                f"{SLACK_WEBHOOK_URL_ENV_VAR}",
                path="webhook_url",
            )

    def _wants(self, *settings: NotificationSetting) -> bool:
        return self._active and self.notifications.reports(*settings)

    def pre_train(self) -> None:
        if self._wants():
            self.notify("started")

    def post_checkpoint_saved(self, path: str) -> None:
        if self._wants():
            self.notify(f"saved a checkpoint to {path}")

    def post_epoch(self) -> None:
        if self._wants():
            self.notify("completed an epoch")

    def post_train(self) -> None:
        if self._wants(NotificationSetting.end_only):
            self.notify("canceled" if self.trainer.is_canceled else "completed successfully")

    def on_error(self, exc: BaseException) -> None:
        if not self._wants(NotificationSetting.end_only, NotificationSetting.failure_only):
            return
        lines = str(exc).rstrip("\n").split("\n")
        if len(lines) > EXC_LINE_LIMIT:
            lines = [*lines[:EXC_LINE_LIMIT], "..."]
        text = "\n".join(lines)
        self.notify(f"failed with {type(exc).__name__}:\n```\n{text}\n```")

    def notify(self, event: str) -> None:
        """Post ``Run <name> <event>`` with the run's progress."""
        trainer = self.trainer
        who = f"Run `{self.name}`" if self.name else "Run"
        text = (
            f"{who} {event}\n*Progress:*\n- step: {trainer.global_step:,d}\n"
            f"- epoch: {trainer.epoch}\n- tokens: {trainer.global_train_tokens_seen:,d}"
        )
        url = self._url()
        assert url is not None
        request = urllib.request.Request(
            url,
            data=json.dumps({"text": text}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                response.read()
        except OSError as e:
            log.warning("Could not post a Slack notification (%s): %s", event.split("\n")[0], e)
