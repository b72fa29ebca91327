"""Draws a dashboard's panels with matplotlib, laid out and styled like Grafana's.

A figure is the board's title, then each row's title and its panels: stats and gauges
four across, time series and bar gauges three across (a line not full is shared evenly,
as the rendered grid does), each panel a card with its title, its plot and, for time
series, its legend below (as Grafana places it). Axes read in the panel's unit (percent,
seconds, bytes, ...). Stats, gauges and bar gauges show each series' last value in the
window, as Grafana's "last (not null)" does.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import matplotlib.dates as mdates
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Wedge
from matplotlib.ticker import FixedLocator, FuncFormatter, Locator, MaxNLocator

from dataloader_exporter.dashboards.model import (
    BARGAUGE,
    BYTES,
    BYTES_PER_SECOND,
    CELSIUS,
    GAUGE,
    RATIO,
    SECONDS,
    STAT,
    TIMESERIES,
    WATTS,
    Board,
    Panel,
    Step,
)

WIDTH = 16.0  # inches; at 100 dpi 1600 px
MARGIN, GAP = 0.3, 0.22
HEADER = 1.15
ROW_TITLE = 0.5
PANEL_TITLE = 0.38
PLOT = 2.45  # a time series' or bar gauge's plot
SMALL = 1.55  # a stat's or gauge's
LEGEND_LINE = 0.19
LEGEND_LINES = 8  # more entries than fit are summed up in a last line
CHAR = 0.06  # the widest mean width of a legend character measured, in inches (8 pt DejaVu Sans)
FILLED = 3  # time series with more series than this are not filled (they would hide each other)
AXIS_LEFT, AXIS_BOTTOM = 0.72, 0.32
FONT = "DejaVu Sans"
BACKGROUND, CARD, EDGE, TEXT, MUTED, GRID = (
    "#eceef1", "#ffffff", "#d8d9da", "#24292e", "#6e7079", "#e6e7e8")
# Grafana's classic palette, in its order.
PALETTE = ("#7eb26d", "#eab839", "#6ed0e0", "#ef843c", "#e24d42", "#1f78c1", "#ba43a9",
           "#705da0", "#508642", "#cca300", "#447ebc", "#c15c17", "#890f02", "#0a437c",
           "#6d1f62", "#584477")
# Threshold colours: the light shade for bands, the dark one for text and bars.
LIGHT = {"green": "#73bf69", "yellow": "#fade2a", "orange": "#ff9830", "red": "#f2495c",
         "blue": "#5794f2"}
DARK = {"green": "#37872d", "yellow": "#c9a100", "orange": "#e55400", "red": "#c4162a",
        "blue": "#1f60c4"}


class SeriesLike(Protocol):
    @property
    def legend(self) -> str: ...
    @property
    def times(self) -> Sequence[float]: ...  # Unix seconds
    @property
    def values(self) -> Sequence[float]: ...  # NaN where there is no value


class ShownLike(Protocol):
    @property
    def panel(self) -> Panel: ...
    @property
    def series(self) -> Sequence[SeriesLike]: ...


def _scaled(v: float, steps: Sequence[tuple[float, str]], digits: int = 3) -> str:
    """v in the largest of (factor, suffix) steps it reaches, to `digits` figures."""
    factor, suffix = steps[0]
    for f, s in steps:
        if abs(v) >= f:
            factor, suffix = f, s
    x = v / factor
    text = f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:.0f}"
    return f"{text}{suffix}"


IEC = tuple((1024.0 ** i, f" {p}") for i, p in enumerate(("B", "KiB", "MiB", "GiB", "TiB")))
DURATION = ((1e-9, " ns"), (1e-6, " µs"), (1e-3, " ms"), (1.0, " s"), (60.0, " min"),
            (3600.0, " h"))
SHORT = ((1.0, ""), (1e3, " K"), (1e6, " Mil"), (1e9, " Bil"))


def formatter(unit: str, decimals: int | None = None) -> Callable[[float], str]:
    """Formats a value in a Grafana unit: percent, seconds, IEC bytes, ..."""
    if unit == RATIO and decimals is not None:
        return lambda v: f"{v * 100:.{decimals}f}%"
    if unit == RATIO:
        return lambda v: f"{v * 100:.3g}%" if abs(v) < 0.1 else f"{v * 100:.0f}%"
    if unit == SECONDS:
        return lambda v: "0 s" if v == 0 else _scaled(v, DURATION)
    if unit == BYTES:
        return lambda v: _scaled(v, IEC)
    if unit == BYTES_PER_SECOND:
        return lambda v: _scaled(v, IEC) + "/s"
    if unit == CELSIUS:
        return lambda v: f"{v:.3g} °C"
    if unit == WATTS:
        return lambda v: _scaled(v, ((1.0, " W"), (1e3, " kW")))
    if unit == "bool_yes_no":
        return lambda v: "Yes" if v else "No"
    return lambda v: _scaled(v, SHORT)


def step_color(steps: Sequence[Step], value: float) -> str:
    """The colour name of the threshold step a value falls in (green without steps)."""
    color = steps[0][1] if steps else "green"
    for bound, name in steps:
        if bound is None or value >= bound:
            color = name
    return color


def last(values: Sequence[float]) -> float:
    return next((v for v in reversed(values) if math.isfinite(v)), math.nan)


def draw_board(board: Board, rows: Sequence[Sequence[ShownLike]], note: str) -> Figure:
    """One figure for the board; rows[i] holds the shown panels of board.rows[i]."""
    plt.rcParams.update({"font.family": FONT, "font.size": 9})
    lines = []  # (row title or "", its panels, their width) per line of panels
    for row, shown in zip(board.rows, rows, strict=True):
        across = 4 if all(s.panel.kind in (STAT, GAUGE) for s in shown) else 3
        for i in range(0, len(shown), across):
            panels = list(shown[i:i + across])  # a line not full is shared evenly
            width = (WIDTH - 2 * MARGIN - GAP * (len(panels) - 1)) / len(panels)
            lines.append((row.title if i == 0 else "", panels, width))
    heights = [(ROW_TITLE if title else 0) + PANEL_TITLE + _line_height(panels, width)
               for title, panels, width in lines]
    total = HEADER + sum(heights) + GAP * len(lines) + MARGIN
    fig = plt.figure(figsize=(WIDTH, total), facecolor=BACKGROUND)
    fig.text(MARGIN / WIDTH, 1 - 0.42 / total, board.title, fontsize=20, weight="bold",
             color=TEXT, va="baseline")
    fig.text(MARGIN / WIDTH, 1 - 0.72 / total, board.description, fontsize=10.5, color=MUTED,
             va="baseline")
    fig.text(MARGIN / WIDTH, 1 - 0.98 / total, note, fontsize=9, color=MUTED, style="italic",
             va="baseline")
    top = HEADER
    for (title, panels, width), height in zip(lines, heights, strict=True):
        if title:
            fig.text(MARGIN / WIDTH, 1 - (top + 0.32) / total, title, fontsize=13.5,
                     weight="bold", color=TEXT, va="baseline")
            top += ROW_TITLE
        card = height - (ROW_TITLE if title else 0)
        for i, panel in enumerate(panels):
            _card(fig, panel, (MARGIN + i * (width + GAP), top, width, card), total)
        top += card + GAP
    return fig


def _line_height(panels: Sequence[ShownLike], width: float) -> float:
    if all(s.panel.kind in (STAT, GAUGE) for s in panels):
        return SMALL
    legend = max(_legend_layout(s, width)[1] for s in panels)
    return PLOT + LEGEND_LINE * legend + (0.12 if legend else 0)


def _legend_layout(shown: ShownLike, width: float) -> tuple[int, int]:
    """(columns, lines) of a time series' legend in a card `width` inches wide; bar
    gauges and stats have none."""
    if shown.panel.kind != TIMESERIES:
        return 0, 0
    longest = max(len(s.legend) for s in shown.series)
    columns = max(1, min(4, int((width - 0.3) // (CHAR * longest + 0.45))))
    lines = math.ceil(len(shown.series) / columns)
    return columns, min(lines, LEGEND_LINES)


def _card(fig: Figure, shown: ShownLike, box: tuple[float, float, float, float],
          total: float) -> None:
    """A panel card at (left, top, width, height), in inches from the top-left."""
    left, top, width, height = box

    def rect(x: float, y: float, w: float, h: float) -> tuple[float, float, float, float]:
        return x / WIDTH, 1 - (y + h) / total, w / WIDTH, h / total  # inches -> figure

    fig.patches.append(FancyBboxPatch(
        (left / WIDTH, 1 - (top + height) / total), width / WIDTH, height / total,
        boxstyle="round,pad=0,rounding_size=0.003", transform=fig.transFigure,
        facecolor=CARD, edgecolor=EDGE, linewidth=0.8, zorder=-1))
    fig.text((left + 0.14) / WIDTH, 1 - (top + 0.26) / total, shown.panel.title,
             fontsize=10.5, weight="bold", color=TEXT, va="baseline")
    kind = shown.panel.kind
    body = height - PANEL_TITLE
    if kind in (STAT, GAUGE):
        ax = fig.add_axes(rect(left + 0.1, top + PANEL_TITLE, width - 0.2, body - 0.1))
        if kind == STAT:
            _stat(ax, shown)
        else:
            _gauge(ax, shown, body - 0.1)
    elif kind == BARGAUGE:
        labels = max(len(s.legend) for s in shown.series)
        room = min(0.3 + 0.068 * labels, width * 0.55)
        ax = fig.add_axes(rect(left + room, top + PANEL_TITLE + 0.05,
                               width - room - 0.85, PLOT - 0.25))
        _bars(ax, shown)
    else:
        ax = fig.add_axes(rect(left + AXIS_LEFT, top + PANEL_TITLE + 0.05,
                               width - AXIS_LEFT - 0.2, PLOT - AXIS_BOTTOM - 0.1))
        _timeseries(ax, shown)
        columns, lines = _legend_layout(shown, width)
        handles, labels_ = ax.get_legend_handles_labels()
        keep = columns * lines
        if len(handles) > keep:
            more = len(handles) - keep + 1
            handles = [*handles[:keep - 1], plt.Line2D([], [], color="none")]
            labels_ = [*labels_[:keep - 1], f"... and {more} more"]
        # Row by row, as Grafana lists them (matplotlib fills columns first).
        order = [i for c in range(columns) for i in range(c, len(handles), columns)]
        handles, labels_ = [handles[i] for i in order], [labels_[i] for i in order]
        ax.legend(handles, labels_, loc="upper left", ncol=columns, frameon=False,
                  fontsize=8, handlelength=1.4, columnspacing=1.4, borderaxespad=0,
                  labelcolor=TEXT, bbox_transform=fig.transFigure,
                  bbox_to_anchor=((left + 0.14) / WIDTH, 1 - (top + PANEL_TITLE + PLOT) / total))


def _timeseries(ax: Axes, shown: ShownLike) -> None:
    p = shown.panel
    times = list(mdates.date2num([datetime.datetime.fromtimestamp(t, datetime.UTC)
                                  for t in shown.series[0].times]))
    colors = [PALETTE[i % len(PALETTE)] for i in range(len(shown.series))]
    if p.stack:
        ys = [[v if math.isfinite(v) else 0.0 for v in s.values] for s in shown.series]
        ax.stackplot(times, ys, colors=colors, alpha=0.6, linewidth=0.8,
                     labels=[s.legend for s in shown.series])
    else:
        for s, color in zip(shown.series, colors, strict=True):
            ax.plot(times, s.values, color=color, linewidth=1.4, label=s.legend)
            if len(shown.series) <= FILLED:
                ax.fill_between(times, s.values, color=color, alpha=0.08, linewidth=0)
    ax.set_xlim(times[0], times[-1])
    bottom, top = ax.get_ylim()
    if all(v == 0 for s in shown.series for v in s.values if math.isfinite(v)):
        top = 1.0  # all zero: an axis from 0 to 1, as Grafana draws it
    ax.set_ylim(p.min if p.min is not None else bottom, p.max if p.max is not None else top)
    if p.thresholds:
        _bands(ax, p.thresholds)
    fmt = formatter(p.unit)
    ax.yaxis.set_major_locator(_locator(p.unit, *ax.get_ylim()))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt(v)))
    ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=3, maxticks=7))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=datetime.UTC))
    ax.grid(True, color=GRID, linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.spines["bottom"].set_color(EDGE)
    ax.tick_params(colors=MUTED, labelsize=8, length=0)


def _locator(unit: str, bottom: float, top: float) -> Locator:
    """About five ticks; bytes at round multiples of KiB, MiB, GiB as Grafana puts them."""
    if unit not in (BYTES, BYTES_PER_SECOND) or top <= 1024:
        return MaxNLocator(5, integer=unit in (BYTES, BYTES_PER_SECOND))
    scale = 1024.0 ** int(math.log(top, 1024))
    ticks = MaxNLocator(5).tick_values(bottom / scale, top / scale)
    return FixedLocator([t * scale for t in ticks if bottom <= t * scale <= top])


def _bands(ax: Axes, steps: Sequence[Step]) -> None:
    """Grafana's "line+area" thresholds: a faint band per step and a dashed line."""
    bottom, top = ax.get_ylim()
    bounds = [bottom if b is None else b for b, _ in steps] + [top]
    for (bound, color), lo, hi in zip(steps, bounds, bounds[1:], strict=False):
        if hi > lo:
            ax.axhspan(max(lo, bottom), min(hi, top), color=LIGHT[color], alpha=0.1,
                       linewidth=0, zorder=0)
        if bound is not None and bottom < bound < top:
            ax.axhline(bound, color=LIGHT[color], linewidth=1, linestyle=(0, (4, 3)))
    ax.set_ylim(bottom, top)


