"""Paper-style figures for the diagnostics in :mod:`recursive_lightning.probes.metrics`.

Every public function takes data (torch tensors, numpy arrays or nested sequences)
plus an output path, writes one PNG and returns the :class:`~pathlib.Path` it wrote.
Figures are built with the object-oriented API on an Agg canvas (no ``pyplot``, no
global backend switch, nothing left open), inside a local ``rc_context`` so the
caller's matplotlib settings are untouched.

For each figure type there is a single-model ``plot_*`` function and a
``compare_*`` variant that takes ``{model_name: data}`` (e.g. ``base`` / ``residual``
/ ``anchor`` / ``mesh``) and draws the models side by side (subplots) or as grouped
bars/boxes.

Figures reproduced (papers in ``shared/papers``):

* MeSH Fig. 1a / 3 - computation skew bars (mean +- std over samples) per block;
* MeSH Fig. 1b / 4 - annotated CKA heatmaps;
* MeSH Fig. 1c / 5 - normalised singular spectra, log-y, mean +- std bands;
* MeSH Fig. 10 (App. E.8) - shared-subspace cumulative variance curves;
* MeSH Fig. 11 (App. F) - router heatmaps (write red, read green) and the state
  composition heatmap of Eq. 7;
* SpiralFormer Fig. 4 / 6 / 8 - ridgeline histograms + box plots of head-wise attention
  statistics per loop; Fig. 5 / 7 - layer x head heatmaps (per loop, and of the
  min-max normalised cross-loop range with dynamic heads boxed).

Mela (``probes/mela.py``; no paper figure): heatmaps over block application x memory chunk (surprise
norm, theta / eta / alpha), the memory update's singular values, and MemStack's relative change of the
decoder's memory rows per H cycle.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from recursive_lightning.probes.metrics import dynamic_heads, minmax_normalize, state_composition_labels

__all__ = [
    "model_color",
    "skew_block_labels",
    "plot_skew",
    "compare_skew",
    "plot_cka_heatmap",
    "compare_cka_heatmaps",
    "plot_singular_spectra",
    "compare_singular_spectra",
    "plot_shared_subspace",
    "compare_shared_subspace",
    "plot_mesh_routers",
    "compare_mesh_routers",
    "plot_state_composition",
    "compare_state_composition",
    "plot_attention_probe",
    "compare_attention_probe",
    "plot_head_heatmaps",
    "compare_head_heatmaps",
    "plot_head_range_heatmap",
    "compare_head_range_heatmaps",
    "plot_application_heatmaps",
    "plot_update_spectrum",
    "plot_memstack_change",
]

ArrayLike = torch.Tensor | np.ndarray | Sequence[Any] | float
PathLike = str | os.PathLike[str]

_STYLE: dict[str, Any] = {
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


def model_color(name: str, index: int = 0) -> str:
    """Stable colour per model family (``base`` grey, ``residual`` blue, ``anchor`` orange,
    ``mesh`` red, ...); unknown names cycle through a fallback palette by ``index``."""
    key = name.strip().lower().lstrip("+").replace("-", "_")
    for k in (key, key.split("_")[0], key.split(" ")[0]):
        if k in _MODEL_COLORS:
            return _MODEL_COLORS[k]
    return _FALLBACK[index % len(_FALLBACK)]


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def skew_block_labels(n_loops: int, prelude: bool = True, coda: bool = True) -> list[str]:
    """Block labels of MeSH Fig. 3: ``Prelude, 1st f_core, 2nd f_core, ..., Coda``."""
    labels = [rf"{_ordinal(i + 1)} $f_{{\mathrm{{core}}}}$" for i in range(n_loops)]
    return (["Prelude"] if prelude else []) + labels + (["Coda"] if coda else [])


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _np(x: ArrayLike) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _new_fig(nrows: int, ncols: int, figsize: tuple[float, float], **kw: Any) -> tuple[Figure, np.ndarray]:
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


def _save(fig: Figure, path: PathLike, tight: bool = True) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    fig.savefig(out, dpi=150, format="png", bbox_inches="tight")
    return out


def _mean_std(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean/std over the sample axis 0 (a 1-D array of a single curve has std 0)."""
    if a.ndim <= 1:
        return a, np.zeros_like(a)
    with np.errstate(all="ignore"):
        return np.nanmean(a, axis=0), np.nanstd(a, axis=0)


def _sample_mean_std(v: ArrayLike) -> tuple[float, float]:
    a = _np(v).ravel()
    if a.size == 0:
        return float("nan"), 0.0
    with np.errstate(all="ignore"):
        return float(np.nanmean(a)), float(np.nanstd(a)) if a.size > 1 else 0.0


def _mean_matrix(x: ArrayLike, ndim: int = 2) -> np.ndarray:
    """Average over leading dims down to ``ndim`` trailing dims (NaN-aware)."""
    a = _np(x)
    if a.ndim < ndim:
        raise ValueError(f"expected at least {ndim} dims, got shape {a.shape}")
    if a.ndim > ndim:
        with np.errstate(all="ignore"):
            a = np.nanmean(a.reshape(-1, *a.shape[-ndim:]), axis=0)
    return a


def _curve_mapping(
    data: Mapping[str, ArrayLike] | ArrayLike, labels: Sequence[str] | None
) -> dict[str, np.ndarray]:
    """``{label: [N, k] or [k]}`` from a mapping or an array ``[S, k]`` / ``[N, S, k]``."""
    if isinstance(data, Mapping):
        return {str(k): _np(v) for k, v in data.items()}
    a = _np(data)
    if a.ndim == 2:  # [S, k]
        curves = list(a)
    elif a.ndim == 3:  # [N, S, k]
        curves = [a[:, s] for s in range(a.shape[1])]
    else:
        raise ValueError(f"expected a mapping or an array [S, k] / [N, S, k], got shape {a.shape}")
    names = list(labels) if labels is not None else [rf"$h^{{({s})}}$" for s in range(len(curves))]
    if len(names) != len(curves):
        raise ValueError(f"{len(names)} labels for {len(curves)} curves")
    return dict(zip(names, curves))


