"""The per-batch path's base types, the C build and the Python one side by side: the same
batches, the same exceptions (the very objects), the same records; and the C build is what
an install here runs."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dataloader_exporter.instrument.hotpath import base as hotpath_base

pytestmark = pytest.mark.torch  # the instrument package (its hot path's modules)

BUILDS = [pytest.param((hotpath_base.PyRing, hotpath_base.PyCounts, hotpath_base.PyTimed),
                       id="python")]
try:
    from dataloader_exporter.instrument.hotpath import _hotpath

    BUILDS.append(pytest.param((_hotpath.Ring, _hotpath.Counts, _hotpath.Timed), id="c"))
except ImportError:  # test_the_c_build_is_what_runs says why
    pass


def test_the_c_build_is_what_runs_unless_python_is_asked_for() -> None:
    """The project's install builds the extension (setup.py; gcc and the Python headers
    are on these machines): a silent fall back to Python would cost every batch. `make
    test` also runs the per-batch and loader tests with DATALOADER_EXPORTER_PURE_PYTHON=1,
    where the Python build must be what runs."""
    if os.environ.get(hotpath_base.PURE_PYTHON_ENV) == "1":
        assert not hotpath_base.NATIVE and hotpath_base.Timed is hotpath_base.PyTimed
        return
    assert hotpath_base.NATIVE, "instrument/hotpath/_hotpath.c was not built: pip install -e ."
    assert hotpath_base.Timed.__module__ == "dataloader_exporter.instrument.hotpath._hotpath"


def test_the_version_says_which_build_a_trainer_runs_without_loading_torch() -> None:
    code = ("import sys; from dataloader_exporter.cli import main; main(['--version']); "
            "assert 'torch' not in sys.modules and '_hotpath' not in str(sorted(sys.modules))")
    said = {}
    for pure in ("", "1"):
        env = {**os.environ, hotpath_base.PURE_PYTHON_ENV: pure}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        said[pure] = done.stdout.splitlines()[1]
    assert said["1"] == "per-batch path: Python (DATALOADER_EXPORTER_PURE_PYTHON is set)"
    assert said[""].startswith("per-batch path: C (") and "_hotpath" in said[""]


@pytest.mark.skipif(not hotpath_base.NATIVE, reason="the C build is not what runs (see above)")
def test_the_c_build_holds_only_the_per_batch_state() -> None:
    """The clock's readings, the rings, the loop's counters and a worker's row (and where
    a block's rows start): nothing a subclass, the first batch or the tuner needs, so a
    Python field never touches C."""
    assert {n for n in dir(_hotpath) if not n.startswith("_")} == {
        "Ring", "Counts", "Timed", "beat", "address"}
    assert {n for n in dir(_hotpath.Timed) if n.startswith("_") and not n.startswith("__")
            } == {"_it", "_rec", "_last", "_mark", "_size"}
    counts = _hotpath.Counts()
    assert counts.fetch is None and counts.step is None  # its subclass sets its rings
    timed = _hotpath.Timed()
    with pytest.raises(TypeError, match="with its rings set"):
        timed._rec = counts
    with pytest.raises(TypeError, match="must be a Ring"):
        counts.fetch = [1, 2]
    counts.fetch, counts.step = _hotpath.Ring(4), _hotpath.Ring(4)
    timed._rec = counts
    with pytest.raises(TypeError):
        _hotpath.Ring()  # no default size: the recorder says it (MAX_UNREAD)


def make(build: tuple[Any, Any, Any]) -> tuple[Any, Any]:
    ring, counts, timed = build

    class Rec(counts):  # type: ignore[misc, valid-type]
        def __init__(self, name: str) -> None:
            self.name = name
            self.fetch, self.step = ring(8), ring(8)

    class It(timed):  # type: ignore[misc, valid-type]
        __slots__ = ("calls",)

        def __init__(self, it: Iterator[Any], rec: Any, mark: int, size: int) -> None:
            self._it, self._rec, self._last, self._mark, self._size = it, rec, 0, mark, size
            self.calls: list[tuple[Any, ...]] = []

        def _first(self, batch: Any, t1: int) -> Any:
            self.calls.append(("first", batch))
            self._last = self._rec.last_batch_ns = t1
            self._rec.batches += 1
            return batch

        def _walk(self, batch: Any, b: int) -> Any:
            self.calls.append(("walk", batch, b))
            self._rec.samples += 100
            return batch

        def _exhausted(self) -> None:
            self.calls.append(("end",))

        def _raised(self, e: Exception) -> Any:
            self.calls.append(("raised", e))
            if isinstance(e, KeyError):
                return "instead"  # its return is the batch
            raise e

    return Rec, It


@pytest.mark.parametrize("build", BUILDS)
def test_full_batches_are_recorded_and_the_rest_is_the_subclass(build: Any) -> None:
    rec_t, it_t = make(build)
    rec = rec_t("x")
    before = time.perf_counter_ns()
    it = it_t(iter(range(6)), rec, mark=4, size=3)
    assert list(it) == list(range(6))
    after = time.perf_counter_ns()
    # the first batch, full ones while batches < 4 (2 and 3), then walks at 4, 5, 6
    assert it.calls == [("first", 0), ("walk", 3, 4), ("walk", 4, 5), ("walk", 5, 6),
                        ("end",)]
    assert (rec.batches, rec.samples) == (6, 2 * 3 + 3 * 100)
    fetch = hotpath_base.drain(rec.fetch)
    step = hotpath_base.drain(rec.step)
    assert fetch.dtype == np.int64 and len(fetch) == 6 and len(step) == 5
    assert (fetch >= 0).all() and (step >= 0).all()
    assert before <= rec.last_batch_ns <= after  # perf_counter_ns's clock
    assert len(rec.fetch) == 0 and len(hotpath_base.drain(rec.fetch)) == 0


class _WithState:
    """An iterator with attributes of its own, as torch's iterators have."""

    def __init__(self) -> None:
        self._num_yielded = 0
        self.items = iter([1, 2])

    def __iter__(self) -> _WithState:
        return self

    def __next__(self) -> int:
        self._num_yielded += 1
        return next(self.items)


