"""An HTTP proxy in front of the test's real S3 server (moto) that loses chosen answers.

A network fault, not a mock: requests reach the real server through botocore and s3fs as in
production; the proxy can forward a request and then drop the connection before its answer
reaches the client (the put landed, the client never heard), as a flaky network does. botocore
then retries the request.

``rules``: callables ``rule(method, path) -> "drop_after" | None``, the first answer wins;
``log``: ``(method, path, status or "drop_after")`` of every request forwarded.
"""

from __future__ import annotations

import http.client
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from s3_server import ACCESS_KEY, SECRET_KEY


class LosingProxy:
    def __init__(self, upstream_port: int) -> None:
        self.rules: list[Callable[[str, str], str | None]] = []
        self.log: list[tuple[str, str, Any]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _any(self) -> None:
                body = self._body()
                method, path = self.command, self.path
                with proxy._lock:
                    action = next((a for a in (rule(method, path) for rule in list(proxy.rules)) if a is not None), None)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "connection")}
                headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30)
                conn.request(method, path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                with proxy._lock:
                    proxy.log.append((method, path, action or resp.status))
                if action == "drop_after":  # it landed; the client never hears
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(k, v)
                length = (resp.getheader("Content-Length") or "0") if method == "HEAD" else str(len(data))
                self.send_header("Content-Length", length)
                self.end_headers()
                if method != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def lose_answer_once(self, suffix: str, method: str = "PUT") -> list[str]:
        """Drop the answer to the first ``method`` request whose path ends with ``suffix``;
        returns a list that holds the path once it fired."""
        fired: list[str] = []

        def rule(m: str, path: str) -> str | None:
            if not fired and m == method and path.split("?")[0].endswith(suffix):
                fired.append(path)
                return "drop_after"
            return None

        self.rules.append(rule)
        return fired

    @property
    def storage_options(self) -> dict[str, Any]:
        return {
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{self.port}", "region_name": "us-east-1"},
            "config_kwargs": {"retries": {"max_attempts": 3, "mode": "standard"}, "connect_timeout": 2, "read_timeout": 10},
            "skip_instance_cache": True,
        }

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
