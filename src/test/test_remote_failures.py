"""Remote failures that retrying cannot fix end in seconds, in one line naming the URL.

Real clients against a host that does not resolve and a 127.0.0.1 server that refuses every
request: nothing is mocked.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import fsspec
import pytest
from remote_servers import free_port  # also keeps gcsfs from its slow bucket-type probe
from testutils import patient

from olmolike import io
from olmolike.exceptions import NetworkError

pytest.importorskip("gcsfs")


def point_gs_at(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    options = {"endpoint_url": endpoint, "token": "anon", "project": "test"}
    for key in ("gs", "gcs"):
        monkeypatch.setitem(fsspec.config.conf, key, options)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
    fsspec.get_filesystem_class("gs").clear_instance_cache()


class Refuse(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"error": {"code": 401, "message": "Anonymous caller does not have access"}}'
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def refusing_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=patient(10))


def test_a_host_that_does_not_resolve_fails_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    point_gs_at(monkeypatch, "http://olmolike-test.invalid:80")
    with pytest.raises(NetworkError, match=r"cannot reach gs://b/run: .*olmolike-test.invalid"):
        io.exists("gs://b/run")


def test_refused_credentials_are_not_retried(
    monkeypatch: pytest.MonkeyPatch, refusing_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    point_gs_at(monkeypatch, refusing_server)
    with pytest.raises(NetworkError) as raised:
        io.list_dir("gs://b/run")
    message = str(raised.value)
    assert message.startswith("listing gs://b/run failed: access denied (HTTP 401)")
    assert "GOOGLE_APPLICATION_CREDENTIALS" in message and "\n" not in message
    assert not any("retrying" in r.getMessage() for r in caplog.records)
