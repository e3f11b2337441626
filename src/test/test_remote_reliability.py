"""Checkpoints on object stores when things go wrong, and on several nodes.

Against real servers on 127.0.0.1 (the GCS emulator, moto S3): an overwrite that fails
half-way leaves no marker vouching for a mix of old and new files (and no stale shards of a
larger world size); ranks with node-local work dirs clean up their own staging and download
a checkpoint once per node; and a real two-node ``torchrun`` launch on one machine.
"""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path
from typing import Any

import fsspec
import pytest
from remote_servers import RemoteStore
from testutils import build_trainer, launch_two_nodes, run_distributed

from olmolike.exceptions import CheckpointError
from olmolike.train import CheckpointerConfig, Duration
from olmolike.train.callbacks import CheckpointerCallback
from olmolike.train.checkpoint import MARKER, Checkpointer
from olmolike.train.checkpoint import checkpointer as checkpoint_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(params=["gs", "s3"])
def store(request: pytest.FixtureRequest) -> RemoteStore:
    bucket: RemoteStore = request.getfixturevalue(
        "gcs_bucket" if request.param == "gs" else "s3_bucket"
    )
    return bucket


def store_settings() -> dict[str, Any]:
    """What a spawned rank needs to reach the test's servers (fsspec's options)."""
    return {key: dict(value) for key, value in fsspec.config.conf.items()}


def use_store(settings: dict[str, Any]) -> None:
    fsspec.config.conf.update(settings)


def _train_two_ranks(url: str, settings: dict[str, Any], work: str, steps: int) -> list[str]:
    use_store(settings)
    from olmolike.distributed.utils import get_rank

    work_dir = Path(work) / f"node{get_rank()}"
    callbacks = {"checkpointer": CheckpointerCallback(save_interval=2)}
    trainer = build_trainer(
        url, max_duration=Duration.steps(steps), work_dir=str(work_dir), callbacks=callbacks
    )
    trainer.fit()
    return sorted(str(p.relative_to(work_dir)) for p in work_dir.rglob("*") if p.is_file())


