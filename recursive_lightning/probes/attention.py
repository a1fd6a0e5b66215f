"""Attention probes of the loop-shared core (SpiralFormer Sec. 4.1, App. I): key-marginal entropy and
Local Attention Mass per loop, layer and head, the dynamic heads; metrics, summary and figures (Fig. 4-8)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.patches import Rectangle
from torch import Tensor

from recursive_lightning.probes.figures import (
    STYLE,
    ArrayLike,
    PathLike,
    Sheet,
    draw_boxes,
    mean_std,
    model_color,
    new_fig,
    save,
    suptitle,
    to_numpy,
)

if TYPE_CHECKING:
    from recursive_lightning.probes.captured import Capture

DYNAMIC_FRAC = 0.4  # SpiralFormer Sec. 4.1: top 40% of heads by cross-loop range
METRICS = (("entropy", "Key-marginal entropy"), ("lam", "LAM"))


def _attn_float(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float64 else x.to(torch.float32)


def _query_positions(Lq: int, Lk: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Absolute key-axis position of each query (right-aligned when Lq < Lk) and key index."""
    if Lq > Lk:
        raise ValueError(f"expected Lq <= Lk for causal attention, got Lq={Lq}, Lk={Lk}")
    q = torch.arange(Lq, device=device) + (Lk - Lq)
    k = torch.arange(Lk, device=device)
    return q[:, None], k[None, :]


def key_marginal_entropy(attn: Tensor, causal: bool = True) -> Tensor:
    """Normalised key-marginal entropy per head (SpiralFormer Sec. 4.1).

    For a head's attention matrix ``A in R^{L x L}`` (rows = queries, sum to 1) the
    key marginal is formed by averaging over queries,

        p(k) propto (1/L) sum_q A(q, k),     k = 0..L-1,

    (re-normalised to sum to 1) and the entropy is normalised by the log of the number
    of keys:

        H = -sum_k p(k) log p(k) / log L   in [0, 1].

    Lower = concentrated key usage (selective), higher = diffuse (global).  The paper
    computes the metric per sequence and then averages each head's value over 500
    sequences; this function returns the per-sequence values.

    Args:
        attn: ``[..., H, Lq, Lk]`` attention probabilities at the loop-native length
            (``Lq == Lk == L_t`` in the paper; for ``Lq < Lk`` queries are taken to be
            the last ``Lq`` positions, as with a KV cache).
        causal: zero the entries above the causal diagonal (``k > q``) before averaging
            (a no-op for a proper causal attention matrix; guards against padded or
            garbage upper triangles).  Rows are not re-normalised; the marginal is.
            The normaliser stays ``log Lk`` as in the paper.

    Returns:
        ``[..., H]`` (float32, or float64 for float64 input).  Defined as 0 when
        ``Lk == 1``.
    """
    A = _attn_float(attn)
    Lq, Lk = A.shape[-2], A.shape[-1]
    if causal:
        qpos, kpos = _query_positions(Lq, Lk, A.device)
        A = A.masked_fill(kpos > qpos, 0.0)
    p = A.mean(-2)
    p = p / p.sum(-1, keepdim=True)
    ent = -torch.special.xlogy(p, p).sum(-1)
    if Lk <= 1:
        return torch.zeros_like(ent)
    return ent / math.log(Lk)


def lam_window(resolution_ratio: float, gamma: float = 32.0) -> int:
    """SpiralFormer Eq. (23): window size ``M_t = ceil(gamma * r_t)`` with ``gamma = 32``."""
    # round first to avoid ceil(4.000000000001) == 5 from float noise
    return int(math.ceil(round(gamma * resolution_ratio, 9)))


