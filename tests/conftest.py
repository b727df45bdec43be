"""Shared fixtures: one real S3-compatible server (moto, HTTP on 127.0.0.1) per test process.

Under pytest-xdist every worker is its own process and starts its own server on a free port
(``S3Server`` binds port 0 to pick one), so workers never share or collide on a server. Tests
that stop the server start their own (see ``tests/test_s3.py``), never this shared one.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def s3_server() -> Iterator:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from s3_server import S3Server

    # werkzeug logs every request at INFO; keep test output readable.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = S3Server().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A fresh, empty bucket on the session's S3 server (unique per test)."""
    return s3_server.make_bucket(f"t-{uuid.uuid4().hex[:16]}")


def _loadgroup(config) -> bool:
    return getattr(config.option, "loadgroup", False) or getattr(config.option, "dist", None) == "loadgroup"


def pytest_configure(config) -> None:
    """(the controller) Refuse ``--dist loadgroup`` where it cannot group: pytest >= 9.2 with
    pytest-xdist < 3.9 (pytest-xdist#1386: the group suffix xdist writes into node ids no longer
    takes, so the suite's xdist_group fixtures run once per worker and tests meant to run one
    after another run side by side). The test extra pins pytest below 9.2."""
    if hasattr(config, "workerinput") or not _loadgroup(config):
        return
    from importlib.metadata import version

    xdist = tuple(int(p) for p in version("pytest-xdist").split(".")[:2] if p.isdigit())
    if pytest.version_tuple[:2] >= (9, 2) and xdist < (3, 9):
        raise pytest.UsageError(
            f"--dist loadgroup does not group with pytest {pytest.__version__} and pytest-xdist "
            f"{version('pytest-xdist')} (pytest-xdist#1386); install the test extra's pytest: "
            "pip install -e '.[test]'"
        )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """(each worker) Under ``--dist loadgroup`` every test marked ``xdist_group`` must carry its
    group in its node id, which is how pytest-xdist keeps a group on one worker: a combination
    that drops it (another than the one :func:`pytest_configure` knows) fails the run here."""
    if not hasattr(config, "workerinput") or not _loadgroup(config):
        return
    lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid.rpartition("]")[2].rpartition("::")[2]]
    if lost:
        raise pytest.UsageError(f"--dist loadgroup is not grouping: {len(lost)} test(s) lost their xdist_group (e.g. {lost[0]})")
