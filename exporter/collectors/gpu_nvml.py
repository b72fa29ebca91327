"""GPU metrics from NVML (nvidia-ml-py), read off the scrape thread.

Why it looks like this: NVML can be absent (CPU-only hosts, no driver in the container),
can appear later (driver loaded after the exporter started), can fail for one GPU or one
field (no power sensor), and a sick driver can hang a call for seconds. So NVML state
and every NVML call live in one long-lived daemon thread; a scrape hands it one read and
waits at most `call_timeout`. The scrape thread only turns the finished read into fresh
families, counts errors and logs each problem once.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric as Family

from dataloader_exporter.core import catalogue as c
from dataloader_exporter.core.logonce import LogOnce
from dataloader_exporter.exporter.collectors.base import family

log = logging.getLogger("dataloader_exporter.exporter.gpu")

# Errors after which the NVML session is gone: drop it and init again at the next retry.
_SESSION_LOST = ("NVMLError_Uninitialized", "NVMLError_DriverNotLoaded",
                 "NVMLError_LibraryNotFound")
_PER_GPU = (c.GPU_UTILIZATION, c.GPU_MEMORY_UTILIZATION, c.GPU_MEMORY_USED,
            c.GPU_MEMORY_TOTAL, c.GPU_PCIE_RX, c.GPU_PCIE_TX, c.GPU_TEMPERATURE, c.GPU_POWER)


def _gauge(metric: c.Metric) -> GaugeMetricFamily:
    return cast(GaugeMetricFamily, family(metric))  # family() is typed as the base class


def _utilization(nv: Any, handle: Any) -> dict[c.Metric, float]:
    rates = nv.nvmlDeviceGetUtilizationRates(handle)  # percent
    return {c.GPU_UTILIZATION: rates.gpu / 100.0, c.GPU_MEMORY_UTILIZATION: rates.memory / 100.0}


def _memory(nv: Any, handle: Any) -> dict[c.Metric, float]:
    info = nv.nvmlDeviceGetMemoryInfo(handle)
    return {c.GPU_MEMORY_USED: float(info.used), c.GPU_MEMORY_TOTAL: float(info.total)}


def _pcie_rx(nv: Any, handle: Any) -> dict[c.Metric, float]:
    kb = nv.nvmlDeviceGetPcieThroughput(handle, nv.NVML_PCIE_UTIL_RX_BYTES)  # KB/s
    return {c.GPU_PCIE_RX: kb * 1024.0}


def _pcie_tx(nv: Any, handle: Any) -> dict[c.Metric, float]:
    kb = nv.nvmlDeviceGetPcieThroughput(handle, nv.NVML_PCIE_UTIL_TX_BYTES)  # KB/s
    return {c.GPU_PCIE_TX: kb * 1024.0}


def _temperature(nv: Any, handle: Any) -> dict[c.Metric, float]:
    return {c.GPU_TEMPERATURE: float(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU))}


def _power(nv: Any, handle: Any) -> dict[c.Metric, float]:
    return {c.GPU_POWER: nv.nvmlDeviceGetPowerUsage(handle) / 1000.0}  # milliwatts


# One NVML call per field; a failing call loses only the metrics it feeds.
_FIELDS: tuple[tuple[str, Callable[[Any, Any], dict[c.Metric, float]]], ...] = (
    ("utilization", _utilization), ("memory", _memory), ("pcie_rx", _pcie_rx),
    ("pcie_tx", _pcie_tx), ("temperature", _temperature), ("power", _power),
)


def _text(value: object) -> str:
    """NVML strings are str in current bindings and bytes in old ones."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


@dataclass
class _Device:
    index: str
    handle: Any
    uuid: str
    name: str


@dataclass
class _Reading:
    """What one read found: values per GPU, and the calls that failed (key, message)."""

    driver: str = ""
    devices: list[_Device] = field(default_factory=list)
    values: dict[str, dict[c.Metric, float]] = field(default_factory=dict)
    failures: list[tuple[str, str]] = field(default_factory=list)
    unavailable: bool = False  # no NVML session this scrape (waiting to retry init)


class _Job:
    def __init__(self, fn: Callable[[], _Reading]) -> None:
        self.fn, self.done, self.result = fn, threading.Event(), _Reading()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except Exception as err:  # a bug or an odd binding must not kill the worker
            self.result = _Reading(failures=[("read", f"NVML read failed: {err!r}")])
        self.done.set()


