"""A flood of wrong passwords from many addresses must not lock out a scraper whose
password is right but not yet cached (a sidecar just restarted).

The flood tests run the real server (the one the sidecar runs) with loopback source
addresses (127.0.0.2 and up) as attackers and 127.0.0.1 as the good client; each of the
good client's scrapes is a new user, so every one of them needs a bcrypt check. The
queue and penalty tests drive exporter.web.basic_auth directly with an injected clock.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import http.client
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import bcrypt
import pytest
from prometheus_client import CollectorRegistry
from support.clock import Clock

from dataloader_exporter.exporter.web import webconfig
from dataloader_exporter.exporter.web.basic_auth import (
    BURST,
    MAX_LEVEL,
    PEERS,
    REFILL,
    CheckQueue,
    Failures,
)
from dataloader_exporter.exporter.web.server import serve

ATTACKERS = 16
SCRAPES = 10  # the good client's, one a second, each as a new user: never cached
COST = 6  # bcrypt cost: a few ms a check here, so that the flood keeps the thread busy


def connect(port: int, source: str) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", port, timeout=20, source_address=(source, 0))


def get(conn: http.client.HTTPConnection, user: str, password: str, path: str = "/-/healthy"
        ) -> tuple[int, float]:
    """(status, seconds) of one GET on `conn` (kept alive)."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    start = time.perf_counter()
    conn.request("GET", path, headers={"Authorization": f"Basic {token}"})
    response = conn.getresponse()
    response.read()
    return response.status, time.perf_counter() - start


@dataclass
class Flood:
    good: list[tuple[int, float]] = field(default_factory=list)  # (status, seconds)
    attacks: Counter[int] = field(default_factory=Counter)  # attackers' statuses
    addresses: int = 0  # attacker addresses used
    seconds: float = 0.0  # from the good client's first scrape to its last answer
    checks: int = 0  # bcrypt checks the server ran in that time
    busy: float = 0.0  # seconds the bcrypt thread spent on them

    def report(self) -> str:
        latencies = [s for _, s in self.good]
        return (f"good: {[s for s, _ in self.good]}, median {statistics.median(latencies):.3f} s, "
                f"max {max(latencies):.3f} s; attackers: {dict(self.attacks)} from "
                f"{self.addresses} addresses; {self.checks} checks in {self.seconds:.1f} s, "
                f"bcrypt busy {self.busy / self.seconds:.0%}")


def rotating(i: int) -> Iterator[str]:
    """Attacker i's fresh addresses, 127.(10+i).x.y: none of them known to the server."""
    return (f"127.{10 + i}.{x}.{y}" for x in range(256) for y in range(1, 255))


def flood(tmp_path: Path, rotate: bool) -> Flood:
    """ATTACKERS threads send wrong passwords without pause, each from 127.0.0.(2+i)
    (rotate=False) or from a fresh address whenever it is refused (rotate=True: no
    address stays long enough to be penalised), while the good client scrapes."""
    users = {f"sidecar{k}": f"right-{k}" for k in range(SCRAPES)}
    lines = ["basic_auth_users:"] + [
        f"  {u}: '{bcrypt.hashpw(p.encode(), bcrypt.gensalt(COST)).decode()}'"
        for u, p in {"prometheus": "right", **users}.items()]
    (tmp_path / "web.yml").write_text("\n".join(lines) + "\n")
    handle = serve(CollectorRegistry(), "127.0.0.1", 0,
                        web=webconfig.load(str(tmp_path / "web.yml")))
    result, stop, lock = Flood(), threading.Event(), threading.Lock()
    answered = [threading.Event() for _ in range(ATTACKERS)]

    def attack(i: int) -> None:
        addresses = rotating(i) if rotate else iter([f"127.0.0.{2 + i}"])
        conn, used = connect(handle.port, next(addresses)), 1
        while not stop.is_set():
            status, _ = get(conn, "prometheus", "wrong")  # kept alive: no pause between
            with lock:
                result.attacks[status] += 1
            if status == 401:
                answered[i].set()
            if status == 429 and rotate:
                conn.close()
                conn, used = connect(handle.port, next(addresses)), used + 1
        conn.close()
        with lock:
            result.addresses += used

    threads = [threading.Thread(target=attack, args=(i,)) for i in range(ATTACKERS)]
    checks = getattr(handle._server, "checks", None)
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        for e in answered:  # every attacker has failed once: the flood is on
            assert e.wait(max(0.0, deadline - time.monotonic())), "the flood never started"
        ran, busy = (checks.ran, checks.busy) if checks else (0, 0.0)
        begin = time.monotonic()
        for k in range(SCRAPES):
            time.sleep(max(0.0, begin + k - time.monotonic()))  # pacing, once a second
            conn = connect(handle.port, "127.0.0.1")  # a new connection, as after a restart
            try:
                result.good.append(get(conn, f"sidecar{k}", f"right-{k}", "/metrics"))
            finally:
                conn.close()
        result.seconds = time.monotonic() - begin
        if checks:
            result.checks, result.busy = checks.ran - ran, checks.busy - busy
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        handle.shutdown()
    print(result.report())
    return result


@pytest.mark.slow
def test_sixteen_addresses_flooding_wrong_passwords_cannot_lock_out_a_cold_scraper(
        tmp_path: Path) -> None:
    result = flood(tmp_path, rotate=False)
    assert [s for s, _ in result.good] == [200] * SCRAPES, result.report()
    assert max(s for _, s in result.good) < 1.0, result.report()
    # Each address is refused once it has failed a few times, so the flood costs few checks.
    assert result.attacks[429] > 10 * result.attacks[401], result.report()
    assert result.attacks[401] <= ATTACKERS * (BURST + MAX_LEVEL + 2), result.report()


