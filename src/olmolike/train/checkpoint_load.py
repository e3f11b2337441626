"""Loading a train checkpoint (the read side of :mod:`~olmolike.train.checkpoint`'s format): verify it, read
model and optimizer state with DCP, then this rank's trainer state."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from .. import io
from ..distributed.checkpoint import load_state_dict
from ..distributed.checkpoint_download import local_copy
from ..distributed.checkpoint_format import (
    MODEL_AND_OPTIM,
    TRAIN_STATE,
    DamagedCheckpointError,
    describe_error,
    describe_shape_mismatch,
    load_train_state,
    read_metadata,
    verify_checkpoint,
)
from ..distributed.utils import all_agree, broadcast_object, get_rank, using_group
from ..exceptions import CheckpointError

if TYPE_CHECKING:
    from .train_module import TrainModule

__all__ = ["CheckpointLoad"]


@dataclass
class CheckpointLoad:
    """One load of the checkpoint ``dir`` into ``train_module``, on every rank of ``group``."""

    dir: str
    train_module: TrainModule
    group: dist.ProcessGroup | None
    load_trainer_state: bool | None
    load_optim_state: bool | None
    current_config: str | bytes | None

    def run(self, work_dir: Path, pre_download: bool, thread_count: int | None) -> Any:
        """Load; returns this rank's trainer state (``None`` if not loaded). ``pre_download``
        copies a remote checkpoint under ``work_dir`` first."""
        error: tuple[bool, str] | None = None
        if get_rank() == 0:
            try:
                verify_checkpoint(self.dir)
            except Exception as e:  # every rank raises, not only this one
                error = (isinstance(e, DamagedCheckpointError), str(e))
        with using_group(self.group, "checkpointer"):
            error = broadcast_object(error, group=self.group)
        if error is not None:
            raise (DamagedCheckpointError if error[0] else CheckpointError)(error[1])
        if not (io.is_url(self.dir) and pre_download):
            return self._load_from(self.dir, thread_count)
        with local_copy(
            self.dir, work_dir, process_group=self.group, thread_count=thread_count
        ) as source:
            return self._load_from(source, thread_count)

    def _agree(self, ok: bool) -> bool:
        with using_group(self.group, "checkpointer"):
            return all_agree(ok, self.group)

    def _load_from(self, source: str, thread_count: int | None) -> dict[str, Any] | None:
        dir, train_module = self.dir, self.train_module
        load_optim_state = self.load_optim_state
        dcp_dir = io.join_path(source, MODEL_AND_OPTIM)
        metadata = read_metadata(dcp_dir)
        has_optim = any(key.startswith("optim.") for key in metadata.state_dict_metadata)
        if load_optim_state and not has_optim:
            raise CheckpointError(f"{dir} holds no optimizer state; set load_optim_state=False")
        state = train_module.state_dict_to_load(
            optim=has_optim if load_optim_state is None else load_optim_state
        )
        mismatch = describe_shape_mismatch(
            dir, metadata, state.get("model", {}), self.current_config
        )
        if mismatch is not None:
            raise CheckpointError(mismatch)
        try:
            load_state_dict(dcp_dir, state, process_group=self.group, thread_count=thread_count)
        except (Exception, CheckpointException) as e:  # raised on every rank alike
            raise CheckpointError(f"loading checkpoint {dir} failed: {describe_error(e)}") from None
        train_module.load_state_dict(state)
        if self.load_trainer_state is False:
            return None
        return self._load_train_state(source)

    def _load_train_state(self, source: str) -> dict[str, Any]:
        dir = self.dir
        error: str | None = None
        state: dict[str, Any] = {}
        rank = get_rank()
        # A checkpoint of fewer ranks: a new rank starts from rank 0's state.
        has_own = io.exists(io.join_path(source, f"{TRAIN_STATE}/rank{rank}.pt"))
        try:
            state = load_train_state(source, rank if has_own else 0)
        except CheckpointError as e:
            error = str(e).replace(source, dir)
        if not self._agree(error is None):
            raise DamagedCheckpointError(
                error or f"checkpoint {dir}: a rank's trainer state is bad"
            )
        return state
