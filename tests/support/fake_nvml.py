"""A hand-written stand-in for pynvml: configurable GPUs, failures, a missing library, slowness.

It mirrors the names GpuCollector calls and pynvml's error classes and constants, so the
collector cannot tell it from the real binding. Every call is recorded in `calls`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
NVML_TEMPERATURE_GPU = 0


class NVMLError(Exception):
    """Like pynvml.NVMLError: carries NVML's numeric error value."""

    value = 999  # NVML_ERROR_UNKNOWN

    def __str__(self) -> str:
        return f"{type(self).__name__} (fake NVML error {self.value})"


# pynvml spells its error classes NVMLError_Name; the fake keeps that spelling.
class NVMLError_Uninitialized(NVMLError):
    value = 1


class NVMLError_NotSupported(NVMLError):
    value = 3


class NVMLError_DriverNotLoaded(NVMLError):
    value = 9


class NVMLError_LibraryNotFound(NVMLError):
    value = 12


class NVMLError_GpuIsLost(NVMLError):
    value = 15


@dataclass
class FakeGpu:
    """One GPU's readings, in NVML's own units (percent, bytes, KB/s, Celsius, milliwatts)."""

    uuid: str
    name: str = "NVIDIA Fake 80GB"
    util: int = 0
    mem_util: int = 0
    used: int = 0
    total: int = 80 * 2**30
    rx_kb: int = 0
    tx_kb: int = 0
    temp: int = 40
    power_mw: int = 100_000
    # Call name (e.g. "nvmlDeviceGetPowerUsage") -> the error that call raises for this GPU.
    failures: dict[str, NVMLError] = field(default_factory=dict)


class FakeNvml:
    """A module-like object with pynvml's functions, over a list of FakeGpu."""

    NVMLError = NVMLError
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVML_PCIE_UTIL_TX_BYTES = NVML_PCIE_UTIL_TX_BYTES
    NVML_PCIE_UTIL_RX_BYTES = NVML_PCIE_UTIL_RX_BYTES
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU

    def __init__(self, gpus: list[FakeGpu] | None = None, *, library_missing: bool = False,
                 driver: str = "555.42.06", delay: float = 0.0) -> None:
        self.gpus = list(gpus or [])
        self.library_missing = library_missing
        self.driver = driver
        self.delay = delay  # seconds every call waits, until release() is called
        self.initialized = False
        self.calls: list[str] = []
        self._released = threading.Event()
        self._lock = threading.Lock()

    # --- test controls ----------------------------------------------------------------
    def add_gpu(self, gpu: FakeGpu) -> None:
        self.gpus.append(gpu)

    def install_library(self) -> None:
        """The driver appears: nvmlInit succeeds from now on."""
        self.library_missing = False

    def unload_driver(self) -> None:
        """The driver goes away: calls fail as uninitialized and nvmlInit fails."""
        self.initialized = False
        self.library_missing = True

    def release(self) -> None:
        """End every delay, now and later (call it when a slow test is done)."""
        self._released.set()

    def count(self, name: str) -> int:
        with self._lock:
            return self.calls.count(name)

    def _enter(self, name: str, gpu: FakeGpu | None = None) -> None:
        with self._lock:
            self.calls.append(name)
        if self.delay:
            self._released.wait(self.delay)
        if name != "nvmlInit" and not self.initialized:
            raise NVMLError_Uninitialized()
        if gpu is not None and name in gpu.failures:
            raise gpu.failures[name]

    # --- pynvml's functions, under pynvml's names ---------------------------------------
    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.library_missing:
            raise NVMLError_LibraryNotFound()
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        if index >= len(self.gpus):
            raise NVMLError()
        self._enter("nvmlDeviceGetHandleByIndex", self.gpus[index])
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, gpu: FakeGpu) -> str:
        self._enter("nvmlDeviceGetUUID", gpu)
        return gpu.uuid

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str:
        self._enter("nvmlDeviceGetName", gpu)
        return gpu.name

    def nvmlDeviceGetUtilizationRates(self, gpu: FakeGpu) -> SimpleNamespace:
        self._enter("nvmlDeviceGetUtilizationRates", gpu)
        return SimpleNamespace(gpu=gpu.util, memory=gpu.mem_util)

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> SimpleNamespace:
        self._enter("nvmlDeviceGetMemoryInfo", gpu)
        return SimpleNamespace(used=gpu.used, total=gpu.total, free=gpu.total - gpu.used)

    def nvmlDeviceGetPcieThroughput(self, gpu: FakeGpu, counter: int) -> int:
        self._enter("nvmlDeviceGetPcieThroughput", gpu)
        return gpu.rx_kb if counter == NVML_PCIE_UTIL_RX_BYTES else gpu.tx_kb

    def nvmlDeviceGetTemperature(self, gpu: FakeGpu, sensor: int) -> int:
        self._enter("nvmlDeviceGetTemperature", gpu)
        assert sensor == NVML_TEMPERATURE_GPU
        return gpu.temp

    def nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int:
        self._enter("nvmlDeviceGetPowerUsage", gpu)
        return gpu.power_mw
