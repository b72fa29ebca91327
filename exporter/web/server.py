"""Serving a registry over HTTP/1.1: /metrics, / and /-/healthy, with bounded resources.

The exporter listens on 0.0.0.0 by default, so any peer on the network is a client. The
server is one asyncio event loop in one thread (idle connections cost a few KiB, not a
thread each), with:
- a cap on open connections (``max_connections``, lowered to fit the process's
  descriptor limit), counted from accept (before any TLS handshake); a new connection
  over the cap evicts the one idle longest (waiting for a request, or for a client to
  take its answer), so a Prometheus scrape is served even while idle, slow or
  non-reading clients hold every slot;
- timeouts: the request head must arrive within ``read_header_timeout`` (a new
  connection's TLS handshake too), a kept-alive connection is closed after
  ``idle_timeout`` without a request, an answer must be taken within ``write_timeout``
  (else the connection is aborted, never left to linger), and a collection is awaited
  for the scrape's own timeout (Prometheus's header) or 30 s, then 503;
- collection in a small thread pool, one collection shared by concurrent scrapes
  (exporter.scrape.SingleFlight); bcrypt checks on their own thread, a few at a time
  (429 beyond), so wrong passwords cannot delay scrapes whose credentials are known;
- in the training process (IN_PROCESS), pacing (exporter.web.pacer): one answer per peer
  every 0.2 s and 20 a second in all after a burst of 10, later requests waiting their
  turn at no cost, so that clients cannot take the interpreter lock from the training loop;
- GET and HEAD (headers, no body) on the three paths, 405 with ``Allow`` for other
  methods, 404 elsewhere; TLS and basic auth from a ``--web.config.file``.
The same server runs in the sidecar and in-process. serve() returns a handle you can
shut down.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from dataloader_exporter.exporter.web.connection import Server
from dataloader_exporter.exporter.web.limits import (
    ACCEPT_BATCH,
    IN_PROCESS,
    Limits,
    connection_cap,
)

if TYPE_CHECKING:  # loading a web config (PyYAML, bcrypt) is exporter.web.webconfig's job
    from dataloader_exporter.exporter.web.webconfig import WebConfig

# The limits (exporter.web.limits) are part of this module's interface: callers that serve
# import them from here.
__all__ = ["IN_PROCESS", "Limits", "ServerHandle", "connection_cap", "serve"]

log = logging.getLogger("dataloader_exporter.exporter")

_MAX_HEAD = 16 * 1024  # request line and headers; Prometheus sends a few hundred bytes


class ServerHandle:
    """A running HTTP server: its bound address, its URL, and shutdown()."""

    def __init__(self, server: Server, loop: asyncio.AbstractEventLoop,
                 aserver: asyncio.base_events.Server, thread: threading.Thread,
                 web: WebConfig | None) -> None:
        self._server = server
        self._loop = loop
        self._aserver = aserver
        self._thread = thread
        self.web = web
        sockname = aserver.sockets[0].getsockname()
        self.host = str(sockname[0])
        self.port = int(sockname[1])
        self.scheme = "https" if server.tls is not None else "http"
        self.closed = False

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"{self.scheme}://{host}:{self.port}"

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        server = self._server

        async def stop() -> None:
            server.closing = True  # a connection accepted from now on is closed at once
            self._aserver.close()
            conns = list(server.tracked)
            for conn in conns:
                conn.transport.abort()
            tasks = [c.task for c in conns if c.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._aserver.wait_closed()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=5)
        except Exception as e:  # pragma: no cover - a stuck loop must not hang shutdown
            log.warning("HTTP server did not stop cleanly: %r", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        server.executor.shutdown(wait=False, cancel_futures=True)
        server.bcrypt.shutdown(wait=False, cancel_futures=True)


def _quiet(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Failed TLS handshakes and resets are the clients' business: debug, not warnings."""
    log.debug("http: %s", context.get("message"))


def serve(registry: CollectorRegistry, host: str = "0.0.0.0", port: int = 0,
          web: WebConfig | None = None, limits: Limits | None = None) -> ServerHandle:
    """Serves the registry on host:port (0 picks a free port) from a daemon thread.

    Raises OSError when the address cannot be bound.
    """
    limits = limits or Limits()
    server = Server(registry, limits, connection_cap(limits), web)
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(_quiet)
    started: Future[asyncio.base_events.Server] = Future()

    async def start() -> asyncio.base_events.Server:
        # Plain TCP: TLS starts per connection once admitted (StreamWriter.start_tls).
        return await asyncio.start_server(server.connection, host, port, limit=_MAX_HEAD,
                                          backlog=ACCEPT_BATCH, reuse_address=True)

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            started.set_result(loop.run_until_complete(start()))
        except BaseException as e:
            started.set_exception(e)
            loop.close()
            return
        try:
            loop.run_forever()
        finally:
            loop.close()

    thread = threading.Thread(target=run, name="dataloader-exporter-http", daemon=True)
    thread.start()
    try:
        aserver = started.result()
    except BaseException:
        thread.join()
        server.executor.shutdown(wait=False)
        server.bcrypt.shutdown(wait=False)
        raise
    return ServerHandle(server, loop, aserver, thread, web)