def local_attention_mass(attn: Tensor, window: int, include_self: bool = False) -> Tensor:
    """Local Attention Mass (LAM) per head (SpiralFormer Sec. 4.1, Eq. 23).

    With the causal local backward window ``W(q) = {k : q - M <= k < q}`` (``M`` =
    ``window``, e.g. :func:`lam_window`),

        LAM = (1/L) sum_q sum_{k in W(q)} A(q, k).

    Note that the paper's window is strictly backward (``k < q``): the diagonal
    (self-attention to the current token) is *not* counted, so the first query (whose
    only key is itself) always contributes 0 and ``LAM <= (L - 1)/L`` for any causal
    attention.  ``include_self=True`` widens the window to ``q - M <= k <= q``, under
    which any attention supported within ``M`` tokens back (diagonal included) scores
    exactly 1.

    Args:
        attn: ``[..., H, Lq, Lk]`` attention probabilities (``Lq < Lk``: queries are
            the last ``Lq`` key positions).
        window: ``M >= 0``.
        include_self: also count the diagonal ``k = q`` (not the paper's definition).

    Returns:
        ``[..., H]`` in ``[0, 1]`` (float32, or float64 for float64 input), the
        per-sequence value; the paper averages it over sequences per head.
    """
    if window < 0:
        raise ValueError("window must be >= 0")
    A = _attn_float(attn)
    Lq, Lk = A.shape[-2], A.shape[-1]
    qpos, kpos = _query_positions(Lq, Lk, A.device)
    upper = kpos <= qpos if include_self else kpos < qpos
    mask = (kpos >= qpos - window) & upper
    return (A * mask.to(A.dtype)).sum(-1).mean(-1)


def cross_loop_range(per_loop_stat: Tensor) -> Tensor:
    """``Delta m = max_t m^(t) - min_t m^(t)`` over loops (SpiralFormer App. I.1).

    Args:
        per_loop_stat: ``[T, ...]`` head-wise metric per loop (already averaged over
            sequences, as in the paper).

    Returns:
        ``[...]`` cross-loop range per head.
    """
    return per_loop_stat.amax(0) - per_loop_stat.amin(0)


def dynamic_heads(per_loop_stat: Tensor, frac: float = 0.4) -> Tensor:
    """Indices of the "dynamic heads": top ``frac`` of heads by cross-loop range.

    SpiralFormer Sec. 4.1 / App. I.1: "A head (l, h) is called dynamic under metric m
    if its Delta m_{l,h} is within the top 40% among all heads in the loop-shared
    block (ranked separately for each metric)", with
    ``Delta m = max_t m^(t) - min_t m^(t)`` computed after averaging over sequences.

    The number selected is ``ceil(frac * n_heads)`` (so "within the top 40%" keeps a
    head whose rank fraction is < 0.4, e.g. 4 of 10, 5 of 12).  Ties are broken by the
    lower flat index; heads with a non-finite range are ranked last.

    Args:
        per_loop_stat: ``[T, n_heads_total]`` or ``[T, n_layers, n_heads]`` (trailing
            dims are flattened row-major, so index ``i`` is ``(i // H, i % H)``).
        frac: fraction of heads selected (paper: 0.4).

    Returns:
        int64 ``[ceil(frac * n)]`` flat head indices ordered by decreasing range.
    """
    if per_loop_stat.dim() < 2:
        raise ValueError("per_loop_stat must have shape [T, n_heads...]")
    if not 0.0 <= frac <= 1.0:
        raise ValueError("frac must be in [0, 1]")
    stat = per_loop_stat.reshape(per_loop_stat.shape[0], -1)
    rng = cross_loop_range(stat)
    rng = torch.where(torch.isfinite(rng), rng, torch.full_like(rng, -float("inf")))
    n = rng.numel()
    n_sel = min(n, math.ceil(frac * n - 1e-9))
    order = torch.sort(rng, descending=True, stable=True).indices
    return order[:n_sel]


def minmax_normalize(x: Tensor, eps: float = 1e-12) -> Tensor:
    """Min-max normalise to ``[0, 1]`` over all entries (SpiralFormer App. I.1, Fig. 5).

    ``x' = (x - min x) / (max x - min x)``; "if max(x) - min(x) is numerically
    negligible (or values are non-finite), we set all entries to 0".
    """
    x = x.to(torch.float64) if not x.is_floating_point() else x
    if not bool(torch.isfinite(x).all()):
        return torch.zeros_like(x)
    lo, hi = x.min(), x.max()
    if float(hi - lo) <= eps:
        return torch.zeros_like(x)
    return (x - lo) / (hi - lo)


