"""The doctor's report: the machine, each loader's job across ranks, and each rank's
diagnosis, as text for people and as JSON for tools."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dataloader_exporter.core.envnames import ENV_SETTINGS
from dataloader_exporter.core.settings import (
    AUTO,
    SETTINGS,
    TUNABLE,
    SettingsError,
    format_settings,
)
from dataloader_exporter.diagnosis import tuner_report
from dataloader_exporter.diagnosis.doctor import VERDICTS, Diagnosis, diagnose, verdict
from dataloader_exporter.diagnosis.job_signals import Job, jobs
from dataloader_exporter.diagnosis.machine import Machine
from dataloader_exporter.diagnosis.signals import LoaderSignals
from dataloader_exporter.diagnosis.units import gib, ms, pct
from dataloader_exporter.diagnosis.why import NONE, WorkerView, memory_kind


@dataclass
class Report:
    source: str
    machine: Machine
    diagnoses: list[Diagnosis]
    jobs: list[Job] = field(default_factory=list)
    whole_run: bool = False  # figures over each loader's whole run, not a window

    @property
    def healthy(self) -> bool:
        return all(d.healthy for d in self.diagnoses)

    def as_dict(self) -> dict[str, object]:
        return {"source": self.source, "healthy": self.healthy, "whole_run": self.whole_run,
                "machine": self.machine.as_dict(),
                "jobs": [j.as_dict() | {"verdict": verdict(j.input_stall_share, 1)}
                         for j in self.jobs],
                "loaders": [asdict(d) | {"healthy": d.healthy} for d in self.diagnoses]}

    def text(self) -> str:
        m = self.machine
        lines = [f"dataloader doctor: {self.source}",
                 f"machine: {m.cpu.describe()}, "
                 f"{gib(m.memory_total)} memory ({gib(m.memory_available)} available), "
                 f"/dev/shm {gib(m.shm_size) if m.shm_size else 'unknown'}, "
                 f"storage under {m.data_path}: {m.storage}", ""]
        by_loader = {j.loader: j for j in self.jobs}
        shown: set[str] = set()
        for d in self.diagnoses:
            j = by_loader.get(d.loader)
            if j is not None and len(j.ranks) > 1 and d.loader not in shown:
                shown.add(d.loader)
                lines += _job_lines(j)
            lines += _rank_lines(d, multi=j is not None and len(j.ranks) > 1)
        lines.append("healthy" if self.healthy else "problems found")
        return "\n".join(lines) + "\n"


def _job_lines(j: Job) -> list[str]:
    v = verdict(j.input_stall_share, 1)
    strag = (f"input straggler{'s' if len(j.stragglers) > 1 else ''}: rank "
             f"{', '.join(j.straggler_ranks)}" if j.stragglers else "no input straggler")
    return [f"loader {j.loader}, the job ({len(j.ranks)} ranks): {VERDICTS[v]} - every rank "
            f"waits for the slowest input {pct(j.input_stall_share)} of the time (its fetch "
            f"wait {ms(j.worst_fetch_per_batch)} a batch over a batch period of "
            f"{ms(j.batch_period)}); {strag}", ""]


def _rank_lines(d: Diagnosis, multi: bool) -> list[str]:
    f = d.figures
    lines = [f"loader {d.loader}, rank {d.rank}: {VERDICTS[d.verdict]} - the loop waited "
             f"{pct(f['stall_share'])} of the time for data; "
             f"{f['batches_per_second'] or 0:.1f} batches/s, "
             f"{_per_second(f['samples_per_second'], 'samples')}, fetch p95 "
             f"{ms(f['fetch_p95_seconds'])}"]
    step, wait = f["step_per_batch_seconds"], f["waiting_for_other_ranks_seconds_per_batch"]
    if multi and step is not None and wait is not None:
        lines.append(f"  step {ms(step)} a batch, of which about {ms(wait)} waiting for "
                     "other ranks (estimated: its step minus the fastest rank's)")
    lines += [tuner_report.line(d.tuner)] if d.tuner is not None else []
    lines += _worker_lines(d.workers)
    lines += [f"  ! {x.message}" for x in d.findings]
    lines += [f"  ? {x}" for x in d.unknowns]
    if d.recommendations:
        lines.append("  settings:")
        for r in d.recommendations:
            now = f" (now {r.current})" if r.current else ""
            lines.append(f"    {r.setting}={r.value}{now}: {r.why}")
    return [*lines, ""]


def _worker_lines(v: WorkerView) -> list[str]:
    """Where the workers' time went, their memory, and the bottleneck with its why."""
    if v.bottleneck == NONE and v.running_share is None and v.rss_bytes is None:
        return []  # nothing to say: the loop does not wait and nothing was measured
    if v.running_share is None:
        parts = ["where their time goes is unknown"]
    else:
        parts = [f"running {pct(v.running_share)}, waiting for a CPU "
                 f"{pct(v.waiting_for_cpu_share)}, blocked {pct(v.blocked_share)} of their "
                 f"time ({v.cpu_cores_used or 0:.1f} cores running)"]
    if v.rss_bytes is not None:
        largest = f", the largest {gib(v.max_rss_bytes)} RSS" if v.max_rss_bytes else ""
        parts.append(f"{gib(v.rss_bytes)} each ({memory_kind(v)}){largest}")
    if v.swap_bytes:
        parts.append(f"{gib(v.swap_bytes)} in swap")
    why = f" - {v.why}" if v.why and v.bottleneck != NONE else ""
    return [f"  workers: {'; '.join(parts)}; bottleneck: {v.bottleneck}{why}"]


