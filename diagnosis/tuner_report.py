"""The loader tuner (core/tuner/rules.py) as the doctor sees it: whether a loader is
tuned, still trying or stable, the settings it runs with now and the changes it made.

A tuned loader exports dataloader_tuner_stable (0 while the tuner tries, 1 once stable),
labelled with the settings it tunes; a loader without that series is not tuned. Its
changes are counters by setting and reason, each starting at 0. The settings it runs with
now are dataloader_info's (the trainer relabels it at each iter(), after the tuner's
change); without that series they are unknown and said so. While the tuner tries, the
doctor holds its own advice on the settings it tunes (doctor._recommend); once the tuner
has let a kept pool go because the training changes the dataset between epochs, the
doctor advises no persistent_workers either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core.settings import TUNABLE, TUNED_BY_DEFAULT
from dataloader_exporter.core.tuner.rules import REASONS

Series = Mapping[tuple[str, tuple[tuple[str, str], ...]], float]
TRYING, STABLE = "trying", "stable"


@dataclass
class TunerSignals:
    """A tuned loader's tuner at the window's end: stable or not, the settings it tunes
    (both where the series does not say), and its changes so far by (setting, reason)."""

    stable: bool
    changes: dict[tuple[str, str], float] = field(default_factory=dict)
    settings: tuple[str, ...] = TUNED_BY_DEFAULT


def _tuned(text: str | None) -> tuple[str, ...]:
    named = tuple(s for s in TUNABLE if s in (text or "").split(","))
    return named or TUNED_BY_DEFAULT


def read_tuner(latest: Series, lr: dict[str, str]) -> TunerSignals | None:
    """One (loader, rank)'s tuner; None when the loader is not tuned (no stable gauge)."""
    stable: float | None = None
    settings: tuple[str, ...] = TUNED_BY_DEFAULT
    changes: dict[tuple[str, str], float] = {}
    for (name, labels), v in latest.items():
        d = dict(labels)
        if not all(d.get(k) == x for k, x in lr.items()):
            continue
        if name == cat.TUNER_STABLE.name:
            stable, settings = v, _tuned(d.get("settings"))
        elif name == cat.TUNER_CHANGES.name and v > 0:  # every pair starts at 0
            key = (d.get("setting", ""), d.get("reason", ""))
            changes[key] = changes.get(key, 0.0) + v
    if stable is None:
        return None
    return TunerSignals(stable >= 1, changes, settings)


@dataclass
class TunerView:
    """A diagnosis's `tuner` (None: the loader is not tuned). num_workers and
    prefetch_factor: what it runs with now, None where unknown (prefetch_factor also
    without workers, where torch has none); held: the settings whose advice the doctor
    holds because the tuner still sets them."""

    state: str  # TRYING or STABLE
    num_workers: int | None
    prefetch_factor: int | None
    changes: float
    by_reason: list[dict[str, object]] = field(default_factory=list)  # setting, reason, count
    held: list[str] = field(default_factory=list)
    settings: tuple[str, ...] = TUNED_BY_DEFAULT  # the settings the tuner sets
    persistent: str | None = None  # dataloader_info's persistent_workers, where tuned

    @property
    def let_go(self) -> bool:
        """Whether the tuner let a kept pool go because the training changed the dataset
        between epochs (kept workers would not see it): no advice to keep them then."""
        return any(c["setting"] == "persistent_workers" and c["reason"] == "dataset-changed"
                   for c in self.by_reason)

    @property
    def trying(self) -> bool:
        return self.state == TRYING


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text not in (None, "") else None
    except ValueError:
        return None


def view(t: TunerSignals | None, config: Mapping[str, str]) -> TunerView | None:
    """What the report says of a loader's tuner, from its signals and dataloader_info."""
    if t is None:
        return None
    state = STABLE if t.stable else TRYING
    by = [{"setting": s, "reason": r, "count": n} for (s, r), n in sorted(t.changes.items())]
    return TunerView(state, _int(config.get("num_workers")),
                     _int(config.get("prefetch_factor")), sum(t.changes.values()), by,
                     list(t.settings) if state == TRYING else [], t.settings,
                     config.get("persistent_workers") if "persistent_workers" in t.settings
                     else None)


def _settings(v: TunerView) -> str:
    if v.num_workers is None:
        return "num_workers and prefetch_factor unknown (no dataloader_info in the metrics)"
    if v.num_workers == 0:
        return "num_workers=0 (no prefetch_factor without workers)"
    prefetch = "unknown" if v.prefetch_factor is None else str(v.prefetch_factor)
    keep = f", persistent_workers={v.persistent}" if v.persistent else ""
    return f"num_workers={v.num_workers}, prefetch_factor={prefetch}{keep}"


def _changes(v: TunerView, when: str = "") -> str:
    """'2 changes (num_workers: starved 1, reverted 1)', in the tuner's order of reasons."""
    parts: dict[str, list[str]] = {}
    order = {r: i for i, r in enumerate(REASONS)}
    for c in sorted(v.by_reason, key=lambda c: order.get(str(c["reason"]), len(order))):
        parts.setdefault(str(c["setting"]), []).append(f"{c['reason']} {c['count']:g}")
    how = "; ".join(f"{s}: {', '.join(rs)}" for s, rs in sorted(parts.items()))
    return f"{v.changes:g} change{'' if v.changes == 1 else 's'}{when} ({how})"


def line(v: TunerView) -> str:
    """The report's line on a tuned loader."""
    if v.trying:
        changes = _changes(v, " so far") if v.changes else "no change yet"
        return (f"  tuner: the loader tuner is still trying settings, now {_settings(v)}; "
                f"{changes}; no {' or '.join(v.held)} advice while it sets "
                f"{'it' if len(v.held) == 1 else 'them'}")
    changes = f"after {_changes(v)}" if v.changes else "without a change"
    return (f"  tuner: the loader tuner is stable at {_settings(v)}, {changes}; --format env "
            f"keeps {' and '.join(v.settings)} auto")