# ---------------------------------------------------------------------------
# summary
# ---------------------------------------------------------------------------


def _per_loop_summary(stat: Tensor) -> dict[str, Any]:
    """``stat [N, T, layers, heads]`` -> head-wise per-loop means and the dynamic-head analysis."""
    mean, std = mean_std(stat)  # [T, layers, heads]
    T, nl, nh = mean.shape
    per_loop = torch.from_numpy(mean)
    rng = cross_loop_range(per_loop)
    dyn = dynamic_heads(per_loop, frac=DYNAMIC_FRAC).tolist()
    flat = mean.reshape(T, -1)
    return {
        "per_loop": mean,
        "per_loop_std": std,
        "range": rng.numpy(),
        "range_normalized": minmax_normalize(rng).numpy(),
        "dynamic_heads": [list(divmod(i, nh)) for i in dyn],
        "loop_mean_all": flat.mean(axis=1),
        "loop_mean_dynamic": flat[:, dyn].mean(axis=1) if dyn else [float("nan")] * T,
    }


def summarize(cap: Capture, meta: dict[str, Any]) -> dict[str, Any]:
    if cap.attention is None:
        return {"attention": None}
    _, T, nl, nh = cap.attention["entropy"].shape
    multires = any(g > 1 for g in meta.get("model", {}).get("chunk", []))
    return {
        "attention": {
            "stack": "core0",
            "loops": cap.attention_loops,
            "chunk": cap.attention_chunk,
            "multires": multires,
            "lam_window": cap.attention_window,
            "layers": nl,
            "heads": nh,
            "dynamic_frac": DYNAMIC_FRAC,
            "entropy": _per_loop_summary(cap.attention["entropy"]),
            "lam": _per_loop_summary(cap.attention["lam"]),
        }
    }


def metrics(summary: dict[str, Any]) -> dict[str, Any]:
    att = summary.get("attention")
    if not att:
        return {}
    return {
        f"probe/attention/{metric}/loop{t + 1}": v
        for metric, _ in METRICS
        for t, v in zip(att["loops"], att[metric]["loop_mean_all"])
    }


def loop_labels(summary: dict[str, Any]) -> list[str]:
    att = summary["attention"]
    out = []
    for t, g in zip(att["loops"], att["chunk"]):
        out.append(
            f"loop {t + 1}"
            if not att["multires"]
            else f"loop {t + 1} (1/{g})"
            if g > 1
            else f"loop {t + 1} (1)"
        )
    return out


# ---------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------


def _loop_values(
    per_loop: ArrayLike, loop_labels: Sequence[str] | None, dynamic_frac: float | None
) -> tuple[list[str], list[np.ndarray]]:
    """Head-wise values per loop ``[T, n_heads...]`` -> (labels, [values of loop t]), only the top
    ``dynamic_frac`` heads by cross-loop range if given."""
    stat = to_numpy(per_loop)
    if stat.ndim < 2:
        raise ValueError("per-loop statistics must have shape [T, n_heads...]")
    stat = stat.reshape(stat.shape[0], -1)
    labels = list(loop_labels) if loop_labels is not None else [f"loop {t + 1}" for t in range(stat.shape[0])]
    if dynamic_frac is not None:
        stat = stat[:, dynamic_heads(torch.from_numpy(stat), frac=dynamic_frac).numpy()]
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


