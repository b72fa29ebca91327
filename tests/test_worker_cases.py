"""Why the input is slow and why a worker failed, caused for real: workers that
spin, that fight over one core, that sleep; a dataset that raises, a worker that
segfaults, one killed from outside, a /dev/shm too small, a memory cgroup's OOM kill.
Each failing case runs torch's own DataLoader first, then ours, in the same process: the
loop sees the same exception. The doctor reads the run's snapshot files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.clock import Clock
from support.procs import REPO, SCRIPTS, Run, run_script

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core.facts.cgroup import OomKills
from dataloader_exporter.instrument.failure_causes import OomWatch

pytestmark = [pytest.mark.torch, pytest.mark.slow]

SCRIPT = str(SCRIPTS / "worker_cases.py")


def doctor(directory: Path) -> dict[str, Any]:
    """doctor --metrics-dir over an ended run (its files aged: read whole, at once)."""
    old = time.time() - 60
    for path in directory.glob("*.prom"):
        os.utime(path, (old, old))
    out = subprocess.run([sys.executable, "-m", "dataloader_exporter", "doctor",
                          "--metrics-dir", str(directory), "--format", "json"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode in (0, 1), out.stderr
    return dict(json.loads(out.stdout))


def same_exception(seen: dict[str, str]) -> bool:
    """The loop saw torch's exception with ours as without: the same, or, for a worker
    that died, one of torch's two words for it (which one varies from run to run with
    torch alone: whether its signal handler or its queue's timeout sees the death first,
    ../shared/FACTS.md)."""
    def kind(text: str) -> str:
        died = "is killed by signal" in text or "exited unexpectedly" in text
        return text.split(":", 1)[0] + (": a worker died" if died else text)

    return seen["bare"] != "no exception" and kind(seen["ours"]) == kind(seen["bare"])


def loader(report: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [d for d in report["loaders"] if d["loader"] == name]
    return dict(found)


def case(tmp: Path, name: str, wrap: list[str] | None = None) -> Run:
    return run_script(tmp, [*(wrap or []), sys.executable, SCRIPT, name, str(tmp)],
                      {"DATALOADER_EXPORTER_DIR": str(tmp / "m"),
                       "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(REPO)])})


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("slow")
    return case(tmp, "slow"), doctor(tmp / "m")


@pytest.mark.parametrize("name", ["cpu", "cpu_contention", "blocked"])
def test_the_doctor_names_why_the_workers_are_slow(slow: tuple[Run, dict[str, Any]],
                                                   name: str) -> None:
    _, report = slow
    workers = loader(report, name)["workers"]
    assert workers["bottleneck"] == name, workers
    shares = (workers["running_share"], workers["waiting_for_cpu_share"],
              workers["blocked_share"])
    assert abs(sum(shares) - 1) < 1e-6
    share = dict(zip(("cpu", "cpu_contention", "blocked"), shares, strict=True))[name]
    assert share > 0.5, workers  # the state the bottleneck names is most of their time
    assert workers["rss_bytes"] > 10 * 2**20  # a worker of a torch process: tens of MiB


def test_advice_follows_the_bottleneck(slow: tuple[Run, dict[str, Any]]) -> None:
    _, report = slow

    def advised(name: str) -> dict[str, str]:
        return {r["setting"]: r["value"] for r in loader(report, name)["recommendations"]}

    assert int(advised("cpu_contention").get("num_workers", 4)) < 4  # fewer: they queue
    assert int(advised("blocked")["num_workers"]) > 2  # more: they overlap their waits
    # CPU-bound: no more workers than the cores (the step's CPU counted, none kept for it).
    assert int(advised("cpu").get("num_workers", 1)) <= (os.cpu_count() or 1)


def test_worker_time_is_counted_only_while_batches_flow(
        slow: tuple[Run, dict[str, Any]]) -> None:
    """Three loaders in turn, persistent workers: each loader's workers sat idle while
    the others ran, which is not "blocked". Wall time counted is about the loader's own
    turn (3 s) times its workers, not the whole run's 9 s."""
    run, _ = slow
    for name, workers in (("cpu", 1), ("cpu_contention", 4), ("blocked", 2)):
        counted = sum(v for n, lab, v in run.samples[0]
                      if n == cat.WORKER_TIME.name and lab["loader"] == name)
        assert counted < workers * 4.5, (name, counted)