class GpuCollector:
    """Per-GPU utilization, memory, PCIe, temperature and power, plus a gpu_info series."""

    name = "gpu"

    def __init__(self, nvml: Any = None, call_timeout: float = 0.5,
                 retry_interval: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.up = False
        self.errors = 0
        self.call_timeout = call_timeout
        self.retry_interval = retry_interval
        self._nvml, self._clock = nvml, clock
        self._lock = threading.Lock()
        self._logs = LogOnce(log)
        self._active: set[str] = set()
        self._jobs: queue.SimpleQueue[_Job | None] | None = None  # the worker's inbox
        self._pending: _Job | None = None
        # Touched only by the worker thread:
        self._initialized = False
        self._refresh_at = float("-inf")
        self._driver = ""
        self._devices: list[_Device] = []

    def collect(self) -> Iterable[Family]:
        with self._lock:  # concurrent scrapes take turns rather than start two reads
            families = self._collect()
        yield from families

    def _collect(self) -> list[Family]:
        if self._pending is not None and not self._pending.done.is_set():
            return self._timed_out("NVML is still busy with a read from an earlier scrape")
        job = _Job(self._read)
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(self._jobs,), name="gpu-collector-nvml",
                             daemon=True).start()
        self._jobs.put(job)
        if not job.done.wait(self.call_timeout):
            self._pending = job
            return self._timed_out(f"NVML did not answer within {self.call_timeout:g}s")
        self._pending = None
        reading = job.result
        self._account(reading)
        return self._families(reading)

    def _timed_out(self, message: str) -> list[Family]:
        self.up = False
        self.errors += 1
        self._active.add("timeout")
        self._logs.problem("timeout", "GPU metrics skipped: %s", message)
        return []

    def _account(self, reading: _Reading) -> None:
        active = {key for key, _ in reading.failures} | ({"init"} if reading.unavailable else set())
        for key, message in reading.failures:
            self.errors += 1
            self._logs.problem(key, "GPU collector: %s", message)
        for key in sorted(self._active - active):
            self._logs.cleared(key, "GPU collector: %s works again", key)
        self._active = active
        self.up = not active

    def _families(self, reading: _Reading) -> list[Family]:
        info = _gauge(c.GPU_INFO)
        per_gpu = {m: _gauge(m) for m in _PER_GPU}
        for dev in reading.devices:
            info.add_metric([dev.index, dev.uuid, dev.name, reading.driver], 1.0)
            for metric, value in reading.values.get(dev.index, {}).items():
                per_gpu[metric].add_metric([dev.index, dev.uuid], value)
        return [info, *per_gpu.values()] if reading.devices else []

    def close(self) -> None:
        """Shut NVML down and stop the worker thread, waiting at most call_timeout."""
        with self._lock:
            if self._jobs is None:
                return
            job = _Job(self._close)
            self._jobs.put(job)
            self._jobs.put(None)
            self._jobs = None
        job.done.wait(self.call_timeout)

    # --- everything below runs in the worker thread ---------------------------------------
    def _serve(self, jobs: queue.SimpleQueue[_Job | None]) -> None:
        while (job := jobs.get()) is not None:
            job.run()

    def _close(self) -> _Reading:
        self._refresh_at = float("-inf")  # a later scrape starts NVML afresh
        return self._shutdown()

    def _shutdown(self) -> _Reading:
        if self._initialized:
            self._initialized = False
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()
        return _Reading()

    def _read(self) -> _Reading:
        reading = _Reading()
        now = self._clock()
        if now >= self._refresh_at:
            self._refresh_at = now + self.retry_interval
            self._refresh(reading)
        if not self._initialized:
            reading.unavailable = True
            return reading
        reading.driver, reading.devices = self._driver, list(self._devices)
        for dev in reading.devices:
            reading.values[dev.index] = self._read_device(dev, reading)
            if not self._initialized:  # the session died during this read
                break
        return reading

    def _refresh(self, reading: _Reading) -> None:
        """Init NVML if needed, then list the GPUs: so late drivers and GPUs show up."""
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            nv = self._nvml
            if not self._initialized:
                nv.nvmlInit()
                self._initialized = True
            self._driver = _text(nv.nvmlSystemGetDriverVersion())
            count = nv.nvmlDeviceGetCount()
        except Exception as err:  # ImportError or NVMLError: NVML is not usable now
            self._shutdown()
            reading.failures.append(("init", f"NVML unavailable ({err}); retrying every "
                                     f"{self.retry_interval:g}s"))
            return
        devices = []
        for i in range(count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                uuid = _text(nv.nvmlDeviceGetUUID(handle))
                devices.append(_Device(str(i), handle, uuid, _text(nv.nvmlDeviceGetName(handle))))
            except nv.NVMLError as err:
                reading.failures.append((f"gpu{i}:handle", f"GPU {i} not listed: {err}"))
                self._refresh_at = self._clock()  # try this GPU again next scrape
        self._devices = devices

    def _read_device(self, dev: _Device, reading: _Reading) -> dict[c.Metric, float]:
        nv, values = self._nvml, {}
        for name, read in _FIELDS:
            try:
                values.update(read(nv, dev.handle))
            except nv.NVMLError as err:
                reading.failures.append(
                    (f"gpu{dev.index}:{name}", f"GPU {dev.index} ({dev.uuid}) {name}: {err}"))
                if self._is(err, *_SESSION_LOST):
                    self._shutdown()
                    self._refresh_at = self._clock()  # init again at the next scrape
                    break
                if self._is(err, "NVMLError_GpuIsLost"):
                    self._refresh_at = self._clock()  # list the GPUs again next scrape
        return values

    def _is(self, err: Exception, *names: str) -> bool:
        """Whether err is one of the binding's NVMLError subclasses of these names."""
        kinds = [getattr(self._nvml, n, None) for n in names]
        return isinstance(err, tuple(k for k in kinds if isinstance(k, type)))
