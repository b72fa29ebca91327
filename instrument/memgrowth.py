"""How fast a loader's workers' private memory grows, from the readings of their USS.

A forked worker shares its parent's pages until it writes one; a worker that reads Python
objects its parent holds (a dataset's list of paths) writes their reference counts and so
copies their pages one by one (copy-on-read), and its private memory (USS: pages no other
process holds) grows through its first epoch by about what it reads. A cache the dataset
fills, or a leak, grows it too.

Each worker's growth is the Theil-Sen slope of its readings of the last GROWTH_WINDOW
seconds (the median of the slopes between every two of SLOPES readings spread over them),
so that the batches a worker has in hand (its private memory goes up and down by a few MiB
with them) and a step now and then do not read as growth; its first reading, taken while it
starts (libraries loaded, its first batches built), is left out; and a slope that moves
less than NOISE over the readings' span is flat (0). A worker read over less than
GROWTH_SPAN seconds, or fewer than GROWTH_READINGS times besides its first, has no growth
yet. The pool's growth is the sum over its workers that have one; once measured it is kept
(the latest measured) until a newer one replaces it, so that it is still known after the
pool ends, and above all after a worker was killed for it.
"""

from __future__ import annotations

from collections import deque
from itertools import combinations

GROWTH_WINDOW = 300.0  # seconds of a worker's readings its growth is read over
GROWTH_SPAN = 15.0  # seconds of readings, at least, for a growth
GROWTH_READINGS = 6  # readings, at least, for a growth
SLOPES = 24  # readings, at most, whose pairwise slopes are taken (276 pairs)
NOISE = 4 << 20  # bytes over the span: a few batches in hand, an allocator's arena
_KEEP = 600  # readings kept per worker, at most (one a second over the window, and more)
_ENDED = 16  # ended workers whose first and last reading are kept (for a failure's words)


def _median(xs: list[float]) -> float:
    """The median of xs, as statistics.median (which would load decimal and fractions into
    every process that builds a loader)."""
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def growth_rate(readings: deque[tuple[float, int]]) -> float | None:
    """Bytes per second over `readings` (time, bytes): their Theil-Sen slope, 0 where it
    moves less than NOISE over their span; None when they are too few or span too little."""
    n = len(readings)
    span = readings[-1][0] - readings[0][0] if n else 0.0
    if n < GROWTH_READINGS or span < GROWTH_SPAN:
        return None
    points = [readings[i * (n - 1) // (SLOPES - 1)] for i in range(SLOPES)] if n > SLOPES \
        else list(readings)
    slope = _median([(v2 - v1) / (t2 - t1) for (t1, v1), (t2, v2) in combinations(points, 2)
                    if t2 > t1] or [0.0])
    return 0.0 if abs(slope) * span < NOISE else slope


class PrivateGrowth:
    """The private memory of one loader's workers over time: its growth (bytes per
    second, summed over the workers with one; None until one had), what the live workers
    have grown since their first reading past their start, and the first and last such
    readings of the workers that ended lately."""

    def __init__(self) -> None:
        self.rate: float | None = None
        self._readings: dict[int, deque[tuple[float, int]]] = {}
        self._base: dict[int, int] = {}  # its first reading past its start
        self.ended: dict[int, tuple[int, int]] = {}  # pid -> (first, last) bytes

    def add(self, readings: dict[int, int], now: float) -> None:
        """A fresh reading of the live workers' private memory (pid -> bytes) at `now`
        (seconds, monotonic); a worker missing from it keeps its earlier readings. Readings
        older than GROWTH_WINDOW are dropped while SLOPES newer remain: where they are far
        apart (large workers are read less often), the last SLOPES give the growth."""
        old = now - GROWTH_WINDOW
        for pid, value in readings.items():
            kept = self._readings.get(pid)
            if kept is None:  # its start: not a reading of its growth
                self._readings[pid] = deque(maxlen=_KEEP)
                continue
            self._base.setdefault(pid, value)
            kept.append((now, value))
            while len(kept) > SLOPES and kept[0][0] < old:
                kept.popleft()
        rates = [r for r in map(growth_rate, self._readings.values()) if r is not None]
        if rates:
            self.rate = sum(rates)

    def grown(self) -> int:
        """What the live workers have grown since their first reading past their start,
        summed (a worker that shrank counts 0)."""
        return sum(max(0, kept[-1][1] - self._base[pid]) for pid, kept in
                   self._readings.items() if kept and pid in self._base)

    def end(self, pid: int) -> None:
        """A worker ended: its readings dropped, its first (past its start) and last kept
        a while."""
        kept = self._readings.pop(pid, None)
        base = self._base.pop(pid, None)
        if kept and base is not None:
            self.ended[pid] = (base, kept[-1][1])
            while len(self.ended) > _ENDED:
                del self.ended[next(iter(self.ended))]
