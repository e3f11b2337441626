"""Real object-store servers on 127.0.0.1 for tests: a GCS emulator and moto's S3 server.

The servers run as subprocesses on free ports, so ``gs://`` and ``s3://`` URLs exercise the
same client libraries (gcsfs, s3fs) and the same HTTP round trips as in production, with
nothing leaving the machine. conftest.py registers the fixtures for every test file: name
them as a test's arguments, and do not import them into a test module (pytest would then make
a module's own copy of each session fixture: one server per module instead of per session).

* ``gcs_server`` / ``s3_server`` (session): one server each per test process (one per xdist
  worker), always terminated at the end, also when tests fail.
* ``gcs_bucket`` / ``s3_bucket`` (function): point fsspec at the session's server for one
  test (``fsspec.config.conf``, plus the environment variables other clients read) and hand
  out a :class:`RemoteStore` with a prefix of its own, so tests sharing a server never see
  each other's files.
* ``restartable_gcs_bucket`` (function): a GCS emulator of the test's own that keeps its data
  on disk, so :meth:`ServerProcess.stop` and :meth:`ServerProcess.start` (same port) model a
  server that dies and comes back with what it had stored.

Needs the ``dev`` extra (``gcp-storage-emulator``, ``moto[server]``, ``s3fs``); without it the
tests using these fixtures are skipped with a message saying what is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# gcsfs reads this once, when it is imported: left at its default ("true") every new bucket
# stalls ~60 s on a gRPC probe that the emulator never answers. Set it before anything
# imports gcsfs (fsspec imports it lazily, on the first gs:// URL).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import fsspec
import pytest

__all__ = [
    "BUCKET",
    "RemoteStore",
    "ServerProcess",
    "ServerStartError",
    "dead_endpoint",
    "fast_client_retries",
    "free_port",
    "gcs_bucket",
    "gcs_server",
    "restartable_gcs_bucket",
    "running",
    "s3_bucket",
    "s3_server",
    "start_gcs_emulator",
    "start_moto_server",
]

BUCKET = "bucket"
"""The bucket every server starts with (``gs://bucket/...``, ``s3://bucket/...``)."""

STARTUP_TIMEOUT_S = 30.0
"""How long a server may take to answer its first request (both take ~0.5-2 s here)."""

_FAKE_AWS_ENV = {
    # moto accepts any credentials, but botocore refuses to sign a request without some, and
    # must never pick up real ones from the machine it runs on.
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class ServerStartError(RuntimeError):
    """A server did not answer within its start-up time, or exited while starting."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _executable(name: str) -> str | None:
    """``name`` from this interpreter's environment (the venv), else from ``PATH``."""
    beside_python = Path(sys.executable).parent / name
    if beside_python.is_file():
        return str(beside_python)
    return shutil.which(name)


@dataclass
class ServerProcess:
    """A storage server run as a subprocess on ``127.0.0.1:port``.

    ``stop()`` then ``start()`` brings it back on the same port, so clients configured with
    :attr:`url` keep working once it is back. Its output goes to ``log_path`` (a file, not a
    pipe: a pipe nobody reads fills up and then blocks the server mid-request).
    """

    name: str
    command: list[str]
    port: int
    log_path: Path
    cwd: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout: float = STARTUP_TIMEOUT_S
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the server and wait until it answers HTTP (bounded by ``startup_timeout``)."""
        if self.running:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # A new session: terminating the server never signals the test process's group.
            self._proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.cwd,
                env={**os.environ, **self.env},
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        try:
            self._wait_until_answering()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Terminate the server (kill it if it ignores SIGTERM) and wait until its port is free."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        # The next start() binds the same port: make sure nothing accepts on it any more.
        deadline = time.monotonic() + 5
        while self._port_accepts() and time.monotonic() < deadline:
            time.sleep(0.05)

    def restart(self) -> None:
        """Stop and start again on the same port."""
        self.stop()
        self.start()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no output)"

    def _port_accepts(self) -> bool:
        with socket.socket() as s:
            s.settimeout(0.2)
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def _wait_until_answering(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {self._proc.returncode} while starting "
                    f"({' '.join(self.command)}); its output:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/", timeout=1):
                    return
            except urllib.error.HTTPError:
                return  # an HTTP error status is an answer: the server is up
            except OSError as e:  # refused, reset, timed out: not up yet
                last_error = e
            time.sleep(0.05)
        raise ServerStartError(
            f"{self.name} did not answer on {self.url} within {self.startup_timeout:.0f}s "
            f"(last error: {last_error}); its output:\n{self.log_tail()}"
        )


# Looked up here, not in the forked child: loading a library there could deadlock.
_PRCTL = ctypes.CDLL(None).prctl if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the server process before it starts: on Linux, end it (SIGTERM) when the test
    process that started it dies, even killed, so that no server outlives its test run."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_gcs_emulator(
    workdir: Path, *, in_memory: bool = True, port: int | None = None
) -> ServerProcess:
    """Start ``gcp-storage-emulator`` with the bucket :data:`BUCKET`.

    In memory, a restart loses every object (and the emulator re-creates the empty bucket);
    on disk (under ``workdir``), objects survive a restart.
    """
    exe = _executable("gcp-storage-emulator")
    if exe is None:
        pytest.skip("gcp-storage-emulator is not installed (pip install -e '.[dev]')")
    port = port or free_port()
    command = [exe, "start", "--host=127.0.0.1", f"--port={port}", f"--default-bucket={BUCKET}"]
    if in_memory:
        command.append("--in-memory")
    server = ServerProcess(
        "gcp-storage-emulator",
        command,
        port,
        log_path=workdir / f"gcs-emulator-{port}.log",
        cwd=workdir,
        env={"STORAGE_BASE": str(workdir)},  # where it keeps objects when not in memory
    )
    server.start()
    return server


def start_moto_server(workdir: Path, *, port: int | None = None) -> ServerProcess:
    """Start moto's S3 server and create the bucket :data:`BUCKET` (state is in memory)."""
    exe = _executable("moto_server")
    if exe is None:
        pytest.skip("moto_server is not installed (pip install -e '.[dev]', moto[server])")
    port = port or free_port()
    server = ServerProcess(
        "moto_server",
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        port,
        log_path=workdir / f"moto-server-{port}.log",
        cwd=workdir,
        env=_FAKE_AWS_ENV,
    )
    server.start()
    try:
        # moto does not check signatures: a plain PUT creates the bucket.
        request = urllib.request.Request(f"{server.url}/{BUCKET}", method="PUT")
        with urllib.request.urlopen(request, timeout=10):
            pass
    except BaseException:
        server.stop()
        raise
    return server


def _client_options(protocol: str, endpoint: str) -> dict[str, Any]:
    """fsspec options that send ``protocol`` URLs to ``endpoint``."""
    if protocol == "gs":
        return {"endpoint_url": endpoint, "token": "anon", "project": "test"}
    return {
        "endpoint_url": endpoint,
        "key": _FAKE_AWS_ENV["AWS_ACCESS_KEY_ID"],
        "secret": _FAKE_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {"region_name": _FAKE_AWS_ENV["AWS_DEFAULT_REGION"]},
    }


# fsspec looks options up under each of a filesystem's protocol names; set all of them.
_CONF_KEYS = {"gs": ("gs", "gcs"), "s3": ("s3", "s3a")}


def _clear_fsspec_caches() -> None:
    """Forget cached filesystem instances and their listings.

    Instances are cached by their options and keep directory listings: a test must not get
    one configured for another server, nor listings from before a server restart.
    """
    for protocol in ("gs", "s3"):
        with contextlib.suppress(ImportError, ValueError):
            fsspec.get_filesystem_class(protocol).clear_instance_cache()


@dataclass
class RemoteStore:
    """One test's view of a bucket on a server: ``url()`` builds URLs under its own prefix."""

    protocol: str
    server: ServerProcess
    monkeypatch: pytest.MonkeyPatch
    bucket: str = BUCKET
    prefix: str = field(default_factory=lambda: f"t-{uuid.uuid4().hex[:10]}")

    def url(self, *parts: str) -> str:
        """``{protocol}://{bucket}/{prefix}/{parts...}``."""
        return "/".join([f"{self.protocol}://{self.bucket}", self.prefix, *parts])

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The filesystem olmolike gets for this store's URLs (with the current settings)."""
        return fsspec.core.url_to_fs(self.url())[0]

    def objects(self, *parts: str) -> list[str]:
        """Every object under ``url(*parts)``, relative to it (fresh from the server)."""
        root = self.url(*parts).split("://", 1)[1]
        self.fs.invalidate_cache()
        return sorted(p[len(root) + 1 :] for p in self.fs.find(root))

    def point_at(self, endpoint: str, **extra: Any) -> None:
        """Send this protocol's URLs to ``endpoint`` from now on (until the test ends)."""
        options = {**_client_options(self.protocol, endpoint), **extra}
        for key in _CONF_KEYS[self.protocol]:
            self.monkeypatch.setitem(fsspec.config.conf, key, options)
        if self.protocol == "gs":
            self.monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
        else:
            self.monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
            self.monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
        _clear_fsspec_caches()

    def reconnect(self) -> None:
        """Point at the server again (after :func:`dead_endpoint`)."""
        self.point_at(self.server.url)


@contextlib.contextmanager
def dead_endpoint(store: RemoteStore) -> Iterator[str]:
    """Within the block, ``store``'s URLs go to a port nothing listens on.

    Models a store that becomes unreachable while the server itself keeps its data (moto
    keeps objects in memory only: stopping it would lose them). Every request is refused
    at once; the client's own retries are cut short by :func:`fast_client_retries`.
    """
    endpoint = f"http://127.0.0.1:{free_port()}"
    extra: dict[str, Any] = {}
    if store.protocol == "s3":
        # botocore retries refused connections itself (about 5 s per call); once is enough.
        extra["config_kwargs"] = {"retries": {"total_max_attempts": 1}, "connect_timeout": 1}
    store.point_at(endpoint, **extra)
    try:
        yield endpoint
    finally:
        store.reconnect()


def fast_client_retries(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Make the retries of olmolike and of the storage clients instant; return olmolike's delays.

    olmolike backs off with ``olmolike.io.time.sleep``; gcsfs retries every request 6 times
    with exponential backoff (~33 s when the server is down) through ``asyncio.sleep`` in
    ``gcsfs.retry``. Both keep retrying, only without waiting.
    """
    import olmolike.io

    delays: list[float] = []
    monkeypatch.setattr(olmolike.io.time, "sleep", delays.append)
    if importlib.util.find_spec("gcsfs") is not None:
        import asyncio

        import gcsfs.retry

        real_sleep = asyncio.sleep

        async def no_wait(delay: float, result: Any = None) -> Any:
            return await real_sleep(0, result)

        # Only gcsfs.retry's view of asyncio changes; the event loop's own sleeps do not.
        monkeypatch.setattr(
            gcsfs.retry, "asyncio", types.SimpleNamespace(**{**vars(asyncio), "sleep": no_wait})
        )
    return delays


def _require_client(module: str, package: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{package} is not installed (pip install -e '.[dev]')")
    if module == "gcsfs":
        import gcsfs
        import gcsfs.core

        if gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:
            # Better a clear failure now than every bucket stalling 60 s in each test.
            pytest.fail(
                "gcsfs was imported with GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT enabled (before "
                "remote_servers could disable it); its gRPC bucket probe stalls against the "
                "emulator. Set GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false in the environment."
            )


@contextlib.contextmanager
def running(start: Callable[[], ServerProcess]) -> Iterator[ServerProcess]:
    """The server ``start()`` returns, terminated when the block ends (also on errors)."""
    server = start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A GCS emulator (in memory) for the whole session."""
    _require_client("gcsfs", "gcsfs")
    workdir = tmp_path_factory.mktemp("gcs-server")
    with running(lambda: start_gcs_emulator(workdir, in_memory=True)) as server:
        yield server


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """moto's S3 server for the whole session."""
    _require_client("s3fs", "s3fs")
    workdir = tmp_path_factory.mktemp("s3-server")
    with running(lambda: start_moto_server(workdir)) as server:
        yield server


@pytest.fixture
def gcs_bucket(gcs_server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[RemoteStore]:
    """``gs://`` URLs go to the session's GCS emulator during the test."""
    store = RemoteStore("gs", gcs_server, monkeypatch)
    store.reconnect()
    yield store
    _clear_fsspec_caches()  # monkeypatch restores the settings after this


@pytest.fixture
def s3_bucket(s3_server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[RemoteStore]:
    """``s3://`` URLs go to the session's moto server during the test."""
    for name, value in _FAKE_AWS_ENV.items():
        monkeypatch.setenv(name, value)
    store = RemoteStore("s3", s3_server, monkeypatch)
    store.reconnect()
    yield store
    _clear_fsspec_caches()


@pytest.fixture
def restartable_gcs_bucket(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[RemoteStore]:
    """Like ``gcs_bucket``, but on an emulator of the test's own that stores objects on disk.

    The test may stop and restart ``store.server``: what was uploaded survives, as with a
    real service that has an outage. The server is terminated when the test ends.
    """
    _require_client("gcsfs", "gcsfs")
    workdir = tmp_path_factory.mktemp("gcs-restartable")
    with running(lambda: start_gcs_emulator(workdir, in_memory=False)) as server:
        store = RemoteStore("gs", server, monkeypatch)
        store.reconnect()
        yield store
        _clear_fsspec_caches()
