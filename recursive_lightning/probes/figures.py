"""Shared figure helpers of the probes: style, canvas, heatmaps, bands, boxes, labels, and :class:`Sheet`.

Every figure is built with the object-oriented API on an Agg canvas (no ``pyplot``, no global backend
switch, nothing left open), inside a local ``rc_context`` so the caller's matplotlib settings are untouched.
A probe's figure function takes ``{model: data}``: a single run is the comparison of one model, drawn in
the single-run layout (``single``), several models side by side, in subplots or as grouped bars/boxes.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

ArrayLike = torch.Tensor | np.ndarray | Sequence[Any] | float
PathLike = str | os.PathLike[str]

STYLE: dict[str, Any] = {
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "legend.fontsize": 8,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": False,
    "grid.alpha": 0.3,
    "grid.linestyle": "--",
    "savefig.facecolor": "white",
    "figure.facecolor": "white",
}

_MODEL_COLORS = {
    "base": "#7f7f7f",
    "residual": "#1f77b4",
    "anchor": "#ff7f0e",
    "anchor*": "#bcbd22",
    "anchor_emb": "#bcbd22",
    "mesh": "#d62728",
    "spiral": "#9467bd",
    "spiralformer": "#9467bd",
    "looped": "#7f7f7f",
    "loopedformer": "#7f7f7f",
}
_FALLBACK = ["#2ca02c", "#8c564b", "#e377c2", "#17becf", "#9467bd", "#1f77b4", "#ff7f0e", "#d62728"]


@dataclass(frozen=True)
class Sheet:
    """Where one draw call puts its figures: a single run (``skew.png``, titles ending in
    `` - <title>``) or a comparison (``title`` None: ``compare_skew.png``, the comparison's titles)."""

    out: Path
    title: str | None = None

    @property
    def compare(self) -> bool:
        return self.title is None

    def path(self, name: str) -> Path:
        return self.out / (f"compare_{name}.png" if self.compare else f"{name}.png")

    def heading(self, single: str, compare: str | None = None) -> str:
        return (compare or single) if self.compare else f"{single} - {self.title}"


# ---------------------------------------------------------------------------
# numbers
# ---------------------------------------------------------------------------


def to_numpy(x: ArrayLike) -> np.ndarray:
    """float64 numpy array of a tensor, array or nested sequence."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def mean_std(x: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """NaN-aware mean and std over the sample axis 0 (a 1-D array is one curve: itself, std 0)."""
    a = to_numpy(x)
    if a.ndim <= 1:
        return a, np.zeros_like(a)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(a, axis=0), np.nanstd(a, axis=0)


def sample_mean_std(v: ArrayLike) -> tuple[float, float]:
    a = to_numpy(v).ravel()
    if a.size == 0:
        return float("nan"), 0.0
    with np.errstate(all="ignore"):
        return float(np.nanmean(a)), float(np.nanstd(a)) if a.size > 1 else 0.0


def mean_matrix(x: ArrayLike, ndim: int = 2) -> np.ndarray:
    """Average over leading dims down to ``ndim`` trailing dims (NaN-aware)."""
    a = to_numpy(x)
    if a.ndim < ndim:
        raise ValueError(f"expected at least {ndim} dims, got shape {a.shape}")
    if a.ndim > ndim:
        with np.errstate(all="ignore"):
            a = np.nanmean(a.reshape(-1, *a.shape[-ndim:]), axis=0)
    return a


# ---------------------------------------------------------------------------
# labels and colours
# ---------------------------------------------------------------------------


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def state_label(name: str) -> str:
    """Trace state name -> mathtext label (``h(2)`` -> ``$h^{(2)}$``)."""
    if name == "h_emb":
        return r"$h_{\mathrm{emb}}$"
    if name == "h_out":
        return r"$h_{\mathrm{out}}$"
    m = re.fullmatch(r"h\((\d+)\)", name)
    return rf"$h^{{({m.group(1)})}}$" if m else name


def metric_key(name: str) -> str:
    """A trace name as part of an MLflow metric key (``core 2`` -> ``core_2``)."""
    return re.sub(r"[^\w./ -]", "", name.replace(" ", "_"))


def model_color(name: str, index: int = 0) -> str:
    """Stable colour per model family (``base`` grey, ``residual`` blue, ``anchor`` orange,
    ``mesh`` red, ...); unknown names cycle through a fallback palette by ``index``."""
    key = name.strip().lower().lstrip("+").replace("-", "_")
    for k in (key, key.split("_")[0], key.split(" ")[0]):
        if k in _MODEL_COLORS:
            return _MODEL_COLORS[k]
    return _FALLBACK[index % len(_FALLBACK)]


def state_colors(n: int) -> list[Any]:
    if n <= 10:
        return [matplotlib.colormaps["tab10"](i) for i in range(n)]
    cmap = matplotlib.colormaps["viridis"]
    return [cmap(i / max(n - 1, 1)) for i in range(n)]


# ---------------------------------------------------------------------------
# canvas
# ---------------------------------------------------------------------------


def new_fig(nrows: int, ncols: int, figsize: tuple[float, float], **kw: Any) -> tuple[Figure, np.ndarray]:
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


def save(fig: Figure, path: PathLike, tight: bool = True) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    fig.savefig(out, dpi=150, format="png", bbox_inches="tight")
    return out


def suptitle(fig: Figure, title: str | None) -> None:
    if title:
        fig.suptitle(title, fontsize=11)


def save_titled(fig: Figure, path: PathLike, title: str | None, height: float) -> Path:
    """Suptitle 0.08 in below the top whatever the figure's height (at the default y = 0.98 a tall
    figure's title drops into its first row of panels), then tight_layout around it and save."""
    if title:
        fig.suptitle(title, fontsize=11, y=1 - 0.08 / height, va="top")
    return save(fig, path)


def sparse_ticks(n: int, most: int = 16) -> list[int]:
    step = max(1, -(-n // most))
    return list(range(0, n, step))


# ---------------------------------------------------------------------------
# drawing
# ---------------------------------------------------------------------------


def draw_heatmap(
    ax: Axes,
    mat: np.ndarray,
    row_labels: Sequence[str] | None,
    col_labels: Sequence[str] | None,
    *,
    cmap: str,
    vmin: float | None,
    vmax: float | None,
    annotate: bool,
    fmt: str = "{:.2f}",
) -> Any:
    im = ax.imshow(mat, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
    nr, nc = mat.shape
    ax.set_xticks(range(nc))
    ax.set_yticks(range(nr))
    if col_labels is not None:
        rotate = nc > 4 and max(len(str(c)) for c in col_labels) > 3
        ax.set_xticklabels(list(col_labels), rotation=45 if rotate else 0, ha="right" if rotate else "center")
    if row_labels is not None:
        ax.set_yticklabels(list(row_labels))
    for spine in ax.spines.values():
        spine.set_visible(False)
    if annotate and nr * nc <= 400:
        lo = np.nanmin(mat) if vmin is None else vmin
        hi = np.nanmax(mat) if vmax is None else vmax
        span = (hi - lo) if np.isfinite(hi - lo) and hi > lo else 1.0
        fs = max(5.0, min(9.0, 48.0 / max(nr, nc)))
        for i in range(nr):
            for j in range(nc):
                v = mat[i, j]
                if not np.isfinite(v):
                    continue
                dark = (v - lo) / span > 0.6
                ax.text(
                    j,
                    i,
                    fmt.format(v),
                    ha="center",
                    va="center",
                    fontsize=fs,
                    color="white" if dark else "black",
                )
    return im


def draw_bands(ax: Axes, curves: Mapping[str, ArrayLike], *, logy: bool, x0: int) -> None:
    """One line per curve ``[N, k]`` (mean over samples) with a +-std band."""
    colors = state_colors(len(curves))
    for (label, arr), color in zip(curves.items(), colors):
        mean, std = mean_std(np.atleast_1d(to_numpy(arr)))
        x = np.arange(x0, x0 + mean.shape[-1])
        lo, hi = mean - std, mean + std
        if logy:
            mean = np.where(mean > 0, mean, np.nan)  # zero padding beyond the rank
            pos = mean[np.isfinite(mean)]
            floor = float(pos.min()) * 0.1 if pos.size else 1e-12
            lo = np.where(np.isfinite(mean), np.clip(lo, floor, None), np.nan)
            hi = np.where(np.isfinite(mean), hi, np.nan)
        ax.plot(x, mean, color=color, lw=1.6, label=label)
        if np.any(std > 0):
            ax.fill_between(x, lo, hi, color=color, alpha=0.2, lw=0)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, which="major")


def draw_boxes(
    ax: Axes, positions: np.ndarray, values: Sequence[np.ndarray], color: Any, width: float, label: str | None
) -> None:
    clean = [v[np.isfinite(v)] if v.size else v for v in values]
    keep = [i for i, v in enumerate(clean) if v.size]
    if not keep:
        return
    bp = ax.boxplot(
        [clean[i] for i in keep],
        positions=positions[keep],
        widths=width,
        patch_artist=True,
        showfliers=True,
        flierprops={"markersize": 2, "alpha": 0.5},
        medianprops={"color": "black", "lw": 0.8},
        manage_ticks=False,
    )
    for box in bp["boxes"]:
        box.set_facecolor(color)
        box.set_alpha(0.6)
    means = np.array([np.mean(clean[i]) for i in keep])
    ax.plot(
        positions[keep],
        means,
        "-o",
        color="black" if label is None else color,
        ms=3.5,
        mfc="black",
        mec="black",
        lw=1.0,
        label=label,
        zorder=5,
    )
