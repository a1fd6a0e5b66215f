"""Normalised singular spectra and effective rank of the hidden states (MeSH Fig. 1c / 5): metric,
summary and figure.

The spectra follow from the eigenvalues of the small Gram matrix (``d x d``, or ``L x L`` if ``L < d``)
rather than an SVD of every ``[L, d]`` state (about 10x the forward pass on CPU); singular values come out
with an absolute error of about 1e-8 sigma_0 (float64), far below what the log-scale spectra resolve.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
import torch
from torch import Tensor

from recursive_lightning.probes.figures import (
    STYLE,
    ArrayLike,
    PathLike,
    Sheet,
    draw_bands,
    mean_std,
    metric_key,
    new_fig,
    save,
    state_label,
    suptitle,
    to_numpy,
)

if TYPE_CHECKING:
    from recursive_lightning.probes.captured import Capture


def singular_values(X: Tensor) -> Tensor:
    """Singular values (descending, float64) of ``X [..., n, d]`` via the eigenvalues of its Gram."""
    X = X.to(torch.float64)
    n, d = X.shape[-2:]
    G = X.mT @ X if n >= d else X @ X.mT
    return torch.linalg.eigvalsh(G).flip(-1).clamp_min(0.0).sqrt()


def normalized_spectrum(sv: Tensor, k: int = 50) -> Tensor:
    """``sigma_i / sigma_0`` for the top ``k`` singular values ``sv``, zero-padded beyond the rank."""
    norm = sv / sv[..., :1]
    if norm.shape[-1] < k:
        norm = torch.cat([norm, norm.new_zeros(*norm.shape[:-1], k - norm.shape[-1])], dim=-1)
    return norm[..., :k]


def effective_rank(sv: Tensor) -> Tensor:
    """Effective rank ``exp(H(sigma / sum sigma))`` of singular values ``sv`` (Roy & Vetterli)."""
    p = sv / sv.sum(-1, keepdim=True)
    return torch.exp(-torch.special.xlogy(p, p).sum(-1))


def summarize(cap: Capture, meta: dict[str, Any]) -> dict[str, Any]:
    mean, std = mean_std(cap.spectra)
    out: dict[str, Any] = {
        "spectra": {"states": cap.state_names, "k": cap.spectra.shape[-1], "mean": mean, "std": std}
    }
    mean, std = mean_std(cap.effective_rank)
    out["effective_rank"] = {"states": cap.state_names, "mean": mean, "std": std}
    return out


def metrics(summary: dict[str, Any]) -> dict[str, Any]:
    er = summary["effective_rank"]
    return {f"probe/effective_rank/{metric_key(s)}": v for s, v in zip(er["states"], er["mean"])}


def plot_spectra(
    models: Mapping[str, Mapping[str, ArrayLike]],
    path: PathLike,
    *,
    title: str | None = None,
    single: bool | None = None,
) -> Path:
    """Normalised singular spectra ``sigma_i / sigma_0`` on a log y axis (MeSH Fig. 5):
    ``{model: {state label: per-sample spectra [N, k]}}``, mean line and +-std band (zero padding beyond
    the rank is not drawn); several models one panel each, shared log y axis."""
    single = len(models) == 1 if single is None else single
    m = len(models)
    with matplotlib.rc_context(STYLE):
        if single:
            fig, axes = new_fig(1, 1, (4.2, 3.2))
        else:
            fig, axes = new_fig(1, m, (3.4 * m, 3.2), sharey=True)
        for i, (name, curves) in enumerate(models.items()):
            ax = axes[0, i]
            draw_bands(ax, curves, logy=True, x0=0)
            if not single:
                ax.set_title(name)
            ax.set_xlabel("Singular value index $i$")
            if i == 0:
                ax.set_ylabel(r"$\sigma_i / \sigma_0$")
            ax.legend(frameon=False)
        if single:
            if title:
                axes[0, 0].set_title(title)
        else:
            suptitle(fig, title)
        return save(fig, path)


def draw(results: Mapping[str, tuple[Capture, dict[str, Any]]], sheet: Sheet) -> list[Path]:
    models = {
        k: {state_label(s): to_numpy(c.spectra[:, i]) for i, s in enumerate(c.state_names)}
        for k, (c, _) in results.items()
    }
    title = sheet.heading("Singular spectra", "Normalised singular spectra")
    return [plot_spectra(models, sheet.path("spectra"), title=title, single=not sheet.compare)]
