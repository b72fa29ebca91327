"""GpuCollector against a hand-written fake NVML, and against the real pynvml (no GPU here)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from support.clock import Clock
from support.fake_nvml import FakeGpu, FakeNvml, NVMLError, NVMLError_NotSupported

from dataloader_exporter.core import catalogue as c
from dataloader_exporter.exporter.collectors.gpu_nvml import GpuCollector

A100 = FakeGpu("GPU-aaaa", name="NVIDIA A100-SXM4-80GB", util=75, mem_util=30,
               used=10 * 2**30, total=80 * 2**30, rx_kb=2048, tx_kb=512, temp=65,
               power_mw=250_500)
H100 = FakeGpu("GPU-bbbb", name="NVIDIA H100 80GB HBM3", util=5, mem_util=1,
               used=2**30, total=80 * 2**30, rx_kb=0, tx_kb=1, temp=33, power_mw=70_000)


def gpu(index: int, uuid: str) -> dict[str, str]:
    return {"gpu": str(index), "gpu_uuid": uuid}


def registered(collector: GpuCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def scrape(registry: CollectorRegistry) -> None:
    list(registry.collect())


def gpu_log_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dataloader_exporter.exporter.gpu"]


def make(*gpus: FakeGpu, call_timeout: float = 5.0, retry_interval: float = 30.0,
         clock: Callable[[], float] = time.monotonic,
         ) -> tuple[FakeNvml, GpuCollector, CollectorRegistry]:
    fake = FakeNvml([replace(g) for g in gpus])  # copies: tests may change them
    collector = GpuCollector(nvml=fake, call_timeout=call_timeout,
                             retry_interval=retry_interval, clock=clock)
    return fake, collector, registered(collector)


def test_several_gpus_are_reported_in_base_units() -> None:
    _, collector, registry = make(A100, H100)
    expected = {
        c.GPU_UTILIZATION: (0.75, 0.05),
        c.GPU_MEMORY_UTILIZATION: (0.3, 0.01),
        c.GPU_MEMORY_USED: (10 * 2**30, 2**30),
        c.GPU_MEMORY_TOTAL: (80 * 2**30, 80 * 2**30),
        c.GPU_PCIE_RX: (2048 * 1024, 0),
        c.GPU_PCIE_TX: (512 * 1024, 1024),
        c.GPU_TEMPERATURE: (65, 33),
        c.GPU_POWER: (250.5, 70.0),
    }
    for metric, (first, second) in expected.items():
        assert registry.get_sample_value(metric.name, gpu(0, "GPU-aaaa")) == first, metric.name
        assert registry.get_sample_value(metric.name, gpu(1, "GPU-bbbb")) == second, metric.name
    info = {**gpu(1, "GPU-bbbb"), "name": "NVIDIA H100 80GB HBM3", "driver_version": "555.42.06"}
    assert registry.get_sample_value(c.GPU_INFO.name, info) == 1
    assert collector.up is True
    assert collector.errors == 0


def test_nvml_is_initialised_once_and_kept_across_scrapes() -> None:
    fake, _, registry = make(A100)
    for _ in range(5):
        scrape(registry)
    assert fake.count("nvmlInit") == 1
    assert fake.count("nvmlShutdown") == 0


def test_a_failing_gpu_is_skipped_while_the_others_are_reported(
        caplog: pytest.LogCaptureFixture) -> None:
    broken = FakeGpu("GPU-bbbb", failures={"nvmlDeviceGetHandleByIndex": NVMLError()})
    _, collector, registry = make(A100, broken)
    scrape(registry)
    assert collector.up is False
    assert collector.errors == 1
    assert registry.get_sample_value(c.GPU_UTILIZATION.name, gpu(0, "GPU-aaaa")) == 0.75
    assert registry.get_sample_value(c.GPU_UTILIZATION.name, gpu(1, "GPU-bbbb")) is None
    for _ in range(3):
        scrape(registry)
    assert collector.errors == 6  # one failed call each scrape
    assert len(gpu_log_lines(caplog)) == 1
    assert "GPU 1" in gpu_log_lines(caplog)[0]


def test_a_failing_field_loses_only_its_own_metric(caplog: pytest.LogCaptureFixture) -> None:
    no_power = replace(A100, uuid="GPU-cccc",
                       failures={"nvmlDeviceGetPowerUsage": NVMLError_NotSupported()})
    _, collector, registry = make(H100, no_power)
    scrape(registry)
    assert collector.up is False
    assert collector.errors == 1
    assert registry.get_sample_value(c.GPU_POWER.name, gpu(1, "GPU-cccc")) is None
    assert registry.get_sample_value(c.GPU_UTILIZATION.name, gpu(1, "GPU-cccc")) == 0.75
    assert registry.get_sample_value(c.GPU_TEMPERATURE.name, gpu(1, "GPU-cccc")) == 65
    assert registry.get_sample_value(c.GPU_POWER.name, gpu(0, "GPU-bbbb")) == 70.0
    info = {**gpu(1, "GPU-cccc"), "name": A100.name, "driver_version": "555.42.06"}
    assert registry.get_sample_value(c.GPU_INFO.name, info) == 1
    lines = gpu_log_lines(caplog)
    assert len(lines) == 1
    assert "power" in lines[0]


def test_a_missing_library_gives_no_gpu_series_and_logs_once(
        caplog: pytest.LogCaptureFixture, clock: Clock) -> None:
    fake = FakeNvml([FakeGpu("GPU-aaaa")], library_missing=True)
    collector = GpuCollector(nvml=fake, retry_interval=30.0, clock=clock)
    registry = registered(collector)
    for _ in range(5):
        assert generate_latest(registry) == b""
    assert collector.up is False
    assert collector.errors == 1  # one failed init; the scrapes between retries call nothing
    assert fake.count("nvmlInit") == 1
    clock.advance(30.0)
    for _ in range(5):
        scrape(registry)
    assert collector.errors == 2
    assert len(gpu_log_lines(caplog)) == 1
    assert "NVML unavailable" in gpu_log_lines(caplog)[0]


def test_a_driver_that_appears_later_is_picked_up_after_the_retry_interval(clock: Clock) -> None:
    fake = FakeNvml([replace(A100)], library_missing=True)
    collector = GpuCollector(nvml=fake, retry_interval=30.0, clock=clock)
    registry = registered(collector)
    scrape(registry)
    fake.install_library()
    clock.advance(29.0)
    assert registry.get_sample_value(c.GPU_UTILIZATION.name, gpu(0, "GPU-aaaa")) is None
    assert fake.count("nvmlInit") == 1
    clock.advance(1.0)
    assert registry.get_sample_value(c.GPU_UTILIZATION.name, gpu(0, "GPU-aaaa")) == 0.75
    assert collector.up is True


def test_a_gpu_added_later_is_listed_after_the_retry_interval(clock: Clock) -> None:
    fake, _, registry = make(A100, retry_interval=30.0, clock=clock)
    scrape(registry)
    fake.add_gpu(replace(H100))
    clock.advance(10.0)
    assert registry.get_sample_value(c.GPU_UTILIZATION.name, gpu(1, "GPU-bbbb")) is None
    clock.advance(20.0)
    assert registry.get_sample_value(c.GPU_UTILIZATION.name, gpu(1, "GPU-bbbb")) == 0.05
    assert registry.get_sample_value(c.GPU_UTILIZATION.name, gpu(0, "GPU-aaaa")) == 0.75


def test_a_driver_that_goes_away_is_reinitialised_when_it_returns(clock: Clock) -> None:
    fake, collector, registry = make(A100, retry_interval=30.0, clock=clock)
    scrape(registry)
    fake.unload_driver()
    scrape(registry)  # calls fail as uninitialized: the session is dropped
    assert collector.up is False
    scrape(registry)  # init is tried again at once, fails, and waits for the interval
    assert fake.count("nvmlInit") == 2
    fake.install_library()
    clock.advance(30.0)
    assert registry.get_sample_value(c.GPU_MEMORY_USED.name, gpu(0, "GPU-aaaa")) == 10 * 2**30
    assert collector.up is True
    assert fake.count("nvmlInit") == 3


def test_a_slow_nvml_is_bounded_by_the_call_timeout() -> None:
    fake, collector, registry = make(A100, call_timeout=0.2)
    fake.delay = 30.0
    try:
        started = time.perf_counter()
        exposition = generate_latest(registry)
        assert time.perf_counter() - started < 1.0
        assert exposition == b""
        assert collector.up is False
        assert collector.errors == 1
        started = time.perf_counter()
        scrape(registry)  # the first read is still stuck: no second one is queued
        assert time.perf_counter() - started < 1.0
        assert collector.errors == 2
        assert fake.count("nvmlInit") == 1
    finally:
        fake.release()
    deadline = time.monotonic() + 5.0
    while not collector.up and time.monotonic() < deadline:
        scrape(registry)
    assert collector.up is True
    assert registry.get_sample_value(c.GPU_UTILIZATION.name, gpu(0, "GPU-aaaa")) == 0.75
    # Reads: the stuck one, the one that brought it back, get_sample_value's. A read queued
    # by the second scrape would make it four.
    assert fake.count("nvmlDeviceGetUtilizationRates") == 3


def test_close_shuts_nvml_down_and_a_later_scrape_starts_again() -> None:
    fake, collector, registry = make(A100)
    scrape(registry)
    collector.close()
    assert fake.count("nvmlShutdown") == 1
    assert fake.initialized is False
    assert registry.get_sample_value(c.GPU_TEMPERATURE.name, gpu(0, "GPU-aaaa")) == 65


def test_the_real_pynvml_without_a_gpu_degrades_cleanly() -> None:
    collector = GpuCollector()
    registry = registered(collector)
    exposition = generate_latest(registry).decode()
    if collector.up:
        pytest.skip("NVML works on this machine; the GPU-less path cannot be checked here")
    assert collector.errors >= 1
    assert c.GPU_INFO.name not in exposition


def test_gpu_exposition_passes_promtool_check_metrics(promtool: str) -> None:
    _, _, registry = make(A100, H100)
    result = subprocess.run([promtool, "check", "metrics"], input=generate_latest(registry),
                            capture_output=True, timeout=30, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
