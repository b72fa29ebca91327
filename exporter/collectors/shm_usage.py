"""Size and use of the shared-memory filesystem (/dev/shm).

DataLoader workers hand batches to the main process through /dev/shm; Docker's default
64 MB fills up and kills workers with a "bus error", so this is worth a gauge. statvfs is
injected so tests can give exact numbers or a small filesystem.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import Any, cast

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric as Family

from dataloader_exporter.core import catalogue as c
from dataloader_exporter.core.facts.shm import SHM_PATH, read_shm
from dataloader_exporter.core.logonce import LogOnce
from dataloader_exporter.exporter.collectors.base import family

log = logging.getLogger("dataloader_exporter.exporter.shm")


class ShmCollector:
    """shm_size_bytes, shm_used_bytes and shm_free_bytes for one path."""

    name = "shm"

    def __init__(self, path: str = SHM_PATH,
                 statvfs: Callable[[str], Any] = os.statvfs) -> None:
        self.path = path
        self.up = False
        self.errors = 0
        self._statvfs = statvfs
        self._logs = LogOnce(log)

    def collect(self) -> Iterable[Family]:
        try:
            space = read_shm(self.path, self._statvfs)
        except OSError as err:
            self.up = False
            self.errors += 1
            self._logs.problem("statvfs", "shm metrics skipped: cannot stat %s: %s",
                               self.path, err)
            return
        self.up = True
        self._logs.cleared("statvfs", "shm metrics: %s readable again", self.path)
        values = {
            c.SHM_SIZE: space.size, c.SHM_USED: space.used, c.SHM_FREE: space.free,
        }
        for metric, value in values.items():
            fam = cast(GaugeMetricFamily, family(metric))
            fam.add_metric([self.path], float(value))
            yield fam