def _stat(ax: Axes, shown: ShownLike) -> None:
    p = shown.panel
    fmt = formatter(p.unit)
    n = len(shown.series)
    ax.set_xlim(0, n)
    ax.set_ylim(0, 1)
    ax.axis("off")
    for i, s in enumerate(shown.series):
        value = last(s.values)
        color = step_color(p.thresholds, value)
        finite = [(j, v) for j, v in enumerate(s.values) if math.isfinite(v)]
        if len(finite) > 1:  # the sparkline, in the lower part
            lo = min(v for _, v in finite)
            hi = max(v for _, v in finite)
            span = (hi - lo) or 1.0
            xs = [i + 0.04 + 0.92 * j / (len(s.values) - 1) for j, _ in finite]
            ys = [0.04 + 0.34 * (v - lo) / span for _, v in finite]
            ax.fill_between(xs, ys, 0.04, color=LIGHT[color], alpha=0.25, linewidth=0)
            ax.plot(xs, ys, color=LIGHT[color], linewidth=1.2)
        ax.text(i + 0.5, 0.62, fmt(value), ha="center", va="center", fontsize=26,
                weight="bold", color=DARK[color])
        if n > 1:
            ax.text(i + 0.5, 0.95, s.legend, ha="center", va="top", fontsize=8, color=MUTED)