def plot_attention_probe(
    models: Mapping[str, ArrayLike],
    path: PathLike,
    *,
    metric: str = "Key-marginal entropy",
    loop_labels: Sequence[str] | None = None,
    dynamic_frac: float | None = None,
    bins: int = 20,
    title: str | None = None,
    single: bool | None = None,
) -> Path:
    """Cross-loop distribution of a head-wise attention statistic, ``{model: [T, n_heads] or [T, n_layers,
    n_heads]}`` per loop (averaged over sequences); ``dynamic_frac`` keeps each model's top heads by
    cross-loop range (paper: 0.4; None = all heads, App. I.3).

    One model (SpiralFormer Fig. 4): ridgeline histograms of the head-wise values per loop, and box plots
    per loop with the loop-wise mean as a black dot connected across loops. Several models (Fig. 4 vs 6):
    grouped per-loop box plots, each model's mean connected across loops.
    """
    single = len(models) == 1 if single is None else single
    data = {k: _loop_values(v, loop_labels, dynamic_frac) for k, v in models.items()}
    with matplotlib.rc_context(STYLE):
        if single:
            ((labels, values),) = data.values()
            T = len(values)
            fig, axes = new_fig(1, 2, (8.0, 0.55 * T + 2.0), gridspec_kw={"width_ratios": [1, 1.2]})
            _draw_ridgeline(axes[0, 0], labels, values, bins, "#4c72b0")
            axes[0, 0].set_xlabel(metric)
            axes[0, 0].set_title("Head-wise distribution")
            pos = np.arange(T, dtype=float)
            draw_boxes(axes[0, 1], pos, values, "#4c72b0", 0.55, None)
            axes[0, 1].set_xticks(pos)
            axes[0, 1].set_xticklabels(labels)
            axes[0, 1].set_xlabel("Loop")
            axes[0, 1].set_ylabel(metric)
            axes[0, 1].grid(True, axis="y")
            axes[0, 1].set_title("Per-loop box plot (dot = mean)")
            suptitle(fig, title)
            return save(fig, path)
        m = len(data)
        T = max(len(v[1]) for v in data.values())
        labels = max((v[0] for v in data.values()), key=len)
        width = 0.8 / max(m, 1)
        fig, axes = new_fig(1, 1, (max(4.5, 1.0 * T * max(m, 2) * 0.6 + 2.0), 3.4))
        ax = axes[0, 0]
        for i, (name, (_, values)) in enumerate(data.items()):
            pos = np.arange(len(values), dtype=float) + (i - (m - 1) / 2) * width
            draw_boxes(ax, pos, values, model_color(name, i), width * 0.85, name)
        ax.set_xticks(np.arange(T))
        ax.set_xticklabels(labels)
        ax.set_xlabel("Loop")
        ax.set_ylabel(metric)
        ax.grid(True, axis="y")
        ax.legend(frameon=False, ncols=min(m, 4))
        if title:
            ax.set_title(title)
        return save(fig, path)


def _as_layer_head(per_loop: ArrayLike, n_heads: int | None) -> np.ndarray:
    a = to_numpy(per_loop)
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
    """Layer x head heatmap of a head-wise statistic ``[T, n_layers, n_heads]`` (or ``[T, n_layers *
    n_heads]`` with ``n_heads``) of one model, one panel per loop (shared scale; SpiralFormer Fig. 7)."""
    a = _as_layer_head(per_loop, n_heads)
    T, nl, nh = a.shape
    labels = list(loop_labels) if loop_labels is not None else [f"loop {t + 1}" for t in range(T)]
    vmin, vmax = float(np.nanmin(a)), float(np.nanmax(a))
    with matplotlib.rc_context(STYLE):
        fig, axes = new_fig(1, T, (T * (0.25 * nh + 1.4) + 1.0, 0.25 * nl + 1.8))
        im = None
        for t in range(T):
            im = _draw_layer_head(axes[0, t], a[t], cmap, vmin, vmax)
            axes[0, t].set_title(labels[t])
            if t > 0:
                axes[0, t].set_ylabel("")
        suptitle(fig, title)  # before tight_layout so the suptitle gets its own space
        fig.tight_layout()
        fig.colorbar(im, ax=list(axes[0]), fraction=0.02, pad=0.02, label=metric)
        return save(fig, path, tight=False)


