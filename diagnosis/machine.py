"""The local machine as the doctor weighs it: cores, CPU quota, memory, /dev/shm, storage."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dataloader_exporter.core.advisor import Cpu, local_cpu
from dataloader_exporter.core.facts.memory import host_memory
from dataloader_exporter.core.facts.shm import SHM_PATH, shm_space
from dataloader_exporter.core.facts.storage import storage_kind


@dataclass(frozen=True)
class Machine:
    physical_cores: int
    cpu_quota: float | None  # cores allowed by the cgroup, None when unlimited
    memory_total: int
    memory_available: int
    shm_size: int | None
    storage: str  # "nvme", "ssd", "rotational", "network", "unknown"
    data_path: str
    cpu_affinity: int | None = None  # CPUs in this process's affinity mask

    @property
    def cpu(self) -> Cpu:
        return Cpu(self.physical_cores, self.cpu_quota, self.cpu_affinity)

    @property
    def usable_cores(self) -> int:
        return self.cpu.usable

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "usable_cores": self.usable_cores}


def local_machine(data_path: str = ".", shm_path: str = SHM_PATH) -> Machine:
    """Reads this machine's facts; anything unreadable becomes None or 'unknown'."""
    total, available = host_memory()
    shm = shm_space(shm_path)
    cpu = local_cpu()
    return Machine(cpu.physical, cpu.quota, total, available,
                   None if shm is None else shm.size, storage_kind(data_path), data_path,
                   cpu.affinity)