@pytest.mark.parametrize("build", BUILDS)
def test_other_attributes_are_the_iterators_but_dunder_names(build: Any) -> None:
    rec_t, it_t = make(build)
    inner = _WithState()
    it = it_t(inner, rec_t("x"), mark=0, size=0)
    assert next(it) == 1 and it._num_yielded == 1 and it.items is inner.items
    assert it._last > 0  # its own fields stay its own
    with pytest.raises(AttributeError):
        it.absent  # noqa: B018
    with pytest.raises(AttributeError):
        it.__absent__  # noqa: B018
    assert not hasattr(it, "__len__") and getattr(it, "__dict__", None) is None


@pytest.mark.parametrize("build", BUILDS)
def test_exceptions_pass_as_the_same_objects(build: Any) -> None:
    rec_t, it_t = make(build)
    boom = ValueError("boom")

    def source() -> Iterator[int]:
        yield 1
        raise boom

    it = it_t(source(), rec_t("x"), mark=0, size=0)
    assert next(it) == 1
    with pytest.raises(ValueError) as got:
        next(it)
    assert got.value is boom and got.value.__traceback__ is not None
    assert it.calls[-1] == ("raised", boom)

    def keyed() -> Iterator[int]:
        raise KeyError(1)
        yield 0

    assert next(it_t(keyed(), rec_t("x"), 0, 0)) == "instead"

    def interrupted() -> Iterator[int]:
        raise KeyboardInterrupt
        yield 0

    quiet = it_t(interrupted(), rec_t("x"), 0, 0)
    with pytest.raises(KeyboardInterrupt):
        next(quiet)
    assert quiet.calls == []  # not an Exception: passes untouched


@pytest.mark.parametrize("build", BUILDS)
def test_the_hooks_run_as_in_an_except_block(build: Any) -> None:
    """What _raised raises carries the loader's error as its context, a bare raise raises
    that error, and an iterator that loops back is a RecursionError, not a crash."""
    rec_t, it_t = make(build)
    boom = ValueError("boom")

    def source() -> Iterator[int]:
        raise boom
        yield 0

    class Wraps(it_t):  # type: ignore[misc, valid-type]
        __slots__ = ()

        def _raised(self, e: Exception) -> Any:
            raise RuntimeError("the hook's own")

    with pytest.raises(RuntimeError) as got:
        next(Wraps(source(), rec_t("x"), 0, 0))
    assert got.value.__context__ is boom

    class Bare(it_t):  # type: ignore[misc, valid-type]
        __slots__ = ()

        def _raised(self, e: Exception) -> Any:
            raise

    with pytest.raises(ValueError) as again:
        next(Bare(source(), rec_t("x"), 0, 0))
    assert again.value is boom

    loops = it_t(iter(()), rec_t("x"), 0, 0)
    loops._it = loops
    with pytest.raises(RecursionError):
        next(loops)


