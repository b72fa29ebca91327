"""The HTTP server under hostile and heavy clients: the real sidecar over 127.0.0.1.

Each test starts `dataloader-exporter serve` as a process (stopped by its pid) with short
timeouts, and talks raw HTTP/1.1 over sockets where urllib would hide what the server did.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import shutil
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families
from support.helpers import deadline_poll
from support.procs import Exporter, http_get

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.exporter.scrape import SingleFlight

FAST = ("--no-collector.gpu", "--web.read-header-timeout=1s", "--web.idle-timeout=1s")


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real snapshot files of 4 ranks, written by the real instrumentation."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from _snapshots import write_rank_files

    directory = tmp_path_factory.mktemp("snapshots")
    write_rank_files(directory, ranks=4, loaders=("train", "val"), batches=2)
    return directory


@contextlib.contextmanager
def exporter(*args: str, max_files: int | None = None) -> Iterator[Exporter]:
    exp = Exporter(*args, max_files=max_files)
    try:
        yield exp
    finally:
        exp.stop()


def request(address: str, raw: bytes, timeout: float = 10.0) -> bytes:
    """Sends one raw request and reads until the server closes the connection."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(raw)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def head_and_body(response: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return lines[0], headers, body


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def closed_by_server(s: socket.socket, timeout: float) -> bool:
    """Whether the server closes `s` within `timeout` (what it sent before is ignored)."""
    s.settimeout(timeout)
    try:
        while s.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def get(path: str, method: str = "GET", extra: str = "") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\n{extra}Connection: close\r\n\r\n"
            ).encode()


