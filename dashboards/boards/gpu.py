"""The "GPU" dashboard: utilization, memory, PCIe, temperature and power per GPU.

The exporter's NVML collector feeds it; read it next to the DataLoader overview to tell
a starving GPU (low utilization, high input stall) from a busy or throttled one.
"""

from __future__ import annotations

from dataloader_exporter.core import bands
from dataloader_exporter.core import catalogue as cat

from .. import dcgm
from ..model import (
    BARGAUGE,
    BYTES,
    BYTES_PER_SECOND,
    CELSIUS,
    COUNT,
    RATIO,
    STAT,
    WATTS,
    Board,
    Panel,
    Row,
    Step,
    Variable,
)
from ..promql import BY_GPU, GPUS, HOST, ratio, sel

UTILIZATION_BANDS: tuple[Step, ...] = ((None, "red"), (bands.GPU_IDLE, "yellow"),
                                        (bands.GPU_BUSY, "green"))
MEMORY_BANDS: tuple[Step, ...] = ((None, "green"), (0.9, "orange"), (0.98, "red"))
# Most data-centre GPUs start to throttle their clocks in the 80s (Celsius).
TEMPERATURE_BANDS: tuple[Step, ...] = ((None, "green"), (80, "orange"), (90, "red"))

summary = Row("At a glance", (
    Panel("Mean GPU utilization",
          "Mean share of time a kernel ran, over the selected GPUs. Good: over "
          f"{bands.GPU_BUSY:.0%} while "
          f"training. Under {bands.GPU_IDLE:.0%} with a high input stall share on the "
          "DataLoader overview: "
          "the GPUs are starving for data.",
          RATIO, (("mean", f"avg({sel(cat.GPU_UTILIZATION, GPUS)})"),), STAT,
          UTILIZATION_BANDS, 0, 1),
    Panel("GPUs",
          "Number of GPUs reporting. Good: every GPU the job was given. Fewer means a GPU "
          "fell off the bus (Xid errors in the kernel log) or NVML is unavailable.",
          COUNT, (("GPUs", f"count({sel(cat.GPU_UTILIZATION, GPUS)})"),), STAT),
    Panel("Total power draw",
          "Power drawn by the selected GPUs together. Good: near the GPUs' rated power while "
          "training; far below it, the GPUs are mostly idle.",
          WATTS, (("total", f"sum({sel(cat.GPU_POWER, GPUS)})"),), STAT),
    Panel("Hottest GPU",
          "The highest core temperature of the selected GPUs. Good: under 80 C. Hotter GPUs "
          "lower their clocks: check the cooling and airflow of that host.",
          CELSIUS, (("hottest", f"max({sel(cat.GPU_TEMPERATURE, GPUS)})"),), STAT,
          TEMPERATURE_BANDS),
))

utilization = Row("Utilization", (
    Panel("GPU utilization",
          "Share of each sample period during which a kernel ran, per GPU (in Kubernetes, "
          "where the sidecar has no GPU, dcgm-exporter's for the selected pods). Good: high "
          "and flat while training. Sawtooth or gaps line up with input stalls or "
          "evaluation; one GPU below the others is a straggler's.",
          RATIO, ((BY_GPU, sel(cat.GPU_UTILIZATION, GPUS)),
                  ("{{pod}} GPU {{gpu}} (dcgm-exporter)", dcgm.gpu_utilization(HOST))),
          thresholds=UTILIZATION_BANDS, max=1),
    Panel("Memory-controller utilization",
          "Share of each sample period during which device memory was read or written. Good: "
          "it follows the kernel utilization. High with low kernel utilization is a "
          "memory-bound model (fuse kernels, use mixed precision); both low is an idle GPU.",
          RATIO, ((BY_GPU, sel(cat.GPU_MEMORY_UTILIZATION, GPUS)),), max=1),
))

memory = Row("Memory", (
    Panel("GPU memory used against total",
          "Device memory in use and in total, per GPU. Good: stable after the first steps. "
          "Steady growth is a leak (tensors kept across steps); near total, lower the batch "
          "size or use activation checkpointing before CUDA runs out of memory.",
          BYTES, ((f"used {BY_GPU}", sel(cat.GPU_MEMORY_USED, GPUS)),
                  (f"total {BY_GPU}", sel(cat.GPU_MEMORY_TOTAL, GPUS)))),
    Panel("GPU memory used share",
          "Device memory used / total for each GPU now. Good: under 90%; the caching "
          "allocator holds freed memory, so high values are normal after warm-up, but over "
          "98% leaves no room for fragmentation.",
          RATIO, ((BY_GPU, ratio(cat.GPU_MEMORY_USED, cat.GPU_MEMORY_TOTAL, GPUS)),),
          BARGAUGE, MEMORY_BANDS, 0, 1),
))

pcie = Row("PCIe", (
    Panel("PCIe throughput",
          "Traffic over PCIe per GPU: received (host to device, the batches) and sent. "
          "Good: bursts at each batch, well under the link's rate (PCIe 4 x16: about 25 GB/s). "
          "Sustained near the link's rate, the copies bound the step: keep data on the GPU, "
          "send smaller dtypes, or overlap with pin_memory=True and non_blocking=True.",
          BYTES_PER_SECOND, ((f"rx {BY_GPU}", sel(cat.GPU_PCIE_RX, GPUS)),
                             (f"tx {BY_GPU}", sel(cat.GPU_PCIE_TX, GPUS)))),
))

thermals = Row("Temperature and power", (
    Panel("GPU temperature",
          "Core temperature per GPU. Good: under 80 C under load. Hotter GPUs throttle "
          "their clocks and slow the whole job down: check the host's cooling.",
          CELSIUS, ((BY_GPU, sel(cat.GPU_TEMPERATURE, GPUS)),), thresholds=TEMPERATURE_BANDS),
    Panel("GPU power draw",
          "Power per GPU. Good: near the rated power while training. Low power with low "
          "utilization is an idle GPU; power capped at the limit with falling clocks is "
          "power throttling.",
          WATTS, ((BY_GPU, sel(cat.GPU_POWER, GPUS)),)),
))

GPU_BOARD = Board(
    uid="dataloader-gpu",
    title="GPU",
    description="Utilization, memory, PCIe, temperature and power of each GPU, from the "
                "dataloader-exporter's NVML collector.",
    variables=(
        Variable("datasource", "Data source"),
        Variable("job", "Job", cat.GPU_UTILIZATION.name),
        Variable("instance", "Instance", sel(cat.GPU_UTILIZATION, 'job=~"$job"')),
        Variable("gpu", "GPU", sel(cat.GPU_UTILIZATION, HOST)),
    ),
    rows=(summary, utilization, memory, pcie, thermals),
)
