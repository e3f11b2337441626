"""``pre_download``: a remote checkpoint copied to local disk (once per node), then loaded."""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .. import io
from ..exceptions import CheckpointError
from .utils import all_agree, get_rank, get_world_size, is_distributed

__all__ = ["download_dir", "local_copy"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def local_copy(
    url: str,
    work_dir: Path,
    *,
    process_group: dist.ProcessGroup | None = None,
    thread_count: int | None = None,
) -> Iterator[str]:
    """Yield a local copy of the checkpoint at ``url`` under ``work_dir``, removed afterwards.

    Ranks that see the same download folder on the same host share one copy, downloaded by
    the lowest of them: once per node with a node-local ``work_dir``, and once per rank when
    ranks are given work dirs of their own. Collective over ``process_group``.
    """
    local = work_dir / "checkpoint-download" / url.rstrip("/").rsplit("/", 1)[-1]
    where = (socket.gethostname(), str(local.resolve()))
    downloads = True
    if is_distributed():
        places: list[Any] = [None] * get_world_size(process_group)
        dist.all_gather_object(places, where, group=process_group)
        downloads = places.index(where) == get_rank(process_group)
    ok = True
    if downloads:
        try:
            download_dir(url, local, thread_count=thread_count)
        except CheckpointError as e:  # (says what is wrong in one line)
            log.error("%s", e)
            ok = False
        except Exception:
            log.exception("Downloading %s failed", url)
            ok = False
    if not all_agree(ok, process_group):
        raise CheckpointError(f"downloading {url} to {local} failed on at least one node")
    try:
        yield str(local)
    finally:
        if is_distributed():
            dist.barrier(group=process_group)  # every rank sharing the copy has read it
        if downloads:
            shutil.rmtree(local, ignore_errors=True)


def download_dir(url: str, local: Path, *, thread_count: int | None = None) -> None:
    """Copy the remote folder ``url`` to ``local`` (replacing it), retrying network errors."""
    shutil.rmtree(local, ignore_errors=True)
    fs, path = io.url_to_fs(url)
    # thread_count bounds the concurrent downloads of async stores (gcsfs, s3fs).
    batch = {"batch_size": thread_count} if thread_count else {}
    try:
        io.retry_network(
            lambda: fs.get(path, str(local), recursive=True, **batch), f"downloading {url}"
        )
    except ValueError as e:  # fsspec's refusal of a name that would land outside the copy
        shutil.rmtree(local, ignore_errors=True)
        raise CheckpointError(
            f"refusing to download {url}: a file in it is named to land outside the copy "
            f"({str(e)[:200]}). It was crafted or damaged; load another checkpoint"
        ) from None
    log.info("Downloaded %s to %s", url, local)
