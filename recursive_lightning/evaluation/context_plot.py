"""Perplexity against context length (Mela Fig. 4 / Table 5): one PNG for ``eval`` and for sweep reports.

Log axes, one line per model (or trial), the training length marked: the axis on which Mela's perplexity
stays in one order of magnitude while Transformer++ degrades beyond it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

from recursive_lightning.files import atomic_write_figure


def plot_ppl_by_context(
    series: Mapping[str, Mapping[int, float]],
    path: str | os.PathLike,
    train_length: int | Mapping[str, int] | None = None,
    title: str = "perplexity by context length",
) -> Path:
    """``series``: label -> {context length: perplexity}; ``train_length`` one value, or one per label.
    Written atomically (a temporary file renamed over ``path``)."""
    fig = Figure(figsize=(6.4, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    lengths: set[int] = set()
    values: list[float] = []
    for label, points in series.items():
        xs = sorted(int(k) for k, v in points.items() if math.isfinite(v) and v > 0)
        if not xs:
            continue
        lengths.update(xs)
        values += [points[x] for x in xs]
        ax.plot(xs, [points[x] for x in xs], marker="o", ms=4, lw=1.6, label=label)
    marks = set(train_length.values()) if isinstance(train_length, Mapping) else {train_length} - {None}
    for i, t in enumerate(sorted(marks)):
        ax.axvline(t, color="0.35", ls="--", lw=1, label="training length" if i == 0 else None)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted(lengths | marks)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{t // 1024}K" if t >= 1024 and t % 1024 == 0 else str(t) for t in ticks])
    plain = FuncFormatter(lambda v, _: f"{v:.4g}")  # 12.5, 1103, 2.1e+04: no 1.1032x10^3
    ax.yaxis.set_major_formatter(plain)
    lo, hi = (min(values), max(values)) if values else (1.0, 1.0)
    ax.yaxis.set_minor_formatter(plain if hi / lo < 10 else NullFormatter())
    if hi / lo < 1.5:  # a flat curve stays visibly flat: show at least a factor 1.5 around it
        ax.set_ylim(lo / 1.25, hi * 1.25)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3, ls="--")
    if len(series) > 4:  # many trials: the legend beside the axes, not over the curves
        fig.set_size_inches(8.4, 4.2)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return atomic_write_figure(fig, path, dpi=150)
