"""Constants the per-batch path's two builds share, defined once: the Python build reads
them here, and the C extension (_hotpath.c) reads them from here when it is loaded.

A worker's row of the shared block (workerblock.py) is ROW_FIELDS int64 values in this
order: the process's CPU time, samples collated, the wall time (ns), its pid, batches it
could not count, batches miscounted, its thread's run-queue wait, and the CPU, wait and
wall time as of its first batch.
"""

from __future__ import annotations

ROW_FIELDS = ("cpu", "samples", "heartbeat", "pid", "uncounted", "miscounted", "wait",
              "first_cpu", "first_wait", "first_beat")
(CPU, SAMPLES, HEARTBEAT, PID, UNCOUNTED, MISCOUNTED, WAIT, FIRST_CPU, FIRST_WAIT,
 FIRST_BEAT) = range(len(ROW_FIELDS))
ROW_BYTES = len(ROW_FIELDS) * 8  # int64
FD_UNOPENED = -2  # a worker's schedstat file not opened yet (-1: it cannot be)
SCHEDSTAT = "/proc/thread-self/schedstat"  # run time, run-queue wait, timeslices (ns)
