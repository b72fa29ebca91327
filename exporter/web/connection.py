"""One connection's life: admission under the cap (evicting the connection idle longest),
TLS, reading request heads, pacing, authorizing, answering, and closing without lingering.

exporter.web.server starts the server and says why each bound is what it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, cast

from prometheus_client import CollectorRegistry

from dataloader_exporter import __version__
from dataloader_exporter.core.logonce import LogOnce
from dataloader_exporter.exporter.scrape import SingleFlight, content_type
from dataloader_exporter.exporter.web.limits import WAITERS, Limits
from dataloader_exporter.exporter.web.pacer import Pacer
from dataloader_exporter.exporter.web.wire import (
    REASONS,
    TEXT,
    Reply,
    Request,
    accepts,
    parse_head,
    response_head,
)

if TYPE_CHECKING:
    from dataloader_exporter.exporter.web.basic_auth import CheckQueue
    from dataloader_exporter.exporter.web.webconfig import WebConfig

log = logging.getLogger("dataloader_exporter.exporter")

_INDEX = """<!doctype html>
<html><head><title>dataloader-exporter</title></head>
<body><h1>dataloader-exporter {version}</h1>
<p>PyTorch DataLoader, GPU, /dev/shm and host metrics for Prometheus.</p>
<p><a href="/metrics">Metrics</a></p></body></html>
"""
_PATHS = ("/metrics", "/", "/-/healthy")
_METHODS = ("GET", "HEAD")
_BCRYPT_QUEUE = 16  # password checks waiting at most, one per peer; more get 429
_COLLECT_TIMEOUT = 30.0  # without Prometheus's X-Prometheus-Scrape-Timeout-Seconds


NEW, IDLE, BUSY, DRAINING = "new", "idle", "busy", "draining"
# A connection admitted after waiting for a slot (its client sends a request within
# milliseconds) or whose answer has just been written (its client is reading it) is not
# evicted before this: waiters cannot knock each other out, nor cut off an answer.
_GRACE = 0.5
_POLL = 0.05  # how often a waiting newcomer looks for a slot


class Conn:
    """One client connection: new (no request yet, or its TLS handshake), idle (kept
    alive, between requests), busy (a request being answered: never evicted) or
    draining (its answer written, the client reading it)."""

    __slots__ = ("since", "state", "task", "transport", "waited")

    def __init__(self, transport: asyncio.BaseTransport, task: asyncio.Task[None] | None
                 ) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.task = task
        self.state = NEW
        self.since = time.monotonic()
        self.waited = False

    def set(self, state: str) -> None:
        self.state, self.since = state, time.monotonic()


class Server:
    """The state of one HTTP server shared by its connections (run on its event loop):
    the connections admitted under the cap, the pacer, the password check queue and the
    collection shared by concurrent scrapes."""

    def __init__(self, registry: CollectorRegistry, limits: Limits, cap: int,
                 web: WebConfig | None) -> None:
        self.limits = limits
        self.cap = cap
        self.web = web
        self.tls = web.ssl_context() if web is not None else None
        self.executor = ThreadPoolExecutor(4, thread_name_prefix="dataloader-exporter-scrape")
        self.bcrypt = ThreadPoolExecutor(1, thread_name_prefix="dataloader-exporter-auth")
        self.checks: CheckQueue | None = None  # password checks: fair, bounded
        if web is not None:
            from dataloader_exporter.exporter.web.basic_auth import (
                CheckQueue,  # with its bcrypt: loaded by web already
            )
            self.checks = CheckQueue(self.bcrypt, _BCRYPT_QUEUE)
        self.flight = SingleFlight(registry, self.executor)
        self.conns: set[Conn] = set()  # admitted, counted against the cap
        self.tracked: set[Conn] = set()  # every connection, waiting ones too (shutdown)
        self.closing = False
        self.index = _INDEX.format(version=__version__).encode()
        self.extra_headers = "".join(f"{k}: {v}\r\n" for k, v in (web.headers.items()
                                                                    if web else ()))
        self.log = LogOnce(log, logging.ERROR)
        self.waiting = 0  # newcomers waiting for a slot
        self.pacer = Pacer(limits)

    # --- connections --------------------------------------------------------------
    def _victim(self) -> Conn | None:
        """The connection to evict: the one idle longest (kept alive between requests, or
        new without a request yet), else the oldest draining one past its grace; never a
        busy one, nor one admitted from the wait within its grace."""
        now, idle, late = time.monotonic(), [], []
        for c in self.conns:
            fresh = now - c.since < _GRACE
            if c.state == IDLE or (c.state == NEW and not (c.waited and fresh)):
                idle.append(c)
            elif c.state == DRAINING and not fresh:
                late.append(c)
        pool = idle or late
        return min(pool, key=lambda c: c.since) if pool else None

    def _admit(self, conn: Conn) -> bool:
        if len(self.conns) >= self.cap:
            victim = self._victim()
            if victim is None:
                return False
            self.conns.discard(victim)
            if victim.task is not None:
                victim.task.cancel()  # its finally aborts it (also mid-TLS-handshake)
            else:
                victim.transport.abort()
        conn.set(NEW)
        self.conns.add(conn)
        return True

    async def _wait_for_slot(self, conn: Conn) -> bool:
        """Admits `conn`, waiting (read_header_timeout at most) while no connection can
        be evicted; at most WAITERS newcomers wait, the others are refused at once."""
        if self._admit(conn):
            return True
        if self.waiting >= WAITERS:
            return False
        deadline = time.monotonic() + self.limits.read_header_timeout
        self.waiting += 1
        try:
            while not self.closing and time.monotonic() < deadline:
                await asyncio.sleep(_POLL)
                if self._admit(conn):
                    conn.waited = True
                    return True
            return False
        finally:
            self.waiting -= 1

    async def connection(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        conn = Conn(writer.transport, asyncio.current_task())
        self.tracked.add(conn)
        clean = False
        try:
            if self.closing:
                return
            if self.tls is not None:
                conn.transport.pause_reading()  # the ClientHello is start_tls's to read
            if not await self._wait_for_slot(conn):
                return  # no slot came free: refused
            if self.tls is not None:
                await writer.start_tls(self.tls,
                                       ssl_handshake_timeout=self.limits.read_header_timeout)
                conn.transport = cast(asyncio.Transport, writer.transport)
            clean = await self._serve(conn, reader, writer)
        except (TimeoutError, ConnectionError, ssl.SSLError, OSError,
                asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client went away, would not take the answer, failed TLS; evicted
        except Exception as e:  # a bug must cost one connection, and be seen
            self.log.problem(type(e).__name__, "HTTP connection failed: %r", e)
        finally:
            conn.set(DRAINING)
            if clean and not self.closing:  # let the answer go out, write_timeout at most
                writer.close()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(writer.wait_closed(), self.limits.write_timeout)
            conn.transport.abort()
            self.conns.discard(conn)
            self.tracked.discard(conn)

    async def _serve(self, conn: Conn, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> bool:
        """Answers requests until the connection should close; True if it ends cleanly."""
        wait = self.limits.read_header_timeout
        while True:
            try:
                request = await self._read_request(reader, wait)
            except Reply as e:
                conn.set(BUSY)
                await self._send(conn, writer, e.status, TEXT,
                                 f"{REASONS[e.status]}\n".encode(), None, False)
                return True
            if request is None:
                return True
            conn.set(BUSY)
            await self.pacer.wait(_peer(writer))
            keep = await self._answer(conn, request, writer)
            if not keep:
                return True
            conn.set(IDLE)
            wait = self.limits.idle_timeout

    async def _read_request(self, reader: asyncio.StreamReader, idle: float) -> Request | None:
        """The next request head, None when the client closed or stayed idle."""
        try:
            first = await asyncio.wait_for(reader.read(1), idle)
        except TimeoutError:
            return None
        if not first:
            return None
        try:
            rest = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"),
                                          self.limits.read_header_timeout)
        except TimeoutError:
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
        status = await self._authorize(request, _peer(writer))
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

    async def _authorize(self, request: Request, peer: str) -> int | None:
        """None when the request may pass, else the status to answer (401 or 429).

        Password checks wait in a fair queue (exporter.web.basic_auth.CheckQueue): one
        per peer address, _BCRYPT_QUEUE in all, peers with no recent failure first,
        and an address that keeps failing is refused, ever longer."""
        web, checks = self.web, self.checks
        header = request.headers.get("authorization")
        if web is None or checks is None or web.known(header):  # no users, or cached
            return None
        # loaded with the web config
        from dataloader_exporter.exporter.web.basic_auth import parse_basic

        if parse_basic(header) is None:  # no credentials: no check, nothing to count
            return 401
        ok = await checks.check(peer, functools.partial(web.authorized, header))
        return 429 if ok is None else None if ok else 401

    async def _metrics(self, conn: Conn, request: Request, writer: asyncio.StreamWriter,
                       head_only: bool) -> None:
        openmetrics = accepts(request.headers.get("accept", ""), "application/openmetrics-text")
        gzipped = accepts(request.headers.get("accept-encoding", ""), "gzip")
        try:
            body = await asyncio.wait_for(self.flight.body((openmetrics, gzipped)),
                                          _scrape_timeout(request))
        except TimeoutError:
            self.log.problem("slow", "a collection took longer than the scrape allows")
            await self._send(conn, writer, 503, TEXT, b"collection timed out\n", request,
                             request.keep_alive, head_only=head_only)
            return
        except Exception as e:
            self.log.problem("collect", "collecting metrics failed: %s", type(e).__name__)
            await self._send(conn, writer, 500, TEXT, b"error collecting metrics\n", request,
                             request.keep_alive, head_only=head_only)
            return
        self.log.cleared("collect")
        self.log.cleared("slow")
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
        # Waiting for the client to take it: evictable once past its grace.
        conn.set(DRAINING)
        await asyncio.wait_for(writer.drain(), self.limits.write_timeout)


def _peer(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "?"


def _scrape_timeout(request: Request) -> float:
    """The scrape's own timeout (Prometheus sends it), else _COLLECT_TIMEOUT."""
    try:
        return max(0.1, min(float(request.headers["x-prometheus-scrape-timeout-seconds"]),
                            _COLLECT_TIMEOUT))
    except (KeyError, ValueError):
        return _COLLECT_TIMEOUT