def test_the_why_series_stay_within_budget_whatever_the_worker_count(
        slow: tuple[Run, dict[str, Any]]) -> None:
    """At most 15 more series per loader and rank, the same for 1 worker as for 4."""
    run, _ = slow
    new = {m.name for m in (cat.WORKER_TIME, cat.WORKER_READ, cat.WORKER_MAJOR_FAULTS,
                            cat.WORKER_MEMORY, cat.WORKER_MAX_RSS, cat.FAILURES)}
    counts = {name: sum(1 for n, lab, _ in run.samples[0] if n in new and lab["loader"] == name)
              for name in ("cpu", "cpu_contention")}
    assert counts["cpu"] == counts["cpu_contention"] <= 15, counts


@pytest.mark.parametrize(("name", "cause"), [("error", "error"), ("crash", "crash"),
                                             ("killed", "killed")])
def test_a_failure_is_told_by_its_cause_and_the_loop_sees_torchs_exception(
        tmp_path: Path, name: str, cause: str) -> None:
    run = case(tmp_path, name)
    assert same_exception(run.truth[0]["seen"]), run.truth[0]["seen"]
    assert run.value(0, cat.FAILURES.name, loader=name, cause=cause) == 1
    others = [c for c in cat.FAILURE_CAUSES if c != cause]  # never seen: never written
    assert all(run.value(0, cat.FAILURES.name, loader=name, cause=c) is None for c in others)
    assert run.log.count(f"dataloader '{name}'") >= 1  # one line, with its fix
    failures = loader(doctor(tmp_path / "m"), name)["failures"]
    assert [f["cause"] for f in failures] == [cause] and failures[0]["fix"]


def _root_or_skip(what: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"needs root for {what}")


def test_a_full_dev_shm_is_told_as_shm_with_the_size_to_give(tmp_path: Path) -> None:
    """A private 32 MiB /dev/shm (unshare -m, a tmpfs of its own) and batches of 16 MiB."""
    _root_or_skip("a private /dev/shm")
    small = ["unshare", "-m", "sh", "-c",
             'mount -t tmpfs -o size=32m tmpfs /dev/shm && exec "$@"', "sh"]
    run = case(tmp_path, "shm", small)
    assert same_exception(run.truth[0]["seen"]), run.truth[0]["seen"]
    assert run.value(0, cat.FAILURES.name, loader="shm", cause="shm") == 1
    assert "lack of shared memory" in run.log and "--shm-size=1g" in run.log
    # (The doctor runs outside that namespace: the /dev/shm it sees is the machine's.)
    [failure] = loader(doctor(tmp_path / "m"), "shm")["failures"]
    assert failure["cause"] == "shm" and "shm-size" in failure["fix"]


