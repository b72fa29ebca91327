"""One trainer snapshot file, read as untrusted input and validated against the catalogue.

Any process that can write to the metrics directory can put anything there: a FIFO, a
symbolic link to a secret, a file cut short by a copy, another program's metrics, a
50 MB file. So a file is read only if it is a regular file (opened without blocking and
without following a symbolic link, then checked on the open descriptor), only up to a
size bound, and is accepted only if it is exactly what instrument's snapshot writer
(prometheus_client's text encoder over instrument/loader_collector.py's LoaderCollector)
writes:

- every trainer family of the catalogue, once, with the catalogue's type, and no other
  family (no ``_created`` samples either: the writer's families carry no creation time)
  but the retired ones older writers still write (cat.RETIRED), validated as any other
  and dropped: never served, since the catalogue no longer has them; an older writer's
  file may lack the families added since (cat.ADDED);
- on each sample exactly the catalogue's label names (plus ``le`` on buckets), or the
  former ones older writers wrote (cat.FORMER_LABELS: the exit time per loader, served
  once per rank, its latest), no series twice, counters finite and >= 0;
- histograms whole: per label set one of the catalogue's bucket layouts in order (for
  dataloader_time_seconds each phase's, cat.PHASE_BUCKETS, and the fetch layout that
  older writers used for both; a layout older writers used, cat.FORMER_BUCKETS), or none
  (the large-job setting, core/seriesmode.py), then ``+Inf``, ``_count`` and ``_sum``; bucket
  counts whole numbers, cumulative, ``_count`` equal to the ``+Inf`` bucket, ``_sum``
  finite and >= 0;
- the writer's invariants per (loader, rank): the batch, epoch and lost-worker counters
  are there for every loader the file names (a histogram only once it holds an
  observation, the transfer counter once to_device ran), the per-worker families name
  the same workers (samples: some of them), and a loader that started an epoch has its
  dataloader_info; a process's series (cat.PROCESS_LABELS: the exit time) name a rank
  that some loader of the file has.
  With every family required, these make a file cut at any line boundary invalid: the
  writer's last family is dataloader_info, and a cut inside it leaves a loader that
  started an epoch without its info.

A file is taken whole or rejected whole, with one of REASONS. Rejections say what is
wrong by line number and catalogue name, never by anything read from the file.
"""

from __future__ import annotations

import errno
import math
import os
import stat
from dataclasses import dataclass

from prometheus_client.samples import Sample

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.exporter.exposition import float_text

from .textparse import Labels, ParsedFamily, parse

SUFFIX = ".prom"  # a snapshot file's name ends with it (write_to_textfile's temporaries do not)
NOT_REGULAR = "not_regular"  # a FIFO, device, socket, directory or symbolic link
UNREADABLE = "unreadable"  # open() or read() failed: permissions, I/O error
TOO_LARGE = "too_large"  # over max_file_bytes
TOO_MANY_SERIES = "too_many_series"  # over max_series sample lines
MALFORMED = "malformed"  # not UTF-8, or not the text format line by line
INVALID = "invalid"  # well-formed, but not what the snapshot writer writes
REASONS: tuple[str, ...] = (NOT_REGULAR, UNREADABLE, TOO_LARGE, TOO_MANY_SERIES, MALFORMED,
                            INVALID)

Owner = tuple[str, str]  # (loader, rank); a process's series are the rank's alone
Stamp = tuple[int, int, int]  # (inode, mtime_ns, size): a version of a file

_OPEN_FLAGS = (os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY
               | getattr(os, "O_CLOEXEC", 0))
_CHUNK = 1 << 20
_TRAINER: dict[str, cat.Metric] = {m.name: m for m in cat.ALL if m.source == cat.TRAINER}
_RETIRED: dict[str, cat.Metric] = {m.name: m for m in cat.RETIRED}
_ADDED = frozenset(m.name for m in cat.ADDED)
# What instrument/loader_collector.py writes for every (loader, rank) it knows.
# (Not samples: a count that cannot be known is left out, instrument/hotpath/batch.py.)
_ALWAYS = frozenset(m.name for m in (cat.BATCHES, cat.EPOCHS, cat.WORKERS_LOST))
_PHASES = frozenset((cat.PHASE_FETCH, cat.PHASE_TRANSFER))
_INF_ONLY = ("+Inf",)
# Every worker with CPU time has a heartbeat where an older writer wrote them; its samples
# may be unknown.
_CPU, _WORKER_SAMPLES, (_HEARTBEAT,) = cat.WORKER_CPU.name, cat.WORKER_SAMPLES.name, _RETIRED