@pytest.mark.slow
def test_a_flood_from_ever_new_addresses_keeps_bcrypt_busy_but_a_cold_scraper_is_served(
        tmp_path: Path) -> None:
    result = flood(tmp_path, rotate=True)
    assert [s for s, _ in result.good] == [200] * SCRAPES, result.report()
    assert max(s for _, s in result.good) < 2.0, result.report()
    assert result.busy > 0.5 * result.seconds, result.report()  # the flood saturates bcrypt


# --- the queue and the penalties, with an injected clock ---------------------------------

def test_a_peer_may_fail_a_few_times_then_waits_longer_each_time_it_runs_dry(clock: Clock) -> None:
    failures = Failures(clock=clock)
    for _ in range(BURST):
        assert failures.wait("a") == 0.0
        failures.failed("a")
    waits = []
    for _ in range(MAX_LEVEL + 2):
        waits.append(failures.wait("a"))
        clock.now += waits[-1]
        assert failures.wait("a") == 0.0
        failures.failed("a")
    assert waits == [REFILL * 2 ** min(n, MAX_LEVEL) for n in range(1, MAX_LEVEL + 3)]
    assert failures.score("a") > failures.score("b") == 0.0
    failures.passed("a")  # it knows a password after all
    assert failures.score("a") == 0.0 and failures.wait("a") == 0.0


def test_a_wrong_password_scraped_every_second_always_gets_its_check(clock: Clock) -> None:
    failures = Failures(clock=clock)
    for _ in range(100):
        assert failures.wait("prometheus") == 0.0
        failures.failed("prometheus")
        clock.now += REFILL
    assert failures.score("prometheus") == 0.0  # a full allowance again: nothing on record


def test_a_calm_peer_is_forgiven_and_the_record_is_bounded(clock: Clock) -> None:
    failures = Failures(size=PEERS, clock=clock)
    for _ in range(BURST + 3):
        clock.now += failures.wait("a")
        failures.failed("a")
    clock.now += BURST * REFILL * 2 ** MAX_LEVEL
    assert failures.score("a") == 0.0 and failures.wait("a") == 0.0
    for n in range(PEERS + 10):
        failures.failed(f"10.0.{n // 256}.{n % 256}")
    assert len(failures) == PEERS and failures.score("10.0.0.0") == 0.0


def run_queue(peers: list[str], failures: Failures, size: int
              ) -> tuple[list[str], list[bool | None]]:
    """Holds the bcrypt thread with a first check, queues `peers` in order (each a
    failing check), then lets it go: the order the checks ran and each one's answer."""
    order: list[str] = []
    held = threading.Event()

    def record(peer: str) -> bool:
        order.append(peer)
        return False

    async def main() -> list[bool | None]:
        with ThreadPoolExecutor(1) as executor:
            queue = CheckQueue(executor, size, failures)
            first = asyncio.ensure_future(queue.check("holder", lambda: held.wait(10)))
            await asyncio.sleep(0)
            tasks = []
            for p in peers:
                tasks.append(asyncio.ensure_future(queue.check(p, functools.partial(record, p))))
                await asyncio.sleep(0)
            held.set()
            assert await first
            return [await t for t in tasks]

    return order, asyncio.run(main())


def test_peers_without_failures_are_checked_first_and_push_the_worst_out_of_a_full_queue(
        clock: Clock) -> None:
    failures = Failures(clock=clock)
    for peer, n in (("bad1", 1), ("bad2", 2), ("bad3", 3)):
        for _ in range(n):
            failures.failed(peer)
    order, answers = run_queue(["bad3", "bad1", "bad2", "fresh1", "fresh2"], failures, size=4)
    assert order == ["fresh1", "fresh2", "bad1", "bad2"]
    assert answers == [None, False, False, False, False]  # bad3 pushed out: 429
    assert failures.wait("bad3") == 0.0 and failures.score("bad3") == 3  # refused: not failed


def test_one_check_per_peer_and_none_for_a_peer_out_of_allowance_or_a_full_queue(
        clock: Clock) -> None:
    failures = Failures(clock=clock)
    for _ in range(BURST):
        failures.failed("dry")
    order, answers = run_queue(["a", "a", "dry", "b", "c"], failures, size=2)
    assert order == ["a", "b"]
    assert answers == [False, None, None, False, None]


def test_a_check_counts_for_its_peer_even_when_its_client_has_gone(clock: Clock) -> None:
    failures = Failures(clock=clock)
    held = threading.Event()

    async def main() -> None:
        with ThreadPoolExecutor(1) as executor:
            queue = CheckQueue(executor, 4, failures)
            running = asyncio.ensure_future(queue.check("a", lambda: not held.wait(10)))
            waiting = asyncio.ensure_future(queue.check("b", lambda: False))
            await asyncio.sleep(0)
            running.cancel()
            waiting.cancel()
            await asyncio.sleep(0)
            assert queue.waiting == [] and queue.peers == {"a"}  # b's place is freed at once
            held.set()
            deadline = time.monotonic() + 10
            while queue.peers and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert not queue.peers and not queue.running and queue.ran == 1

    asyncio.run(main())
    assert failures.score("a") == 1 and failures.score("b") == 0
