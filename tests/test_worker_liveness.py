"""A killed worker shows up in the metrics, and torch's own error still reaches the loop."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from prometheus_client import CollectorRegistry
from support.helpers import parse, refreshes, value
from support.torch_helpers import FailingDataset, SleepDataset
from torch.utils.data import IterableDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.instrument import compat

pytestmark = [pytest.mark.torch, pytest.mark.slow]

L = {"loader": "t", "rank": "0"}


def test_a_sigkilled_worker_shows_as_one_fewer_active_within_two_seconds(
        registry: CollectorRegistry) -> None:
    # Earlier tests' iterators left in reference cycles (a raised exception's frames hold
    # them, torch's or not) go now: collected in the scraper's thread below, each would
    # hold its scrape for seconds while torch joins its workers.
    gc.collect()
    # Slow samples, so the victim is killed while it works on a sample rather than while
    # handing one over (torch then fails with EOFError from its fd-passing instead).
    loader = instrument.DataLoader(SleepDataset(40, 0.3), batch_size=1, num_workers=2,
                                   persistent_workers=True, name="t", registry=registry)
    it = iter(loader)
    next(it)
    assert value(registry, cat.WORKERS_ACTIVE.name, **L) == 2
    seen_at: list[float] = []

    def scraper() -> None:  # a scrape from another thread, as the snapshot writer does
        end = time.monotonic() + 5
        while time.monotonic() < end and not seen_at:
            if value(registry, cat.WORKERS_ACTIVE.name, **L) == 1:
                seen_at.append(time.monotonic())
            time.sleep(0.05)

    victim = compat.worker_pids(it)[0]  # this loader's worker, not another test's
    poller = threading.Thread(target=scraper)
    poller.start()
    killed_at = time.monotonic()
    # torch's SIGCHLD handler raises its error in the main thread wherever it is. Let it
    # land in a sleep: raised inside torch's queue code it can leave a lock held, and the
    # iterator's shutdown then hangs (a hazard of torch's, with or without this library).
    with pytest.raises(RuntimeError) as signalled:
        os.kill(victim, signal.SIGKILL)
        time.sleep(10)
    assert f"DataLoader worker (pid {victim}) is killed by signal" in str(signalled.value)
    # The loop then gets torch's own error from its queue checks, unchanged.
    with pytest.raises(RuntimeError) as err:
        for _ in it:
            pass
    assert f"DataLoader worker (pid(s) {victim}) exited unexpectedly" in str(err.value)
    poller.join()
    assert seen_at and seen_at[0] - killed_at < 2.0
    assert value(registry, cat.WORKERS_LOST.name, **L) == 1
    assert value(registry, cat.WORKERS_CONFIGURED.name, **L) == 2
    # Shut the iterator down now: torch's SIGCHLD handler would otherwise raise the same
    # error again in whatever test runs next.
    del err, signalled, it, loader
    gc.collect()


def test_workers_that_exit_cleanly_are_not_counted_as_lost(
        registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(6), batch_size=2, num_workers=2, name="t",
                                   registry=registry)
    for _ in range(2):
        for _ in loader:
            value(registry, cat.WORKERS_ACTIVE.name, **L)  # refresh mid-epoch
    for _ in range(3):  # several refreshes after the workers are gone
        loader._instruments.rec.flush(now=1e12 + _)
    assert value(registry, cat.WORKERS_LOST.name, **L) == 0
    assert value(registry, cat.WORKERS_ACTIVE.name, **L) == 0


class UnevenShards(IterableDataset):  # type: ignore[type-arg]
    """Worker 0's shard ends after 2 items, worker 1's after 12: torch tells worker 0 to
    exit mid-epoch, on purpose."""

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        wid = 0 if info is None else info.id
        for i in range(2 if wid == 0 else 12):
            if wid:
                time.sleep(0.02)
            yield torch.tensor([wid, i])


def test_a_worker_whose_shard_ran_out_has_finished_and_is_not_lost(
        registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(UnevenShards(), batch_size=None, num_workers=2, name="t",
                                   registry=registry)
    bare = torch.utils.data.DataLoader(UnevenShards(), batch_size=None, num_workers=2)
    items = []
    for x in loader:
        items.append(x.tolist())
        refreshes(loader, 1)  # a liveness check at every batch, worker 0 gone for most
    assert sorted(items) == sorted(x.tolist() for x in bare)
    refreshes(loader)
    assert value(registry, cat.WORKERS_LOST.name, **L) == 0


def test_a_bad_batch_the_loop_skips_loses_no_worker(registry: CollectorRegistry) -> None:
    def skip_bad(loader: Any) -> tuple[list[Any], Any]:
        got, it = [], iter(loader)
        while True:  # the usual "skip what fails" loop
            try:
                got.append(next(it)[1].tolist())
            except StopIteration:
                return got, it
            except ValueError:
                continue

    bare = torch.utils.data.DataLoader(FailingDataset(8, bad=3), batch_size=2, num_workers=2)
    loader = instrument.DataLoader(FailingDataset(8, bad=3), batch_size=2, num_workers=2,
                                   name="t", registry=registry)
    (mine, held), (theirs, _) = skip_bad(loader), skip_bad(bare)
    assert mine == theirs
    refreshes(loader)  # the exhausted iterator is still held: its workers are still known
    assert value(registry, cat.WORKERS_LOST.name, **L) == 0
    assert value(registry, cat.WORKERS_ACTIVE.name, **L) == 0
    del held


def test_a_collection_during_a_scrape_never_counts_a_generation_twice(
        registry: CollectorRegistry) -> None:
    # The iterator dies in a reference cycle, so the cyclic collector frees it: let that
    # happen at every allocation count in turn while a scrape reads the figures.
    loader = instrument.DataLoader(SleepDataset(4), batch_size=2, num_workers=1, name="t",
                                   registry=registry)
    tracker = loader._instruments.rec.workers

    def samples() -> int:
        return sum(n for _, _, n, _ in tracker.per_worker())

    threshold = gc.get_threshold()
    try:
        for k in range(40):
            it = iter(loader)
            for _ in it:
                pass
            gc.collect()
            before = samples()
            holder: dict[str, Any] = {"it": it}
            holder["self"] = holder
            del it, holder
            gc.set_threshold(40)
            prime = [[] for _ in range(k)]
            during = samples()
            gc.set_threshold(*threshold)
            gc.collect()
            assert during == before == samples(), (k, before, during, samples())
            del prime
    finally:
        gc.set_threshold(*threshold)


def _reading(path: str) -> tuple[float, float, float] | None:
    """(collection began, collection ended, dataloader_workers_active) in one snapshot."""
    try:
        series = parse(Path(path).read_text())
    except FileNotFoundError:
        return None
    found = (series.get(("test_collect_begin", ())), series.get(("test_collect_end", ())),
             series.get((cat.WORKERS_ACTIVE.name, tuple(sorted(L.items())))))
    return None if None in found else cast(tuple[float, float, float], found)


def _workers_active_in(path: str) -> float | None:
    reading = _reading(path)
    return reading[2] if reading is not None else None


class _Clocked:
    """A snapshot writer's registry that also says when its collection began and ended
    (monotonic time): the figures between were taken then."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily
        yield GaugeMetricFamily("test_collect_begin", "", value=time.monotonic())
        yield from self.inner.collect()
        yield GaugeMetricFamily("test_collect_end", "", value=time.monotonic())


