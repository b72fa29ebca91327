"""One connection's life for exporter.http: admission under the cap, TLS, reading
request heads, authorizing, answering, and closing without lingering.

See exporter.http for the limits and why they are what they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, cast

from prometheus_client import CollectorRegistry

from exporter import __version__
from exporter.httpwire import (
    REASONS,
    TEXT,
    Reply,
    Request,
    accepts,
    parse_head,
    response_head,
)
from exporter.scrape import SingleFlight, content_type

if TYPE_CHECKING:
    from exporter.http import Limits
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
_BCRYPT_QUEUE = 4  # bcrypt checks waiting at most; more get 429
_COLLECT_TIMEOUT = 30.0  # without Prometheus's X-Prometheus-Scrape-Timeout-Seconds
STARTTLS = hasattr(asyncio.StreamWriter, "start_tls")  # Python >= 3.11


class Conn:
    """One client connection: busy while a request is being answered (not evictable)."""

    __slots__ = ("busy", "last", "transport")

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.busy = False
        self.last = time.monotonic()


class Server:
    def __init__(self, registry: CollectorRegistry, limits: Limits, cap: int,
                 web: WebConfig | None) -> None:
        self.limits = limits
        self.cap = cap
        self.web = web
        self.tls = web.ssl_context() if web is not None else None
        self.executor = ThreadPoolExecutor(4, thread_name_prefix="dataloader-exporter-scrape")
        self.bcrypt = ThreadPoolExecutor(1, thread_name_prefix="dataloader-exporter-auth")
        self.bcrypt_waiting = 0
        self.flight = SingleFlight(registry, self.executor)
        self.conns: set[Conn] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.index = _INDEX.format(version=__version__).encode()
        self.extra_headers = "".join(f"{k}: {v}\r\n" for k, v in (web.headers.items()
                                                                    if web else ()))
        self.failing: set[str] = set()  # problems logged, once each
        self.freed = asyncio.Event()  # a connection stopped being busy, or closed
        self.waiting = 0  # new connections waiting for a slot while every one is busy

    # --- connections --------------------------------------------------------------
    def _admit(self, conn: Conn) -> bool:
        if len(self.conns) >= self.cap:
            idle = [c for c in self.conns if not c.busy]
            if not idle:
                return False
            victim = min(idle, key=lambda c: c.last)
            self.conns.discard(victim)
            victim.transport.abort()
        self.conns.add(conn)
        return True

    async def _wait_for_slot(self, conn: Conn) -> bool:
        """Admits `conn`, waiting (read_header_timeout at most) while every connection is
        busy answering; at most `cap` newcomers wait, the others are refused at once."""
        if self._admit(conn):
            return True
        if self.waiting >= self.cap:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.read_header_timeout
        self.waiting += 1
        try:
            while not self._admit(conn):
                self.freed.clear()
                await asyncio.wait_for(self.freed.wait(), deadline - loop.time())
        except asyncio.TimeoutError:
            return False
        finally:
            self.waiting -= 1
        return True

    async def connection(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        conn = Conn(writer.transport)
        if not await self._wait_for_slot(conn):
            conn.transport.abort()  # every slot stayed busy answering: refuse
            return
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
        clean = False
        try:
            if self.tls is not None and STARTTLS:
                await writer.start_tls(self.tls,
                                       ssl_handshake_timeout=self.limits.read_header_timeout)
                conn.transport = cast(asyncio.Transport, writer.transport)
            clean = await self._serve(conn, reader, writer)
        except (ConnectionError, asyncio.TimeoutError, ssl.SSLError, OSError,
                asyncio.IncompleteReadError):
            pass  # the client went away, would not take the answer, or failed TLS
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug must cost one connection, and be seen
            self._problem(type(e).__name__, "HTTP connection failed: %r", e)
        finally:
            conn.busy = False
            if clean:  # the answer is written: let it go out, for write_timeout at most
                writer.close()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(writer.wait_closed(), self.limits.write_timeout)
            conn.transport.abort()
            self.conns.discard(conn)
            self.freed.set()
            if task is not None:
                self.tasks.discard(task)

    async def _serve(self, conn: Conn, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> bool:
        """Answers requests until the connection should close; True if it ends cleanly."""
        wait = self.limits.read_header_timeout
        while True:
            try:
                request = await self._read_request(reader, wait)
            except Reply as e:
                conn.busy = True
                await self._send(conn, writer, e.status, TEXT,
                                 f"{REASONS[e.status]}\n".encode(), None, False)
                return True
            if request is None:
                return True
            conn.busy = True
            keep = await self._answer(conn, request, writer)
            if not keep:
                return True
            wait = self.limits.idle_timeout

    async def _read_request(self, reader: asyncio.StreamReader, idle: float) -> Request | None:
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
            raise Reply(408) from None
        except asyncio.LimitOverrunError:
            raise Reply(431) from None
        except asyncio.IncompleteReadError:
            return None
        return parse_head(first + rest)

    # --- answers --------------------------------------------------------------------
    async def _answer(self, conn: Conn, request: Request,
                      writer: asyncio.StreamWriter) -> bool:
        keep, head_only = request.keep_alive, request.method == "HEAD"
        status = await self._authorize(request)
        if status is not None:
            extra = 'WWW-Authenticate: Basic realm="dataloader-exporter"\r\n' if status == 401 \
                else "Retry-After: 1\r\n"
            await self._send(conn, writer, status, TEXT, b"Unauthorized\n" if status == 401
                             else b"Too many password checks\n", request, keep, extra,
                             head_only)
        elif request.path not in _PATHS:
            await self._send(conn, writer, 404, TEXT, b"404 page not found\n", request, keep,
                             head_only=head_only)
        elif request.method not in _METHODS:
            await self._send(conn, writer, 405, TEXT, b"Method Not Allowed\n", request, keep,
                             "Allow: GET, HEAD\r\n")
        elif request.path == "/":
            await self._send(conn, writer, 200, "text/html; charset=utf-8", self.index,
                             request, keep, head_only=head_only)
        elif request.path == "/-/healthy":
            await self._send(conn, writer, 200, TEXT, b"OK\n", request, keep,
                             head_only=head_only)
        else:
            await self._metrics(conn, request, writer, head_only)
        return keep

    async def _authorize(self, request: Request) -> int | None:
        """None when the request may pass, else the status to answer (401 or 429)."""
        web = self.web
        header = request.headers.get("authorization")
        if web is None or web.known(header):  # no users, or a cached success: no bcrypt
            return None
        if self.bcrypt_waiting >= _BCRYPT_QUEUE:
            return 429
        self.bcrypt_waiting += 1
        try:
            loop = asyncio.get_running_loop()
            ok = await loop.run_in_executor(self.bcrypt, web.authorized, header)
        finally:
            self.bcrypt_waiting -= 1
        return None if ok else 401

    async def _metrics(self, conn: Conn, request: Request, writer: asyncio.StreamWriter,
                       head_only: bool) -> None:
        openmetrics = accepts(request.headers.get("accept", ""), "application/openmetrics-text")
        gzipped = accepts(request.headers.get("accept-encoding", ""), "gzip")
        try:
            body = await asyncio.wait_for(self.flight.body((openmetrics, gzipped)),
                                          _scrape_timeout(request))
        except asyncio.TimeoutError:
            self._problem("slow", "a collection took longer than the scrape allows")
            await self._send(conn, writer, 503, TEXT, b"collection timed out\n", request,
                             request.keep_alive, head_only=head_only)
            return
        except Exception as e:
            self._problem("collect", "collecting metrics failed: %s", type(e).__name__)
            await self._send(conn, writer, 500, TEXT, b"error collecting metrics\n", request,
                             request.keep_alive, head_only=head_only)
            return
        self.failing.discard("collect")
        self.failing.discard("slow")
        extra = "Content-Encoding: gzip\r\n" if gzipped else ""
        await self._send(conn, writer, 200, content_type(openmetrics), body, request,
                         request.keep_alive, extra + "Vary: Accept, Accept-Encoding\r\n",
                         head_only)

    async def _send(self, conn: Conn, writer: asyncio.StreamWriter, status: int, ctype: str,
                    body: bytes, request: Request | None, keep_alive: bool, extra: str = "",
                    head_only: bool = False) -> None:
        writer.write(response_head(status, ctype, len(body), request, keep_alive,
                                   extra + self.extra_headers))
        if not head_only:
            writer.write(body)  # not head + body: that copies a 1 MB body per client
        # Waiting for the client to take it: evictable, as an idle connection is.
        conn.busy, conn.last = False, time.monotonic()
        self.freed.set()
        await asyncio.wait_for(writer.drain(), self.limits.write_timeout)

    def _problem(self, key: str, msg: str, *args: object) -> None:
        if key not in self.failing:
            self.failing.add(key)
            log.error(msg, *args)


def _scrape_timeout(request: Request) -> float:
    """The scrape's own timeout (Prometheus sends it), else _COLLECT_TIMEOUT."""
    try:
        return max(0.1, min(float(request.headers["x-prometheus-scrape-timeout-seconds"]),
                            _COLLECT_TIMEOUT))
    except (KeyError, ValueError):
        return _COLLECT_TIMEOUT
