"""Serving a registry over HTTP/1.1: /metrics, / and /-/healthy, with bounded resources.

The exporter listens on 0.0.0.0 by default, so any peer on the network is a client. The
server is one asyncio event loop in one thread (idle connections cost a few KiB, not a
thread each), with:
- a cap on open connections (``max_connections``, lowered to fit the process's
  descriptor limit); a new connection over the cap evicts the connection idle longest,
  so a Prometheus scrape is served even while idle or slow clients hold every slot;
- timeouts: the request head must arrive within ``read_header_timeout`` of its first
  byte (slowloris), a kept-alive connection is closed after ``idle_timeout`` without a
  request, and a response must be taken within ``write_timeout``;
- collection in a small thread pool, one collection shared by concurrent scrapes
  (exporter.scrape.SingleFlight);
- GET and HEAD (headers, no body) on the three paths, 405 with ``Allow`` for other
  methods, 404 elsewhere; TLS and basic auth from a ``--web.config.file``
  (exporter.webconfig).
The same server runs in the sidecar and in-process. A factory returns a handle you can
shut down.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import ssl
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from prometheus_client import CollectorRegistry

from exporter import __version__
from exporter.scrape import SingleFlight, content_type

if TYPE_CHECKING:  # loading a web config (PyYAML, bcrypt) is exporter.webconfig's job
    from exporter.webconfig import WebConfig

log = logging.getLogger("exporter")

_INDEX = """<!doctype html>
<html><head><title>dataloader-exporter</title></head>
<body><h1>dataloader-exporter {version}</h1>
<p>PyTorch DataLoader, GPU, /dev/shm and host metrics for Prometheus.</p>
<p><a href="/metrics">Metrics</a></p></body></html>
"""
_PATHS = ("/metrics", "/", "/-/healthy")
_METHODS = ("GET", "HEAD")
_MAX_HEAD = 16 * 1024  # request line and headers; Prometheus sends a few hundred bytes
_TEXT = "text/plain; charset=utf-8"
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            405: "Method Not Allowed", 408: "Request Timeout",
            431: "Request Header Fields Too Large", 500: "Internal Server Error",
            505: "HTTP Version Not Supported"}
# Descriptors kept free for everything else (snapshot files, /proc, NVML, logs).
_RESERVED_FDS = 64


@dataclass(frozen=True)
class Limits:
    """Bounds on what clients can hold; the defaults suit scrapes every 1 s to 2 min."""

    max_connections: int = 128
    read_header_timeout: float = 10.0
    idle_timeout: float = 150.0  # above Prometheus's longest usual scrape interval (2 min)
    write_timeout: float = 30.0


def connection_cap(limits: Limits) -> int:
    """max_connections, lowered so that open connections cannot exhaust descriptors."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits.max_connections
    return max(4, min(limits.max_connections, (soft - _RESERVED_FDS) // 2))


class _Conn:
    __slots__ = ("busy", "last", "transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.busy = False
        self.last = time.monotonic()


@dataclass
class _Request:
    method: str
    path: str
    headers: dict[str, str]
    keep_alive: bool


class _Reply(Exception):
    """An early answer to a request that cannot be served (bad request, timeout)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class _Server:
    def __init__(self, registry: CollectorRegistry, limits: Limits,
                 web: WebConfig | None) -> None:
        self.limits = limits
        self.cap = connection_cap(limits)
        self.web = web
        self.executor = ThreadPoolExecutor(4, thread_name_prefix="dataloader-exporter-scrape")
        self.flight = SingleFlight(registry, self.executor)
        self.conns: dict[asyncio.Transport, _Conn] = {}
        self.index = _INDEX.format(version=__version__).encode()
        self.extra_headers = "".join(f"{k}: {v}\r\n" for k, v in (web.headers.items()
                                                                    if web else ()))
        self.failing = False

    # --- connections --------------------------------------------------------------
    def _admit(self, conn: _Conn) -> bool:
        if len(self.conns) >= self.cap:
            idle = [c for c in self.conns.values() if not c.busy]
            if not idle:
                return False
            victim = min(idle, key=lambda c: c.last)
            del self.conns[victim.transport]
            victim.transport.abort()
        self.conns[conn.transport] = conn
        return True

    async def connection(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        conn = _Conn(cast(asyncio.Transport, writer.transport))
        if not self._admit(conn):
            conn.transport.abort()  # every slot is busy answering: refuse
            return
        try:
            wait = self.limits.read_header_timeout
            while True:
                try:
                    request = await self._read_request(reader, wait)
                except _Reply as e:
                    conn.busy = True
                    await self._send(writer, e.status, _TEXT, f"{_REASONS[e.status]}\n".encode(),
                                     keep_alive=False)
                    return
                if request is None:
                    return
                conn.busy = True
                keep = await self._answer(request, writer)
                conn.busy, conn.last = False, time.monotonic()
                if not keep:
                    return
                wait = self.limits.idle_timeout
        except (ConnectionError, asyncio.TimeoutError, ssl.SSLError, OSError):
            pass  # the client went away or would not take the answer
        finally:
            self.conns.pop(conn.transport, None)
            writer.close()

    async def _read_request(self, reader: asyncio.StreamReader,
                            idle: float) -> _Request | None:
        """The next request head, None when the client closed or stayed idle."""
        try:
            first = await asyncio.wait_for(reader.read(1), idle)
        except asyncio.TimeoutError:
            return None
        if not first:
            return None
        try:
            rest = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"),
                                          self.limits.read_header_timeout)
        except asyncio.TimeoutError:
            raise _Reply(408) from None
        except asyncio.LimitOverrunError:
            raise _Reply(431) from None
        except asyncio.IncompleteReadError:
            return None
        return _parse_head(first + rest)

    # --- answers --------------------------------------------------------------------
    async def _answer(self, request: _Request, writer: asyncio.StreamWriter) -> bool:
        keep = request.keep_alive
        if self.web is not None and self.web.users:
            loop = asyncio.get_running_loop()
            ok = await loop.run_in_executor(  # bcrypt takes milliseconds: off the loop
                self.executor, self.web.authorized, request.headers.get("authorization"))
            if not ok:
                await self._send(writer, 401, _TEXT, b"Unauthorized\n", keep,
                                 'WWW-Authenticate: Basic realm="dataloader-exporter"\r\n',
                                 request.method == "HEAD")
                return keep
        if request.path not in _PATHS:
            await self._send(writer, 404, _TEXT, b"404 page not found\n", keep,
                             head_only=request.method == "HEAD")
            return keep
        if request.method not in _METHODS:
            await self._send(writer, 405, _TEXT, b"Method Not Allowed\n", keep,
                             "Allow: GET, HEAD\r\n")
            return keep
        head_only = request.method == "HEAD"
        if request.path == "/":
            await self._send(writer, 200, "text/html; charset=utf-8", self.index, keep,
                             head_only=head_only)
        elif request.path == "/-/healthy":
            await self._send(writer, 200, _TEXT, b"OK\n", keep, head_only=head_only)
        else:
            await self._metrics(request, writer, head_only)
        return keep

    async def _metrics(self, request: _Request, writer: asyncio.StreamWriter,
                       head_only: bool) -> None:
        openmetrics = "application/openmetrics-text" in request.headers.get("accept", "")
        gzipped = "gzip" in request.headers.get("accept-encoding", "")
        try:
            body = await self.flight.body((openmetrics, gzipped))
        except Exception as e:
            if not self.failing:
                self.failing = True
                log.error("collecting metrics failed: %s", type(e).__name__)
            await self._send(writer, 500, _TEXT, b"error collecting metrics\n",
                             request.keep_alive, head_only=head_only)
            return
        self.failing = False
        extra = "Content-Encoding: gzip\r\n" if gzipped else ""
        await self._send(writer, 200, content_type(openmetrics), body, request.keep_alive,
                         extra + "Vary: Accept, Accept-Encoding\r\n", head_only)

    async def _send(self, writer: asyncio.StreamWriter, status: int, ctype: str, body: bytes,
                    keep_alive: bool, extra: str = "", head_only: bool = False) -> None:
        head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\n{extra}{self.extra_headers}"
                f"{'' if keep_alive else 'Connection: close' + chr(13) + chr(10)}\r\n")
        writer.write(head.encode("latin-1"))
        if not head_only:
            writer.write(body)  # not head + body: that copies a 1 MB body per client
        await asyncio.wait_for(writer.drain(), self.limits.write_timeout)


def _parse_head(data: bytes) -> _Request:
    """Request line and headers; _Reply(400/505) when they are not HTTP/1.x."""
    lines = data.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[1].startswith("/"):
        raise _Reply(400)
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise _Reply(505 if version.startswith("HTTP/") else 400)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise _Reply(400)
        headers[name.lower()] = value.strip()
    connection = headers.get("connection", "").lower()
    keep = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    # A request body is never read: answer, then close rather than parse it as a request.
    if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
        keep = False
    return _Request(method, target.split("?", 1)[0], headers, keep)


class ServerHandle:
    """A running HTTP server: its bound address, its URL, and shutdown()."""

    def __init__(self, server: _Server, loop: asyncio.AbstractEventLoop,
                 aserver: asyncio.base_events.Server, thread: threading.Thread,
                 tls: bool) -> None:
        self._server = server
        self._loop = loop
        self._aserver = aserver
        self._thread = thread
        sockname = aserver.sockets[0].getsockname()
        self.host = str(sockname[0])
        self.port = int(sockname[1])
        self.scheme = "https" if tls else "http"
        self.closed = False

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def connections(self) -> int:
        """Open connections (past the TLS handshake)."""
        return len(self._server.conns)

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True

        async def stop() -> None:
            self._aserver.close()
            for transport in list(self._server.conns):
                transport.abort()
            await self._aserver.wait_closed()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=5)
        except Exception as e:  # pragma: no cover - a stuck loop must not hang shutdown
            log.warning("HTTP server did not stop cleanly: %r", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._server.executor.shutdown(wait=False, cancel_futures=True)


def _quiet(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Failed TLS handshakes and resets are the clients' business: debug, not warnings."""
    log.debug("http: %s", context.get("message"))


def serve(registry: CollectorRegistry, host: str = "0.0.0.0", port: int = 0,
          web: WebConfig | None = None, limits: Limits | None = None) -> ServerHandle:
    """Serves the registry on host:port (0 picks a free port) from a daemon thread.

    Raises OSError when the address cannot be bound.
    """
    server = _Server(registry, limits or Limits(), web)
    ctx = web.ssl_context() if web is not None else None
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(_quiet)
    started: Future[asyncio.base_events.Server] = Future()

    async def start() -> asyncio.base_events.Server:
        return await asyncio.start_server(
            server.connection, host, port, ssl=ctx, limit=_MAX_HEAD, backlog=1024,
            reuse_address=True,
            ssl_handshake_timeout=server.limits.read_header_timeout if ctx else None)

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
        raise
    return ServerHandle(server, loop, aserver, thread, ctx is not None)

