"""In-process serving: the trainer's registry over real HTTP."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from support.helpers import parse
from support.torch_helpers import SleepDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat

pytestmark = pytest.mark.torch


def get(url: str, accept: str | None = None) -> tuple[int, str, str]:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def test_serve_exposes_the_loaders_metrics_and_the_usual_endpoints(
        registry: CollectorRegistry) -> None:
    handle = instrument.serve(0, addr="127.0.0.1", registry=registry)
    try:
        loader = instrument.DataLoader(SleepDataset(6), batch_size=2, name="t",
                                       registry=registry)
        for _ in loader:
            pass
        status, ctype, body = get(handle.url + "/metrics")
        assert status == 200 and ctype.startswith("text/plain")
        assert parse(body)[(cat.BATCHES.name, (("loader", "t"), ("rank", "0")))] == 3
        status, ctype, body = get(handle.url + "/metrics",
                                  "application/openmetrics-text; version=1.0.0")
        assert status == 200 and ctype.startswith("application/openmetrics-text")
        assert body.rstrip().endswith("# EOF")
        assert get(handle.url + "/")[0] == 200 and "/metrics" in get(handle.url + "/")[2]
        assert get(handle.url + "/-/healthy")[:1] == (200,)
        assert get(handle.url + "/nope")[0] == 404
    finally:
        handle.shutdown()


def test_a_taken_port_is_logged_and_the_loader_still_works(
        registry: CollectorRegistry, caplog: pytest.LogCaptureFixture) -> None:
    handle = instrument.serve(0, addr="0.0.0.0", registry=CollectorRegistry())
    try:
        loader = instrument.DataLoader(SleepDataset(4), batch_size=2, name="t",
                                       port=handle.port, registry=registry)
        assert len(list(loader)) == 2
        assert any("cannot serve metrics" in r.getMessage() for r in caplog.records)
    finally:
        handle.shutdown()


@pytest.mark.slow
def test_a_client_in_a_tight_loop_waits_its_turn_and_others_are_answered_at_once(
        registry: CollectorRegistry) -> None:
    """In-process pacing (exporter.web.server.IN_PROCESS): after a burst, a peer is answered
    once per peer_interval however fast it asks (waiting costs the training loop
    nothing), and another peer scraping once in a while is answered without waiting."""
    import http.client
    import threading
    import time

    from dataloader_exporter.exporter.web.server import IN_PROCESS

    handle = instrument.serve(0, addr="127.0.0.1", registry=registry)
    answered = 0
    latencies: list[float] = []
    stop = threading.Event()

    def tight() -> None:  # keep-alive, no pause: a `watch -n0 curl`
        nonlocal answered
        conn = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=30,
                                          source_address=("127.0.0.1", 0))
        while not stop.is_set():
            conn.request("GET", "/metrics")
            conn.getresponse().read()
            answered += 1
        conn.close()

    def occasional() -> None:  # another address, every half second: Prometheus
        while not stop.wait(0.5):
            conn = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=30,
                                              source_address=("127.0.0.2", 0))
            start = time.monotonic()
            conn.request("GET", "/metrics")
            assert conn.getresponse().status == 200
            latencies.append(time.monotonic() - start)
            conn.close()

    try:
        threads = [threading.Thread(target=tight), threading.Thread(target=occasional)]
        start = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(3.0)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        elapsed = time.monotonic() - start
    finally:
        handle.shutdown()
    # A burst, then one answer per peer_interval (and the one under way at the stop).
    most = IN_PROCESS.pace_burst + elapsed / IN_PROCESS.peer_interval + 2
    assert IN_PROCESS.pace_burst <= answered <= most, (answered, elapsed)
    # Never behind the tight client's queue: at most one turn of the global rate.
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies
