"""Rules of the test suite itself, which keep it fast and clean as it grows."""

from __future__ import annotations

import ast
from pathlib import Path

import conftest
import remote_servers

TESTS = Path(__file__).parent


def _fixtures_defined_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any("fixture" in ast.unparse(d) for d in node.decorator_list)
    }


def test_storage_server_fixtures_are_registered_once_for_the_session() -> None:
    """A session fixture imported into a test module becomes that module's own: a GCS emulator
    and a moto server per module, all alive until the end of the run. conftest registers
    them once; test modules only name them."""
    fixtures = _fixtures_defined_in(Path(remote_servers.__file__))
    assert {"gcs_server", "s3_server", "gcs_bucket", "s3_bucket"} <= fixtures
    assert all(getattr(conftest, name) is getattr(remote_servers, name) for name in fixtures)
    importing = {}
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "remote_servers":
                names = {alias.name for alias in node.names} & fixtures
                if names:
                    importing[path.name] = sorted(names)
    assert not importing, f"import these fixtures from nowhere (conftest has them): {importing}"
