"""Shared subspace of the loop states (MeSH App. E.8, Fig. 10): metric, summary and figure."""

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
    new_fig,
    save,
    state_label,
    suptitle,
    to_numpy,
)

if TYPE_CHECKING:
    from recursive_lightning.probes.captured import Capture


def shared_subspace_variance(states: Tensor, k_max: int | None = None, center: bool = True) -> Tensor:
    """Cumulative variance of each state ``[..., S, n, d]`` in the subspace the states share, ``[..., S,
    k_max or d]`` (padded with the last value beyond ``d``).

    MeSH App. E.8 / Fig. 10: "performing SVD on the concatenated hidden states of all loop iterations
    (h^(0), ..., h^(3)) and using the top singular directions as the shared basis ... the cumulative
    variance of each individual state when projected onto this shared subspace": each state centred by
    its token mean (``center``), ``C[s, k-1] = sum_{j<=k} ||X_s v_j||^2 / ||X_s||_F^2``, non-decreasing
    in ``k``, 1 once the basis spans the row space of ``X_s``.

    With ``G_s = X_s^T X_s`` and ``G = sum_s G_s`` (the Gram of the token-concatenation), the shared
    basis ``v_j`` are the eigenvectors of ``G`` (descending eigenvalue = squared singular value of the
    concatenation) and ``||X_s v_j||^2 = v_j^T G_s v_j``.
    """
    X = states.to(torch.float64)
    if center:
        X = X - X.mean(-2, keepdim=True)
    Gs = X.mT @ X  # [..., S, d, d]
    _, V = torch.linalg.eigh(Gs.sum(-3))  # ascending
    V = V.flip(-1).unsqueeze(-3)  # [..., 1, d, d] columns = shared directions, descending
    energy = ((Gs @ V) * V).sum(-2)  # [..., S, d]
    total = torch.diagonal(Gs, dim1=-2, dim2=-1).sum(-1)
    cum = energy.cumsum(-1) / total.unsqueeze(-1)
    d = cum.shape[-1]
    k = d if k_max is None else int(k_max)
    if k <= d:
        return cum[..., :k]
    return torch.cat([cum, cum[..., -1:].expand(*cum.shape[:-1], k - d)], dim=-1)


def summarize(cap: Capture, meta: dict[str, Any]) -> dict[str, Any]:
    if cap.subspace is None:
        return {"shared_subspace": None}
    mean, std = mean_std(cap.subspace)
    return {
        "shared_subspace": {
            "states": cap.state_names[1 : cap.n_loop + 2],
            "k": cap.subspace.shape[-1],
            "mean": mean,
            "std": std,
        }
    }


def plot_shared_subspace(
    models: Mapping[str, Mapping[str, ArrayLike]],
    path: PathLike,
    *,
    title: str | None = None,
    single: bool | None = None,
) -> Path:
    """Cumulative variance of each loop state in the shared subspace (MeSH App. E.8, Fig. 10):
    ``{model: {state label: per-sample curves [N, k]}}``, mean line and +-std band; several models side
    by side (Fig. 10 a vs b)."""
    single = len(models) == 1 if single is None else single
    m = len(models)
    with matplotlib.rc_context(STYLE):
        if single:
            fig, axes = new_fig(1, 1, (4.2, 3.2))
        else:
            fig, axes = new_fig(1, m, (3.4 * m, 3.2), sharey=True)
        for i, (name, curves) in enumerate(models.items()):
            ax = axes[0, i]
            draw_bands(ax, curves, logy=False, x0=1)
            ax.set_ylim(0.0, 1.02)
            ax.set_xlabel("Number of shared directions $k$")
            if not single:
                ax.set_title(name)
            if i == 0:
                ax.set_ylabel("Cumulative explained variance")
            ax.legend(frameon=False, loc="lower right")
        if single:
            if title:
                axes[0, 0].set_title(title)
        else:
            suptitle(fig, title)
        return save(fig, path)


def draw(results: Mapping[str, tuple[Capture, dict[str, Any]]], sheet: Sheet) -> list[Path]:
    models = {
        k: {state_label(s): to_numpy(c.subspace[:, i]) for i, s in enumerate(c.state_names[1 : c.n_loop + 2])}
        for k, (c, _) in results.items()
        if c.subspace is not None
    }
    if not models:
        return []
    title = sheet.heading("Shared subspace")
    return [
        plot_shared_subspace(models, sheet.path("shared_subspace"), title=title, single=not sheet.compare)
    ]