def test_snapshots_show_the_workers_of_short_epochs_and_none_after_the_last(
        registry: CollectorRegistry, tmp_path: Any) -> None:
    """Epochs far shorter than the snapshot interval, workers not persistent (torch restarts
    them at each iter()). Every snapshot taken while an epoch's workers were known (from
    iter()'s return to the epoch's last batch, on the loop's own clock) says 2, not 0 as
    when each was written as an epoch ended (the bug: 0 in 50 of 50); the last, after the
    loop, says 0. Torch forks the workers inside iter(), which takes a large share of a
    short epoch in a big process (fork copies its page tables), so a snapshot taken then
    may say 0: only snapshots inside the known windows are judged, and the loop runs until
    enough of them have been seen."""
    loader = instrument.DataLoader(SleepDataset(8, 0.01), batch_size=2, num_workers=2,
                                   name="t", registry=registry)
    writer = instrument.hub_for(registry).write_snapshots(str(tmp_path), interval=0.2)
    writer.registry = _Clocked(writer.registry)  # type: ignore[assignment]
    readings: list[tuple[float, float, float]] = []
    done = threading.Event()

    def poll() -> None:  # every version of the file, as a sidecar scraping it would see it
        seen = None
        while not done.is_set():
            try:
                st = os.stat(writer.path)
            except FileNotFoundError:
                st = None
            if st is not None and (st.st_ino, st.st_mtime_ns) != seen:
                seen = (st.st_ino, st.st_mtime_ns)
                reading = _reading(writer.path)
                if reading is not None:
                    readings.append(reading)
            time.sleep(0.01)

    def judged() -> list[float]:
        return [active for begin, end, active in list(readings)
                if any(known <= begin and end <= last for known, last in windows)]

    poller = threading.Thread(target=poll)
    poller.start()
    windows: list[tuple[float, float]] = []  # (iter() returned, the last batch came)
    start = time.monotonic()
    try:
        while time.monotonic() - start < 2.5 or (len(judged()) < 5
                                                 and time.monotonic() - start < 30):
            it = iter(loader)
            known = last = time.monotonic()
            for _ in it:
                last = time.monotonic()
            windows.append((known, last))
            del it
    finally:
        done.set()
        poller.join()
    inside = judged()
    assert len(windows) >= 3 and len(inside) >= 5, (len(windows), readings, windows)
    assert inside == [2.0] * len(inside), (inside, readings, windows)
    writer.close()  # the last snapshot, as at exit
    assert _workers_active_in(writer.path) == 0