def _gauge(ax: Axes, shown: ShownLike, height: float) -> None:
    p = shown.panel
    fmt = formatter(p.unit, decimals=1)  # as the rendered gauge's fieldConfig says
    lo = p.min if p.min is not None else 0.0
    n = len(shown.series)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_xlim(-1.25, 2.5 * n - 1.25)
    ax.set_ylim(-0.75, 1.15)
    start, sweep = 220.0, 260.0  # clockwise from lower left to lower right
    size = 13 * height  # points: the value fits inside the arc at any height (inches)
    for i, s in enumerate(shown.series):
        value = last(s.values)
        hi = p.max if p.max is not None else max(value, 1.0)
        x = 2.5 * i

        def angle(v: float, hi: float = hi) -> float:
            return start - sweep * (min(max(v, lo), hi) - lo) / ((hi - lo) or 1.0)

        ax.add_patch(Wedge((x, 0), 1.0, start - sweep, start, width=0.22, color=GRID))
        ax.add_patch(Wedge((x, 0), 1.0, angle(value), start, width=0.22,
                           color=LIGHT[step_color(p.thresholds, value)]))
        bounds = [lo if b is None else b for b, _ in p.thresholds or ((None, "green"),)]
        for (_, color), a, b in zip(p.thresholds or ((None, "green"),), bounds,
                                    [*bounds[1:], hi], strict=True):
            ax.add_patch(Wedge((x, 0), 1.1, angle(b), angle(a), width=0.06,
                               color=LIGHT[color]))
        ax.text(x, -0.05, fmt(value), ha="center", va="center", fontsize=size, weight="bold",
                color=DARK[step_color(p.thresholds, value)])


