"""The overview's row on the loader's workers as the trainer reads them from /proc: where
their wall time goes (running, waiting for a CPU, blocked), their memory and its growth
(copy-on-read), their reads, and why they failed. Each panel reads per loader; the $rank
variable picks ranks."""

from __future__ import annotations

from dataloader_exporter.core import bands
from dataloader_exporter.core import catalogue as cat

from ..model import BYTES, BYTES_PER_SECOND, COUNT, Panel, Row
from ..promql import (
    GROWTH_HORIZON_S,
    LOADER,
    RATE_INTERVAL,
    rate,
    sel,
    worker_memory,
    workers_by_state,
)

W = RATE_INTERVAL
_ROOM = "available"  # not the workers' memory: what more of them would have to fit in
_HELD = f'kind!="{_ROOM}"'
_HOURS = GROWTH_HORIZON_S // 3600

WHY_WORKERS = Row("Why the workers are slow, and why they fail", (
    Panel("Worker time by state",
          "The loader's workers in each state while the loader hands out batches, stacked, so "
          "the stack is its live workers then (0 while the loader is idle): running on a CPU, "
          "waiting for a CPU (runnable but queued: more workers than cores, "
          "or other processes on them), and blocked (storage, the network, a lock, a full "
          "queue or sleep); from /proc, Linux only. Good: while the loop waits for data (Input "
          "stall share high) the largest part says what to fix. Mostly running: the samples "
          "cost CPU (more workers only if cores are free, else cheaper samples or more cores). "
          f"Waiting for a CPU {round(bands.CPU_CONTENTION * 100)}% of the time or more: too many "
          "workers for the cores they get (fewer workers; DataLoaderWorkersCpuStarved). "
          "Mostly blocked: storage or the network (more workers, a deeper prefetch_factor, "
          "caching, faster storage). While the loop does not wait, blocked is mostly workers "
          "idle on a full queue, which is fine.",
          COUNT, (("{{loader}} {{state}}", workers_by_state(LOADER, W, "loader")),),
          stack=True),
    Panel("Worker memory",
          "Memory of the loader's live workers, summed: PSS (shared pages divided among their "
          "sharers: what the workers really cost, about PSS / workers each) and swap, or RSS "
          "instead of PSS where PSS cannot be read (pages shared copy-on-write with the main "
          "process count in every worker, so it overstates); and the largest worker's RSS. "
          "Good: flat, with swap at 0. Growing: something accumulates per worker (a cache, "
          "Python objects touched copy-on-access: keep datasets in numpy arrays or tensors; "
          "see Worker memory growth). Swap in use and growing slows workers to a crawl and the "
          "OOM killer is next: fewer workers or a lower prefetch_factor. The doctor never "
          "advises more workers than the memory available holds at this size: available is "
          "the least the trainer's container could still allocate while they ran (per rank, "
          "so the panel shows the tightest rank).",
          BYTES, (("{{loader}} {{kind}}",
                   f"sum by (loader, kind) "
                   f"({sel(cat.WORKER_MEMORY, f'{LOADER},{_HELD}')})"),
                  ("{{loader}} available (tightest rank)",
                   f"min by (loader) ({worker_memory(_ROOM, LOADER)})"),
                  ("{{loader}} largest worker (rss)",
                   f"max by (loader) ({sel(cat.WORKER_MAX_RSS, LOADER)})"))),
    Panel("Worker memory growth",
          "How much the private memory (USS) of the loader's live workers would grow in "
          f"{_HOURS} hours at the rate the trainer measures (summed over the workers, each "
          "over its last minutes, past the batches it has in hand; the latest measured, kept "
          "after the workers end), at the fastest rank; the least memory the trainer's "
          "container could still allocate while they ran, at the tightest rank; the workers' "
          "PSS, at the largest rank, which rises with a real growth; and the largest container "
          "of Python objects among the dataset's attributes (its path, type, item type and "
          "items), with about what each worker copies once it has read it all. Good: the "
          f"{_HOURS}-hour growth near 0 once the workers have read the data, and well under "
          "available. Growth above available while PSS rises: the workers or the trainer will "
          "be OOM-killed hours into the run (DataLoaderWorkerMemoryGrowth). The usual cause "
          "is copy-on-read: a worker that reads a Python object writes its reference count "
          "and so copies its page, and a list of paths or dicts ends up copied into every "
          "worker; the container shown is the one to change. Store it as a numpy array "
          '(np.array(paths, dtype="S")), a pyarrow array or a tensor; `dataloader-exporter '
          'doctor` names it and the time left.',
          BYTES, ((f"{{{{loader}}}} growth in {_HOURS} h at the measured rate (fastest rank)",
                   f"max by (loader) ({sel(cat.WORKER_PRIVATE_GROWTH, LOADER)}) * "
                   f"{GROWTH_HORIZON_S}"),
                  ("{{loader}} available (tightest rank)",
                   f"min by (loader) ({worker_memory(_ROOM, LOADER)})"),
                  ("{{loader}} pss (largest rank)",
                   f"max by (loader) ({worker_memory('pss', LOADER)})"),
                  ("{{loader}} {{attribute}}: {{container}} of {{objects}} {{item}} "
                   "(each worker)",
                   f"max by (loader, attribute, container, item, objects) "
                   f"({sel(cat.DATASET_OBJECTS, LOADER)})"))),
    Panel("Worker reads",
          "Bytes per second the loader's workers read: from storage (block devices), and "
          "through read calls of any kind (syscalls: the page cache and the network too). "
          "Good: steady, and well under what the storage delivers. Workers mostly blocked "
          "while storage reads sit near the device's limit: storage-bound (faster storage, "
          "caching, fewer and larger reads). Blocked with many reads but few from storage: "
          "the network; with few reads of any kind: not I/O at all (locks, sleep, a slow "
          "remote API).",
          BYTES_PER_SECOND,
          (("{{loader}} {{source}}",
            f"sum by (loader, source) ({rate(sel(cat.WORKER_READ, LOADER), W)})"),)),
    Panel("Worker major page faults",
          "Pages the loader's workers had to read back from disk or swap, per second: memory-"
          "mapped files (numpy memmap, Arrow, LMDB) read on first touch, or swapped-out pages. "
          "Good: near 0 once the data is warm. High while workers are blocked: they wait on "
          "the disk through memory maps (faster storage, a warm page cache, or fewer workers "
          "when it is swap: see Worker memory).",
          COUNT, (("{{loader}}", f"sum by (loader) "
                                 f"({rate(sel(cat.WORKER_MAJOR_FAULTS, LOADER), W)})"),)),
    Panel("Worker failures by cause",
          "Failures of the loader's workers in each interval, by the cause the trainer "
          "observed: oom (killed while the cgroup's OOM-kill count rose: fewer workers, a "
          "lower prefetch_factor or a higher memory limit), killed (another kill: a "
          "scheduler, a watchdog, a person), crash (native code such as a decoding library: "
          "run with num_workers=0 to see the traceback), shm (/dev/shm full: a larger "
          "--shm-size or sizeLimit, fewer workers or a lower prefetch_factor), error (the "
          "dataset raised). Good: nothing plotted.",
          COUNT, (("{{loader}} rank {{rank}} {{cause}}",
                   f"sum by (loader, rank, cause) (increase({sel(cat.FAILURES, LOADER)}[{W}])) "
                   "> 0"),)),
))