class Rejected(Exception):
    """A file skipped whole: one of REASONS and a detail free of the file's content."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Snapshot:
    """A validated file: its sample lines by (loader, rank), and its process's by rank,
    then by catalogue name, as the encoders write them (the same in both formats),
    joined: encoded once per version of the file, however many scrapes serve it."""

    series: int
    owners: dict[Owner, dict[str, str]]
    ranks: dict[str, dict[str, str]]


def stamp_of(st: os.stat_result) -> Stamp:
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def read(path: str, max_bytes: int) -> tuple[bytes, Stamp]:
    """The bytes of a regular file, at most max_bytes of them, and the version read.

    FileNotFoundError if it is gone (a writer's rename raced the listing); Rejected for
    anything else that is not a small regular file.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Rejected(NOT_REGULAR, "a symbolic link") from None
        raise Rejected(UNREADABLE, os.strerror(e.errno or 0)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Rejected(NOT_REGULAR, "not a regular file")
        if st.st_size > max_bytes:
            raise Rejected(TOO_LARGE, f"{st.st_size} bytes, more than {max_bytes}")
        chunks, left = [], max_bytes + 1  # one byte more tells a file that grew
        while left > 0:
            chunk = os.read(fd, min(left, _CHUNK))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise Rejected(UNREADABLE, os.strerror(e.errno or 0)) from None
    finally:
        os.close(fd)
    if left <= 0:
        raise Rejected(TOO_LARGE, f"more than {max_bytes} bytes")
    return b"".join(chunks), stamp_of(st)


def load(data: bytes, max_series: int) -> Snapshot:
    """Decodes, bounds, parses and validates one file's bytes; Rejected if not whole."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Rejected(MALFORMED, f"not UTF-8 at byte {e.start}") from None
    # Lines counted before parsing anything (exact for a well-formed file): a HELP and a
    # TYPE line per family, and one line per series.
    comments = text.count("\n#") + text.startswith("#")
    series = text.count("\n") - comments
    if series > max_series:
        raise Rejected(TOO_MANY_SERIES, f"{series} series, more than {max_series}")
    if comments > 2 * (len(_TRAINER) + len(_RETIRED)):
        raise _invalid(f"{comments} comment lines, more than the catalogue's families need")
    try:
        families = parse(text)
    except ValueError as e:
        raise Rejected(MALFORMED, str(e)) from None
    return validate(families)


def _invalid(detail: str) -> Rejected:
    return Rejected(INVALID, detail)


def validate(families: list[ParsedFamily]) -> Snapshot:
    """The families as a Snapshot if they are exactly what the writer writes."""
    owners: dict[Owner, dict[str, list[Sample]]] = {}
    lines: dict[Owner, dict[str, list[str]]] = {}
    ranks: dict[str, dict[str, str]] = {}
    series = retired = 0
    for position, fam in enumerate(families, 1):
        shape = _SHAPES.get(fam.name)
        if shape is None:
            raise _invalid(f"family {position} is not a trainer metric of the catalogue")
        if fam.type != shape.metric.type:
            raise _invalid(f"{shape.metric.name} is not a {shape.metric.type}")
        if shape.loader < 0:
            series += _process(shape, fam, ranks)
            continue
        served = lines
        if fam.name in _RETIRED:
            retired += 1
            served = {}  # checked (_consistent reads its samples), not served
        if fam.type == cat.HISTOGRAM:
            _histogram(shape, fam, owners, served)
        else:
            _simple(shape, fam, owners, served)
        if served is lines:
            series += len(fam.samples)
    # The parser refuses a family twice; an older writer's file lacks the families added
    # since, which are never its last (dataloader_info): a file cut short still lacks one.
    missing = len(_TRAINER) - len(families) + retired
    if missing and missing != len(_ADDED - {f.name for f in families}):
        raise _invalid(f"{missing} trainer families missing (cut short?)")
    _consistent(owners, beats=retired > 0)
    if not ranks.keys() <= {rank for _, rank in owners}:
        raise _invalid("a process's series for a rank without a loader in the file")
    return Snapshot(series, {owner: {name: "".join(chunk) for name, chunk in by_family.items()}
                             for owner, by_family in lines.items()}, ranks)


@dataclass(frozen=True)
class _Shape:
    """What the catalogue says a family's samples look like, worked out once."""

    metric: cat.Metric
    names: tuple[str, ...]  # label names, sorted as parsed labels are
    former: tuple[str, ...]  # an older writer's (cat.FORMER_LABELS), else names
    loader: int  # where loader and rank are among them (loader -1: a process's series)
    rank: int
    bounds: tuple[str, ...]  # le values, as instrument/hotpath/recorder.py writes them
    # Every layout allowed, by its first two le values (the second "" for +Inf alone: the
    # next line is _count's): a former layout may share its first le with the current one.
    layouts: dict[tuple[str, str], tuple[str, ...]]

    @staticmethod
    def of(metric: cat.Metric) -> _Shape:
        names = tuple(sorted(metric.labels))
        former = tuple(sorted(cat.FORMER_LABELS.get(metric.name, names)))
        layouts = [(*(repr(float(b)) for b in buckets), "+Inf") for buckets in (
            metric.buckets, *(cat.PHASE_BUCKETS.values() if "phase" in metric.labels else ()),
            *cat.FORMER_BUCKETS.get(metric.name, ()))]
        keyed = {(bounds[0], bounds[1] if len(bounds) > 1 else ""): bounds
                 for bounds in (*layouts, _INF_ONLY)}
        if len(keyed) != len(set((*layouts, _INF_ONLY))):
            raise ValueError(f"{metric.name}: two bucket layouts begin alike")
        loader = names.index("loader") if "loader" in names else -1
        return _Shape(metric, names, former, loader, names.index("rank"), layouts[0], keyed)


_SHAPES = {name: _Shape.of(m) for name, m in (*_TRAINER.items(), *_RETIRED.items())}
_new = tuple.__new__  # Sample(...) without its Python-level __new__: twice as fast


def _simple(shape: _Shape, fam: ParsedFamily, owners: dict[Owner, dict[str, list[Sample]]],
            lines: dict[Owner, dict[str, list[str]]]) -> None:
    metric, names, li, ri = shape.metric, shape.names, shape.loader, shape.rank
    counter = metric.type == cat.COUNTER
    seen: set[Labels] = set()
    owner: Owner | None = None
    out: list[Sample] = []
    text: list[str] = []
    for name, labels, value in fam.samples:
        pairs = labels.pairs
        if labels.names != names or pairs in seen:
            raise _invalid(f"{metric.name}: label names differ from the catalogue, "
                           "or a series twice")
        seen.add(pairs)
        if counter and not 0.0 <= value < math.inf:
            raise _invalid(f"{metric.name}: a counter negative or not finite")
        if owner is None or owner != (pairs[li][1], pairs[ri][1]):
            owner = (pairs[li][1], pairs[ri][1])
            out = owners.setdefault(owner, {}).setdefault(metric.name, [])
            text = lines.setdefault(owner, {}).setdefault(metric.name, [])
        out.append(_new(Sample, (name, labels.mapping, value, None, None, None)))
        text.append(f"{name}{labels.text} {float_text(value)}\n")


def _process(shape: _Shape, fam: ParsedFamily, ranks: dict[str, dict[str, str]]) -> int:
    """A process's gauge, one series per rank, into ranks; an older writer's (one per
    loader and rank, shape.former) once per rank, its latest. The series served."""
    metric = shape.metric
    seen: set[Labels] = set()
    latest: dict[str, float] = {}
    for _, labels, value in fam.samples:
        if labels.names not in (shape.names, shape.former) or labels.pairs in seen:
            raise _invalid(f"{metric.name}: label names differ from the catalogue, "
                           "or a series twice")
        seen.add(labels.pairs)
        rank = labels.mapping["rank"]
        latest[rank] = max(value, latest.get(rank, value))
    for rank, value in latest.items():
        quoted = rank.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
        ranks.setdefault(rank, {})[metric.name] = (
            f'{metric.name}{{rank="{quoted}"}} {float_text(value)}\n')
    return len(latest)


def _histogram(shape: _Shape, fam: ParsedFamily, owners: dict[Owner, dict[str, list[Sample]]],
               lines: dict[Owner, dict[str, list[str]]]) -> None:
    metric, names = shape.metric, shape.names
    with_le, inf = len(names) + 1, math.inf
    bucket, count, total = (metric.name + s for s in ("_bucket", "_count", "_sum"))
    samples = fam.samples
    seen: set[Labels] = set()
    start = 0
    while start < len(samples):
        # One of the layouts, known by its first two le (+Inf alone: the large-job setting).
        second = samples[start + 1][1].le if start + 1 < len(samples) else ""
        bounds = shape.layouts.get((samples[start][1].le, second), shape.bounds)
        width = len(bounds) + 2
        group = samples[start:start + width]
        start += width
        if len(group) < width or group[-1][0] == bucket:
            raise _invalid(f"{metric.name}: a histogram incomplete")
        labels = group[-1][1].pairs  # _sum's labels: the group's, without le
        if group[-1][1].names != names or labels in seen:
            raise _invalid(f"{metric.name}: label names differ from the catalogue, "
                           "or a series twice")
        seen.add(labels)
        owner = (labels[shape.loader][1], labels[shape.rank][1])
        out = owners.setdefault(owner, {}).setdefault(metric.name, [])
        text = lines.setdefault(owner, {}).setdefault(metric.name, [])
        previous = 0.0
        for (name, got, value), le in zip(group, bounds, strict=False):
            # The group's labels and one le: exactly the catalogue's label names.
            if got.le != le or name != bucket or got.rest != labels or len(
                    got.pairs) != with_le:
                raise _invalid(f"{metric.name}: buckets differ from the catalogue's")
            if not (previous <= value < inf and value.is_integer()):
                raise _invalid(f"{metric.name}: bucket counts not cumulative whole numbers")
            previous = value
            text.append(f"{name}{got.text} {float_text(value)}\n")
        (cname, clabels, cvalue), (sname, slabels, svalue) = group[-2:]
        if cname != count or clabels.pairs != labels or cvalue != previous:
            raise _invalid(f"{metric.name}: _count missing or not the +Inf bucket")
        if sname != total or not 0.0 <= svalue < inf:
            raise _invalid(f"{metric.name}: _sum missing, negative or not finite")
        # Only _count and _sum as samples: _consistent() reads labels, never buckets.
        out.append(_new(Sample, (cname, clabels.mapping, cvalue, None, None, None)))
        out.append(_new(Sample, (sname, slabels.mapping, svalue, None, None, None)))
        text.append(f"{cname}{clabels.text} {float_text(cvalue)}\n"
                    f"{sname}{slabels.text} {float_text(svalue)}\n")


def _consistent(owners: dict[Owner, dict[str, list[Sample]]], beats: bool) -> None:
    """The writer's invariants across families, per (loader, rank); beats: the file has
    the retired per-worker heartbeat family (an older writer's)."""
    for by_family in owners.values():
        if not by_family.keys() >= _ALWAYS:
            raise _invalid("a loader without all of its latency histograms and counters")
        phases = [s.labels.get("phase") for s in by_family.get(cat.TIME.name, ())]
        if not set(phases) <= _PHASES:
            raise _invalid(f"{cat.TIME.name}: a phase other than fetch and transfer")
        cpu, samples, beat = ([s.labels["worker"] for s in by_family.get(name, ())]
                              for name in (_CPU, _WORKER_SAMPLES, _HEARTBEAT))
        if (beats and beat != cpu) or not set(samples) <= set(cpu):
            raise _invalid("the per-worker families name different workers")
        epochs = by_family[cat.EPOCHS.name][0].value
        if epochs > 0 and cat.INFO.name not in by_family:
            raise _invalid(f"a loader that started an epoch without {cat.INFO.name} "
                           "(cut short?)")