def _bars(ax: Axes, shown: ShownLike) -> None:
    p = shown.panel
    fmt = formatter(p.unit)
    values = [last(s.values) for s in shown.series]
    lo = p.min if p.min is not None else 0.0
    hi = p.max if p.max is not None else (max(values) * 1.1 or 1.0)
    ys = list(range(len(values)))
    colors = [step_color(p.thresholds, v) for v in values]
    height = 0.7
    ax.barh(ys, [hi - lo] * len(values), left=lo, height=height, color=GRID)
    ax.barh(ys, [v - lo for v in values], left=lo, height=height,
            color=[LIGHT[c] for c in colors])
    size = 9 if len(values) <= 8 else 7.5
    for y, v, c in zip(ys, values, colors, strict=True):
        ax.text(hi + (hi - lo) * 0.02, y, fmt(v), va="center", ha="left", fontsize=size + 1,
                weight="bold", color=DARK[c])
    ax.set_xlim(lo, hi)
    pad = max(0, 4 - len(values)) / 2  # a few bars keep the thickness of four
    ax.set_ylim(len(values) - 0.5 + pad, -0.5 - pad)
    ax.set_yticks(ys, [s.legend for s in shown.series], fontsize=size, color=TEXT)
    ax.tick_params(length=0)
    ax.xaxis.set_visible(False)
    for spine in ax.spines.values():
        spine.set_visible(False)
