"""A data loader in stages: each stage's own loader (its own data mixture) for its own steps.

:class:`StagedDataLoader` serves the first ``steps`` batches of a run from stage 1's loader,
the next ones from stage 2's, and so on; the last stage may run until the run ends. Each
stage's loader keeps its own order, epochs and rank slicing (a stage longer than one epoch of
its data starts that loader's next epoch), and the staged loader's state holds every stage's
state, so a resume is exact on either side of a boundary.

The whole staged schedule is one epoch of the staged loader, so the trainer's step and the
loader's batch count agree and a boundary falls on a known step (what two-stage training's
snapshot step must match).

:class:`StagedDataLoaderConfig` describes the same thing in a config file or on the command
line: a mapping of named stages, each its dataset, its loader settings and its steps, e.g.
``--data_loader.stages.stage1.steps=500``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..config import Config
from ..exceptions import ConfigurationError, DataError
from .data_loader import Batch, DataLoaderBase
from .numpy_data_loader import NumpyDataLoaderConfig
from .numpy_dataset import METADATA_FILE, NumpyDatasetConfig
from .sft_dataset import SFTDatasetConfig

__all__ = ["DataStageConfig", "StagedDataLoader", "StagedDataLoaderConfig"]

log = logging.getLogger(__name__)


class StagedDataLoader(DataLoaderBase):
    """Stage ``i``'s loader serves batches ``sum(steps[:i]) + 1 .. sum(steps[:i + 1])``.

    :param stages: ``(loader, steps)`` per stage, in order; only the last stage's ``steps``
        may be ``None`` (until the run ends). Every loader must have the same
        ``global_batch_size`` and data-parallel layout.
    """

    def __init__(self, stages: Sequence[tuple[DataLoaderBase, int | None]]) -> None:
        if not stages:
            raise ConfigurationError("needs at least one (loader, steps) stage", path="stages")
        for i, (_, steps) in enumerate(stages):
            last = i == len(stages) - 1
            if steps is None and not last:
                raise ConfigurationError(
                    f"stage {i + 1} has no length; only the last stage may run until the run ends",
                    path="stages",
                )
            if steps is not None and steps <= 0:
                raise ConfigurationError(
                    f"stage {i + 1} must last a positive number of steps, got {steps}",
                    path="stages",
                )
        first = stages[0][0]
        self.loaders = [loader for loader, _ in stages]
        self.stage_steps = [steps for _, steps in stages]
        for i, loader in enumerate(self.loaders):
            layout = (loader.global_batch_size, loader.dp_world_size, loader.dp_rank)
            if layout != (first.global_batch_size, first.dp_world_size, first.dp_rank):
                raise ConfigurationError(
                    f"stage {i + 1}'s loader has global_batch_size {loader.global_batch_size} on "
                    f"rank {loader.dp_rank} of {loader.dp_world_size}, stage 1's "
                    f"{first.global_batch_size} on rank {first.dp_rank} of {first.dp_world_size}; "
                    "build every stage's loader with the same batch size and ranks",
                    path="stages",
                )
        self._iters: dict[int, Iterator[Batch]] = {}
        super().__init__(
            global_batch_size=first.global_batch_size,
            dp_world_size=first.dp_world_size,
            dp_rank=first.dp_rank,
        )

    def _check_global_batch_size(self, value: int) -> None:
        if value != self.loaders[0].global_batch_size:
            raise ConfigurationError(
                f"a staged loader keeps its stages' global_batch_size "
                f"({self.loaders[0].global_batch_size}); got {value}",
                path="global_batch_size",
            )

    @property
    def total_batches(self) -> int | None:
        if any(steps is None for steps in self.stage_steps):
            return None
        return sum(steps for steps in self.stage_steps if steps is not None)

    @property
    def stage_starts(self) -> list[int]:
        """The 0-based batch index at which each stage begins."""
        starts = [0]
        for steps in self.stage_steps[:-1]:
            assert steps is not None
            starts.append(starts[-1] + steps)
        return starts

    def stage_of(self, batch_index: int) -> int:
        """The 0-based stage serving the 0-based ``batch_index`` of the run."""
        return max(i for i, start in enumerate(self.stage_starts) if start <= batch_index)

    def _iter_batches(self) -> Iterator[Batch]:
        while self.total_batches is None or self.next_batch_index < self.total_batches:
            stage = self.stage_of(self.next_batch_index)
            if stage and self.next_batch_index == self.stage_starts[stage]:
                log.info("data stage %d begins at batch %d", stage + 1, self.next_batch_index + 1)
            yield self._next_of(stage)

    def _next_of(self, stage: int) -> Batch:
        """The next batch of ``stage``'s loader, starting its next epoch when one ends."""
        loader = self.loaders[stage]
        for _ in range(2):
            if loader.epoch is None or loader.epoch_finished:
                loader.reshuffle(1 if loader.epoch is None else loader.epoch + 1)
                self._iters.pop(stage, None)
            if stage not in self._iters:
                self._iters[stage] = iter(loader)
            batch = next(self._iters[stage], None)
            if batch is not None:
                return batch
            loader.reshuffle(loader.epoch + 1 if loader.epoch is not None else 1)
            self._iters.pop(stage)
        raise DataError(f"stage {stage + 1}'s data loader produced no batch in a whole epoch")

    def reshuffle(self, epoch: int | None = None) -> None:
        if epoch is not None and epoch != self.epoch:
            self._iters.clear()
        super().reshuffle(epoch)

    def reset(self) -> None:
        super().reset()
        self._iters.clear()

    def state_dict(self) -> dict[str, Any]:
        return {
            "stage_steps": list(self.stage_steps),
            "epoch": self.epoch,
            "batches_processed": self.batches_processed,
            "tokens_processed": self.tokens_processed,
            "stages": [loader.state_dict() for loader in self.loaders],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if list(state_dict["stage_steps"]) != list(self.stage_steps):
            raise DataError(
                f"the checkpoint's data stages lasted {state_dict['stage_steps']} steps but this "
                f"loader's last {self.stage_steps}; set the stages back to resume exactly"
            )
        for loader, saved in zip(self.loaders, state_dict["stages"], strict=True):
            loader.load_state_dict(saved)
        self._iters.clear()
        self.epoch = state_dict["epoch"]
        self.batches_processed = state_dict["batches_processed"]
        self.tokens_processed = state_dict["tokens_processed"]

    def get_mock_batch(self) -> Batch:
        return self.loaders[0].get_mock_batch()


@dataclass
class DataStageConfig(Config):
    """One stage of a :class:`StagedDataLoaderConfig`: its data, how it is batched, how long."""

    dataset: NumpyDatasetConfig | SFTDatasetConfig
    """The stage's data: token files or a mixture (``numpy``, the default), or a
    ``prepare-data --sft`` folder (``_CLASS_: sft``), trained on its responses only (its
    labels mask the prompts) with attention kept within each packed example. A stage exists to
    change what the model sees."""
    data_loader: NumpyDataLoaderConfig
    """How the stage's batches are drawn: its own seed and shuffling, so each stage's order is
    independent of the others'. Its ``global_batch_size`` must equal every other stage's, since
    the trainer runs one batch size for the whole run."""
    steps: int | None = None
    """Batches (optimizer steps) this stage serves before the next stage begins; ``None``, for
    the last stage only, serves until the run ends. A stage longer than one epoch of its data
    starts its next epoch."""

    def validate(self) -> None:
        if self.steps is not None and self.steps <= 0:
            raise self._invalid(
                "steps", f"must be a positive number of steps (or null), got {self.steps}"
            )


@dataclass
class StagedDataLoaderConfig(Config):
    """Builds a :class:`StagedDataLoader`: each stage's data for its steps, in order.

    Stages are named so that a command line can reach one (``--data_loader.stages.stage2.
    dataset.paths=[data/b]``); they run in the order the mapping lists them.
    """

    stages: dict[str, DataStageConfig]
    """The stages, in order. Only the last may leave ``steps`` unset."""

    def validate(self) -> None:
        if not self.stages:
            raise self._invalid("stages", "needs at least one stage, e.g. {stage1: {...}}")
        names = list(self.stages)
        for name in names[:-1]:
            if self.stages[name].steps is None:
                raise self._invalid(
                    f"stages.{name}.steps",
                    f"is unset, but only the last stage ({names[-1]!r}) may run until the run "
                    f"ends; give stage {name!r} a number of steps",
                )
        first_name, first = names[0], self.stages[names[0]]
        for name, stage in self.stages.items():
            if stage.data_loader.global_batch_size != first.data_loader.global_batch_size:
                raise self._invalid(
                    f"stages.{name}.data_loader.global_batch_size",
                    f"is {stage.data_loader.global_batch_size} but stage {first_name!r} has "
                    f"{first.data_loader.global_batch_size}; every stage needs the same batch size",
                )
        self._check_lengths(strict=False)

    def _check_lengths(self, *, strict: bool) -> None:
        """Every stage's sequence length is the first's. An SFT folder's length is in its
        metadata: not yet prepared, it is checked when the loader is built (``strict``)."""
        lengths = {
            name: _sequence_length(stage.dataset, strict) for name, stage in self.stages.items()
        }
        known = {name: n for name, n in lengths.items() if n is not None}
        if not known:
            return
        first_name, first = next(iter(known.items()))
        for name, length in known.items():
            if length != first:
                raise self._invalid(
                    f"stages.{name}.dataset.sequence_length",
                    f"is {length} but stage {first_name!r} has {first}; every stage needs the "
                    "same length",
                )

    @property
    def stage_steps(self) -> list[int | None]:
        """Each stage's steps, in order (what the built loader's ``stage_steps`` will be)."""
        return [stage.steps for stage in self.stages.values()]

    def build(
        self,
        *,
        dp_process_group: dist.ProcessGroup | None = None,
        dp_rank: int | None = None,
        dp_world_size: int | None = None,
    ) -> StagedDataLoader:
        """Every stage's dataset and loader for this rank (see
        :meth:`NumpyDataLoaderConfig.build` for the rank arguments)."""
        self.validate()
        self._check_lengths(strict=True)
        stages: list[tuple[DataLoaderBase, int | None]] = []
        for name, stage in self.stages.items():
            try:
                loader = stage.data_loader.build(
                    stage.dataset.build(),
                    dp_process_group=dp_process_group,
                    dp_rank=dp_rank,
                    dp_world_size=dp_world_size,
                )
            except ConfigurationError as e:
                raise e.under(f"stages.{name}") from None
            stages.append((loader, stage.steps))
        return StagedDataLoader(stages)


def _sequence_length(dataset: NumpyDatasetConfig | SFTDatasetConfig, strict: bool) -> int | None:
    """``None`` for an SFT folder not prepared yet, unless ``strict``."""
    if isinstance(dataset, SFTDatasetConfig) and not (Path(dataset.path) / METADATA_FILE).exists():
        if not strict:
            return None
        raise DataError(
            f"{dataset.path} holds no {METADATA_FILE}; make it with olmolike prepare-data --sft"
        )
    return dataset.sequence_length
