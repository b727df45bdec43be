"""A real S3-compatible HTTP server on 127.0.0.1 for tests and benchmarks (moto's server mode).

Like s3fs's own test-suite: the code under test talks HTTP to a local server through s3fs and
botocore, nothing is mocked in-process. Credentials are dummies; nothing leaves the machine.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from dist_harness import free_port

ACCESS_KEY = "testing-key"
SECRET_KEY = "testing-secret"


class S3Server:
    """A moto server in a thread of this process. ``storage_options`` is what s3fs needs."""

    def __init__(self, port: int | None = None) -> None:
        from moto.server import ThreadedMotoServer

        # moto/botocore look at these; make sure nothing could reach real AWS.
        os.environ.setdefault("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.running = False

    @property
    def storage_options(self) -> dict[str, Any]:
        return {
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            # A stopped server must fail fast in tests, not after minutes of retries.
            "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}, "connect_timeout": 2, "read_timeout": 10},
            "skip_instance_cache": True,
        }

    def start(self) -> S3Server:
        self._server.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                time.sleep(0.05)
        self.running = True
        return self

    def stop(self) -> None:
        if self.running:
            self._server.stop()
            self.running = False

    def make_bucket(self, name: str) -> str:
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=name)
        return name
