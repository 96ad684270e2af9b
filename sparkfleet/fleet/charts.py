"""The benchmark report's charts, drawn with matplotlib (Agg backend) and written as PNG.

Three kinds of figure, each built as a :class:`~matplotlib.figure.Figure` (so tests can read its
axes, lines and text) and turned into PNG bytes by :func:`png`:

- :func:`bar_figure`: grouped bars (per workload, prompt, turn or host; several series);
- :func:`line_figure`: lines over categories (runs over time, draft positions); the y axis is
  autoscaled with a margin, not pinned at 0, so a 5 % change between two runs is plain to see;
- :func:`sweep_figure`: output tok/s against concurrency (aggregate and per stream), 1..N points.

A profile's baseline is a :class:`Threshold`: the figure it names, the baseline and the run's
tolerance. Every figure it applies to draws it (a dashed line at the baseline, a dotted red line at
the limit the tolerance allows, both labelled) and marks each value beyond the limit in red with
the text "FAIL", as ``sparkfleet.hostlib.bench.results.compare_figure`` judges it. Text is drawn as given
("spark-01" stays lower case). Files are deterministic: fixed size and dpi, no software stamp.

Controller side only (matplotlib is a controller dependency): ``sparkfleet.hostlib.bench`` is copied to the
serving hosts and imports only the standard library and packages vLLM brings, so the charts live outside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from io import BytesIO

import matplotlib

matplotlib.use("Agg")  # never a display: the report runs on controllers and in CI

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.container import BarContainer  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FixedLocator, NullLocator  # noqa: E402

Value = float | int | None
Series = Sequence[tuple[str, Sequence[Value]]]

SIZE_IN = (9.0, 4.6)
DPI = 100  # 900 x 460 pixels
FAIL_COLOR = "#d62728"
BASELINE_COLOR = "#333333"
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
MARKERS = ["o", "s", "^", "D", "v", "P", "*", "h", "<"]
LINESTYLES = ["-", "--", "-.", ":"]


@dataclass(frozen=True)
class Threshold:
    """One baseline on a chart: ``figure``'s ``baseline`` with ``tolerance_pct`` in the bad direction.

    ``categories`` are the bar groups / x labels it applies to (None: every one); ``series`` the
    series it applies to (None: every one).
    """

    figure: str
    baseline: float
    tolerance_pct: float
    lower_is_better: bool = False
    categories: tuple[str, ...] | None = None
    series: str | None = None

    @property
    def limit(self) -> float:
        """The worst value that still passes."""
        allowance = abs(self.baseline) * self.tolerance_pct / 100.0
        return self.baseline + allowance if self.lower_is_better else self.baseline - allowance

    def fails(self, value: Value) -> bool:
        if value is None or not math.isfinite(value):
            return False  # nothing drawn: the report's verdict lines say "not measured"
        return value > self.limit if self.lower_is_better else value < self.limit

    def applies(self, series: str | None, category: str) -> bool:
        """Whether it applies to ``series`` (None: whichever) at ``category``."""
        return (self.series is None or series is None or self.series == series) and (
            self.categories is None or category in self.categories
        )

    @property
    def label(self) -> str:
        where = f" ({', '.join(self.categories)})" if self.categories else ""
        return f"baseline {self.figure} {self.baseline:.4g}{where}"

    @property
    def limit_label(self) -> str:
        side = "above" if self.lower_is_better else "below"
        return f"fail {side} {self.limit:.4g} ({self.tolerance_pct:g} % tolerance)"


def merge_thresholds(thresholds: Sequence[Threshold], categories: Sequence[str]) -> list[Threshold]:
    """One threshold per (figure, baseline, tolerance, series): their categories joined, None when all."""
    merged: dict[tuple, Threshold] = {}
    for threshold in thresholds:
        key = (threshold.figure, threshold.baseline, threshold.tolerance_pct, threshold.series)
        known = merged.get(key)
        if known is None:
            merged[key] = threshold
        elif known.categories is not None:
            joined = None
            if threshold.categories is not None:
                joined = tuple(dict.fromkeys(known.categories + threshold.categories))
            merged[key] = replace(known, categories=joined)
    out = []
    for threshold in merged.values():
        if threshold.categories is not None and set(categories) <= set(threshold.categories):
            threshold = replace(threshold, categories=None)
        out.append(threshold)
    return out


def new_figure(ncols: int = 1) -> tuple[Figure, list]:
    fig = Figure(figsize=SIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    for ax in axes:
        ax.grid(True, axis="y", color="#e0e0e0", linewidth=0.8)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    return fig, list(axes)


def png(fig: Figure) -> bytes:
    """The figure as PNG bytes (no software or date stamp: the same input gives the same file)."""
    buffer = BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
    return buffer.getvalue()


def finite(value: Value) -> float | None:
    if value is None or isinstance(value, bool) or not math.isfinite(value):
        return None
    return float(value)


def short(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def label_categories(ax, labels: Sequence[str]) -> None:
    ax.set_xticks(range(len(labels)), labels)
    if sum(len(label) for label in labels) > 90 or max((len(label) for label in labels), default=0) > 16:
        for tick in ax.get_xticklabels():
            tick.set_rotation(25)
            tick.set_horizontalalignment("right")


def draw_threshold(ax, threshold: Threshold, spans: Sequence[tuple[float, float]] | None) -> None:
    """The baseline (dashed) and its limit (dotted red), over ``spans`` of x (data) or the full width.

    One legend entry names both; a line across the figure also carries its label at its right end.
    """
    label = f"{threshold.label}; {threshold.limit_label}"
    lines = [(threshold.baseline, "--", BASELINE_COLOR, label, "baseline")]
    if threshold.limit != threshold.baseline:
        lines.append((threshold.limit, ":", FAIL_COLOR, "_nolegend_", "baseline-limit"))
    for y, style, color, legend_label, gid in lines:
        if spans is None:
            line = ax.axhline(y, linestyle=style, color=color, linewidth=1.4, label=legend_label)
            line.set_gid(gid)
        else:
            for i, (x0, x1) in enumerate(spans):
                (line,) = ax.plot([x0, x1], [y, y], linestyle=style, color=color, linewidth=1.6)
                line.set_label(legend_label if i == 0 else "_nolegend_")
                line.set_gid(gid)
    if spans is None:
        text = ax.text(
            1.0,
            threshold.baseline,
            label,
            transform=ax.get_yaxis_transform(),
            ha="right",
            va="bottom",
            fontsize=7.5,
            color=BASELINE_COLOR,
        )
        text.set_gid("baseline-label")


def failing(thresholds: Sequence[Threshold], series: str, category: str, value: Value) -> bool:
    return any(t.applies(series, category) and t.fails(finite(value)) for t in thresholds)


def legend(fig: Figure) -> None:
    """One legend below the axes (it hides no bar or point), when there is more than one entry."""
    handles, labels = [], []
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if isinstance(handle, BarContainer):  # the series' colour, not its first bar's FAIL marking
                handle = Patch(facecolor=handle.patches[0].get_facecolor())
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    if len(labels) > 1:
        fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize=8, frameon=False)


def bar_figure(
    title: str,
    categories: Sequence[str],
    series: Series,
    ylabel: str,
    thresholds: Sequence[Threshold] = (),
) -> Figure:
    """Grouped bars: one group per category, one bar per series; value labels on the bars."""
    if not categories or not series:
        raise ValueError("a bar chart needs at least one category and one series")
    thresholds = merge_thresholds(thresholds, categories)
    fig, (ax,) = new_figure()
    width = 0.8 / len(series)
    names = [name for name, _ in series]
    for s, (name, values) in enumerate(series):
        xs = [c - 0.4 + width * (s + 0.5) for c in range(len(categories))]
        heights = [finite(v) for v in values]
        bars = ax.bar(
            xs, [h if h is not None else 0.0 for h in heights], width * 0.92, label=name, color=COLORS[s % len(COLORS)]
        )
        texts = ax.bar_label(bars, labels=["n/a" if h is None else short(h) for h in heights], padding=2, fontsize=8)
        for category, bar, text, height in zip(categories, bars, texts, heights, strict=True):
            if failing(thresholds, name, category, height):
                bar.set_edgecolor(FAIL_COLOR)
                bar.set_linewidth(2.0)
                bar.set_hatch("//")
                text.set_text(f"{text.get_text()} FAIL")
                text.set_color(FAIL_COLOR)
                text.set_fontweight("bold")
                text.set_gid("fail")
    for threshold in thresholds:
        spans = None  # across the figure: every bar
        if threshold.categories is not None or (threshold.series is not None and len(series) > 1):
            if threshold.series is not None and threshold.series in names:  # over that series' bar
                s = names.index(threshold.series)
                x0, x1 = -0.4 + width * s - 0.03, -0.4 + width * (s + 1) + 0.03
            else:  # over the whole group
                x0, x1 = -0.45, 0.45
            spans = [(c + x0, c + x1) for c, category in enumerate(categories) if threshold.applies(None, category)]
        draw_threshold(ax, threshold, spans)
    label_categories(ax, categories)
    ax.set_xlim(-0.6, len(categories) - 0.4)
    ax.margins(y=0.15)
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=11)
    ax.set_ylabel(ylabel)
    legend(fig)
    return fig


def distinct_labels(series: Series) -> list[str]:
    """Series names, each repeating an earlier series' values saying so (the lines lie on each other)."""
    labels = []
    for s, (name, values) in enumerate(series):
        same = next((series[e][0] for e in range(s) if list(series[e][1]) == list(values)), None)
        labels.append(name if same is None else f"{name} (same values as {same})")
    return labels