def test_an_oom_kill_is_told_as_oom_only_on_the_kernels_count(tmp_path: Path) -> None:
    """A worker that allocates past its memory cgroup's limit (cgroup v1 here)."""
    _root_or_skip("a memory cgroup")
    group = Path("/sys/fs/cgroup/memory") / f"dataloader-exporter-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(800 * 2**20))
    except OSError as e:
        pytest.skip(f"no writable cgroup v1 memory controller here ({e})")
    try:
        run = case(tmp_path, "oom", ["sh", "-c",
                                     f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh"])
        kills = OomKills(cgroup_root="/sys/fs/cgroup")  # ours, not the test's group
        assert kills.source is not None
        assert "oom_kill 2" in (group / "memory.oom_control").read_text()  # bare's, ours
    finally:
        group.rmdir()
    assert same_exception(run.truth[0]["seen"]), run.truth[0]["seen"]
    assert run.value(0, cat.FAILURES.name, loader="oom", cause="oom") == 1
    assert run.value(0, cat.FAILURES.name, loader="oom", cause="killed") is None
    assert "killed by the kernel's OOM killer" in run.log


class Counter:
    """The kernel's count as a test sets it."""

    def __init__(self) -> None:
        self.value: int | None = 0

    def count(self) -> int | None:
        return self.value


def test_an_oom_rise_is_claimed_once_by_a_worker_seen_alive_before_it(clock: Clock) -> None:
    kills = Counter()
    watch = OomWatch(kills, clock=clock)
    a = b = watch.read()  # two workers seen alive
    assert watch.claim(a) is False  # no rise: a SIGKILL from elsewhere
    kills.value = 1
    assert watch.claim(a) is True and watch.claim(b) is False  # one kill, one claim
    kills.value = 2  # another process of the cgroup is OOM-killed...
    clock.advance(5.0)
    c = watch.read()  # ...before worker c is last seen alive
    clock.advance(1.0)
    assert watch.claim(c) is False  # so c's SIGKILL later is not the OOM killer's
    clock.advance(24.0)
    assert watch.claim(c) is None  # seen too long ago: no cause rather than a guess
    kills.value = None
    assert watch.claim(watch.read()) is None  # the kernel gives no count


class CountedCounter(Counter):
    """A Counter that says how often the kernel's count was read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def count(self) -> int | None:
        self.reads += 1
        return super().count()


def test_a_pool_started_soon_after_a_reading_takes_it_and_an_older_one_reads_again(
        clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short-lived pool's start reads the OOM-kill count at most once per tracker
    interval: a reading that recent is as close to the new workers as a live worker's last
    refresh is to its death. A rise after the reading a pool took is still its workers'."""
    from dataloader_exporter.instrument import failure_causes
    from dataloader_exporter.instrument.worker_tracker import WorkerTracker

    kills = CountedCounter()
    watch = OomWatch(kills, clock=clock)
    monkeypatch.setattr(failure_causes, "_watch", watch)
    tracker = WorkerTracker(min_interval=0.9)
    tracker.prepare()
    first = tracker._prepared
    assert kills.reads == 1
    clock.advance(0.5)
    tracker.prepare()  # the next pool, half a second on
    assert kills.reads == 1 and tracker._prepared == first
    clock.advance(0.5)  # a second after the reading: too old
    tracker.prepare()
    assert kills.reads == 2 and tracker._prepared != first
    seen = tracker._prepared[0] if tracker._prepared else None
    assert watch.read() is not None and kills.reads == 3  # a plain read always reads
    kills.value = 1  # the new pool's worker is OOM-killed
    assert watch.claim(seen) is True
    kills.value = None  # a count the kernel stops giving is not taken from an old reading
    clock.advance(1.0)
    assert watch.read(0.9) is None


def test_cgroup_v2_and_v1_oom_counts_are_read_from_the_processes_own_cgroup(
        tmp_path: Path) -> None:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/kubepods/pod1/trainer\n")
    events = root / "kubepods" / "pod1" / "trainer" / "memory.events"
    events.parent.mkdir(parents=True)
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n")
    assert OomKills(str(proc), str(root)).count() == 1
    (proc / "self" / "cgroup").write_text("12:memory:/train\n0::/\n")
    control = root / "memory" / "train" / "memory.oom_control"
    control.parent.mkdir(parents=True)
    control.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 4\n")
    events.unlink()
    assert OomKills(str(proc), str(root)).count() == 4
    (proc / "vmstat").write_text("nr_free_pages 1\noom_kill 9\n")
    control.unlink()
    assert OomKills(str(proc), str(root)).count() == 9  # no cgroup counts: the machine's
    kills = OomKills(str(proc), str(root))
    for text, want in (("oom_kill 5", 5), ("pgoom_kill 8\noom_kill 6\n", 6),
                       ("pgoom_kill 8\n", None), ("oom_kill x\n", None)):
        (proc / "vmstat").write_text(text)  # only a line's own key counts
        assert kills.count() == want, text


def test_the_snapshot_is_written_before_the_exception_reaches_the_loop(
        tmp_path: Path) -> None:
    """No periodic write for an hour: what the file says right after the loop caught the
    exception was written on the way to it."""
    from prometheus_client import CollectorRegistry
    from support.helpers import parse
    from support.torch_helpers import FailingDataset

    from dataloader_exporter import instrument

    registry = CollectorRegistry()
    writer = instrument.hub_for(registry).write_snapshots(str(tmp_path), interval=3600)
    loader = instrument.DataLoader(FailingDataset(8, bad=3), batch_size=1, name="t",
                                   registry=registry)
    with pytest.raises(ValueError, match="corrupt sample 3"):
        for _ in loader:
            pass
    written = parse(Path(writer.path).read_text())
    labels = (("cause", "error"), ("loader", "t"), ("rank", "0"))
    assert written[(cat.FAILURES.name, labels)] == 1
    assert written[(cat.BATCHES.name, (("loader", "t"), ("rank", "0")))] == 3
    writer.close()


@pytest.mark.parametrize(("text", "workers", "cause"), [
    ("Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback (most recent "
     "call last):\nRuntimeError: unable to allocate shared memory(shm) for file "
     "</torch_19231_3379463723_1>: No space left on device (28)", 2, "shm"),
    ("Caught RuntimeError in DataLoader worker process 1.\nRuntimeError: unable to write to "
     "file </torch_12_34_5>: No space left on device (28)", 2, "shm"),
    ("[Errno 28] No space left on device: '/home/me/cache/shm_feats.npy'", 0, "error"),
    ("Caught OSError in DataLoader worker process 1.\nOSError: [Errno 28] No space left on "
     "device: '/data/shm/x'", 2, "error"),  # a full disk of the dataset's, not /dev/shm
    ("DataLoader timed out after 1 seconds", 2, None),  # torch's own: not the dataset's
    ("[Errno 2] No such file or directory", 2, None),  # torch's internals, a worker gone
    ("corrupt sample 3", 0, "error"),  # no workers: the dataset raised in the loop's process
    ("Caught ValueError in DataLoader worker process 0. " + "/dev/shm/x " * 50_000, 2,
     "error"),  # a message of half a megabyte: read in linear time
])
def test_an_exception_is_given_only_the_cause_its_words_show(
        text: str, workers: int, cause: str | None) -> None:
    from dataloader_exporter.instrument.failure_causes import cause_of_error

    assert cause_of_error(RuntimeError(text), workers) == cause


def test_a_worker_that_ended_cleanly_is_not_lost_when_another_raises(tmp_path: Path) -> None:
    """Worker 0's shard runs out (it exits 0); worker 1's raises: one failure, no loss."""
    from prometheus_client import CollectorRegistry
    from torch.utils.data import IterableDataset, get_worker_info

    from dataloader_exporter import instrument

    class Shards(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            info = get_worker_info()
            assert info is not None
            if info.id == 0:
                yield from range(2)
                return
            for i in range(40):
                if i == 20:
                    time.sleep(0.5)  # worker 0 has ended by now
                    raise ValueError("bad shard")
                yield i

    registry = CollectorRegistry()
    loader = instrument.DataLoader(Shards(), batch_size=None, num_workers=2, name="t",
                                   registry=registry)
    with pytest.raises(ValueError, match="bad shard"):
        for _ in loader:
            pass
    lr = {"loader": "t", "rank": "0"}
    assert registry.get_sample_value(cat.WORKERS_LOST.name, lr) == 0
    assert registry.get_sample_value(cat.FAILURES.name, {**lr, "cause": "error"}) == 1


def test_worker_time_is_left_out_when_workers_live_shorter_than_a_reading(clock: Clock
                                                                           ) -> None:
    """Epochs of a fraction of a second without persistent workers, their workers read at
    each batch as a scrape would, on the test's clock (0.1 s a batch): each worker is read
    once, its pool gone before a second reading is due, so there is no interval to count:
    unknown, not 0. On the machine's clock, a loaded machine can stretch such an epoch past
    the reading interval: its workers are then read twice, a measured interval (below)."""
    from prometheus_client import CollectorRegistry
    from support.torch_helpers import SleepDataset

    from dataloader_exporter import instrument

    registry = CollectorRegistry()
    loader = instrument.DataLoader(SleepDataset(4), batch_size=2, num_workers=2, name="t",
                                   registry=registry)
    rec = loader._instruments.rec
    assert rec.workers.min_interval > 0.1  # an epoch's two batches: one reading
    for _ in range(8):  # pools one after another, each its own pids
        for _ in loader:
            clock.advance(0.1)
            rec.flush(now=clock())
    lr = {"loader": "t", "rank": "0"}
    assert registry.get_sample_value(cat.WORKER_TIME.name, {**lr, "state": "running"}) is None
    assert registry.get_sample_value(cat.WORKER_MAX_RSS.name, lr)  # memory is still read


def test_workers_read_twice_while_a_batch_flows_have_their_time_known_even_when_idle(
        clock: Clock) -> None:
    """The same epoch with its two batches a reading interval apart (a loaded machine):
    each worker is read twice while the loader hands out a batch, a measured interval. Its
    time is known, and said: running is a number (0 where the workers had made their
    batches before it began), never left out."""
    from prometheus_client import CollectorRegistry
    from support.torch_helpers import SleepDataset

    from dataloader_exporter import instrument

    registry = CollectorRegistry()
    loader = instrument.DataLoader(SleepDataset(4), batch_size=2, num_workers=2, name="t",
                                   registry=registry)
    rec = loader._instruments.rec
    for _ in loader:
        rec.flush(now=clock())
        clock.advance(rec.workers.min_interval)
    lr = {"loader": "t", "rank": "0"}
    got = {st: registry.get_sample_value(cat.WORKER_TIME.name, {**lr, "state": st})
           for st in cat.WORKER_STATES}
    assert None not in got.values() and min(v or 0.0 for v in got.values()) >= 0, got


def test_a_pool_stopped_twice_counts_its_workers_own_time_once() -> None:
    """The next iter() stops the last pool again while the loop still holds its iterator:
    its workers' own figures (an epoch too short for two /proc readings) count once."""
    from dataloader_exporter.instrument.hotpath.layout import (
        CPU,
        FIRST_BEAT,
        FIRST_CPU,
        FIRST_WAIT,
        HEARTBEAT,
        PID,
        WAIT,
    )
    from dataloader_exporter.instrument.hotpath.workerblock import new_block
    from dataloader_exporter.instrument.worker_tracker import WorkerTracker

    class Iterator:  # weak-referenceable, as torch's is
        pass

    block = new_block(1)
    ms = 1_000_000
    for field, value in ((PID, 4_000_000), (FIRST_CPU, 5 * ms), (CPU, 105 * ms),
                         (FIRST_WAIT, 0), (WAIT, 50 * ms), (FIRST_BEAT, 10**18),
                         (HEARTBEAT, 10**18 + 400 * ms)):
        block[0, field] = value
    tracker = WorkerTracker()
    it = Iterator()
    key = tracker.start(it, block, []).key
    tracker.stop(key)  # the epoch's end
    tracker.stop(key)  # the next iter(), the old iterator still held
    fig = tracker.proc_figures()
    assert fig is not None
    assert (fig.running_ns, fig.waiting_ns, fig.blocked_ns) == (100 * ms, 50 * ms, 250 * ms)


def test_a_stopped_pool_leaves_no_reading_of_its_workers_behind() -> None:
    """Each short-lived pool's workers get an OOM-count reading when it starts; a pool
    stopped on purpose and collected leaves none of its pids behind (a loader built for
    each evaluation would otherwise grow the tracker by a pool's pids each time)."""
    import gc

    from dataloader_exporter.instrument.hotpath.workerblock import new_block
    from dataloader_exporter.instrument.worker_tracker import WorkerTracker

    class Iterator:  # weak-referenceable, as torch's is
        pass

    tracker = WorkerTracker()
    for pool in range(50):
        it = Iterator()
        pids = [4_000_000 + 2 * pool, 4_000_001 + 2 * pool]  # never this machine's
        key = tracker.start(it, new_block(2), pids).key
        tracker.version()  # a collector's call: the pool is watched from then on
        assert set(pids) <= tracker._seen.keys()  # read before the workers could be killed
        tracker.stop(key)  # the epoch's end
        del it
        gc.collect()
    tracker.per_worker()  # folds the last one
    assert not tracker._seen and not tracker._live