@pytest.mark.parametrize("build", BUILDS)
def test_the_end_keeps_the_iterators_stopiteration(build: Any) -> None:
    rec_t, it_t = make(build)

    class Ends:
        def __iter__(self) -> Ends:
            return self

        def __next__(self) -> int:
            raise StopIteration("its value")

    it = it_t(Ends(), rec_t("x"), 0, 0)
    with pytest.raises(StopIteration) as got:
        next(it)
    assert got.value.args == ("its value",) and it.calls == [("end",)]
    not_an_iterator = it_t(object(), rec_t("x"), 0, 0)
    with pytest.raises(TypeError, match="not an iterator"):
        next(not_an_iterator)
    assert [c[0] for c in not_an_iterator.calls] == ["raised"]  # an error like any other


@pytest.mark.parametrize("build", BUILDS)
def test_a_ring_keeps_its_newest_values_in_order(build: Any) -> None:
    ring = build[0](8)
    for i in range(20):
        ring.append(i)
    assert len(ring) == 8
    assert hotpath_base.drain(ring).tolist() == list(range(12, 20))
    if build[0] is not hotpath_base.PyRing:
        with pytest.raises(OverflowError):
            build[0](1 << 62)
    big = build[0](1 << 12)
    for i in range(3000):  # past the first allocations
        big.append(i)
    assert hotpath_base.drain(big).tolist() == list(range(3000))


