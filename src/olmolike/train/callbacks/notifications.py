"""Which events of a run the notifying callbacks (Comet, Slack) report."""

from __future__ import annotations

from ...config import StrEnum

__all__ = ["NotificationSetting"]


class NotificationSetting(StrEnum):
    """Which events of a run send a notification."""

    all = "all"
    """Every event the callback reports: the start and the end, and for Slack also every
    completed checkpoint and epoch."""
    end_only = "end_only"
    """Only the end: completed, canceled (Slack) or failed."""
    failure_only = "failure_only"
    """Only a failure."""
    none = "none"
    """Nothing."""

    def reports(self, *settings: NotificationSetting) -> bool:
        """Whether an event is reported that these ``settings`` (and ``all``) report."""
        return self in (NotificationSetting.all, *settings)
