"""Where a process's loader metrics live and how they leave it.

One Hub per registry, and the Hub owns everything attached to that registry: the
recorders (keyed by loader name and rank), the one trainer collector over them, the
snapshot writers (one thread per directory), the HTTP servers (one per address) and
the GPU, /dev/shm and host collectors (attached once, for in-process serving). Snapshot
files carry only the trainer's metrics: a sidecar reads the system metrics itself.
Nothing here runs at import time or touches prometheus_client's global REGISTRY; the
default hub's registry, and prometheus_client with it, is built when first read (a
snapshot writer, a server, default_registry()), so building a loader and taking its
batches does not import it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

from dataloader_exporter.core.facts.shm import SHM_PATH
from dataloader_exporter.core.logonce import LogOnce

if TYPE_CHECKING:  # loaded on first use only: the drop-in does not pay for them
    from prometheus_client import CollectorRegistry

    from dataloader_exporter.exporter.collectors.supervisor import Supervisor
    from dataloader_exporter.exporter.web.server import ServerHandle

    from .snapshot_writer import SnapshotWriter

from .hotpath.recorder import LoaderRecorder
from .rank import local_rank

T = TypeVar("T")

log = logging.getLogger("dataloader_exporter.instrument")

SNAPSHOT_INTERVAL = 1.0


class Hub:
    """The recorders of one registry and the sinks attached to it.

    Building a second Hub on a registry raises (the trainer collector describes its
    families, so the registry refuses duplicates): use hub_for(), which finds the one.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._recorders: dict[tuple[str, str], LoaderRecorder] = {}
        self._shared: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()
        self._bind_lock = threading.Lock()
        self._writers: dict[str, SnapshotWriter] = {}
        self._servers: dict[tuple[str, int], ServerHandle] = {}
        self._system: Supervisor | None = None
        self._registry: CollectorRegistry | None = None
        self._trainer_only: CollectorRegistry | None = None
        if registry is not None:  # a caller's registry: bound now, so a second Hub raises
            self._bind(registry)

    @property
    def registry(self) -> CollectorRegistry:
        """The registry the trainer collector is registered in (built on first read)."""
        registry = self._registry
        if registry is None:
            with self._bind_lock:
                if self._registry is None:
                    from prometheus_client import CollectorRegistry

                    self._bind(CollectorRegistry())
                registry = self._registry
            assert registry is not None
        return registry

    def _snapshot_registry(self) -> CollectorRegistry:
        """What snapshot files carry: the trainer collector alone."""
        if self._trainer_only is None:
            self.registry  # noqa: B018  (binds it)
        assert self._trainer_only is not None
        return self._trainer_only

    def _bind(self, registry: CollectorRegistry) -> None:
        from prometheus_client import CollectorRegistry

        from .loader_collector import LoaderCollector

        trainer = LoaderCollector(self.recorders)
        registry.register(trainer)
        # What snapshot files carry: the trainer collector alone.
        trainer_only = CollectorRegistry()
        trainer_only.register(trainer)
        setattr(registry, _HUB_ATTR, self)  # a registry carries its hub (a GC-able cycle)
        self._trainer_only = trainer_only
        self._registry = registry

    def recorders(self) -> Iterable[LoaderRecorder]:
        with self._lock:
            return list(self._recorders.values())

    def recorder(self, name: str, rank: str) -> LoaderRecorder:
        """The recorder for (name, rank); loaders that share a name share series."""
        with self._lock:
            rec = self._recorders.get((name, rank))
            if rec is None:
                rec = self._recorders[(name, rank)] = LoaderRecorder(name, rank)
            return rec

    def shared(self, kind: str, name: str, make: Callable[[], T]) -> T:
        """The one object of `kind` for a loader name (made by make() at first use), shared
        by every loader of that name here, as its recorder is."""
        with self._lock:
            got = self._shared.get((kind, name))
            if got is None:
                got = self._shared[(kind, name)] = make()
            return got  # type: ignore[return-value]  # made by make() for this kind

    def write_snapshots(self, directory: str, interval: float = SNAPSHOT_INTERVAL
                        ) -> SnapshotWriter:
        """Starts (once per directory) the thread that writes this hub's snapshots."""
        from .snapshot_writer import SnapshotWriter

        key = os.path.abspath(directory)
        trainer_only = self._snapshot_registry()
        with self._lock:
            writer = self._writers.get(key)
            if writer is None:
                writer = self._writers[key] = SnapshotWriter(
                    trainer_only, key, interval, on_exit=self.exiting, activity=self.activity)
                writer.start()
            return writer

    def activity(self) -> object:
        """Equal across two calls when no loader of this hub recorded anything in between
        (loader_collector.activity): what lets an idle snapshot writer skip a write."""
        from .loader_collector import activity

        return activity(self.recorders())

    def exiting(self) -> None:
        """The interpreter exits normally (exit handlers run): the last snapshots say so
        (dataloader_exit_timestamp_seconds), which a killed process's never do."""
        now = time.time()
        for rec in self.recorders():
            if rec.exited_at is None:
                rec.exited_at = now

    def flush_now(self) -> None:
        """Asks every snapshot writer for a write soon (the end of an epoch)."""
        for writer in list(self._writers.values()):
            writer.wake()

    def write_soon(self, wait: float = 0.0) -> None:
        """Asks every snapshot writer for a write at once, in its own thread, and waits up
        to `wait` seconds for them (a failure's snapshot before its exception goes on)."""
        writers = list(self._writers.values())
        asked = [(w, w.ask()) for w in writers]
        deadline = time.monotonic() + wait
        for writer, ticket in asked:
            writer.wait_for(ticket, max(0.0, deadline - time.monotonic()))

    def serve(self, port: int = 0, addr: str = "0.0.0.0", system_metrics: bool = True,
              shm_path: str = SHM_PATH, web_config_file: str | None = None) -> ServerHandle:
        """Serves the registry on addr:port, once per address (port 0: a new free port).

        Under torchrun (LOCAL_RANK set) a port other than 0 is a base: local rank r serves
        on port + r, so every rank on a machine is served (see rank_port).

        system_metrics attaches the GPU (NVML), /dev/shm and host collectors to the
        registry, once. web_config_file turns on TLS and basic auth as the sidecar's
        --web.config.file does. Raises OSError when the port is taken by anything else,
        exporter.web.webconfig.WebConfigError (a ValueError) when the web config is bad.
        """
        from dataloader_exporter.exporter.sources import attach, system_sources
        from dataloader_exporter.exporter.web.server import IN_PROCESS
        from dataloader_exporter.exporter.web.server import serve as http_serve

        port = rank_port(port)
        registry = self.registry
        with self._lock:
            handle = self._servers.get((addr, port)) if port else None
            if handle is not None and not handle.closed and (
                    (handle.web.path if handle.web else None) != web_config_file):
                raise ValueError(f"{addr}:{port} is served already, with another web config "
                                 f"({handle.web.path if handle.web else 'none'}): shut it "
                                 "down first, or pass the same web_config_file")
            if handle is None or handle.closed:
                web = None
                if web_config_file is not None:  # loaded for a new server only
                    from dataloader_exporter.exporter.web import webconfig

                    web = webconfig.load(web_config_file)
                handle = http_serve(registry, addr, port, web, IN_PROCESS)
                self._servers[(addr, handle.port)] = handle
            if system_metrics and self._system is None:
                self._system = attach(registry, system_sources(shm_path))
            return handle

    def close(self) -> None:
        """Stops this hub's servers and snapshot threads (after one last snapshot each)."""
        with self._lock:
            servers, self._servers = list(self._servers.values()), {}
            writers, self._writers = list(self._writers.values()), {}
        for handle in servers:
            handle.shutdown()
        for writer in writers:
            writer.close()


_ports_said = LogOnce(log, logging.INFO)  # keyed by the base port


def rank_port(port: int) -> int:
    """port + $LOCAL_RANK under torchrun (logged once per port), else port; 0 stays 0."""
    local = local_rank()
    if not port or local is None:
        return port
    if port + local > 65535:
        raise OSError(f"port {port} + LOCAL_RANK {local} is past 65535")
    _ports_said.problem(str(port), "dataloader-exporter: local rank %d serves its metrics on "
                        "port %d (port %d + LOCAL_RANK)", local, port + local, port)
    return port + local


_default: Hub | None = None
_default_lock = threading.Lock()
_HUB_ATTR = "_dataloader_exporter_hub"  # set on a registry by Hub._bind


def hub_for(registry: CollectorRegistry | None = None) -> Hub:
    """The process's default hub, or the one hub bound to a caller's registry."""
    global _default
    with _default_lock:
        if registry is None:
            if _default is None:
                _default = Hub()
            return _default
        hub = getattr(registry, _HUB_ATTR, None)
        if not isinstance(hub, Hub):
            hub = Hub(registry)
        return hub


def default_registry() -> CollectorRegistry:
    """The registry instrumented loaders use when given none."""
    return hub_for().registry