def plot_lines(
    ax, xs: Sequence[float], categories: Sequence[str], series: Series, thresholds: Sequence[Threshold]
) -> None:
    """Each series with a marker and line style of its own, the earlier ones drawn larger: none hides another."""
    for s, ((_, values), label) in enumerate(zip(series, distinct_labels(series), strict=True)):
        ax.plot(
            xs,
            [math.nan if y is None else y for y in map(finite, values)],
            label=label,
            color=COLORS[s % len(COLORS)],
            marker=MARKERS[s % len(MARKERS)],
            linestyle=LINESTYLES[s % len(LINESTYLES)],
            markersize=max(4.0, 9.0 - 1.2 * s),
            linewidth=1.8,
            zorder=3 + s,
        )
    fail_labelled = False
    for name, values in series:
        for x, category, y in zip(xs, categories, map(finite, values), strict=True):
            if failing(thresholds, name, category, y):
                (mark,) = ax.plot([x], [y], linestyle="none", marker="X", markersize=12, color=FAIL_COLOR, zorder=10)
                mark.set_gid("fail")
                mark.set_label("_nolegend_" if fail_labelled else "FAIL: beyond the baseline's tolerance")
                fail_labelled = True
                text = ax.annotate(
                    "FAIL",
                    (x, y),
                    xytext=(0, 9),
                    textcoords="offset points",
                    ha="center",
                    fontsize=8,
                    fontweight="bold",
                    color=FAIL_COLOR,
                )
                text.set_gid("fail")