def _draw_range_heatmap(ax: Axes, a: np.ndarray, frac: float) -> Any:
    T, nl, nh = a.shape
    t = torch.from_numpy(a)
    rng = minmax_normalize(t.amax(0) - t.amin(0)).numpy()
    im = _draw_layer_head(ax, rng, "viridis", 0.0, 1.0)
    for idx in dynamic_heads(t.reshape(T, -1), frac=frac).tolist():
        layer, head = divmod(idx, nh)
        ax.add_patch(Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="black", lw=1.4))
    return im


def plot_head_range(
    models: Mapping[str, ArrayLike],
    path: PathLike,
    *,
    metric: str = "Key-marginal entropy",
    frac: float = DYNAMIC_FRAC,
    n_heads: int | None = None,
    title: str | None = None,
    single: bool | None = None,
) -> Path:
    """Min-max normalised cross-loop range per head, dynamic heads (top ``frac``) boxed, of
    ``{model: [T, n_layers, n_heads]}`` (SpiralFormer Fig. 5; several models side by side, Fig. 5 vs 7)."""
    single = len(models) == 1 if single is None else single
    arrs = {k: _as_layer_head(v, n_heads) for k, v in models.items()}
    m = len(arrs)
    nl = max(a.shape[1] for a in arrs.values())
    nh = max(a.shape[2] for a in arrs.values())
    label = rf"normalised $\Delta$ {metric}"
    with matplotlib.rc_context(STYLE):
        if single:
            (a,) = arrs.values()
            fig, axes = new_fig(1, 1, (0.3 * nh + 2.4, 0.25 * nl + 1.8))
            im = _draw_range_heatmap(axes[0, 0], a, frac)
            fig.colorbar(im, ax=axes[0, 0], fraction=0.046, pad=0.04, label=label)
            axes[0, 0].set_title(title or rf"Cross-loop range of {metric}")
            return save(fig, path)
        fig, axes = new_fig(1, m, (m * (0.3 * nh + 1.6) + 1.0, 0.25 * nl + 1.8))
        im = None
        for i, (name, a) in enumerate(arrs.items()):
            im = _draw_range_heatmap(axes[0, i], a, frac)
            axes[0, i].set_title(name)
        suptitle(fig, title)  # before tight_layout so the suptitle gets its own space
        fig.tight_layout()
        fig.colorbar(im, ax=list(axes[0]), fraction=0.02, pad=0.02, label=label)
        return save(fig, path, tight=False)


def draw(results: Mapping[str, tuple[Capture, dict[str, Any]]], sheet: Sheet) -> list[Path]:
    att = {k: s for k, (_, s) in results.items() if s.get("attention")}
    if not att:
        return []
    single = not sheet.compare
    files = []
    for metric, name in METRICS:
        per_loop = {k: np.asarray(s["attention"][metric]["per_loop"], dtype=float) for k, s in att.items()}
        labels = max((loop_labels(s) for s in att.values()), key=len)
        if sheet.compare and (
            len({p.shape[0] for p in per_loop.values()}) > 1
            or any(s["attention"]["multires"] for s in att.values())
        ):
            labels = [f"loop {t + 1}" for t in range(len(labels))]
        for kind, frac, heading in (
            ("dynamic", DYNAMIC_FRAC, "dynamic heads (top 40%)"),
            ("all", None, "all heads"),
        ):
            files.append(
                plot_attention_probe(
                    per_loop,
                    sheet.path(f"attention_{metric}_{kind}"),
                    metric=name,
                    loop_labels=labels,
                    dynamic_frac=frac,
                    title=sheet.heading(f"{name}, {heading}"),
                    single=single,
                )
            )
        if single:
            (one,) = per_loop.values()
            files.append(
                plot_head_heatmaps(
                    one,
                    sheet.path(f"attention_{metric}_heads"),
                    metric=name,
                    loop_labels=labels,
                    title=sheet.heading(f"{name} per layer and head"),
                )
            )
        files.append(
            plot_head_range(
                per_loop,
                sheet.path(f"attention_{metric}_range"),
                metric=name,
                frac=DYNAMIC_FRAC,
                title=sheet.heading(f"Cross-loop range of {name}"),
                single=single,
            )
        )
    return files