@pytest.mark.torch  # the `snapshots` fixture runs 4 ranks' trainers
@pytest.mark.slow
def test_head_sends_the_headers_of_get_without_a_body_and_other_methods_get_405(
        snapshots: Path) -> None:
    with exporter(*FAST, f"--metrics-dir={snapshots}") as exp:
        for path in ("/metrics", "/", "/-/healthy"):
            status, headers, body = head_and_body(request(exp.address, get(path)))
            assert status == "HTTP/1.1 200 OK" and int(headers["content-length"]) == len(body)
            status, head_headers, head_body = head_and_body(
                request(exp.address, get(path, "HEAD")))
            assert status == "HTTP/1.1 200 OK" and head_body == b""
            assert head_headers["content-type"] == headers["content-type"]
            if path != "/metrics":  # the metrics' length changes from scrape to scrape
                assert head_headers["content-length"] == headers["content-length"]
            for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
                status, headers, _ = head_and_body(request(
                    exp.address, get(path, method, "Content-Length: 3\r\n") + b"a=b"))
                assert status == "HTTP/1.1 405 Method Not Allowed", (method, path)
                assert headers["allow"] == "GET, HEAD"
        status, _, _ = head_and_body(request(exp.address, get("/nope")))
        assert status == "HTTP/1.1 404 Not Found"
        # gzip only when it is accepted (q=0 refuses it); HTTP/1.0 keep-alive is said so.
        _, headers, _ = head_and_body(request(exp.address, get(
            "/metrics", extra="Accept-Encoding: gzip;q=0, identity\r\n")))
        assert "content-encoding" not in headers
        _, headers, _ = head_and_body(request(exp.address, get(
            "/metrics", extra="Accept-Encoding: br, gzip\r\n")))
        assert headers["content-encoding"] == "gzip"
        with connect(exp.address) as s:
            s.sendall(b"GET /-/healthy HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            assert b"\r\nConnection: keep-alive\r\n" in s.recv(4096)
        status, _, _ = head_and_body(request(exp.address, b"NONSENSE\r\n\r\n"))
        assert status == "HTTP/1.1 400 Bad Request"


@pytest.mark.torch  # the `snapshots` fixture runs 4 ranks' trainers
@pytest.mark.slow
def test_idle_and_slow_clients_are_closed_after_the_timeouts_while_scrapes_are_served(
        snapshots: Path) -> None:
    with exporter(*FAST, f"--metrics-dir={snapshots}") as exp:
        idle = [connect(exp.address) for _ in range(10)]
        slow = [connect(exp.address) for _ in range(10)]
        kept = connect(exp.address)  # one request, then idle on a kept-alive connection
        kept.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
        assert kept.recv(4096).startswith(b"HTTP/1.1 200 OK")
        stop = threading.Event()

        def drip() -> None:  # slowloris: a byte of an endless request head now and then
            n = 0
            while not stop.is_set():
                for s in slow:
                    with contextlib.suppress(OSError):
                        s.sendall(b"GET /metrics HTTP/1.1\r\n"[n % 24:n % 24 + 1])
                n += 1
                stop.wait(0.1)

        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        try:
            scrapes = 0
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:  # served all along
                assert cat.BATCHES.name in exp.metrics()
                scrapes += 1
            assert scrapes > 3
            for s in [*idle, kept]:
                assert closed_by_server(s, 5), "idle connection not closed"
            for s in slow:
                assert closed_by_server(s, 5), "slow connection not closed"
        finally:
            stop.set()
            dripper.join()
            for s in [*idle, *slow, kept]:
                s.close()
        deadline_poll(lambda: exp_connections(exp) == 0, 5)


def exp_connections(exp: Exporter) -> int:
    """Established TCP connections on the exporter's port, its side (/proc/net/tcp)."""
    port = f":{int(exp.address.rsplit(':', 1)[1]):04X}"
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        count += local.endswith(port) and state == "01"
    return count


def raise_own_file_limit(wanted: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


@pytest.mark.torch  # the `snapshots` fixture runs 4 ranks' trainers
@pytest.mark.slow
def test_a_thousand_idle_connections_leave_scrapes_answered_and_resources_bounded(
        snapshots: Path) -> None:
    n = min(1000, raise_own_file_limit(1200) - 100)
    assert shutil.which("prlimit"), "util-linux prlimit"
    # 256 descriptors in all, as in a small container: 300 idle connections must not
    # starve the server of descriptors and time out every scrape.
    with exporter("--no-collector.gpu", f"--metrics-dir={snapshots}", max_files=256) as exp:
        pid = exp.proc.pid
        base_threads, base_files = threads(pid), open_files(pid)
        held = []
        try:
            for _ in range(n):
                held.append(connect(exp.address))
            start = time.monotonic()
            body = exp.metrics()
            assert cat.BATCHES.name in body
            assert time.monotonic() - start < 3  # the target, 1 s, is the benchmark's
            # The cap under 256 descriptors is 256 - 64 - 100 = 92 connections.
            assert open_files(pid) <= base_files + 92 + 8
            assert threads(pid) <= base_threads + 5  # the scrape pool, not one per client
            # Evicted connections were closed by the server, not left half-open.
            closed = sum(closed_by_server(s, 0.01) for s in held[:50])
            assert closed == 50
        finally:
            for s in held:
                s.close()


@pytest.mark.torch  # the `snapshots` fixture runs 4 ranks' trainers
@pytest.mark.slow
def test_over_the_connection_cap_the_longest_idle_connection_makes_way(
        snapshots: Path) -> None:
    with exporter("--no-collector.gpu", f"--metrics-dir={snapshots}",
                  "--web.max-connections=5") as exp:
        first = [connect(exp.address) for _ in range(5)]
        deadline_poll(lambda: exp_connections(exp) == 5, 5)
        newest = connect(exp.address)
        assert closed_by_server(first[0], 5)  # the oldest made way ...
        newest.sendall(get("/-/healthy"))
        assert newest.recv(4096).startswith(b"HTTP/1.1 200 OK")  # ... for the newcomer
        assert exp_connections(exp) <= 5
        for s in [*first, newest]:
            s.close()


@pytest.mark.torch  # the `snapshots` fixture runs 4 ranks' trainers
@pytest.mark.slow
def test_clients_that_never_read_their_answers_cannot_lock_out_a_scrape(
        snapshots: Path) -> None:
    with exporter("--no-collector.gpu", f"--metrics-dir={snapshots}",
                  "--web.max-connections=4") as exp:
        hogs = [connect(exp.address) for _ in range(4)]
        pipelined = get("/metrics").replace(b"Connection: close\r\n", b"") * 200
        for s in hogs:  # answers pile up unread until the server's buffer is full
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            with contextlib.suppress(OSError):
                s.sendall(pipelined)
        deadline_poll(lambda: exp_connections(exp) == 4, 5)
        start = time.monotonic()
        assert cat.BATCHES.name in exp.metrics()  # a hog waiting on its reader made way
        assert time.monotonic() - start < 5
        assert exp_connections(exp) <= 4
        for s in hogs:
            s.close()
        deadline_poll(lambda: exp_connections(exp) == 0, 10)  # nothing lingers


@pytest.mark.torch  # the `snapshots` fixture runs 4 ranks' trainers
@pytest.mark.slow
def test_fifty_concurrent_clients_get_valid_bodies_from_shared_collections(
        snapshots: Path) -> None:
    clients, per_client = 50, 10
    with exporter(*FAST, f"--metrics-dir={snapshots}") as exp:
        before = collections(exp.metrics())
        barrier = threading.Barrier(clients)

        def scrape(i: int) -> list[str]:
            barrier.wait()
            bodies = []
            for _ in range(per_client):
                accept = "Accept: application/openmetrics-text; version=1.0.0\r\n" if i % 2 \
                    else ""
                status, _, body = head_and_body(request(exp.address, get("/metrics",
                                                                         extra=accept)))
                assert status == "HTTP/1.1 200 OK"
                bodies.append((i % 2, body.decode()))
            return bodies

        with ThreadPoolExecutor(clients) as pool:
            results = [b for bodies in pool.map(scrape, range(clients)) for b in bodies]
        assert len(results) == clients * per_client
        for openmetrics, body in results:
            parse = om_parse if openmetrics else text_string_to_metric_families
            names = {f.name for f in parse(body)}
            assert cat.BATCHES.family in names
        ran = collections(exp.metrics()) - before - 1
        assert 0 < ran < clients * per_client  # shared, not one per scrape


def collections(body: str) -> float:
    for family in text_string_to_metric_families(body):
        if family.name == cat.COLLECTIONS.family:
            return float(family.samples[0].value)
    raise AssertionError("no collections counter")


def test_concurrent_scrapes_join_the_collection_in_flight() -> None:
    """Ten scrapes arrive while one collection runs: one collection serves them all."""
    registry = CollectorRegistry()
    Counter("answers", "Answers.", registry=registry).inc()
    gate, calls = threading.Event(), []

    def slow_collect(reg: CollectorRegistry) -> list:
        calls.append(1)
        gate.wait(5)
        return list(reg.collect())

    async def scrapes() -> list[bytes]:
        with ThreadPoolExecutor(4) as pool:
            flight = SingleFlight(registry, pool, slow_collect)
            tasks = [asyncio.ensure_future(flight.body((i % 2 == 1, False)))
                     for i in range(10)]
            await asyncio.sleep(0)  # every task has joined before the gate opens
            gate.set()
            bodies = await asyncio.gather(*tasks)
            after = await flight.body((False, False))  # a later scrape: a fresh collection
            return [*bodies, after]

    bodies = asyncio.run(scrapes())
    assert len(calls) == 2
    assert all(b"answers_total 1.0" in b for b in bodies)
    assert bodies[0] is bodies[2]  # the same format is encoded once per collection


@pytest.mark.torch  # the `snapshots` fixture runs 4 ranks' trainers
@pytest.mark.slow
def test_a_symlinked_secret_never_reaches_the_log_and_a_bad_file_counts_once(
        snapshots: Path, tmp_path: Path) -> None:
    directory = tmp_path / "metrics"
    directory.mkdir()
    for path in snapshots.glob("*.prom"):
        (directory / path.name).write_bytes(path.read_bytes())
    secret = tmp_path / "secret.env"
    secret.write_text("API_TOKEN=hunter2\n")
    (directory / "x.prom").symlink_to(secret)
    (directory / "y.prom").write_text("API_TOKEN=hunter2\n")  # a regular file, not the format
    with exporter(*FAST, f"--metrics-dir={directory}", "--log.level=debug") as exp:
        bodies = [exp.metrics() for _ in range(5)]
        assert all(cat.BATCHES.name in b and "hunter2" not in b for b in bodies)
        errors = {s.labels["reason"]: s.value for f in text_string_to_metric_families(bodies[-1])
                  if f.name == cat.SNAPSHOT_ERRORS.family for s in f.samples}
        assert errors["not_regular"] == 1 and errors["malformed"] == 1  # once, not per scrape
    log = "".join(exp.lines)
    assert "hunter2" not in log and "API_TOKEN" not in log
    assert "'x.prom'" in log and "'y.prom'" in log  # named, with the reason


class Gate:
    """A collector that blocks every collection until opened: scrapes stay busy."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def collect(self):  # type: ignore[no-untyped-def]
        self.open.wait(20)
        yield from ()


@contextlib.contextmanager
def gated_server(cap: int, web_file: Path | None = None) -> Iterator[tuple[Gate, object]]:
    from dataloader_exporter.exporter.web import webconfig
    from dataloader_exporter.exporter.web.server import Limits, serve

    registry, gate = CollectorRegistry(), Gate()
    registry.register(gate)  # type: ignore[arg-type]
    web = webconfig.load(str(web_file)) if web_file is not None else None
    handle = serve(registry, "127.0.0.1", 0, web, Limits(max_connections=cap,
                                                          read_header_timeout=5))
    try:
        yield gate, handle
    finally:
        gate.open.set()
        handle.shutdown()


def fetch_status(url: str, ctx: ssl.SSLContext | None = None) -> int:
    return http_get(url, 15, ctx)[0]


def test_newcomers_wait_for_busy_slots_and_are_all_served_in_turn_over_tls(
        tmp_path: Path) -> None:

    from support.tls import make_tls_files

    tls = make_tls_files(tmp_path / "tls")
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {tls.server_cert}\n"
                   f"  key_file: {tls.server_key}\n")
    ctx = ssl.create_default_context(cafile=str(tls.ca_cert))
    with gated_server(4, web) as (gate, handle), ThreadPoolExecutor(7) as pool:
        url = handle.url + "/metrics"  # type: ignore[attr-defined]
        busy = [pool.submit(fetch_status, url, ctx) for _ in range(4)]  # 4: the least cap
        deadline_poll(lambda: len(handle._server.conns) == 4 and all(  # type: ignore
            c.state == "busy" for c in handle._server.conns), 10)  # type: ignore[attr-defined]
        waiters = [pool.submit(fetch_status, url, ctx) for _ in range(3)]
        deadline_poll(lambda: handle._server.waiting == 3, 10)  # type: ignore[attr-defined]
        gate.open.set()
        # Each waiter takes a freed slot and keeps it through its TLS handshake.
        assert [f.result() for f in busy + waiters] == [200] * 7


def test_shutdown_closes_newcomers_still_waiting_for_a_slot() -> None:
    with gated_server(4) as (_gate, handle), ThreadPoolExecutor(4) as pool:
        host, port = handle.host, handle.port  # type: ignore[attr-defined]
        busy = [pool.submit(fetch_status, handle.url + "/metrics")  # type: ignore[attr-defined]
                for _ in range(4)]
        deadline_poll(lambda: len(handle._server.conns) == 4, 10)  # type: ignore[attr-defined]
        with socket.create_connection((host, port), timeout=10) as waiter:
            waiter.sendall(get("/-/healthy"))
            deadline_poll(lambda: handle._server.waiting == 1, 10)  # type: ignore[attr-defined]
            start = time.monotonic()
            handle.shutdown()  # type: ignore[attr-defined]
            assert time.monotonic() - start < 3
            assert closed_by_server(waiter, 5)
            assert not handle._server.tracked  # type: ignore[attr-defined]
        for f in busy:
            with contextlib.suppress(OSError):
                f.result()


def test_evicting_connections_that_never_start_tls_is_quiet(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:

    from support.tls import make_tls_files

    tls = make_tls_files(tmp_path / "tls")
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {tls.server_cert}\n"
                   f"  key_file: {tls.server_key}\n")
    ctx = ssl.create_default_context(cafile=str(tls.ca_cert))
    with gated_server(4, web) as (gate, handle):
        gate.open.set()
        host, port = handle.host, handle.port  # type: ignore[attr-defined]
        held = [socket.create_connection((host, port), timeout=10) for _ in range(40)]
        try:
            assert fetch_status(handle.url + "/metrics", ctx) == 200  # type: ignore[attr-defined]
        finally:
            for s in held:
                s.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
