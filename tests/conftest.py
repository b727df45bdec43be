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
