"""Figures as the doctor prints them: shares in whole percent, milliseconds, bytes."""

from __future__ import annotations

from dataloader_exporter.diagnosis.job_signals import points

GiB = 1024**3


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{points(x)}%"


def ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.1f} ms"


def gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB" if x >= GiB / 10 else f"{x / 1024**2:.1f} MiB"
