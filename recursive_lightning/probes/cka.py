"""CKA between hidden states (MeSH Fig. 1b / 4; Kornblith et al. 2019): metric, summary and figure."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
import numpy as np
import torch
from torch import Tensor

from recursive_lightning.probes.figures import (
    STYLE,
    ArrayLike,
    PathLike,
    Sheet,
    draw_heatmap,
    mean_matrix,
    mean_std,
    metric_key,
    new_fig,
    save,
    state_label,
    suptitle,
)

if TYPE_CHECKING:
    from recursive_lightning.probes.captured import Capture


def cka_matrix(states: Tensor, kernel: str = "rbf", sigma_frac: float = 1.0) -> Tensor:
    """Pairwise CKA ``[..., S, S]`` between the states ``[..., S, n, d]`` (the ``n`` rows are the examples).

    ``CKA(X, Y) = HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L))`` with double-centred kernel matrices: linear
    ``X X^T`` or RBF ``exp(-||x_i - x_j||^2 / (2 sigma^2))``, ``sigma = sigma_frac x`` the median pairwise
    distance of each state (median heuristic of Kornblith et al. 2019, Sec. 3, over the ``n(n-1)/2``
    distinct pairs - their reference code takes the full matrix, zero diagonal included, which biases
    sigma down for small ``n``; with it CKA is invariant to isotropic scaling and orthogonal transforms, as
    linear CKA is). MeSH uses RBF without stating sigma. Squared distances come from the Gram ``X X^T``
    (in place), the median from two ``kthvalue`` selections instead of a full sort, and the kernel and its
    double-centring are formed in place; ``HSIC_ij = <Kc_i, Kc_j>_F`` is one batched matmul.
    """
    X = states.to(torch.float64)
    K = X @ X.mT  # [..., S, n, n]
    n = K.shape[-1]
    if kernel == "rbf":
        sq = K.diagonal(dim1=-2, dim2=-1).clone()
        d2 = K.mul_(-2.0).add_(sq.unsqueeze(-1)).add_(sq.unsqueeze(-2)).clamp_min_(0.0)
        d2.diagonal(dim1=-2, dim2=-1).zero_()
        iu = torch.triu_indices(n, n, offset=1, device=d2.device)
        pairs = d2[..., iu[0], iu[1]]  # [..., S, n(n-1)/2] squared distances
        m = pairs.shape[-1]
        lo = pairs.kthvalue((m - 1) // 2 + 1, dim=-1).values
        hi = pairs.kthvalue(m // 2 + 1, dim=-1).values if m % 2 == 0 else lo
        del pairs
        sigma = (sigma_frac * 0.5 * (lo.sqrt() + hi.sqrt())).clamp_min(torch.finfo(torch.float64).tiny)
        K = d2.div_((-2.0 * sigma * sigma)[..., None, None]).exp_()
    elif kernel != "linear":
        raise ValueError(f"unknown kernel {kernel!r}; expected 'rbf' or 'linear'")
    row = K.mean(-1, keepdim=True)
    col = K.mean(-2, keepdim=True)
    tot = row.mean(-2, keepdim=True)
    Kc = K.sub_(row).sub_(col).add_(tot)
    F = Kc.flatten(-2)
    hsic = F @ F.mT
    norm = torch.diagonal(hsic, dim1=-2, dim2=-1).sqrt()
    return hsic / (norm.unsqueeze(-1) * norm.unsqueeze(-2))


def cka_in_chunks(states: Tensor, kernel: str, sigma_frac: float, max_bytes: int) -> Tensor:
    """Per-sample CKA matrices ``[b, S, S]`` of ``states [b, S, n, d]``, in sample chunks whose kernel
    matrices fit in ``max_bytes``."""
    b, S, n, _ = states.shape
    per_sample = S * n * n * 8 * 2  # the in-place kernel matrix + the pair list for the median (float64)
    chunk = max(1, min(b, max_bytes // max(per_sample, 1)))
    out = [
        cka_matrix(states[i : i + chunk], kernel=kernel, sigma_frac=sigma_frac) for i in range(0, b, chunk)
    ]
    return torch.cat(out)


def summarize(cap: Capture, meta: dict[str, Any]) -> dict[str, Any]:
    mean, std = mean_std(cap.cka)
    return {
        "cka": {"states": cap.state_names, "mean": mean, "std": std, "tokens_per_sample": cap.cka_positions}
    }


def metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """CKA between consecutive loop states ``h(t), h(t+1)``."""
    states, cka = summary["cka"]["states"], np.asarray(summary["cka"]["mean"], dtype=float)
    out = {}
    for i in range(len(states) - 1):
        if re.fullmatch(r"h\(\d+\)", states[i]) and re.fullmatch(r"h\(\d+\)", states[i + 1]):
            out[f"probe/cka/{metric_key(states[i])}_{metric_key(states[i + 1])}"] = cka[i, i + 1]
    return out


def plot_cka(
    models: Mapping[str, ArrayLike],
    path: PathLike,
    *,
    labels: Mapping[str, Sequence[str]],
    title: str | None = None,
    annotate: bool = True,
    cmap: str = "Blues",
    single: bool | None = None,
) -> Path:
    """Annotated pairwise CKA heatmaps (MeSH Fig. 4): ``{model: [S, S] or per-sample [N, S, S]}`` (averaged,
    NaN-aware, as in the paper's "mean similarity across 500 samples"), ``labels`` the state names per
    model; several models side by side with a shared colour bar."""
    single = len(models) == 1 if single is None else single
    mats = {k: mean_matrix(v) for k, v in models.items()}
    m = len(mats)
    s = max(v.shape[0] for v in mats.values())
    with matplotlib.rc_context(STYLE):
        if single:
            ((name, mat),) = mats.items()
            fig, axes = new_fig(1, 1, (0.55 * s + 2.2, 0.5 * s + 1.6))
            lab = list(labels[name])
            im = draw_heatmap(axes[0, 0], mat, lab, lab, cmap=cmap, vmin=0.0, vmax=1.0, annotate=annotate)
            fig.colorbar(im, ax=axes[0, 0], fraction=0.046, pad=0.04, label="CKA")
            if title:
                axes[0, 0].set_title(title)
            return save(fig, path)
        fig, axes = new_fig(1, m, ((0.5 * s + 1.3) * m + 1.0, 0.5 * s + 1.6))
        im = None
        for i, (name, mat) in enumerate(mats.items()):
            lab = list(labels[name])
            im = draw_heatmap(axes[0, i], mat, lab, lab, cmap=cmap, vmin=0.0, vmax=1.0, annotate=annotate)
            axes[0, i].set_title(name)
        suptitle(fig, title)  # before tight_layout so the suptitle gets its own space
        fig.tight_layout()
        fig.colorbar(im, ax=list(axes[0]), fraction=0.02, pad=0.02, label="CKA")
        return save(fig, path, tight=False)


def draw(results: Mapping[str, tuple[Capture, dict[str, Any]]], sheet: Sheet) -> list[Path]:
    return [
        plot_cka(
            {k: c.cka for k, (c, _) in results.items()},
            sheet.path("cka"),
            labels={k: [state_label(s) for s in c.state_names] for k, (c, _) in results.items()},
            title=sheet.heading("CKA", "CKA between hidden states"),
            single=not sheet.compare,
        )
    ]
