"""Computation skew per block (MeSH Fig. 1a / 3): metric, summary and figure."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
import numpy as np
import torch
from matplotlib.axes import Axes
from torch import Tensor

from recursive_lightning.probes.figures import (
    STYLE,
    ArrayLike,
    PathLike,
    Sheet,
    mean_std,
    metric_key,
    model_color,
    new_fig,
    ordinal,
    sample_mean_std,
    save,
    to_numpy,
)

if TYPE_CHECKING:
    from recursive_lightning.probes.captured import Capture


def computation_skew(h_in: Tensor, h_out: Tensor) -> Tensor:
    """Relative update magnitude of one computational block, per sample.

    MeSH Fig. 1a and Fig. 3: for a block ``f`` mapping ``h -> f(h)``,

        skew = 2 ||f(h) - h||_F / (||f(h)||_F + ||h||_F),

    with the Frobenius norm taken over each sample's ``[L, D]`` state matrix.  The value lies in
    ``[0, 2]``: 0 for the identity, 2 for ``f(h) = -h``.  Which tensors play ``h`` and ``f(h)`` for a
    block is the caller's choice (:mod:`recursive_lightning.probes.capture`).

    Args:
        h_in: block input ``h``, shape ``[..., L, D]`` (typically ``[N, L, D]``).
        h_out: block output ``f(h)``, same shape as ``h_in``.

    Returns:
        float64 tensor of shape ``[...]`` (``[N]`` for ``[N, L, D]`` inputs).  NaN where both norms
        are zero.
    """
    if h_in.shape != h_out.shape:
        raise ValueError(f"h_in {tuple(h_in.shape)} and h_out {tuple(h_out.shape)} must match")
    if h_in.dim() < 2:
        raise ValueError("states must have shape [..., L, D]")
    x, y = h_in.to(torch.float64), h_out.to(torch.float64)
    diff = torch.linalg.matrix_norm(y - x, ord="fro")
    denom = torch.linalg.matrix_norm(y, ord="fro") + torch.linalg.matrix_norm(x, ord="fro")
    return 2.0 * diff / denom


def block_label(name: str, vanilla: bool = False) -> str:
    """Trace block name -> MeSH Fig. 3 label (``core 2`` -> ``2nd f_core``)."""
    if name == "prelude":
        return "Layers" if vanilla else "Prelude"
    if name == "coda":
        return "Coda"
    m = re.fullmatch(r"core (\d+)", name)
    return rf"{ordinal(int(m.group(1)))} $f_{{\mathrm{{core}}}}$" if m else name


def summarize(cap: Capture, meta: dict[str, Any]) -> dict[str, Any]:
    vanilla = meta.get("model", {}).get("kind") == "vanilla"
    mean, std = mean_std(cap.skew)
    return {
        "skew": {
            "blocks": cap.block_names,
            "labels": [block_label(b, vanilla) for b in cap.block_names],
            "mean": mean,
            "std": std,
            "definition": "2 ||f(h) - h||_F / (||f(h)||_F + ||h||_F) per sample (MeSH Fig. 3)",
        }
    }


def metrics(summary: dict[str, Any]) -> dict[str, Any]:
    return {
        f"probe/skew/{metric_key(b)}": v for b, v in zip(summary["skew"]["blocks"], summary["skew"]["mean"])
    }


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
        stats = [sample_mean_std(per_block[b]) if b in per_block else (np.nan, 0.0) for b in blocks]
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
    models: Mapping[str, Mapping[str, ArrayLike]],
    path: PathLike,
    *,
    title: str | None = None,
    ylabel: str = "Relative update magnitude",
    single: bool | None = None,
) -> Path:
    """Bar chart of the computation skew per block, mean +- std over samples (MeSH Fig. 3):
    ``{model: {block label: per-sample skews}}`` in flow order, grouped bars (one colour per model)
    for several models (``single``: the one-model layout, default for one model)."""
    single = len(models) == 1 if single is None else single
    n_blocks = max((len(v) for v in models.values()), default=1)
    with matplotlib.rc_context(STYLE):
        if single:
            size = (max(3.5, 0.9 * n_blocks + 1.5), 3.0)
        else:
            size = (max(4.5, 0.35 * n_blocks * len(models) + 2.5), 3.2)
        fig, axes = new_fig(1, 1, size)
        _draw_skew(axes[0, 0], models, legend=not single, ylabel=ylabel)
        if title:
            axes[0, 0].set_title(title)
        return save(fig, path)


def draw(results: Mapping[str, tuple[Capture, dict[str, Any]]], sheet: Sheet) -> list[Path]:
    models = {
        k: {lab: to_numpy(c.skew[:, i]) for i, lab in enumerate(s["skew"]["labels"])}
        for k, (c, s) in results.items()
    }
    title = sheet.heading("Computation skew")
    return [plot_skew(models, sheet.path("skew"), title=title, single=not sheet.compare)]