def test_a_failed_overwrite_leaves_no_marker_and_no_stale_files(
    store: RemoteStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = store.url("run")
    run_distributed_ok(_train_two_ranks, url, store_settings(), str(tmp_path / "two"), 2)
    assert {"train/rank1.pt", "model_and_optim/__1_0.distcp"} <= set(store.objects("run", "step2"))

    # One rank now overwrites step 2; the store fails after the first uploaded file.
    trainer = build_trainer(  # one thread: one upload at a time, the first one succeeds
        url,
        max_duration=Duration.steps(2),
        save_overwrite=True,
        work_dir=str(tmp_path / "one"),
        checkpointer=CheckpointerConfig(save_thread_count=1),
    )
    trainer.global_step = 2
    real_persist = checkpoint_module.io.persist
    uploads: list[str] = []

    def failing_persist(src: Any, dst: Any, name: Any, **kwargs: Any) -> str:
        if uploads:
            raise ConnectionError("the store went away")
        uploads.append(str(name))
        return real_persist(src, dst, name, **kwargs)

    monkeypatch.setattr(checkpoint_module.io, "persist", failing_persist)
    with pytest.raises(CheckpointError, match="step2"):
        trainer.save_checkpoint()
    left = store.objects("run", "step2")
    assert MARKER not in left  # nothing vouches for what is there
    assert left == uploads, left  # the old files were deleted before anything was written
    assert not Checkpointer.dir_is_checkpoint(url + "/step2")

    monkeypatch.setattr(checkpoint_module.io, "persist", real_persist)
    trainer.save_checkpoint()
    assert store.objects("run", "step2") == sorted(
        [MARKER, "model_and_optim/.metadata", "model_and_optim/__0_0.distcp", "train/rank0.pt"]
    )


def run_distributed_ok(fn: Any, *args: Any) -> list[Any]:
    outcomes = run_distributed(fn, 2, args=args, timeout=300)
    failures = [o for o in outcomes if o.error is not None or o.exitcode != 0]
    assert not failures, "\n".join(f"rank {o.rank}: {o.error}" for o in failures)
    return [o.result for o in outcomes]


class _Downloads(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Downloaded "):
            self.count += 1


def _resume_with_pre_download(
    url: str, settings: dict[str, Any], work: str, shared_work_dir: bool
) -> dict[str, Any]:
    use_store(settings)
    from olmolike.distributed.utils import get_rank

    downloads = _Downloads()
    logger = logging.getLogger("olmolike.distributed.checkpoint_download")
    logger.addHandler(downloads)
    logger.setLevel(logging.INFO)
    work_dir = Path(work) / ("shared" if shared_work_dir else f"node{get_rank()}")
    trainer = build_trainer(
        url,
        max_duration=Duration.steps(4),
        work_dir=str(work_dir),
        checkpointer=CheckpointerConfig(pre_download=True),
        callbacks={"checkpointer": CheckpointerCallback(save_interval=2)},
    )
    trainer.fit()
    files = sorted(str(p.relative_to(work_dir)) for p in work_dir.rglob("*") if p.is_file())
    return {"downloads": downloads.count, "files": files, "loaded": trainer.checkpoint_loaded}


@pytest.mark.parametrize("shared_work_dir", [False, True], ids=["node-local", "shared"])
def test_ranks_with_their_own_work_dirs_clean_staging_and_download_once_per_node(
    store: RemoteStore, tmp_path: Path, shared_work_dir: bool
) -> None:
    url = store.url("run")
    staged = run_distributed_ok(_train_two_ranks, url, store_settings(), str(tmp_path), 2)
    assert staged == [[], []], staged  # every node's staging is gone, not only rank 0's
    results = run_distributed_ok(
        _resume_with_pre_download, url, store_settings(), str(tmp_path), shared_work_dir
    )
    assert all(r["loaded"] for r in results)
    assert [r["files"] for r in results] == [[], []]  # downloads and staging removed
    downloads = [r["downloads"] for r in results]
    assert downloads == ([1, 0] if shared_work_dir else [1, 1]), downloads
    assert [s for s, _ in Checkpointer.find_checkpoints(url)] == [0, 2, 4]


NODE_SCRIPT = """
import json, logging, os, sys
from pathlib import Path
sys.path.insert(0, {test_dir!r})
import fsspec
from testutils import build_trainer
from olmolike.train import CheckpointerConfig, Duration, prepare_training_environment
from olmolike.train import teardown_training_environment
from olmolike.train.callbacks import CheckpointerCallback

if __name__ == "__main__":
    fsspec.config.conf.update(json.loads(os.environ["TEST_FSSPEC_CONF"]))
    url, work_dir, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    prepare_training_environment(seed=0)
    downloads = []
    logger = logging.getLogger("olmolike.distributed.checkpoint_download")
    logger.setLevel(logging.INFO)
    logger.addHandler(logging.Handler())
    logger.handlers[-1].emit = lambda record: downloads.append(record.getMessage())
    trainer = build_trainer(
        url,
        max_duration=Duration.steps(steps),
        work_dir=str(work_dir),
        checkpointer=CheckpointerConfig(pre_download=True),
        callbacks={{"checkpointer": CheckpointerCallback(save_interval=2)}},
    )
    trainer.fit()
    left = [str(p) for p in work_dir.rglob("*") if p.is_file()]
    assert not left, left
    n = sum(m.startswith("Downloaded ") for m in downloads)
    print(f"NODE DONE step={{trainer.global_step}} downloads={{n}}", flush=True)
    teardown_training_environment()
"""


def launch_nodes(script: Path, url: str, work: Path, steps: int) -> list[str]:
    """Both nodes' output; each node is one ``torchrun`` with one rank."""
    return launch_two_nodes(
        lambda node: [str(script), url, str(work / f"node{node}"), str(steps)],
        nproc_per_node=1,
        env={"TEST_FSSPEC_CONF": json.dumps(store_settings())},
        timeout=240,
        preloaded=True,  # about the store and the launch, not how an interpreter starts
    )


def test_a_real_two_node_launch_saves_and_resumes_on_the_store(
    store: RemoteStore, tmp_path: Path
) -> None:
    script = tmp_path / "node.py"
    script.write_text(textwrap.dedent(NODE_SCRIPT.format(test_dir=str(Path(__file__).parent))))
    url = store.url("run")
    outputs = launch_nodes(script, url, tmp_path, 2)
    assert all("NODE DONE step=2 downloads=0" in out for out in outputs), outputs
    assert [s for s, _ in Checkpointer.find_checkpoints(url)] == [0, 2]
    outputs = launch_nodes(script, url, tmp_path, 4)  # resumes: downloads once per node
    assert all("NODE DONE step=4 downloads=1" in out for out in outputs), outputs
    assert [s for s, _ in Checkpointer.find_checkpoints(url)] == [0, 2, 4]
    objects = store.objects("run", "step4")
    assert {"train/rank0.pt", "train/rank1.pt", MARKER} <= set(objects)
