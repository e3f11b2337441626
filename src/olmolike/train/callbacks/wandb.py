"""Metrics to Weights & Biases, and canceling a run by tagging it there."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

from ...distributed.utils import get_rank
from ...exceptions import ConfigurationError
from ...threads import DaemonThreadPool
from .callback import Callback
from .sink_process import SinkError, SinkProcess

__all__ = ["WandBCallback", "WandBSink"]

log = logging.getLogger(__name__)

MODES = ("online", "offline", "disabled")

FINISH_TIMEOUT_S = 300.0
"""How long the end of a run waits for W&B to take the last metrics and finish."""


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

    The training process does not run W&B's SDK: ``run.log`` costs ~0.6 ms of Python per step
    (even offline), which on a helper thread still competes with training for the GIL. The
    run lives in a child process (:class:`~.sink_process.SinkProcess`) that receives each
    step's metrics, in order; a failure there is raised in the training loop when the next
    metrics are logged, or when the run finishes. Tag lookups (requests to the W&B API) run on
    a background thread; a tag seen by one cancels the run at the next lookup step, and a
    lookup still running then is not repeated.
    """

    enabled: bool = True
    """``False`` turns the callback off while keeping it in the config (an override can turn it back
    on)."""
    project: str | None = None
    """The W&B project the run goes to; default ``$WANDB_PROJECT`` or W&B's own."""
    entity: str | None = None
    """The W&B user or team that owns the run; default the API key's."""
    run_name: str | None = None
    """The run's display name (W&B's ``name``)."""
    group: str | None = None
    """A W&B group that gathers related runs (an ablation's, say)."""
    tags: list[str] = field(default_factory=list)
    """Tags added to the run."""
    notes: str | None = None
    """A longer description shown on the run's page."""
    config: dict[str, Any] | None = None
    """The experiment config as plain values, shown on the run's page."""
    mode: str = "online"
    """``online``, ``offline`` (no network; sync later) or ``disabled``."""
    dir: str | None = None
    """Local folder for W&B's files; default: the trainer's ``work_dir``."""
    cancel_tag: str | None = "cancel"
    """Tag that stops the run; ``None`` turns the check off (unless ``cancel_tags`` is set)."""
    name: str | None = None
    """OLMo-core's name for ``run_name``; give one of the two."""
    cancel_tags: list[str] | None = None
    """OLMo-core's form: any of these tags stops the run (case-insensitive); when set it
    replaces ``cancel_tag``, and an empty list turns the check off."""
    cancel_check_interval: int = 10
    """Steps between tag lookups (each is a request to the W&B API)."""

    sink_class: ClassVar[type[WandBSink]]
    """What runs in the sink process (:class:`WandBSink`; tests replace it)."""

    _sink: SinkProcess | None = field(default=None, init=False, repr=False)
    _run_id: str | None = field(default=None, init=False, repr=False)
    _run_info: dict[str, str] = field(default_factory=dict, init=False, repr=False)
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
        if self.name is not None and self.run_name is not None and self.name != self.run_name:
            raise ConfigurationError(
                f"and run_name name the run differently ({self.name!r}, {self.run_name!r}); "
                "give only one of them",
                path="name",
            )

    @property
    def _cancel_tags(self) -> set[str]:
        if self.cancel_tags is not None:
            return {tag.lower() for tag in self.cancel_tags}
        return set() if self.cancel_tag is None else {self.cancel_tag.lower()}

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
        init_kwargs = {
            "project": self.project,
            "entity": self.entity,
            "name": self.name or self.run_name,
            "group": self.group,
            "tags": list(self.tags),
            "notes": self.notes,
            "config": self.config,
            "mode": self.mode,
            "dir": str(folder),
            "id": self._run_id,
            "resume": "allow" if self._run_id else None,
        }
        self._sink = SinkProcess(partial(self.sink_class, init_kwargs), "wandb-sink")
        self._run_info = self._sink.call("info")
        self._run_id = self._run_info["id"]
        log.info("W&B run %s (%s), files in %s", self._run_id, self.mode, self._run_info["dir"])

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self._sink is None:
            return
        self._sink.buffer("log", {name: float(v) for name, v in metrics.items()}, step)

    def post_log_metrics(self) -> None:
        if self._sink is not None:
            self._sink.flush()

    def post_step(self) -> None:
        if self._sink is None or not self._cancel_tags:
            return
        if self.step % self.cancel_check_interval != 0:
            return
        lookup = self._tag_lookup
        if lookup is not None and not lookup.done():
            return  # the API is slow: one lookup at a time
        found = sorted(self._cancel_tags & {t.lower() for t in lookup.result()}) if lookup else []
        if found:
            self._tag_lookup = None
            self.trainer.cancel_run(f"the W&B run has the tag {found[0]!r}")
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
        info = self._run_info
        try:
            api = _wandb().Api()
            return list(api.run(f"{info['entity']}/{info['project']}/{info['id']}").tags)
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
        sink, self._sink = self._sink, None
        if self._tag_thread is not None:
            self._tag_thread.shutdown(wait=False)
            self._tag_thread = None
        if sink is None:
            return
        try:
            # Waits for every step sent before: W&B has them all once this returns.
            sink.call("finish", exit_code, timeout=FINISH_TIMEOUT_S)
        except SinkError as e:
            if exit_code == 0:
                raise
            log.error("Finishing the W&B run after a failure failed too: %s", e)
        finally:
            sink.close()


class WandBSink:
    """The W&B run itself, in the sink process (see :mod:`.sink_process`)."""

    def __init__(self, init_kwargs: dict[str, Any]) -> None:
        self.run = _wandb().init(**init_kwargs)

    def info(self) -> dict[str, str]:
        run = self.run
        return {"id": run.id, "dir": run.dir, "entity": run.entity, "project": run.project}

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def finish(self, exit_code: int) -> None:
        self.run.finish(exit_code=exit_code)


WandBCallback.sink_class = WandBSink