def test_liveness_tells_a_reused_pid_and_a_zombie_from_the_worker_first_seen(tmp_path: Path
                                                                           ) -> None:
    """/proc/<pid>/stat as the kernel writes it (a command name with spaces and ')'),
    read as psutil's is_running() and status() would: the same start time, not a zombie."""
    from dataloader_exporter.instrument.failure_causes import Liveness

    def stat(state: str, start: int) -> None:
        (tmp_path / "7").mkdir(exist_ok=True)
        fields = [state, *["0"] * 18, str(start), "0", "0"]
        (tmp_path / "7" / "stat").write_text(f"7 (pt worker) 1) {' '.join(fields)}\n")

    (tmp_path / "self").mkdir()  # a /proc: psutil is not asked
    live = Liveness(str(tmp_path))
    stat("S", 1000)
    assert live.alive(7) and live.alive(7)
    stat("Z", 1000)
    assert not live.alive(7)
    stat("R", 2000)  # the pid was reused by another process
    assert not live.alive(7)
    live.forget(7)
    assert live.alive(7)  # a new worker with that pid is seen afresh
    (tmp_path / "7" / "stat").unlink()
    assert not live.alive(7) and not live.alive(8)
    # On its way out: exiting (PF_EXITING in its flags, field 9) or SIGKILL pending (the
    # signal field, 31): dying, neither alive nor gone, until it is a zombie.
    dying = Liveness(str(tmp_path))
    for flags, signals in (("4", "0"), ("0", str(1 << 8)), ("0", "0")):
        fields = ["S", "0", "0", "0", "0", "0", flags, *["0"] * 12, "1000", *["0"] * 8,
                  signals, "0"]
        (tmp_path / "7" / "stat").write_text(f"7 (pt worker) 1) {' '.join(fields)}\n")
        want = "alive" if (flags, signals) == ("0", "0") else "dying"
        assert dying.state(7) == want, (flags, signals)
    # And the real thing: this process is alive, a child that exited is not.
    real = Liveness()
    assert real.alive(os.getpid())
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 10
    while real.alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not real.alive(pid)  # a zombie until reaped, and not alive
    os.waitpid(pid, 0)
    assert not real.alive(pid)


def test_a_workers_time_the_hypervisor_took_is_waiting_for_a_cpu_not_blocked(tmp_path: Path
                                                                            ) -> None:
    """A worker that ran 50 ms in an interval of 200 ms or more on its own, while the
    machine's CPUs lost half their busy time to steal (/proc/stat), lost 50 ms more
    waiting for a CPU, not blocked on storage, and the figures say how much of the wait
    was steal (the tuner counts it as CPU); without steal nothing moves. The figures are
    /proc as the kernel writes it, for one worker read twice by its loader's account."""
    from dataloader_exporter.instrument.procstat import ProcAccount

    def write(root: Path, utime: int, steal: int) -> None:
        task = root / "7" / "task" / "7"
        task.mkdir(parents=True, exist_ok=True)
        fields = ["S", *["0"] * 10, str(utime), "0", *["0"] * 6, "1", "0", "100"]
        (root / "7" / "stat").write_text(f"7 (pt_data_worker) {' '.join(fields)}\n")
        (task / "schedstat").write_text("0 0 0\n")
        (root / "stat").write_text(f"cpu  {1000 + steal} 0 0 9000 0 0 0 {steal} 0 0\n")

    tick = os.sysconf("SC_CLK_TCK")
    accounts = {}
    for name in ("steal", "bare"):
        root = tmp_path / name
        write(root, 0, 0)
        accounts[name] = ProcAccount(str(root))
        accounts[name].observe([7], 0.0, active=True)
    time.sleep(0.2)  # at least this long: the interval's wall time, the rest blocked
    for name, steal in (("steal", 5 * tick), ("bare", 0)):
        write(tmp_path / name, tick // 20, steal)  # 50 ms on a CPU, in clock ticks
        accounts[name].observe([7], 1e6, active=True)  # long after: /proc/stat is due
    stolen, bare = (accounts[n].figures() for n in ("steal", "bare"))
    assert stolen is not None and bare is not None
    ran = tick // 20 * 1_000_000_000 // tick
    assert stolen.running_ns == bare.running_ns == ran
    assert bare.waiting_ns == 0 and bare.blocked_ns is not None and bare.blocked_ns >= 3 * ran
    assert stolen.waiting_ns == stolen.stolen_ns == ran  # busy and stolen ticks rose alike
    assert bare.stolen_ns == 0
    from dataloader_exporter.instrument.tuner.epoch import _times

    assert _times(stolen) == (2 * ran, 0, stolen.blocked_ns)  # the tuner: steal is CPU
    assert stolen.blocked_ns is not None and stolen.blocked_ns >= 2 * ran
    # /proc/stat is read again only when its reads stay within their share of a core.
    from dataloader_exporter.instrument.procstat import StealRate

    stat = tmp_path / "steal" / "stat"
    for budget, rate in ((1.0, 1.0), (1e-12, None)):  # cheap enough, or far from it
        steal = StealRate(str(stat), budget)
        stat.write_text("cpu  1000 0 0 9000 0 0 0 0 0 0\n")
        assert steal.read(0.0) is None  # one reading: no interval yet
        stat.write_text("cpu  2000 0 0 9000 0 0 0 1000 0 0\n")
        assert steal.read(1.0) == rate
