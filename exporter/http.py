"""Serving a registry over HTTP: /metrics, / and /-/healthy; anything else is 404.

A factory returns a handle you can shut down, so tests and the CLI own the server's
lifetime. /metrics is the text format, or OpenMetrics when the Accept header asks for
it (Prometheus does), written by exporter.exposition's fast encoders; gzip when asked.
"""

from __future__ import annotations

import gzip
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry

from exporter import __version__, exposition

_INDEX = """<!doctype html>
<html><head><title>dataloader-exporter</title></head>
<body><h1>dataloader-exporter {version}</h1>
<p>PyTorch DataLoader, GPU, /dev/shm and host metrics for Prometheus.</p>
<p><a href="/metrics">Metrics</a></p></body></html>
"""

StartResponse = Callable[..., Any]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # socketserver's default of 5 drops bursts of scrapes


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def make_app(registry: CollectorRegistry) -> Callable[[dict[str, Any], StartResponse],
                                                        Iterable[bytes]]:
    """The WSGI app: routes the three endpoints, 404 for the rest."""
    index = _INDEX.format(version=__version__).encode()

    def metrics(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if "application/openmetrics-text" in environ.get("HTTP_ACCEPT", ""):
            body, ctype = exposition.openmetrics(registry.collect()), (
                exposition.OPENMETRICS_CONTENT_TYPE)
        else:
            body, ctype = exposition.text(registry.collect()), exposition.TEXT_CONTENT_TYPE
        headers = [("Content-Type", ctype)]
        if "gzip" in environ.get("HTTP_ACCEPT_ENCODING", ""):
            body = gzip.compress(body, compresslevel=1)  # level 9 costs ~10x the time
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [body]

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return metrics(environ, start_response)
        if path == "/":
            start_response("200 OK", [("Content-Type", "text/html; charset=utf-8")])
            return [index]
        if path == "/-/healthy":
            start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"OK\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"404 page not found\n"]

    return app


class ServerHandle:
    """A running HTTP server: its bound address, and shutdown()."""

    def __init__(self, server: _Server, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        host, port = server.server_address[:2]
        self.host = host.decode() if isinstance(host, bytes) else str(host)
        self.port = int(port)
        self.closed = False

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        if ":" in str(host):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=2)


def serve(registry: CollectorRegistry, host: str = "0.0.0.0", port: int = 0) -> ServerHandle:
    """Serves the registry on host:port (0 picks a free port) in a daemon thread."""
    server_class = _Server6 if ":" in host else _Server
    server = make_server(host, port, make_app(registry), server_class,
                         handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="dataloader-exporter-http",
                              daemon=True)
    thread.start()
    return ServerHandle(server, thread)
