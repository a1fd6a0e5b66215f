"""Figures of the Mela probes (no paper figure): heatmaps over block application x memory chunk (surprise
norm, theta / eta / alpha), the memory update's singular values, and MemStack's relative change of the
decoder's memory rows per H cycle."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.lines import Line2D

from recursive_lightning.probes.figures import (
    STYLE,
    ArrayLike,
    PathLike,
    draw_boxes,
    draw_heatmap,
    new_fig,
    save,
    save_titled,
    sparse_ticks,
    state_colors,
    suptitle,
    to_numpy,
)
from recursive_lightning.probes.mela import MelaCapture


def _group_edges(groups: Sequence[int]) -> list[float]:
    """Row boundaries (between rows i-1 and i) where the group (e.g. the H cycle) changes."""
    return [i - 0.5 for i in range(1, len(groups)) if groups[i] != groups[i - 1]]


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
    mats = {k: to_numpy(v) for k, v in panels.items()}
    nr, nc = len(rows), len(cols)
    m = max(len(mats), 1)
    annotate = nr * nc <= 160
    dense = nr > 32  # e.g. mela-400m: 96 applications
    label_w = (0.05 if dense else 0.065) * max((len(r) for r in rows), default=4) + 0.4
    panel_w = max(2.4, 0.5 * nc + 1.4) if annotate else max(2.4, 0.12 * nc + 1.6)
    height = max(2.6, (0.14 if dense else 0.24) * nr + 1.4)
    style = {**STYLE, "ytick.labelsize": 6.5} if dense else STYLE
    with matplotlib.rc_context(style):
        fig, axes = new_fig(1, m, (label_w + m * panel_w, height))
        for p, (name, mat) in enumerate(mats.items()):
            ax = axes[0, p]
            if not np.isfinite(mat).any():
                ax.set_axis_off()
                ax.text(0.5, 0.5, f"{name}:\nnot used", ha="center", va="center", transform=ax.transAxes)
                continue
            lo, hi = float(np.nanmin(mat)), float(np.nanmax(mat))
            im = draw_heatmap(
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
            ticks = sparse_ticks(nc)
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
        return save_titled(fig, path, title, height)


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
    sv = to_numpy(singular)
    A, T, n_t, k = sv.shape
    cyc = sorted(set(groups))
    palette = state_colors(len(cyc))
    color = {c: palette[i] for i, c in enumerate(cyc)}
    is_h = ["Hb" in a for a in apps]
    dense = A > 16  # one tensor per row pair, full width
    width = min(max(4.8, 0.28 * A + 1.6), 16.0)
    if dense:
        shape, size, ratios = (2 * n_t, 1), (width, 6.4 * n_t), [1, 1.1] * n_t
    else:
        shape, size, ratios = (2, n_t), (width * n_t, 6.4), [1, 1.1]
    height = size[1]
    with matplotlib.rc_context(STYLE):
        fig, grid = new_fig(*shape, size, gridspec_kw={"height_ratios": ratios})
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
                draw_boxes(ax, pos[a : a + 1], [vals[a]], color[groups[a]], 0.6, None)
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
        return save_titled(fig, path, title, height)


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
    r = to_numpy(ratio)
    N, H1, n = r.shape
    with matplotlib.rc_context(STYLE):
        fig, axes = new_fig(1, 2, (max(3.2, 1.0 * H1 + 2.0) + max(3.6, 0.35 * n + 2.0), 3.3))
        ax, ax2 = axes[0]
        if H1 == 0:
            for a in (ax, ax2):
                a.set_axis_off()
            ax.text(0.5, 0.5, "H = 1: no MemStack", ha="center", va="center", transform=ax.transAxes)
            suptitle(fig, title)
            return save(fig, path)
        per_sample = r[:, :, 1:].mean(axis=2) if n > 1 else np.zeros((N, H1))
        means, stds = per_sample.mean(axis=0), per_sample.std(axis=0)
        x = np.arange(H1)
        colors = state_colors(H1)
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
        ticks = sparse_ticks(n)
        ax2.set_xticks(ticks)
        ax2.set_xlabel("text chunk $j$ (chunk 0 reads the initial memory: nothing added)")
        ax2.set_ylabel("relative change")
        ax2.set_ylim(bottom=0)
        ax2.grid(True)
        ax2.legend(frameon=False)
        ax2.set_title("per text chunk, mean $\\pm$ std over samples")
        suptitle(fig, title)
        return save(fig, path)


def draw_mela(cap: MelaCapture, out: Path, title: str) -> list[Path]:
    """The Mela figures: memory heatmaps (surprise; theta / eta / alpha), update spectrum, MemStack."""
    cfg = cap.cfg
    names = [a["name"] for a in cap.applications]
    short = [a["short"] for a in cap.applications]
    chunks = [str(t) for t in range(cap.memory_chunks)]
    cycles = [a["cycle"] for a in cap.applications]
    files = []
    if cap.surprise is not None:
        files.append(
            plot_application_heatmaps(
                {lab: cap.surprise[:, :, i] for i, lab in enumerate(cap.tensor_labels)},
                out / "mela_surprise.png",
                rows=names,
                cols=chunks,
                groups=cycles,
                cmap="magma",
                title=f"Surprise norm per memory tensor (mean over samples and heads) - {title}",
            )
        )
        rates = {r"learning rate $\theta$": cap.theta, r"momentum $\eta$": cap.eta}
        rates[r"forgetting $\alpha$"] = cap.alpha
        if cfg.memory_update in ("plain", "momentum"):
            rates.pop(r"forgetting $\alpha$")  # 1 by definition
        if cfg.memory_update == "plain":
            rates.pop(r"momentum $\eta$")  # no momentum
        files.append(
            plot_application_heatmaps(
                rates,
                out / "mela_rates.png",
                rows=names,
                cols=chunks,
                groups=cycles,
                cmap="viridis",
                fmt="{:.3f}",
                title=f"Gates the memory update used (memory_update: {cfg.memory_update}) - {title}",
            )
        )
        ns = cfg.memory_update == "newton_schulz"
        files.append(
            plot_update_spectrum(
                cap.singular,
                out / "mela_update_spectrum.png",
                apps=short,
                tensors=cap.tensor_labels,
                groups=cycles,
                reference=1.0 if ns else None,
                title=(
                    f"Singular values of the memory update after Newton-Schulz-{cfg.ns_steps}"
                    + (f" and the step floor {cfg.memory_step_floor:g}" if cfg.memory_step_floor else "")
                    + f" - {title}"
                    if ns
                    else f"Singular values of the memory update (no Newton-Schulz) - {title}"
                ),
            )
        )
    files.append(
        plot_memstack_change(
            cap.memstack_ratio,
            out / "mela_memstack.png",
            enabled=bool(cfg.memstack),
            title=f"MemStack: relative change of the decoder's memory rows - {title}",
        )
    )
    return files