def line_figure(
    title: str,
    categories: Sequence[str],
    series: Series,
    ylabel: str,
    thresholds: Sequence[Threshold] = (),
    ylim: tuple[float, float] | None = None,
    xlabel: str | None = None,
) -> Figure:
    """Lines over categories (runs in time order, draft positions); a missing value leaves a gap.

    Without ``ylim`` the y axis is autoscaled with a margin around the data (and the baselines): it
    does not start at 0, so a few per cent between two runs span a good part of the axes' height.
    """
    if not categories or not series:
        raise ValueError("a line chart needs at least one category and one series")
    thresholds = merge_thresholds(thresholds, categories)
    fig, (ax,) = new_figure()
    xs = list(range(len(categories)))
    plot_lines(ax, xs, categories, series, thresholds)
    for threshold in thresholds:
        draw_threshold(ax, threshold, None)
    label_categories(ax, categories)
    ax.set_xlim(-0.5, len(categories) - 0.5)
    if ylim is not None:
        ax.set_ylim(*ylim)
    else:
        ax.margins(y=0.12)
    ax.set_title(title, fontsize=11)
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
    legend(fig)
    return fig


AGGREGATE = "aggregate output tok/s"
PER_STREAM = "output tok/s per stream"


def sweep_figure(
    title: str, points: Sequence[tuple[float, Value] | tuple[float, Value, Value]], thresholds: Sequence[Threshold] = ()
) -> Figure:
    """Output tok/s against concurrency: aggregate (left) and per stream (right).

    ``points`` are (concurrency, aggregate output tok/s[, per-stream tok/s]), one or more; without a
    per-stream figure it is aggregate / concurrency. ``thresholds`` apply to the aggregate (their
    categories are concurrencies written as text, e.g. "8").
    """
    if not points:
        raise ValueError("a concurrency sweep needs at least one point")
    points = sorted(points, key=lambda point: point[0])
    xs = [float(point[0]) for point in points]
    categories = [f"{c:g}" for c in xs]
    aggregate = [finite(point[1]) for point in points]
    per_stream = [
        finite(point[2]) if len(point) > 2 and point[2] is not None else (None if v is None or c <= 0 else v / c)
        for point, c, v in zip(points, xs, aggregate, strict=True)
    ]
    thresholds = merge_thresholds([replace(t, series=AGGREGATE) for t in thresholds], categories)
    fig, axes = new_figure(2)
    for ax, name, values in ((axes[0], AGGREGATE, aggregate), (axes[1], PER_STREAM, per_stream)):
        drawn = [t for t in thresholds if t.series == name]
        plot_lines(ax, xs, categories, [(name, values)], drawn)
        for threshold in drawn:
            draw_threshold(ax, threshold, None)
        for x, y in zip(xs, values, strict=True):
            if y is not None:
                ax.annotate(short(y), (x, y), xytext=(0, -13), textcoords="offset points", ha="center", fontsize=8)
        if len(xs) > 1 and xs[0] > 0 and xs[-1] / xs[0] >= 4:
            ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(xs))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels(categories)
        if len(xs) == 1:
            ax.set_xlim(xs[0] / 2, xs[0] * 1.5)
        ax.margins(y=0.15)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("max concurrency (vllm bench serve)")
        ax.set_ylabel(name)
    fig.suptitle(title, fontsize=11)
    legend(fig)
    return fig


