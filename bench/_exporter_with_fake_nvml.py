"""The exporter as `dataloader-exporter serve` builds it, but over a fake NVML with N GPUs.

The real CLI always uses the real pynvml, and there is no GPU here, so the scrape
benchmark starts this instead: the same registry (Supervisor over trainer, gpu, shm and
host collectors, via exporter.sources.attach) served by exporter.web.server.serve, and the same
"listening on http://..." line on stderr. Only the NVML binding differs: tests/support/fake_nvml.py.

    python bench/_exporter_with_fake_nvml.py --metrics-dir DIR [--gpus 8]
        [--web.listen-address 127.0.0.1:0] [--stale-after SECONDS]
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from dataloader_exporter import __version__
from dataloader_exporter.exporter.collectors.base import SourceCollector
from dataloader_exporter.exporter.collectors.gpu_nvml import GpuCollector
from dataloader_exporter.exporter.collectors.host import HostCollector
from dataloader_exporter.exporter.collectors.shm_usage import ShmCollector
from dataloader_exporter.exporter.collectors.trainer import TrainerCollector
from dataloader_exporter.exporter.config import parse_address
from dataloader_exporter.exporter.sources import attach
from dataloader_exporter.exporter.web.server import serve

# tests/ is not a package: import the fake from tests/support/ with tests/ on the path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.fake_nvml import FakeGpu, FakeNvml  # type: ignore[import-not-found]

log = logging.getLogger("dataloader_exporter.exporter")


class QuietFakeNvml(FakeNvml):
    """FakeNvml without its call log, which would grow by 56 entries a scrape (8 GPUs)."""

    def _enter(self, name: str, gpu: Any = None) -> None:
        super()._enter(name, gpu)
        with self._lock:
            self.calls.clear()


def fake_nvml(gpus: int) -> FakeNvml:
    """`gpus` busy 80 GB GPUs with distinct, plausible readings."""
    return QuietFakeNvml([
        FakeGpu(uuid=f"GPU-00000000-0000-0000-0000-{i:012d}", name="NVIDIA H100 80GB HBM3",
                util=90 - i, mem_util=60 + i, used=(40 + i) * 2**30, rx_kb=12_000_000 + i,
                tx_kb=900_000 + i, temp=60 + i, power_mw=550_000 + 1000 * i)
        for i in range(gpus)
    ])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--web.listen-address", dest="listen", default="127.0.0.1:0")
    parser.add_argument("--metrics-dir", required=True)
    parser.add_argument("--stale-after", type=float, default=30.0)
    parser.add_argument("--gpus", type=int, default=8)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, port = parse_address(args.listen)
    # The CLI's order: trainer first, then gpu, shm and host (exporter.serve_cli.run_serve).
    sources: list[SourceCollector] = [
        TrainerCollector(args.metrics_dir, args.stale_after),
        GpuCollector(nvml=fake_nvml(args.gpus)), ShmCollector(), HostCollector()]
    registry = CollectorRegistry()
    supervisor = attach(registry, sources)
    handle = serve(registry, host, port)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("dataloader-exporter %s (fake NVML, %d GPUs) listening on %s (collectors: %s)",
             __version__, args.gpus, handle.url, ", ".join(s.name for s in sources))
    stop.wait()
    handle.shutdown()
    supervisor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
