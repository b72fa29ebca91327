"""What clients may hold of the HTTP server: connections, time, and (in the training
process) answers. Shared by exporter.web.server, which serves, exporter.web.connection,
which runs each connection, and exporter.web.pacer; exporter.web.server explains why each
bound is what it is."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

RESERVED_FDS = 64  # for everything else: snapshot files, /proc, NVML, logs
# asyncio accepts up to this many connections in one go (and listens with it): evicted
# connections give their descriptors back only on the next turn of the loop.
ACCEPT_BATCH = 100
WAITERS = 16  # newcomers waiting for a slot while none can be evicted; others refused


@dataclass(frozen=True)
class Limits:
    """Bounds on what clients can hold; the defaults suit scrapes every 1 s to 2 min."""

    max_connections: int = 128
    read_header_timeout: float = 10.0
    idle_timeout: float = 150.0  # above Prometheus's longest usual scrape interval (2 min)
    write_timeout: float = 30.0
    # Pacing (0: none): one answer per peer address every peer_interval seconds, and
    # answers_per_second in all, each after a burst of pace_burst at once; a request
    # early for its turn waits for it.
    peer_interval: float = 0.0
    answers_per_second: float = 0.0
    pace_burst: int = 10


# In the training process the server shares the interpreter lock with the loop, so what
# clients make it do is bounded: a scraper every second (Prometheus, `top`, the doctor)
# is never held back, a client in a tight loop or fifty at once wait their turn.
# Measured by bench/scrapers.py (README, Performance).
IN_PROCESS = Limits(peer_interval=0.2, answers_per_second=20.0, pace_burst=10)


def connection_cap(limits: Limits) -> int:
    """max_connections, lowered so that connections (and newcomers waiting, and a batch of
    accepts) cannot exhaust the descriptors the process has left."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits.max_connections
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 0
    left = soft - in_use - RESERVED_FDS - ACCEPT_BATCH - WAITERS
    return max(4, min(limits.max_connections, left))