def test_the_python_build_runs_a_loader_the_same(tmp_path: Path) -> None:
    """With DATALOADER_EXPORTER_PURE_PYTHON=1 the loader runs on the Python build: the
    same batches as torch's own loader, and the same counts, its workers' too."""
    script = tmp_path / "pure.py"
    script.write_text(
        "import torch\n"
        "from prometheus_client import CollectorRegistry\n"
        "from dataloader_exporter import instrument\n"
        "from dataloader_exporter.instrument.hotpath import base as hotpath_base\n"
        "assert not hotpath_base.NATIVE\n"
        "ds = torch.utils.data.TensorDataset(torch.arange(50.0))\n"
        "reg = CollectorRegistry()\n"
        "ours = instrument.DataLoader(ds, batch_size=4, name='p', registry=reg)\n"
        "bare = torch.utils.data.DataLoader(ds, batch_size=4)\n"
        "for _ in range(2):\n"
        "    got, want = [b[0].tolist() for b in ours], [b[0].tolist() for b in bare]\n"
        "    assert got == want, (got, want)\n"
        "rec = ours._instruments.rec\n"
        "rec.flush()\n"
        "assert (rec.batches, rec.samples) == (26, 100), (rec.batches, rec.samples)\n"
        "assert int(rec.fetch_h.counts.sum()) == 26 and int(rec.step_h.counts.sum()) == 24\n"
        "pool = instrument.DataLoader(ds, batch_size=4, num_workers=2, name='w', registry=reg)\n"
        "got = [b[0].tolist() for b in pool]\n"
        "assert got == [b[0].tolist() for b in bare], got\n"
        "workers = pool._instruments.rec.workers.per_worker()\n"
        "assert [(w, s) for w, _, s, _ in workers] == [(0, 26), (1, 24)], workers\n"
        "assert all(cpu > 0 and beat > 0 for _, cpu, _, beat in workers), workers\n"
        "print('ok')\n")
    env = {**os.environ, hotpath_base.PURE_PYTHON_ENV: "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_block_for_forked_workers_is_shared_with_them_without_a_file() -> None:
    """Workers forked from this process share its block as an anonymous mapping: what a
    child writes, the parent reads; no descriptor or /dev/shm file is made for it, and
    torch's shared memory stays for workers that are spawned."""
    from dataloader_exporter.instrument.hotpath import workerblock as wb

    fds = len(os.listdir("/proc/self/fd"))
    block = wb.new_block(3, forked=True)
    assert len(os.listdir("/proc/self/fd")) == fds and isinstance(block, np.ndarray)
    assert block.shape == (3, len(wb.ROW_FIELDS)) and not block.any()
    pid = os.fork()
    if pid == 0:  # the child: a worker's write, then out without Python's exit
        block[2, wb.PID] = os.getpid()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0 and block[2, wb.PID].item() == pid
    assert wb.new_block(3).is_shared()  # spawned workers map torch's shared memory


@pytest.mark.skipif(not hotpath_base.NATIVE, reason="the C build is not what runs (see above)")
def test_a_workers_beat_writes_its_row_the_same_in_both_builds() -> None:
    """_hotpath.beat (by the row's address) and py_beat (on a numpy view) write the same
    fields of a worker's row: counts, pid, clocks, run-queue wait and the first batch's."""
    from dataloader_exporter.instrument.hotpath import workerblock as wb

    block = wb.new_block(2)
    rows = block.numpy()
    c_row, py_row = block.data_ptr(), rows[1]
    fds = []
    try:
        before = time.time_ns()
        fd_c = _hotpath.beat(c_row, 8, False, wb.FD_UNOPENED)
        fd_py = wb.py_beat(py_row, 8, False, wb.FD_UNOPENED)
        fds = [fd for fd in (fd_c, fd_py) if fd >= 0]
        assert fd_c >= 0 and fd_py >= 0  # /proc/thread-self/schedstat is readable here
        first = rows.copy()
        for r in first:
            assert (r[wb.SAMPLES], r[wb.PID], r[wb.UNCOUNTED], r[wb.MISCOUNTED]) == (
                8, os.getpid(), 0, 0)
            assert 0 < r[wb.CPU] <= time.process_time_ns()
            assert before <= r[wb.HEARTBEAT] <= time.time_ns()
            assert r[wb.WAIT] >= 0
            assert (r[wb.FIRST_CPU], r[wb.FIRST_WAIT], r[wb.FIRST_BEAT]) == (
                r[wb.CPU], r[wb.WAIT], r[wb.HEARTBEAT])
        sum(range(200_000))  # some CPU time between the two batches
        assert _hotpath.beat(c_row, -1, True, fd_c) == fd_c
        assert wb.py_beat(py_row, -1, True, fd_py) == fd_py
        for r, f in zip(rows, first, strict=True):
            assert (r[wb.SAMPLES], r[wb.UNCOUNTED], r[wb.MISCOUNTED]) == (8, 1, 1)
            assert r[wb.CPU] > f[wb.CPU] and r[wb.HEARTBEAT] >= f[wb.HEARTBEAT]
            assert r[wb.WAIT] >= f[wb.WAIT]
            assert (r[wb.FIRST_CPU], r[wb.FIRST_WAIT], r[wb.FIRST_BEAT]) == (
                f[wb.FIRST_CPU], f[wb.FIRST_WAIT], f[wb.FIRST_BEAT])
        # Without schedstat (-1): the wait is unknown, never 0.
        assert _hotpath.beat(c_row, 1, False, -1) == -1 and rows[0][wb.WAIT] == -1
        assert wb.py_beat(py_row, 1, False, -1) == -1 and rows[1][wb.WAIT] == -1
        with pytest.raises(ValueError):
            _hotpath.beat(0, 1, False, -1)
        with pytest.raises(ValueError):
            _hotpath.beat(c_row + 4, 1, False, -1)
        # A forked pool's block is a numpy array: its rows' address is its buffer's.
        forked = wb.new_block(2, forked=True)
        assert wb.address(forked) == forked.ctypes.data
        assert _hotpath.beat(wb.address(forked) + wb.ROW_BYTES, 3, False, -1) == -1
        assert forked[1][wb.SAMPLES] == 3 and forked[1][wb.PID] == os.getpid()
        assert not forked[0].any()
        with pytest.raises(BufferError):
            _hotpath.address(b"read-only")
    finally:
        for fd in fds:
            os.close(fd)


def test_a_pickled_collate_takes_the_build_of_the_process_that_unpickles_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A spawned worker unpickles the loader's TimedCollate: it binds its row the way its
    own build can (the C build by the row's address, found again there; the Python build
    by a numpy view), whatever the trainer's build was."""
    from dataloader_exporter.instrument.hotpath import workerblock as wb

    sent = pickle.dumps(wb.TimedCollate(list, wb.new_block(2), True))
    for native in (True, False):
        monkeypatch.setattr(wb, "NATIVE", native)
        got = pickle.loads(sent)
        assert (got.native, got._base, got._row, got._fd) == (native, 0, None, wb.FD_UNOPENED)
        assert got([1, 2]) == [1, 2]  # in no worker: no row, the user's collate_fn's batch