def _per_second(x: float | None, what: str) -> str:
    """A rate as printed; an unknown one says so rather than 0."""
    return f"{what}/s unknown" if x is None else f"{x:.0f} {what}/s"


def build_report(source: str, machine: Machine, signals: list[LoaderSignals],
                 local_ranks: dict[str, int] | int, whole_run: bool = False) -> Report:
    """Diagnoses every (loader, rank) with its job's view; local_ranks is one count for
    every rank, or each rank's count of ranks that share its machine; whole_run: the
    signals are whole runs' totals (Window.whole_run), not a window's."""
    views = jobs(signals)
    by_loader = {j.loader: j for j in views}

    def local(rank: str) -> int:
        if isinstance(local_ranks, int):
            return max(1, local_ranks)
        return max(1, local_ranks.get(rank, 1))

    return Report(source, machine,
                  [diagnose(s, machine, local(s.rank), by_loader.get(s.loader))
                   for s in signals], views, whole_run)


def env_line(report: Report) -> tuple[str, list[str]]:
    """The settings advice as one line of DATALOADER_EXPORTER_SETTINGS, ready for a
    ConfigMap, and the loaders left out (a name the line cannot carry). Loader settings
    only (not --shm-size or non_blocking, which are not the loader's), and only changes.
    The ranks of a loader share one line: the most workers any rank was advised, a flag
    any rank was advised to set, and the deepest queue, or the shallowest when a rank was
    told to shrink it (shared memory comes first). A loader the loader tuner tunes (on any
    rank) keeps ``auto`` for the settings it tunes (dataloader_tuner_stable's `settings`
    label): the line replaces the one that asked for the tuner."""
    advice: dict[str, dict[str, list[int | bool]]] = {}
    tuned_loaders: dict[str, set[str]] = {}
    for d in report.diagnoses:
        if d.tuner is not None:
            tuned_loaders.setdefault(d.loader, set()).update(d.tuner.settings)
    lower: set[tuple[str, str]] = set()
    for d in report.diagnoses:
        for r in d.recommendations:
            if r.setting not in SETTINGS or r.value == r.current:
                continue
            kind, _ = SETTINGS[r.setting]
            value: int | bool = r.value.lower() == "true" if kind is bool else int(r.value)
            advice.setdefault(d.loader, {}).setdefault(r.setting, []).append(value)
            if kind is int and r.current.isdigit() and value < int(r.current):
                lower.add((d.loader, r.setting))
    items, skipped = [], []
    for loader in sorted(set(advice) | set(tuned_loaders)):
        settings = advice.get(loader, {})
        chosen: dict[str, object] = {
            name: (min(values) if (loader, name) in lower else max(values))
            for name, values in settings.items()}
        if loader in tuned_loaders:
            chosen.update({s: AUTO for s in TUNABLE if s in tuned_loaders[loader]})
        try:
            items.append(format_settings(loader, chosen))
        except SettingsError:
            skipped.append(loader)
    return f"{ENV_SETTINGS}={','.join(items)}", skipped