def _state_colors(n: int) -> list[Any]:
    if n <= 10:
        return [matplotlib.colormaps["tab10"](i) for i in range(n)]
    cmap = matplotlib.colormaps["viridis"]
    return [cmap(i / max(n - 1, 1)) for i in range(n)]


def _draw_heatmap(
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


def _draw_bands(ax: Axes, curves: Mapping[str, np.ndarray], *, logy: bool, x0: int) -> None:
    colors = _state_colors(len(curves))
    for (label, arr), color in zip(curves.items(), colors):
        mean, std = _mean_std(np.atleast_1d(arr))
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


def _title(fig: Figure, title: str | None) -> None:
    if title:
        fig.suptitle(title, fontsize=11)


# ---------------------------------------------------------------------------
# Computation skew (MeSH Fig. 1a / 3)
# ---------------------------------------------------------------------------


def _draw_skew(ax: Axes, models: Mapping[str, Mapping[str, ArrayLike]], legend: bool, ylabel: str) -> None:
    blocks: list[str] = []
    for per_block in models.values():
        for b in per_block:
            if b not in blocks:
                blocks.append(b)
    m = len(models)
    width = 0.8 / max(m, 1)
    x = np.arange(len(blocks))
    for i, (name, per_block) in enumerate(models.items()):
        stats = [_sample_mean_std(per_block[b]) if b in per_block else (np.nan, 0.0) for b in blocks]
        means = np.array([s[0] for s in stats])
        stds = np.array([s[1] for s in stats])
        color = model_color(name, i) if m > 1 else "#4c72b0"
        ax.bar(
            x + (i - (m - 1) / 2) * width,
            means,
            width * 0.92,
            yerr=stds,
            capsize=3,
            color=color,
            edgecolor="black",
            linewidth=0.5,
            label=name,
            error_kw={"elinewidth": 0.8, "ecolor": "black"},
        )
    ax.set_xticks(x)
    ax.set_xticklabels(blocks, rotation=0)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(True, axis="y")
    ax.set_axisbelow(True)
    if legend and m > 1:
        ax.legend(frameon=False, ncols=min(m, 4))


def plot_skew(
    values: Mapping[str, ArrayLike],
    path: PathLike,
    *,
    title: str | None = None,
    ylabel: str = "Relative update magnitude",
) -> Path:
    """Bar chart of the computation skew per block, mean +- std over samples (MeSH Fig. 3).

    Args:
        values: ``{block_label: per-sample skews}`` in flow order, e.g. the output of
            :func:`~recursive_lightning.probes.metrics.computation_skew` for each of
            ``skew_block_labels(K)``.  A scalar is drawn without an error bar.
        path: output PNG path.
    """
    with matplotlib.rc_context(_STYLE):
        fig, axes = _new_fig(1, 1, (max(3.5, 0.9 * len(values) + 1.5), 3.0))
        _draw_skew(axes[0, 0], {"model": values}, legend=False, ylabel=ylabel)
        if title:
            axes[0, 0].set_title(title)
        return _save(fig, path)


def compare_skew(
    models: Mapping[str, Mapping[str, ArrayLike]],
    path: PathLike,
    *,
    title: str | None = None,
    ylabel: str = "Relative update magnitude",
    layout: str = "grouped",
) -> Path:
    """Computation skew of several models (MeSH Fig. 3): ``{model: {block: per-sample skews}}``.

    ``layout="grouped"`` draws grouped bars (one colour per model) on one axis;
    ``layout="subplots"`` draws one panel per model with a shared y axis.
    """
    with matplotlib.rc_context(_STYLE):
        n_blocks = max((len(v) for v in models.values()), default=1)
        if layout == "grouped":
            fig, axes = _new_fig(1, 1, (max(4.5, 0.35 * n_blocks * len(models) + 2.5), 3.2))
            _draw_skew(axes[0, 0], models, legend=True, ylabel=ylabel)
            if title:
                axes[0, 0].set_title(title)
        elif layout == "subplots":
            m = len(models)
            fig, axes = _new_fig(1, m, (max(3.0, 0.8 * n_blocks + 1.2) * m, 3.0), sharey=True)
            for i, (name, per_block) in enumerate(models.items()):
                ax = axes[0, i]
                _draw_skew(ax, {name: per_block}, legend=False, ylabel=ylabel if i == 0 else "")
                for patch in ax.patches:
                    patch.set_facecolor(model_color(name, i))
                ax.set_title(name)
            _title(fig, title)
        else:
            raise ValueError("layout must be 'grouped' or 'subplots'")
        return _save(fig, path)


# ---------------------------------------------------------------------------
# CKA heatmaps (MeSH Fig. 1b / 4)
# ---------------------------------------------------------------------------


def _default_state_labels(S: int) -> list[str]:
    return [rf"$h^{{({s})}}$" for s in range(S)]


def plot_cka_heatmap(
    cka: ArrayLike,
    path: PathLike,
    *,
    labels: Sequence[str] | None = None,
    title: str | None = None,
    annotate: bool = True,
    cmap: str = "Blues",
) -> Path:
    """Annotated pairwise CKA heatmap (MeSH Fig. 4).

    Args:
        cka: ``[S, S]`` or per-sample ``[N, S, S]`` (averaged, NaN-aware, as in the
            paper's "mean similarity across 500 samples").
        labels: state names, e.g. ``[r"$h_{emb}$", r"$h^{(0)}$", ..., r"$h_{out}$"]``.
    """
    mat = _mean_matrix(cka)
    labels = list(labels) if labels is not None else _default_state_labels(mat.shape[0])
    with matplotlib.rc_context(_STYLE):
        s = mat.shape[0]
        fig, axes = _new_fig(1, 1, (0.55 * s + 2.2, 0.5 * s + 1.6))
        im = _draw_heatmap(axes[0, 0], mat, labels, labels, cmap=cmap, vmin=0.0, vmax=1.0, annotate=annotate)
        fig.colorbar(im, ax=axes[0, 0], fraction=0.046, pad=0.04, label="CKA")
        if title:
            axes[0, 0].set_title(title)
        return _save(fig, path)


def compare_cka_heatmaps(
    models: Mapping[str, ArrayLike],
    path: PathLike,
    *,
    labels: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
    title: str | None = None,
    annotate: bool = True,
    cmap: str = "Blues",
) -> Path:
    """CKA heatmaps of several models side by side with a shared colour bar (MeSH Fig. 4).

    ``labels`` is one list for all models or ``{model: labels}`` when the models have different
    states (e.g. a vanilla model next to looped ones); y tick labels are then kept on every panel.
    """
    mats = {k: _mean_matrix(v) for k, v in models.items()}
    m = len(mats)
    s = max(v.shape[0] for v in mats.values())
    per_model = isinstance(labels, Mapping)
    with matplotlib.rc_context(_STYLE):
        fig, axes = _new_fig(1, m, ((0.5 * s + 1.3) * m + 1.0, 0.5 * s + 1.6))
        im = None
        for i, (name, mat) in enumerate(mats.items()):
            given = labels.get(name) if per_model else labels
            lab = list(given) if given is not None else _default_state_labels(mat.shape[0])
            im = _draw_heatmap(axes[0, i], mat, lab, lab, cmap=cmap, vmin=0.0, vmax=1.0, annotate=annotate)
            axes[0, i].set_title(name)
            if i > 0 and not per_model:
                axes[0, i].set_yticklabels([])
        _title(fig, title)  # before tight_layout so the suptitle gets its own space
        fig.tight_layout()
        fig.colorbar(im, ax=list(axes[0]), fraction=0.02, pad=0.02, label="CKA")
        return _save(fig, path, tight=False)


# ---------------------------------------------------------------------------
# Singular spectra (MeSH Fig. 1c / 5) and shared subspace (MeSH Fig. 10)
# ---------------------------------------------------------------------------


def plot_singular_spectra(
    spectra: Mapping[str, ArrayLike] | ArrayLike,
    path: PathLike,
    *,
    labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Normalised singular spectra ``sigma_i / sigma_0`` on a log y axis (MeSH Fig. 5).

    Args:
        spectra: ``{state_label: [N, k]}`` (per-sample spectra from
            :func:`~recursive_lightning.probes.metrics.normalized_spectrum`; mean line
            and +-std band) or an array ``[N, S, k]`` / ``[S, k]`` with ``labels``.
            Zero padding beyond the rank is not drawn.
    """
    curves = _curve_mapping(spectra, labels)
    with matplotlib.rc_context(_STYLE):
        fig, axes = _new_fig(1, 1, (4.2, 3.2))
        ax = axes[0, 0]
        _draw_bands(ax, curves, logy=True, x0=0)
        ax.set_xlabel("Singular value index $i$")
        ax.set_ylabel(r"$\sigma_i / \sigma_0$")
        ax.legend(frameon=False)
        if title:
            ax.set_title(title)
        return _save(fig, path)


def compare_singular_spectra(
    models: Mapping[str, Mapping[str, ArrayLike] | ArrayLike],
    path: PathLike,
    *,
    labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Singular spectra of several models, one panel each, shared log y axis (MeSH Fig. 5)."""
    m = len(models)
    with matplotlib.rc_context(_STYLE):
        fig, axes = _new_fig(1, m, (3.4 * m, 3.2), sharey=True)
        for i, (name, data) in enumerate(models.items()):
            ax = axes[0, i]
            _draw_bands(ax, _curve_mapping(data, labels), logy=True, x0=0)
            ax.set_title(name)
            ax.set_xlabel("Singular value index $i$")
            if i == 0:
                ax.set_ylabel(r"$\sigma_i / \sigma_0$")
            ax.legend(frameon=False)
        _title(fig, title)
        return _save(fig, path)


def _draw_subspace(ax: Axes, curves: Mapping[str, np.ndarray]) -> None:
    _draw_bands(ax, curves, logy=False, x0=1)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("Number of shared directions $k$")


def plot_shared_subspace(
    curves: Mapping[str, ArrayLike] | ArrayLike,
    path: PathLike,
    *,
    labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Cumulative variance of each loop state in the shared subspace (MeSH App. E.8, Fig. 10).

    Args:
        curves: ``{state_label: [N, k]}`` or the output of
            :func:`~recursive_lightning.probes.metrics.shared_subspace_variance`
            (``[N, S, k]`` / ``[S, k]``) with ``labels``.  Mean line, +-std band.
    """
    data = _curve_mapping(curves, labels)
    with matplotlib.rc_context(_STYLE):
        fig, axes = _new_fig(1, 1, (4.2, 3.2))
        ax = axes[0, 0]
        _draw_subspace(ax, data)
        ax.set_ylabel("Cumulative explained variance")
        ax.legend(frameon=False, loc="lower right")
        if title:
            ax.set_title(title)
        return _save(fig, path)


def compare_shared_subspace(
    models: Mapping[str, Mapping[str, ArrayLike] | ArrayLike],
    path: PathLike,
    *,
    labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Shared-subspace curves for several models side by side (MeSH Fig. 10 a vs b)."""
    m = len(models)
    with matplotlib.rc_context(_STYLE):
        fig, axes = _new_fig(1, m, (3.4 * m, 3.2), sharey=True)
        for i, (name, data) in enumerate(models.items()):
            ax = axes[0, i]
            _draw_subspace(ax, _curve_mapping(data, labels))
            ax.set_title(name)
            if i == 0:
                ax.set_ylabel("Cumulative explained variance")
            ax.legend(frameon=False, loc="lower right")
        _title(fig, title)
        return _save(fig, path)


# ---------------------------------------------------------------------------
# MeSH routers and state composition (MeSH App. F, Fig. 11)
# ---------------------------------------------------------------------------


def _router_matrix(w: ArrayLike) -> np.ndarray:
    """``[K+1, ..., B]`` -> ``[K+1, B]`` averaged over the middle (sample/token) dims."""
    a = _np(w)
    if a.ndim < 2:
        raise ValueError("router weights must have shape [K+1, ..., B]")
    if a.ndim > 2:
        a = a.reshape(a.shape[0], -1, a.shape[-1]).mean(axis=1)
    return a


def _draw_routers(
    axes: Sequence[Axes],
    write: np.ndarray,
    read: np.ndarray,
    annotate: bool,
    step_labels: Sequence[str] | None,
) -> list[Any]:
    steps = (
        list(step_labels) if step_labels is not None else [f"t={t}" for t in range(-1, write.shape[0] - 1)]
    )
    slots = [str(b) for b in range(write.shape[1])]
    ims = []
    for ax, mat, cmap, name in ((axes[0], write, "Reds", "Write"), (axes[1], read, "Greens", "Read")):
        vmax = max(1.0, float(np.nanmax(mat))) if mat.size else 1.0
        ims.append(_draw_heatmap(ax, mat, steps, slots, cmap=cmap, vmin=0.0, vmax=vmax, annotate=annotate))
        ax.set_xlabel("Buffer slot $b$")
        ax.set_title(f"{name} router")
    axes[0].set_ylabel("Step")
    return ims


def plot_mesh_routers(
    write: ArrayLike,
    read: ArrayLike,
    path: PathLike,
    *,
    step_labels: Sequence[str] | None = None,
    title: str | None = None,
    annotate: bool = True,
) -> Path:
    """Write (red) and read (green) router weights as step x slot heatmaps (MeSH Fig. 11a).

    Args:
        write, read: ``[K+1, ..., B]`` router weights, step ``t = -1..K-1`` first; any
            middle dims (samples, tokens) are averaged ("sequence average").  Slice a
            single token beforehand for the token-level view.
    """
    w, r = _router_matrix(write), _router_matrix(read)
    with matplotlib.rc_context(_STYLE):
        k1, b = w.shape
        fig, axes = _new_fig(1, 2, (2 * (0.45 * b + 1.6), 0.4 * k1 + 1.6))
        ims = _draw_routers(axes[0], w, r, annotate, step_labels)
        for ax, im in zip(axes[0], ims):
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
        _title(fig, title)
        return _save(fig, path)


def compare_mesh_routers(
    models: Mapping[str, tuple[ArrayLike, ArrayLike]],
    path: PathLike,
    *,
    title: str | None = None,
    annotate: bool = True,
) -> Path:
    """Router heatmaps of several MeSH models: one row per model ``{name: (write, read)}``."""
    mats = {k: (_router_matrix(w), _router_matrix(r)) for k, (w, r) in models.items()}
    m = len(mats)
    k1 = max(w.shape[0] for w, _ in mats.values())
    b = max(w.shape[1] for w, _ in mats.values())
    with matplotlib.rc_context(_STYLE):
        fig, axes = _new_fig(m, 2, (2 * (0.45 * b + 1.6), m * (0.4 * k1 + 1.4)))
        for i, (name, (w, r)) in enumerate(mats.items()):
            ims = _draw_routers(axes[i], w, r, annotate, None)
            axes[i, 0].set_ylabel(f"{name}\nStep")
            for ax, im in zip(axes[i], ims):
                fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
        _title(fig, title)
        return _save(fig, path)


def _draw_composition(ax: Axes, coef: np.ndarray, annotate: bool) -> Any:
    rows, cols = state_composition_labels(coef.shape[0] - 1)
    # sources not yet computed when a state is formed (h_m^(i), i >= t) are blank
    future = np.arange(coef.shape[1])[None, :] > np.arange(coef.shape[0])[:, None] + 1
    coef = np.where(future, np.nan, coef)
    vmax = max(1.0, float(np.nanmax(coef))) if coef.size else 1.0
    im = _draw_heatmap(ax, coef, rows, cols, cmap="Purples", vmin=0.0, vmax=vmax, annotate=annotate)
    ax.set_xlabel("Source")
    ax.set_ylabel("State")
    return im


def plot_state_composition(
    coef: ArrayLike,
    path: PathLike,
    *,
    title: str | None = None,
    annotate: bool = True,
) -> Path:
    """State-composition heatmap (state x source) of MeSH Eq. 7 / Fig. 11b.

    Args:
        coef: ``[..., K+1, K+2]`` from
            :func:`~recursive_lightning.probes.metrics.mesh_state_composition`; leading
            (sample/token) dims are averaged.
    """
    mat = _mean_matrix(coef)
    with matplotlib.rc_context(_STYLE):
        fig, axes = _new_fig(1, 1, (0.6 * mat.shape[1] + 2.2, 0.45 * mat.shape[0] + 1.6))
        im = _draw_composition(axes[0, 0], mat, annotate)
        fig.colorbar(im, ax=axes[0, 0], fraction=0.046, pad=0.04, label="coefficient")
        axes[0, 0].set_title(title or "State composition")
        return _save(fig, path)


def compare_state_composition(
    models: Mapping[str, ArrayLike],
    path: PathLike,
    *,
    title: str | None = None,
    annotate: bool = True,
) -> Path:
    """State-composition heatmaps of several MeSH models side by side."""
    mats = {k: _mean_matrix(v) for k, v in models.items()}
    m = len(mats)
    nr = max(v.shape[0] for v in mats.values())
    nc = max(v.shape[1] for v in mats.values())
    with matplotlib.rc_context(_STYLE):
        fig, axes = _new_fig(1, m, (m * (0.6 * nc + 2.4), 0.45 * nr + 1.6))
        for i, (name, mat) in enumerate(mats.items()):
            im = _draw_composition(axes[0, i], mat, annotate)
            fig.colorbar(im, ax=axes[0, i], fraction=0.046, pad=0.04)
            axes[0, i].set_title(name)
        _title(fig, title)
        return _save(fig, path)


# ---------------------------------------------------------------------------
# Attention probes (SpiralFormer Fig. 4-8)
# ---------------------------------------------------------------------------


def _loop_values(
    per_loop: Mapping[str, ArrayLike] | ArrayLike,
    loop_labels: Sequence[str] | None,
    heads: ArrayLike | None,
    dynamic_frac: float | None,
) -> tuple[list[str], list[np.ndarray]]:
    """Head-wise values per loop -> (labels, [values of loop t])."""
    if isinstance(per_loop, Mapping):
        labels = [str(k) for k in per_loop]
        rows = [_np(v).ravel() for v in per_loop.values()]
        if heads is not None or dynamic_frac is not None:
            stat = np.stack(rows)  # requires equal head counts
        else:
            return labels, rows
    else:
        stat = _np(per_loop)
        if stat.ndim < 2:
            raise ValueError("per-loop statistics must have shape [T, n_heads...]")
        stat = stat.reshape(stat.shape[0], -1)
        labels = (
            list(loop_labels) if loop_labels is not None else [f"loop {t + 1}" for t in range(stat.shape[0])]
        )
    if heads is None and dynamic_frac is not None:
        heads = dynamic_heads(torch.from_numpy(stat), frac=dynamic_frac)
    if heads is not None:
        idx = _np(heads).astype(np.int64).ravel()
        stat = stat[:, idx]
    return labels, list(stat)


def _draw_ridgeline(
    ax: Axes, labels: Sequence[str], values: Sequence[np.ndarray], bins: int, color: Any
) -> None:
    finite = [v[np.isfinite(v)] for v in values]
    allv = np.concatenate(finite) if finite else np.array([])
    if allv.size == 0:
        return
    lo, hi = float(allv.min()), float(allv.max())
    if hi - lo < 1e-12:
        lo, hi = lo - 0.05, hi + 0.05
    edges = np.linspace(lo, hi, bins + 1)
    centers = 0.5 * (edges[:-1] + edges[1:])
    n = len(values)
    for t, v in enumerate(finite):
        base = n - 1 - t  # first loop on top
        if v.size == 0:
            continue
        hist, _ = np.histogram(v, bins=edges)
        h = hist / max(hist.max(), 1) * 0.9
        ax.fill_between(
            centers, base, base + h, step="mid", color=color, alpha=0.55, lw=0, zorder=2 * (n - t)
        )
        ax.step(centers, base + h, where="mid", color="black", lw=0.6, zorder=2 * (n - t) + 1)
        ax.axhline(base, color="black", lw=0.4, zorder=0)
    ax.set_yticks(np.arange(n)[::-1])
    ax.set_yticklabels(list(labels))
    ax.set_ylim(-0.1, n)
    ax.spines["left"].set_visible(False)


def _draw_boxes(
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


def plot_attention_probe(
    per_loop: Mapping[str, ArrayLike] | ArrayLike,
    path: PathLike,
    *,
    metric: str = "Key-marginal entropy",
    loop_labels: Sequence[str] | None = None,
    heads: ArrayLike | None = None,
    dynamic_frac: float | None = None,
    bins: int = 20,
    title: str | None = None,
) -> Path:
    """Cross-loop distribution of a head-wise attention statistic (SpiralFormer Fig. 4).

    Left: ridgeline histograms of head-wise values per loop; right: box plots per loop
    with the loop-wise mean as a black dot connected across loops.

    Args:
        per_loop: ``[T, n_heads]`` or ``[T, n_layers, n_heads]`` head-wise values per
            loop (already averaged over sequences), or ``{loop_label: values}``.
        metric: y/x axis label (e.g. ``"Key-marginal entropy"``, ``"LAM"``).
        heads: optional flat head indices to keep (e.g. from
            :func:`~recursive_lightning.probes.metrics.dynamic_heads`).
        dynamic_frac: if given (and ``heads`` is not), keep the top ``dynamic_frac``
            heads by cross-loop range (paper: 0.4); ``None`` = all heads (App. I.3).
    """
    labels, values = _loop_values(per_loop, loop_labels, heads, dynamic_frac)
    with matplotlib.rc_context(_STYLE):
        T = len(values)
        fig, axes = _new_fig(1, 2, (8.0, 0.55 * T + 2.0), gridspec_kw={"width_ratios": [1, 1.2]})
        _draw_ridgeline(axes[0, 0], labels, values, bins, "#4c72b0")
        axes[0, 0].set_xlabel(metric)
        axes[0, 0].set_title("Head-wise distribution")
        pos = np.arange(T, dtype=float)
        _draw_boxes(axes[0, 1], pos, values, "#4c72b0", 0.55, None)
        axes[0, 1].set_xticks(pos)
        axes[0, 1].set_xticklabels(labels)
        axes[0, 1].set_xlabel("Loop")
        axes[0, 1].set_ylabel(metric)
        axes[0, 1].grid(True, axis="y")
        axes[0, 1].set_title("Per-loop box plot (dot = mean)")
        _title(fig, title)
        return _save(fig, path)


def compare_attention_probe(
    models: Mapping[str, Mapping[str, ArrayLike] | ArrayLike],
    path: PathLike,
    *,
    metric: str = "Key-marginal entropy",
    loop_labels: Sequence[str] | None = None,
    dynamic_frac: float | None = None,
    title: str | None = None,
) -> Path:
    """Grouped per-loop box plots of a head-wise statistic for several models
    (e.g. SpiralFormer vs LoopedFormer, SpiralFormer Fig. 4 vs Fig. 6); the mean of each
    model is connected across loops.  Dynamic-head selection, if requested, is done per model."""
    data = {k: _loop_values(v, loop_labels, None, dynamic_frac) for k, v in models.items()}
    m = len(data)
    T = max(len(v[1]) for v in data.values())
    labels = max((v[0] for v in data.values()), key=len)
    width = 0.8 / max(m, 1)
    with matplotlib.rc_context(_STYLE):
        fig, axes = _new_fig(1, 1, (max(4.5, 1.0 * T * max(m, 2) * 0.6 + 2.0), 3.4))
        ax = axes[0, 0]
        for i, (name, (_, values)) in enumerate(data.items()):
            pos = np.arange(len(values), dtype=float) + (i - (m - 1) / 2) * width
            _draw_boxes(ax, pos, values, model_color(name, i), width * 0.85, name)
        ax.set_xticks(np.arange(T))
        ax.set_xticklabels(labels)
        ax.set_xlabel("Loop")
        ax.set_ylabel(metric)
        ax.grid(True, axis="y")
        ax.legend(frameon=False, ncols=min(m, 4))
        if title:
            ax.set_title(title)
        return _save(fig, path)


def _as_layer_head(per_loop: ArrayLike, n_heads: int | None) -> np.ndarray:
    a = _np(per_loop)
    if a.ndim == 2:
        a = a.reshape(a.shape[0], -1, n_heads if n_heads else a.shape[1])
    if a.ndim != 3:
        raise ValueError(f"expected [T, n_layers, n_heads] (or [T, n] with n_heads), got {a.shape}")
    return a


def _draw_layer_head(ax: Axes, mat: np.ndarray, cmap: str, vmin: float, vmax: float) -> Any:
    im = ax.imshow(
        mat, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest", origin="lower"
    )
    ax.set_xlabel("Head $h$")
    ax.set_ylabel(r"Layer $\ell$")
    ax.set_xticks(range(mat.shape[1]))
    ax.set_yticks(range(mat.shape[0]))
    for spine in ax.spines.values():
        spine.set_visible(False)
    return im


def plot_head_heatmaps(
    per_loop: ArrayLike,
    path: PathLike,
    *,
    metric: str = "Key-marginal entropy",
    loop_labels: Sequence[str] | None = None,
    n_heads: int | None = None,
    cmap: str = "viridis",
    title: str | None = None,
) -> Path:
    """Layer x head heatmap of a head-wise statistic, one panel per loop (shared scale).

    Args:
        per_loop: ``[T, n_layers, n_heads]`` (or ``[T, n_layers * n_heads]`` with ``n_heads``).
    """
    a = _as_layer_head(per_loop, n_heads)
    T, nl, nh = a.shape
    labels = list(loop_labels) if loop_labels is not None else [f"loop {t + 1}" for t in range(T)]
    vmin, vmax = float(np.nanmin(a)), float(np.nanmax(a))
    with matplotlib.rc_context(_STYLE):
        fig, axes = _new_fig(1, T, (T * (0.25 * nh + 1.4) + 1.0, 0.25 * nl + 1.8))
        im = None
        for t in range(T):
            im = _draw_layer_head(axes[0, t], a[t], cmap, vmin, vmax)
            axes[0, t].set_title(labels[t])
            if t > 0:
                axes[0, t].set_ylabel("")
        _title(fig, title)  # before tight_layout so the suptitle gets its own space
        fig.tight_layout()
        fig.colorbar(im, ax=list(axes[0]), fraction=0.02, pad=0.02, label=metric)
        return _save(fig, path, tight=False)


def compare_head_heatmaps(
    models: Mapping[str, ArrayLike],
    path: PathLike,
    *,
    metric: str = "Key-marginal entropy",
    loop_labels: Sequence[str] | None = None,
    n_heads: int | None = None,
    cmap: str = "viridis",
    title: str | None = None,
) -> Path:
    """Layer x head heatmaps for several models: one row per model, one column per loop."""
    arrs = {k: _as_layer_head(v, n_heads) for k, v in models.items()}
    m = len(arrs)
    T = max(a.shape[0] for a in arrs.values())
    nl = max(a.shape[1] for a in arrs.values())
    nh = max(a.shape[2] for a in arrs.values())
    vmin = min(float(np.nanmin(a)) for a in arrs.values())
    vmax = max(float(np.nanmax(a)) for a in arrs.values())
    labels = list(loop_labels) if loop_labels is not None else [f"loop {t + 1}" for t in range(T)]
    with matplotlib.rc_context(_STYLE):
        fig, axes = _new_fig(m, T, (T * (0.25 * nh + 1.4) + 1.0, m * (0.25 * nl + 1.6)))
        im = None
        for i, (name, a) in enumerate(arrs.items()):
            for t in range(T):
                ax = axes[i, t]
                if t >= a.shape[0]:
                    ax.set_axis_off()
                    continue
                im = _draw_layer_head(ax, a[t], cmap, vmin, vmax)
                ax.set_title(f"{name} - {labels[t]}")
                if t > 0:
                    ax.set_ylabel("")
        _title(fig, title)  # before tight_layout so the suptitle gets its own space
        fig.tight_layout()
        fig.colorbar(im, ax=list(axes.ravel()), fraction=0.02, pad=0.02, label=metric)
        return _save(fig, path, tight=False)


def _draw_range_heatmap(ax: Axes, a: np.ndarray, frac: float) -> Any:
    T, nl, nh = a.shape
    t = torch.from_numpy(a)
    rng = minmax_normalize(t.amax(0) - t.amin(0)).numpy()
    im = _draw_layer_head(ax, rng, "viridis", 0.0, 1.0)
    for idx in dynamic_heads(t.reshape(T, -1), frac=frac).tolist():
        layer, head = divmod(idx, nh)
        ax.add_patch(Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="black", lw=1.4))
    return im


def plot_head_range_heatmap(
    per_loop: ArrayLike,
    path: PathLike,
    *,
    metric: str = "Key-marginal entropy",
    frac: float = 0.4,
    n_heads: int | None = None,
    title: str | None = None,
) -> Path:
    """Min-max normalised cross-loop range per head, dynamic heads boxed (SpiralFormer Fig. 5).

    Args:
        per_loop: ``[T, n_layers, n_heads]`` head-wise metric per loop (averaged over sequences).
        frac: dynamic-head fraction (paper: top 40% by range).
    """
    a = _as_layer_head(per_loop, n_heads)
    with matplotlib.rc_context(_STYLE):
        fig, axes = _new_fig(1, 1, (0.3 * a.shape[2] + 2.4, 0.25 * a.shape[1] + 1.8))
        im = _draw_range_heatmap(axes[0, 0], a, frac)
        fig.colorbar(im, ax=axes[0, 0], fraction=0.046, pad=0.04, label=rf"normalised $\Delta$ {metric}")
        axes[0, 0].set_title(title or rf"Cross-loop range of {metric}")
        return _save(fig, path)


def compare_head_range_heatmaps(
    models: Mapping[str, ArrayLike],
    path: PathLike,
    *,
    metric: str = "Key-marginal entropy",
    frac: float = 0.4,
    n_heads: int | None = None,
    title: str | None = None,
) -> Path:
    """Cross-loop range heatmaps of several models side by side (SpiralFormer Fig. 5 vs 7)."""
    arrs = {k: _as_layer_head(v, n_heads) for k, v in models.items()}
    m = len(arrs)
    nl = max(a.shape[1] for a in arrs.values())
    nh = max(a.shape[2] for a in arrs.values())
    with matplotlib.rc_context(_STYLE):
        fig, axes = _new_fig(1, m, (m * (0.3 * nh + 1.6) + 1.0, 0.25 * nl + 1.8))
        im = None
        for i, (name, a) in enumerate(arrs.items()):
            im = _draw_range_heatmap(axes[0, i], a, frac)
            axes[0, i].set_title(name)
        _title(fig, title)  # before tight_layout so the suptitle gets its own space
        fig.tight_layout()
        fig.colorbar(im, ax=list(axes[0]), fraction=0.02, pad=0.02, label=rf"normalised $\Delta$ {metric}")
        return _save(fig, path, tight=False)


# ---------------------------------------------------------------------------
# Mela (probes/mela.py): memory updates per block application and chunk, MemStack
# ---------------------------------------------------------------------------


def _group_edges(groups: Sequence[int]) -> list[float]:
    """Row boundaries (between rows i-1 and i) where the group (e.g. the H cycle) changes."""
    return [i - 0.5 for i in range(1, len(groups)) if groups[i] != groups[i - 1]]


def _sparse_ticks(n: int, most: int = 16) -> list[int]:
    step = max(1, -(-n // most))
    return list(range(0, n, step))


def plot_application_heatmaps(
    panels: Mapping[str, ArrayLike],
    path: PathLike,
    *,
    rows: Sequence[str],
    cols: Sequence[str],
    groups: Sequence[int] | None = None,
    cmap: str = "viridis",
    fmt: str = "{:.2f}",
    col_title: str = "memory chunk $t$",
    title: str | None = None,
) -> Path:
    """Heatmaps of per-(block application, chunk) quantities side by side, rows shared (Mela probes).

    Args:
        panels: ``{panel title: [applications, chunks]}``; a panel of only NaN says "not used".
        rows: application names (execution order); ``groups`` (e.g. the H cycle of each row) draws a
            white line where it changes.
    """
    mats = {k: _np(v) for k, v in panels.items()}
    nr, nc = len(rows), len(cols)
    m = max(len(mats), 1)
    annotate = nr * nc <= 160
    dense = nr > 32  # e.g. mela-400m: 96 applications
    label_w = (0.05 if dense else 0.065) * max((len(r) for r in rows), default=4) + 0.4
    panel_w = max(2.4, 0.5 * nc + 1.4) if annotate else max(2.4, 0.12 * nc + 1.6)
    height = max(2.6, (0.14 if dense else 0.24) * nr + 1.4)
    style = {**_STYLE, "ytick.labelsize": 6.5} if dense else _STYLE
    with matplotlib.rc_context(style):
        fig, axes = _new_fig(1, m, (label_w + m * panel_w, height))
        for p, (name, mat) in enumerate(mats.items()):
            ax = axes[0, p]
            if not np.isfinite(mat).any():
                ax.set_axis_off()
                ax.text(0.5, 0.5, f"{name}:\nnot used", ha="center", va="center", transform=ax.transAxes)
                continue
            lo, hi = float(np.nanmin(mat)), float(np.nanmax(mat))
            im = _draw_heatmap(
                ax,
                mat,
                list(rows) if p == 0 else None,
                None,
                cmap=cmap,
                vmin=lo,
                vmax=hi if hi > lo else lo + 1e-12,
                annotate=False,
            )
            if annotate:  # text colour from the cell's luminance (works for dark-low and dark-high maps)
                fs = max(6.0, min(8.0, 80.0 / max(nr, nc)))
                for i in range(nr):
                    for j in range(nc):
                        if np.isfinite(mat[i, j]):
                            r, g, b, _ = im.cmap(im.norm(mat[i, j]))
                            dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5
                            ax.text(
                                j,
                                i,
                                fmt.format(mat[i, j]),
                                ha="center",
                                va="center",
                                fontsize=fs,
                                color="white" if dark else "black",
                            )
            ticks = _sparse_ticks(nc)
            ax.set_xticks(ticks)
            ax.set_xticklabels([cols[t] for t in ticks])
            if p:
                ax.set_yticks(range(nr))
                ax.set_yticklabels([])
            for y in _group_edges(groups or []):
                ax.axhline(y, color="white", lw=2.0)
            ax.set_xlabel(col_title)
            ax.set_title(name)
            cb = fig.colorbar(
                im, ax=ax, fraction=0.08 if annotate else 0.05, pad=0.03, shrink=min(1.0, 6 / height)
            )
            cb.formatter.set_useOffset(False)
            cb.update_ticks()
        return _save_titled(fig, path, title, height)


def _save_titled(fig: Figure, path: PathLike, title: str | None, height: float) -> Path:
    """Suptitle 0.08 in below the top whatever the figure's height (at the default y = 0.98 a tall
    figure's title drops into its first row of panels), then tight_layout around it and save."""
    if title:
        fig.suptitle(title, fontsize=11, y=1 - 0.08 / height, va="top")
    return _save(fig, path)


def plot_update_spectrum(
    singular: ArrayLike,
    path: PathLike,
    *,
    apps: Sequence[str],
    tensors: Sequence[str],
    groups: Sequence[int],
    reference: float | None = 1.0,
    rel_floor: float = 1e-2,
    title: str | None = None,
) -> Path:
    """Singular values of the memory update, one column per memory tensor (Mela probes).

    Top: sigma_k against k (log y), mean over chunks, one line per block application, coloured by
    ``groups`` (the H cycle), H-blocks solid and L-blocks dashed (from the ``apps`` names). Bottom: box
    per application of the singular values above ``rel_floor`` x the largest, pooled over chunks (the
    rank-deficient tail of a C-patch update is left out), with a line at ``reference`` (Newton-Schulz
    drives the retained ones towards 1).

    Args:
        singular: ``[applications, chunks, tensors, k]``, descending along k.
    """
    sv = _np(singular)
    A, T, n_t, k = sv.shape
    cyc = sorted(set(groups))
    palette = _state_colors(len(cyc))
    color = {c: palette[i] for i, c in enumerate(cyc)}
    is_h = ["Hb" in a for a in apps]
    dense = A > 16  # one tensor per row pair, full width
    width = min(max(4.8, 0.28 * A + 1.6), 16.0)
    if dense:
        shape, size, ratios = (2 * n_t, 1), (width, 6.4 * n_t), [1, 1.1] * n_t
    else:
        shape, size, ratios = (2, n_t), (width * n_t, 6.4), [1, 1.1]
    height = size[1]
    with matplotlib.rc_context(_STYLE):
        fig, grid = _new_fig(*shape, size, gridspec_kw={"height_ratios": ratios})
        axes = grid.reshape(n_t, 2).T if dense else grid  # axes[row, tensor]
        for i in range(n_t):
            ax = axes[0, i]
            x = np.arange(1, k + 1)
            for a in range(A):
                curve = sv[a, :, i].mean(axis=0)
                curve = np.where(curve > 0, curve, np.nan)
                ax.plot(x, curve, color=color[groups[a]], ls="-" if is_h[a] else "--", lw=1.1, alpha=0.85)
            if reference is not None:
                ax.axhline(reference, color="black", lw=0.8, ls=":")
            ax.set_yscale("log")
            ax.set_xlabel("singular value index $k$")
            ax.set_ylabel(r"$\sigma_k$ (mean over chunks)")
            ax.set_title(tensors[i])
            ax.grid(True, which="major")
            handles = [Line2D([], [], color=color[c], lw=1.5, label=f"cycle {c}") for c in cyc]
            handles += [
                Line2D([], [], color="grey", ls="-", label="H-block"),
                Line2D([], [], color="grey", ls="--", label="L-block"),
            ]
            ax.legend(handles=handles, frameon=False, ncols=2 if len(handles) > 4 else 1, loc="best")
            ax = axes[1, i]
            vals = []
            for a in range(A):
                v = sv[a, :, i].ravel()
                top = v.max() if v.size else 0.0
                vals.append(v[v > rel_floor * top] if top > 0 else v[:0])
            pos = np.arange(A)
            for a in range(A):
                _draw_boxes(ax, pos[a : a + 1], [vals[a]], color[groups[a]], 0.6, None)
            if reference is not None:
                ax.axhline(reference, color="black", lw=0.8, ls=":")
            ax.set_xticks(pos)
            ax.set_xticklabels(
                list(apps), rotation=90 if A > 6 else 0, fontsize=6 if A > 48 else 7 if A > 24 else 8
            )
            ax.set_xlim(-0.7, A - 0.3)
            ax.set_ylabel(rf"$\sigma_k$ > {rel_floor:g} $\sigma_{{max}}$")
            ax.set_xlabel("block application (c = H cycle, L = L step, Lb / Hb = L- / H-block)")
            ax.grid(True, axis="y")
            ax.set_axisbelow(True)
        return _save_titled(fig, path, title, height)


def plot_memstack_change(
    ratio: ArrayLike,
    path: PathLike,
    *,
    enabled: bool = True,
    title: str | None = None,
) -> Path:
    """How much each H cycle's MemStack injection changes the decoder's memory rows (Mela Eq. 13).

    Left: bar per cycle i, mean +- std over samples of ``||z(i)|| / ||y(i)||`` averaged over text chunks
    1..n-1 (chunk 0 receives nothing). Right: the same per text chunk (mean +- std band over samples).

    Args:
        ratio: ``[samples, H-1, text chunks]``.
    """
    r = _np(ratio)
    N, H1, n = r.shape
    with matplotlib.rc_context(_STYLE):
        fig, axes = _new_fig(1, 2, (max(3.2, 1.0 * H1 + 2.0) + max(3.6, 0.35 * n + 2.0), 3.3))
        ax, ax2 = axes[0]
        if H1 == 0:
            for a in (ax, ax2):
                a.set_axis_off()
            ax.text(0.5, 0.5, "H = 1: no MemStack", ha="center", va="center", transform=ax.transAxes)
            _title(fig, title)
            return _save(fig, path)
        per_sample = r[:, :, 1:].mean(axis=2) if n > 1 else np.zeros((N, H1))
        means, stds = per_sample.mean(axis=0), per_sample.std(axis=0)
        x = np.arange(H1)
        colors = _state_colors(H1)
        ax.bar(
            x,
            means,
            0.6,
            yerr=stds,
            capsize=3,
            color=colors,
            edgecolor="black",
            linewidth=0.5,
            error_kw={"elinewidth": 0.8, "ecolor": "black"},
        )
        for xi, m, sd in zip(x, means, stds):
            ax.text(xi, m + sd, f"{m:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x)
        ax.set_xticklabels([f"cycle {i + 1}\n(after layer {i + 1})" for i in range(H1)])
        ax.set_ylabel(r"$\|z^{(i)}\|_F \,/\, \|y^{(i)}\|_F$ (memory rows)")
        top = float(np.max(means + stds))
        ax.set_ylim(bottom=0, top=top * 1.2 if top > 0 else 1.0)
        ax.grid(True, axis="y")
        ax.set_axisbelow(True)
        ax.set_title("mean over text chunks 1..n-1")
        if not enabled:
            ax.text(
                0.5,
                0.5,
                "memstack: false\nnothing is added",
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
        xs = np.arange(n)
        for c in range(H1):
            mean, std = r[:, c].mean(axis=0), r[:, c].std(axis=0)
            ax2.plot(xs, mean, "-o", color=colors[c], ms=3, lw=1.4, label=f"cycle {c + 1}")
            if N > 1:
                ax2.fill_between(xs, mean - std, mean + std, color=colors[c], alpha=0.2, lw=0)
        ticks = _sparse_ticks(n)
        ax2.set_xticks(ticks)
        ax2.set_xlabel("text chunk $j$ (chunk 0 reads the initial memory: nothing added)")
        ax2.set_ylabel("relative change")
        ax2.set_ylim(bottom=0)
        ax2.grid(True)
        ax2.legend(frameon=False)
        ax2.set_title("per text chunk, mean $\\pm$ std over samples")
        _title(fig, title)
        return _save(fig, path)
