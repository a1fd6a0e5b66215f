"""Perplexity (and accuracy) against test-time depth: the ``eval --loops`` / ``--h-cycles`` PNG.

Left: against the loop count (Mela: high-level cycles), log2 axis; right: against the forward FLOPs per
token at that depth, the compute the extra depth costs. The trained depth is marked on both. A second row,
when tasks were run: the average accuracy of each few-shot count.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

from recursive_lightning import formatting as fmt
from recursive_lightning.files import atomic_write_figure

DIAL_LABEL = {"loops": "loop count K'", "h_cycles": "high-level cycles H'"}


def plot_by_depth(section: dict[str, Any], path: str | os.PathLike, title: str) -> Path | None:
    """The PNG of a result's ``depth`` section (evaluation/depth.py) at ``path``, written atomically; None
    when there is no finite perplexity and no accuracy to draw."""
    counts = {int(k): e for k, e in section["counts"].items()}
    ks = sorted(counts)
    first = next(iter(counts[ks[0]]["ppl"]), None)
    ppl = {
        k: v for k in ks if first is not None and math.isfinite(v := counts[k]["ppl"][first]["ppl"]) and v > 0
    }
    shots = sorted({s for k in ks for s, v in counts[k].get("avg", {}).items() if v is not None}, key=int)
    rows = [r for r in (("ppl", ppl), ("acc", shots)) if r[1]]
    if not rows:
        return None
    flops = {k: counts[k]["flops_forward_per_token"] for k in ks}
    trained = section["trained"]
    trained_flops = section["trained_flops_forward_per_token"]
    fig = Figure(figsize=(10.0, 3.6 * len(rows)))
    FigureCanvasAgg(fig)
    plain = FuncFormatter(lambda v, _: f"{v:.4g}")
    for r, (what, data) in enumerate(rows):
        for c, xs_of in enumerate((lambda k: k, lambda k: flops[k])):
            ax = fig.add_subplot(len(rows), 2, 2 * r + c + 1)
            if what == "ppl":
                xs = sorted(data)
                ax.plot([xs_of(k) for k in xs], [data[k] for k in xs], marker="o", ms=5, lw=1.6, label=first)
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(plain)
                lo, hi = min(data.values()), max(data.values())
                ax.yaxis.set_minor_formatter(plain if hi / lo < 10 else NullFormatter())
                if hi / lo < 1.5:  # a flat curve stays visibly flat
                    ax.set_ylim(lo / 1.25, hi * 1.25)
                ax.set_ylabel("perplexity (log scale)")
            else:
                for s in data:
                    xs = [k for k in ks if counts[k]["avg"].get(s) is not None]
                    ys = [100 * counts[k]["avg"][s] for k in xs]
                    ax.plot([xs_of(k) for k in xs], ys, marker="o", ms=5, lw=1.6, label=f"average, {s}-shot")
                ax.set_ylabel("accuracy (%)")
            mark = trained if c == 0 else trained_flops
            ax.axvline(mark, color="0.35", ls="--", lw=1, label=f"trained ({trained})")
            ax.set_xscale("log", base=2 if c == 0 else 10)
            ticks = sorted(set(ks) | {trained}) if c == 0 else sorted(set(flops.values()) | {trained_flops})
            ax.xaxis.set_major_locator(FixedLocator(ticks))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticklabels(
                [str(t) if c == 0 else fmt.flops(t).removesuffix("FLOPs").strip() for t in ticks],
                rotation=0 if c == 0 else 30,
            )
            ax.set_xlabel(DIAL_LABEL[section["dial"]] if c == 0 else "forward FLOPs per token")
            ax.grid(True, which="both", alpha=0.3, ls="--")
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return atomic_write_figure(fig, path, dpi=150)