TUNE_TOK_S = "decode tok/s"
TUNE_ACCEPTANCE = "acceptance length"


def tune_figure(title: str, points: Sequence[tuple[int, Value, Value]], best: int | None = None) -> Figure:
    """`make tune`'s chart: decode tok/s (left) and acceptance length (right) against
    num_speculative_tokens; ``points`` are (n, tok/s, acceptance), a value not measured is left out, and
    the ``best`` n is marked on both."""
    if not points:
        raise ValueError("a tuning chart needs at least one value of n")
    points = sorted(points, key=lambda point: point[0])
    xs = [float(point[0]) for point in points]
    fig, axes = new_figure(2)
    for ax, name, column, color in ((axes[0], TUNE_TOK_S, 1, COLORS[0]), (axes[1], TUNE_ACCEPTANCE, 2, COLORS[1])):
        values = [finite(point[column]) for point in points]
        shown = [(x, y) for x, y in zip(xs, values, strict=True) if y is not None]
        if shown:
            ax.plot([x for x, _ in shown], [y for _, y in shown], marker="o", color=color, label=name)
        for x, y in shown:
            ax.annotate(short(y), (x, y), xytext=(0, 7), textcoords="offset points", ha="center", fontsize=8)
            if best is not None and x == best:
                ax.plot([x], [y], marker="*", markersize=16, color=FAIL_COLOR, linestyle="none")
        if best is not None:
            ax.axvline(best, color=BASELINE_COLOR, linestyle=":", linewidth=1)
        ax.xaxis.set_major_locator(FixedLocator(xs))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([f"{x:g}" for x in xs])
        if len(xs) == 1:
            ax.set_xlim(xs[0] - 1, xs[0] + 1)
        ax.margins(y=0.15)
        ax.set_xlabel("num_speculative_tokens")
        ax.set_ylabel(name)
    if best is not None:
        axes[0].plot([], [], marker="*", markersize=12, color=FAIL_COLOR, linestyle="none", label=f"best: n={best}")
    fig.suptitle(title, fontsize=11)
    legend(fig)
    return fig
