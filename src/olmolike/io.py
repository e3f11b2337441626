"""Every byte that leaves the process goes through here.

Local paths are written atomically (a temporary file in the same directory, then a rename),
so a reader never sees half a file. URLs (``gs://``, ``s3://``, ``memory://``, ...) go through
fsspec, with transient network errors retried with exponential backoff.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import fsspec

from .exceptions import NetworkError

__all__ = [
    "create_file",
    "exists",
    "fsync_path",
    "is_url",
    "join_path",
    "list_dir",
    "persist",
    "read_bytes",
    "remove",
    "removed_if_left_empty",
    "resolve_download_url",
    "retry_network",
    "url_to_fs",
    "write_file",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

PathOrStr = str | Path

# Errors that retrying cannot fix: the request itself is wrong.
_PERMANENT = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)


def _transient_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [OSError, ConnectionError, TimeoutError]
    try:  # s3fs's client raises its own connection errors, which are not OSErrors
        import botocore.exceptions as botocore_errors

        types += [botocore_errors.ConnectionError, botocore_errors.HTTPClientError]
    except ImportError:
        pass
    return tuple(types)


_TRANSIENT = _transient_error_types()


def _is_transient(error: BaseException) -> bool:
    if isinstance(error, _PERMANENT):
        return False
    if isinstance(error, _TRANSIENT):
        return True
    # gcsfs raises HttpError (a plain Exception) once its own retries are spent.
    code = getattr(error, "code", None)
    return (
        type(error).__name__ == "HttpError"
        and isinstance(code, int)
        and (code == 429 or code >= 500)
    )


# Where a protocol's requests go unless configured otherwise, and what configures it.
_ENDPOINTS = {
    "gs": ("STORAGE_EMULATOR_HOST", "https://storage.googleapis.com"),
    "gcs": ("STORAGE_EMULATOR_HOST", "https://storage.googleapis.com"),
    "s3": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "https://s3.amazonaws.com"),
    "s3a": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "https://s3.amazonaws.com"),
}
_RESOLVED: set[str] = set()
_CREDENTIAL_ERRORS = {
    "DefaultCredentialsError",
    "RefreshError",
    "NoCredentialsError",
    "PartialCredentialsError",
}
_CREDENTIALS_HINT = (
    "no valid credentials for it (gs://: GOOGLE_APPLICATION_CREDENTIALS or `gcloud auth "
    "application-default login`; s3://: AWS_ACCESS_KEY_ID / AWS_PROFILE)"
)


def _endpoint_host(protocol: str) -> str | None:
    *variables, default = _ENDPOINTS.get(protocol, ("",))
    if not default:
        return None
    options: dict[str, Any] = fsspec.config.conf.get(protocol, {})
    endpoint = options.get("endpoint_url") or next(
        (os.environ[v] for v in variables if os.environ.get(v)), default
    )
    return urlsplit(endpoint if "//" in endpoint else f"//{endpoint}").hostname


def url_to_fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """``fsspec.core.url_to_fs``, after checking (once per host) that the store's host resolves.

    Without a network (or with a mistyped endpoint) the clients retry for minutes, and gcsfs
    probes for credentials first; a host that does not resolve is no transient error.
    """
    host = _endpoint_host(url.split("://", 1)[0]) if is_url(url) else None
    if host is not None and host not in _RESOLVED:
        try:
            socket.getaddrinfo(host, None)
        except OSError as e:
            raise NetworkError(
                f"cannot reach {url}: the storage host {host} does not resolve ({e.strerror}); "
                "no network, or a wrong endpoint"
            ) from None
        _RESOLVED.add(host)
    return fsspec.core.url_to_fs(url)


def _permanent_failure(error: BaseException) -> str | None:
    """Why retrying ``error`` cannot help (a missing DNS name, no credentials), or None."""
    chain: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    for e in chain:
        name = type(e).__name__
        if isinstance(e, socket.gaierror) or name.endswith("DNSError"):
            return "the storage host does not resolve: no network, or a wrong endpoint"
        if name in _CREDENTIAL_ERRORS or isinstance(e, PermissionError):
            return f"access denied: {_CREDENTIALS_HINT}"
        code = getattr(e, "code", None)
        if name == "HttpError" and code in (401, 403):
            return f"access denied (HTTP {code}): {_CREDENTIALS_HINT}"
    return None


def is_url(path: PathOrStr) -> bool:
    text = str(path)
    return "://" in text and not text.startswith("file://")


def local_path(path: PathOrStr) -> Path:
    text = str(path)
    return Path(text[len("file://") :] if text.startswith("file://") else text)


@contextlib.contextmanager
def removed_if_left_empty(*paths: PathOrStr | None) -> Iterator[None]:
    """Around work that may create the local directories ``paths`` and then fail (a refused
    run): on failure, each directory it created, and each parent it created with it, is
    removed again if still empty, so that nothing is left behind. URLs and ``None`` are
    skipped; a directory that existed before, or that holds anything, is kept."""
    created = []
    for path in paths:
        if path is None or is_url(path):
            continue
        missing = None
        for folder in (local_path(path).absolute(), *local_path(path).absolute().parents):
            if folder.exists():
                break
            missing = folder
        if missing is not None:
            created.append((local_path(path).absolute(), missing))
    try:
        yield
    except BaseException:
        for leaf, top in created:
            for folder in (leaf, *leaf.parents):
                try:
                    folder.rmdir()  # only if empty
                except OSError:
                    break
                if folder == top:
                    break
        raise


def join_path(dir: PathOrStr, name: PathOrStr) -> str:
    if is_url(dir):
        return f"{str(dir).rstrip('/')}/{str(name).lstrip('/')}"
    return str(local_path(dir) / name)


def retry_network(
    fn: Callable[[], T], what: str, *, attempts: int = 5, initial_delay: float = 0.5
) -> T:
    """Call ``fn``; retry transient errors with exponential backoff, then raise NetworkError."""
    delay = initial_delay
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as e:
            cause = _permanent_failure(e)
            if cause is not None:
                raise NetworkError(f"{what} failed: {cause} ({type(e).__name__}: {e})") from e
            if not _is_transient(e):
                raise
            if attempt == attempts:
                raise NetworkError(f"{what} failed after {attempts} attempts: {e}") from e
            log.warning(
                "%s failed (%s); retrying in %.1fs (%d/%d)", what, e, delay, attempt, attempts
            )
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def write_file(
    dir: PathOrStr, name: PathOrStr, contents: str | bytes, *, overwrite: bool = False
) -> str:
    """Write ``contents`` to ``dir/name`` and return the path or URL.

    :raises FileExistsError: if the file exists and ``overwrite`` is false.
    """
    target = join_path(dir, name)
    data = contents.encode() if isinstance(contents, str) else contents
    if is_url(target):
        _put_remote(
            target, overwrite, f"writing {target}", lambda fs, path: fs.pipe_file(path, data)
        )
    else:
        _replace_atomically(Path(target), overwrite, lambda tmp: _write_synced(tmp, data))
    return target


def persist(
    src_dir: PathOrStr,
    dst_dir: PathOrStr,
    name: PathOrStr,
    *,
    overwrite: bool = False,
    directory: bool | None = None,
) -> str:
    """Copy the file or directory ``src_dir/name`` (local) to ``dst_dir/name`` (local or URL);
    ``directory`` says which it must be (``None``: either)."""
    source = local_path(src_dir) / name
    target = join_path(dst_dir, name)
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist")
    if directory is True and not source.is_dir():
        raise NotADirectoryError(f"{source} is not a directory")
    if directory is False and not source.is_file():
        raise FileNotFoundError(f"{source} is not a file")
    if not is_url(target) and Path(target).resolve() == source.resolve():
        return target
    if source.is_dir():
        for child in sorted(source.rglob("*")):
            if child.is_file():
                persist(
                    src_dir, dst_dir, child.relative_to(local_path(src_dir)), overwrite=overwrite
                )
    elif is_url(target):
        what = f"uploading {source} to {target}"
        _put_remote(target, overwrite, what, lambda fs, path: fs.put_file(str(source), path))
    else:
        _replace_atomically(Path(target), overwrite, lambda tmp: shutil.copyfile(source, tmp))
    return target


def _exists_error(target: PathOrStr) -> FileExistsError:
    return FileExistsError(f"{target} exists; pass overwrite=True (save_overwrite) to replace it")


def _replace_atomically(target: Path, overwrite: bool, fill: Callable[[Path], object]) -> None:
    """Fill a temporary file beside ``target``, then rename it into place: never a half file."""
    if target.exists() and not overwrite:
        raise _exists_error(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_temp_file(target)
    try:
        fill(tmp)
        fsync_path(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(target.parent)  # the rename itself survives a crash only once its dir is synced


def _new_temp_file(target: Path) -> Path:
    """An empty file beside ``target`` created with the user's umask (``mkstemp`` forces 0600,
    which would make every written file unreadable to teammates on a shared filesystem)."""
    while True:
        tmp = target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


def fsync_path(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk: a rename or a new file in a folder is
    durable only once the folder is synced (best effort: some filesystems cannot fsync a
    directory; a path that cannot be opened is skipped)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def create_file(path: PathOrStr, contents: str | bytes) -> bool:
    """Write ``path`` only if nothing exists there; returns whether this call created it.

    Exclusive on local disks (a hard link, which fails if the name exists) and on stores with
    conditional writes (S3 ``If-None-Match``, GCS ``ifGenerationMatch=0``). A store that
    ignores the condition overwrites: callers that need exclusivity read the file back.
    """
    data = contents.encode() if isinstance(contents, str) else contents
    if is_url(path):
        fs, fs_path = url_to_fs(str(path))

        def put() -> bool:
            try:
                fs.pipe_file(fs_path, data, mode="create")
            except FileExistsError:
                return False
            return True

        return retry_network(put, f"creating {path}")
    target = local_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_temp_file(target)
    try:
        _write_synced(tmp, data)
        os.link(tmp, target)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(target.parent)
    return True


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _put_remote(
    target: str, overwrite: bool, what: str, put: Callable[[fsspec.AbstractFileSystem, str], object]
) -> None:
    fs, fs_path = url_to_fs(target)

    def attempt() -> None:
        if not overwrite and fs.exists(fs_path):
            raise _exists_error(target)
        put(fs, fs_path)

    retry_network(attempt, what)


def exists(path: PathOrStr) -> bool:
    if not is_url(path):
        return local_path(path).exists()
    fs, fs_path = url_to_fs(str(path))
    return bool(retry_network(lambda: fs.exists(fs_path), f"checking {path}"))


def read_bytes(path: PathOrStr) -> bytes:
    if not is_url(path):
        return local_path(path).read_bytes()
    fs, fs_path = url_to_fs(str(path))
    return bytes(retry_network(lambda: fs.cat_file(fs_path), f"reading {path}"))


def list_dir(path: PathOrStr) -> list[str]:
    """Names of the entries directly in ``path`` (empty if it does not exist)."""
    if not is_url(path):
        directory = local_path(path)
        return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    fs, fs_path = url_to_fs(str(path))

    def listing() -> list[str]:
        try:
            entries = fs.ls(fs_path, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    return retry_network(listing, f"listing {path}")


def remove(path: PathOrStr, *, recursive: bool = False) -> None:
    """Delete a file (or, with ``recursive``, a directory tree); missing is fine."""
    if not is_url(path):
        target = local_path(path)
        if target.is_dir() and recursive:
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)
        return
    fs, fs_path = url_to_fs(str(path))

    def delete() -> None:
        with contextlib.suppress(FileNotFoundError):
            fs.rm(fs_path, recursive=recursive)

    retry_network(delete, f"deleting {path}")


def resolve_download_url(path: PathOrStr, cache_dir: PathOrStr) -> str:
    """An http(s) URL as a local path: downloaded (archives extracted) once, then cached.

    HTTP cannot list a directory, so a checkpoint served over HTTP comes as an archive
    (``.tar.gz``, ``.zip``). Other paths and URLs are returned unchanged.
    """
    text = str(path)
    if not text.startswith(("http://", "https://")):
        return text
    from cached_path import cached_path

    local = retry_network(
        lambda: cached_path(text, cache_dir=str(cache_dir), extract_archive=True, quiet=True),
        f"downloading {text}",
    )
    return str(local)
