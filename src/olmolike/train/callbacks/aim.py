"""Metrics to an Aim repository (https://aimstack.io), browsed with ``aim up``."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

from ... import io
from ...distributed.utils import get_rank
from ...exceptions import ConfigurationError
from .callback import Callback
from .sink_process import SinkProcess

__all__ = ["AimCallback", "AimSink"]

log = logging.getLogger(__name__)

SERVER_SCHEME = "aim://"

CLOSE_TIMEOUT_S = 300.0
"""How long the end of a run waits for Aim to take the last metrics and close the run."""


def _aim() -> Any:
    try:
        import aim
    except ImportError:
        raise ConfigurationError(
            "AimCallback needs the 'aim' package; install it with: "
            "pip install 'olmolike[aim]' (or remove the callback)",
            path="aim",
        ) from None
    return aim


@dataclass
class AimCallback(Callback, name="aim"):
    """Tracks every logged metric in an Aim run at its step (rank 0), one call per step.

    The Aim repository is ``repo``; by default ``{save_folder}/aim`` when the save folder is
    local, and ``{work_dir}/aim`` when it is remote (an Aim repository is a set of local
    databases: it cannot live in a bucket, and is not copied there). ``config`` is stored as the
    run's ``hparams``. A resumed run continues the same Aim run: its hash is kept in the
    checkpoints, and the steps trained again replace their earlier values. Nothing else is
    collected: no terminal output, system metrics or environment.

    Aim's SDK spends ~0.2 ms of Python per tracked scalar (a few ms per step), so the run lives
    in a child process (:class:`~.sink_process.SinkProcess`) that receives each step's metrics
    in order; the training process only sends them. A failure there is raised in the training
    loop at the next step's logging.
    """

    enabled: bool = True
    """``False`` turns the callback off while keeping it in the config (an override can turn it back
    on)."""
    experiment: str | None = None
    """The run's experiment (Aim's default experiment when ``None``)."""
    run_name: str | None = None
    """The run's display name."""
    repo: str | None = None
    """A local folder, or an Aim server as ``aim://host:port``; default: see above."""
    config: dict[str, Any] | None = None
    """The experiment config as plain values, stored as the run's ``hparams``."""

    sink_class: ClassVar[type[AimSink]]
    """What runs in the sink process (:class:`AimSink`)."""

    _sink: SinkProcess | None = field(default=None, init=False, repr=False)
    _run_hash: str | None = field(default=None, init=False, repr=False)

    priority = -1  # after evaluators and other producers of a step's metrics

    def validate(self) -> None:
        if self.repo is not None and (
            not self.repo or (io.is_url(self.repo) and not self.repo.startswith(SERVER_SCHEME))
        ):
            raise ConfigurationError(
                "must be a local folder or an Aim server such as 'aim://host:53800' "
                f"(Aim cannot write to object storage), got {self.repo!r}",
                path="repo",
            )

    @property
    def _active(self) -> bool:
        return self.enabled and get_rank() == 0

    @property
    def repo_path(self) -> str:
        """Where the run is tracked: the ``repo`` setting, or the default folder."""
        if self.repo is not None and self.repo.startswith(SERVER_SCHEME):
            return self.repo
        if self.repo is not None:
            return str(io.local_path(self.repo))
        save_folder = self.trainer.save_folder
        base = self.trainer.work_dir if io.is_url(save_folder) else io.local_path(save_folder)
        return str(Path(base) / "aim")

    def post_attach(self) -> None:
        if self._active:
            _aim()  # a missing package fails at build time, not mid-run

    def pre_train(self) -> None:
        if not self._active:
            return
        settings: dict[str, Any] = {
            "repo": self.repo_path,
            "experiment": self.experiment,
            # Only what is logged: no stdout/stderr capture, system metrics or environment.
            "capture_terminal_logs": False,
            "system_tracking_interval": None,
            "log_system_params": False,
        }
        factory = partial(self.sink_class, settings, self._run_hash, self.run_name, self.config)
        self._sink = SinkProcess(factory, "aim-sink")
        run_hash, resumed = self._sink.call("start")
        if self._run_hash is not None and not resumed:
            # E.g. a remote save folder resumed on another machine, with a new work_dir.
            log.warning(
                "Aim run %s is not in %s; tracking this run as a new Aim run",
                self._run_hash,
                self.repo_path,
            )
        self._run_hash = run_hash
        log.info("Aim run %s in %s", run_hash, self.repo_path)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self._sink is None or not metrics:
            return
        self._sink.buffer("track", {name: float(v) for name, v in metrics.items()}, step)

    def post_log_metrics(self) -> None:
        if self._sink is not None:
            self._sink.flush()

    def state_dict(self) -> dict[str, Any]:
        return {"run_hash": self._run_hash} if self._run_hash else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._run_hash = state_dict.get("run_hash", self._run_hash)

    def close(self) -> None:
        # Also after a failure: what was tracked is kept, and a resume continues the run.
        sink, self._sink = self._sink, None
        if sink is None:
            return
        try:
            sink.call("close", timeout=CLOSE_TIMEOUT_S)  # after every step sent before
        finally:
            sink.close()


class AimSink:
    """The Aim run itself, in the sink process (see :mod:`.sink_process`)."""

    def __init__(
        self,
        settings: dict[str, Any],
        run_hash: str | None,
        run_name: str | None,
        hparams: dict[str, Any] | None,
    ) -> None:
        aim = _aim()
        from aim.sdk.errors import MissingRunError

        run = None
        if run_hash is not None:
            with contextlib.suppress(MissingRunError):  # the callback warns about it
                run = aim.Run(run_hash=run_hash, **settings)
        self.resumed = run is not None
        if run is None:
            run = aim.Run(**settings)
        if run_name is not None:
            run.name = run_name
        if hparams is not None:
            run["hparams"] = hparams
        self.run: Any = run

    def start(self) -> tuple[str, bool]:
        """The run's hash, and whether it continues the run asked for."""
        return self.run.hash, self.resumed

    def track(self, values: dict[str, float], step: int) -> None:
        self.run.track(values, step=step)  # one call per step, with all of its metrics

    def close(self) -> None:
        self.run.close()


AimCallback.sink_class = AimSink
