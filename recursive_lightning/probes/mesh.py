"""MeSH routers and the state composition of Eq. 7 (MeSH App. F, Fig. 11): metric, summary and figures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    draw_heatmap,
    mean_matrix,
    mean_std,
    new_fig,
    save,
    suptitle,
    to_numpy,
)

if TYPE_CHECKING:
    from recursive_lightning.probes.captured import Capture


def mesh_state_composition(write: Tensor, read: Tensor) -> Tensor:
    """Coefficients ``alpha`` of MeSH Eq. 7: contribution of each source to each state.

    Derived by unrolling Algorithm 2 (MeSH App. C) with linear bookkeeping of the buffer.
    Router index ``j = 0..K`` corresponds to MeSH step ``t = j - 1`` (``j = 0`` is the
    transitional prelude step ``t = -1``).  Sources are
    ``[h_emb, h_m^(-1), h_m^(0), ..., h_m^(K-1)]`` (``K + 2`` columns), states are
    ``h^(0..K)`` (``K + 1`` rows).

    * ``M^(0)``: slot 0 holds ``h_emb`` (coefficient 1), other slots 0 (Eq. 2).
    * Step ``j`` writes its source ``s = j + 1`` (``h_m^(j-1)``; the prelude output for
      ``j = 0``) with ``w_write^(j)`` (Eq. 5 / Alg. 2 lines 11, 20), so slot ``b`` holds
      source ``s`` with weight ``write[s-1, b]`` for every step ``j >= s - 1``.
    * Step ``j`` then reads ``h^(j) = sum_b m_b w_read,b^(j)`` (Alg. 2 lines 13, 22).

    Hence, token-wise (the weights are per position),

        alpha[j, 0]     = read[j, 0]                                    (h_emb)
        alpha[j, s>=1]  = [s - 1 <= j] * sum_b write[s-1, b] read[j, b]   (h_m^(s-2))

    i.e. ``alpha = [read[..., :1] | tril(read @ write^T)]`` - one batched matmul over
    slots.  The diagonal ``sum_b w_write,b^(t) w_read,b^(t)`` is the "gating factor" of
    Eq. 6.  With softmax routers rows need not sum to 1.

    Args:
        write: ``[K+1, ..., B]`` write weights ``w_write^(-1..K-1)`` (e.g.
            ``[K+1, N, L, B]`` for N sequences of length L).
        read: ``[K+1, ..., B]`` read weights, same shape.

    Returns:
        ``[..., K+1, K+2]`` (dtype of the inputs, at least float32): row ``t`` is state
        ``h^(t)``, columns are ``[h_emb, h_m^(-1), h_m^(0), ..., h_m^(K-1)]``.
    """
    if write.shape != read.shape:
        raise ValueError(f"write {tuple(write.shape)} and read {tuple(read.shape)} must match")
    if write.dim() < 2:
        raise ValueError("router weights must have shape [K+1, ..., B]")
    dtype = torch.promote_types(torch.promote_types(write.dtype, read.dtype), torch.float32)
    w = write.to(dtype).movedim(0, -2)  # [..., K+1, B]
    r = read.to(dtype).movedim(0, -2)  # [..., K+1, B]
    gain = torch.tril(r @ w.transpose(-1, -2))  # [..., K+1 (state), K+1 (written source)]
    return torch.cat([r[..., :1], gain], dim=-1)


def state_composition_labels(K: int) -> tuple[list[str], list[str]]:
    """Row/column labels (mathtext) of :func:`mesh_state_composition`: rows ``h^(0..K)``, columns
    ``[h_emb, h_m^(-1), ..., h_m^(K-1)]``."""
    rows = [rf"$h^{{({t})}}$" for t in range(K + 1)]
    cols = [r"$h_{\mathrm{emb}}$"] + [rf"$h_m^{{({i})}}$" for i in range(-1, K)]
    return rows, cols


def summarize(cap: Capture, meta: dict[str, Any]) -> dict[str, Any]:
    if cap.routing is None:
        return {"mesh": None}
    r = cap.routing
    K1, B = r["write_seq"].shape[1:]
    rows = [f"h({t})" for t in range(K1)]
    cols = ["h_emb"] + [f"h_m({i})" for i in range(-1, K1 - 1)]
    mesh: dict[str, Any] = {"steps": list(range(-1, K1 - 1)), "slots": B, "token_index": cap.token_index}
    for key in ("write", "read"):
        m, s = mean_std(r[f"{key}_seq"])
        tm, _ = mean_std(r[f"{key}_tok"])
        mesh[key] = {
            "mean": m,  # [K+1, B] mean over samples and tokens
            "std": s,  # std over samples of the sequence means
            "token_mean": tm,  # at --token-index, mean over samples
            "case_sequence": to_numpy(r[f"{key}_seq"][0]),  # sample 0, sequence mean
            "case_token": to_numpy(r[f"{key}_tok"][0]),  # sample 0 at --token-index
        }
    m, s = mean_std(r["comp_seq"])
    tm, _ = mean_std(r["comp_tok"])
    mesh["composition"] = {
        "rows": rows,
        "cols": cols,
        "mean": m,
        "std": s,
        "token_mean": tm,
        "case_sequence": to_numpy(r["comp_seq"][0]),
        "case_token": to_numpy(r["comp_tok"][0]),
        "gating_factor": np.diagonal(m[:, 1:]),  # Eq. 6: sum_b w_write,b^(t) w_read,b^(t)
    }
    return {"mesh": mesh}


def _router_matrix(w: ArrayLike) -> np.ndarray:
    """``[K+1, ..., B]`` -> ``[K+1, B]`` averaged over the middle (sample/token) dims."""
    a = to_numpy(w)
    if a.ndim < 2:
        raise ValueError("router weights must have shape [K+1, ..., B]")
    if a.ndim > 2:
        a = a.reshape(a.shape[0], -1, a.shape[-1]).mean(axis=1)
    return a


def _draw_routers(axes: Sequence[Axes], write: np.ndarray, read: np.ndarray, annotate: bool) -> list[Any]:
    steps = [f"t={t}" for t in range(-1, write.shape[0] - 1)]
    slots = [str(b) for b in range(write.shape[1])]
    ims = []
    for ax, mat, cmap, name in ((axes[0], write, "Reds", "Write"), (axes[1], read, "Greens", "Read")):
        vmax = max(1.0, float(np.nanmax(mat))) if mat.size else 1.0
        ims.append(draw_heatmap(ax, mat, steps, slots, cmap=cmap, vmin=0.0, vmax=vmax, annotate=annotate))
        ax.set_xlabel("Buffer slot $b$")
        ax.set_title(f"{name} router")
    axes[0].set_ylabel("Step")
    return ims


def plot_mesh_routers(
    models: Mapping[str, tuple[ArrayLike, ArrayLike]],
    path: PathLike,
    *,
    title: str | None = None,
    annotate: bool = True,
    single: bool | None = None,
) -> Path:
    """Write (red) and read (green) router weights as step x slot heatmaps (MeSH Fig. 11a), one row per
    model ``{name: (write, read)}``, each ``[K+1, ..., B]`` with step ``t = -1..K-1`` first; middle dims
    (samples, tokens) are averaged ("sequence average"); slice a token beforehand for the token view."""
    single = len(models) == 1 if single is None else single
    mats = {k: (_router_matrix(w), _router_matrix(r)) for k, (w, r) in models.items()}
    m = len(mats)
    k1 = max(w.shape[0] for w, _ in mats.values())
    b = max(w.shape[1] for w, _ in mats.values())
    with matplotlib.rc_context(STYLE):
        row_h = 0.4 * k1 + 1.6 if single else 0.4 * k1 + 1.4
        fig, axes = new_fig(m, 2, (2 * (0.45 * b + 1.6), m * row_h))
        for i, (name, (w, r)) in enumerate(mats.items()):
            ims = _draw_routers(axes[i], w, r, annotate)
            if not single:
                axes[i, 0].set_ylabel(f"{name}\nStep")
            for ax, im in zip(axes[i], ims):
                fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
        suptitle(fig, title)
        return save(fig, path)


def _draw_composition(ax: Axes, coef: np.ndarray, annotate: bool) -> Any:
    rows, cols = state_composition_labels(coef.shape[0] - 1)
    # sources not yet computed when a state is formed (h_m^(i), i >= t) are blank
    future = np.arange(coef.shape[1])[None, :] > np.arange(coef.shape[0])[:, None] + 1
    coef = np.where(future, np.nan, coef)
    vmax = max(1.0, float(np.nanmax(coef))) if coef.size else 1.0
    im = draw_heatmap(ax, coef, rows, cols, cmap="Purples", vmin=0.0, vmax=vmax, annotate=annotate)
    ax.set_xlabel("Source")
    ax.set_ylabel("State")
    return im


def plot_state_composition(
    models: Mapping[str, ArrayLike],
    path: PathLike,
    *,
    title: str | None = None,
    annotate: bool = True,
    single: bool | None = None,
) -> Path:
    """State-composition heatmaps (state x source) of MeSH Eq. 7 / Fig. 11b: ``{model: [..., K+1, K+2]}``
    from :func:`mesh_state_composition`, leading (sample/token) dims averaged; models side by side."""
    single = len(models) == 1 if single is None else single
    mats = {k: mean_matrix(v) for k, v in models.items()}
    m = len(mats)
    nr = max(v.shape[0] for v in mats.values())
    nc = max(v.shape[1] for v in mats.values())
    with matplotlib.rc_context(STYLE):
        fig, axes = new_fig(1, m, (m * (0.6 * nc + (2.2 if single else 2.4)), 0.45 * nr + 1.6))
        for i, (name, mat) in enumerate(mats.items()):
            im = _draw_composition(axes[0, i], mat, annotate)
            if single:
                fig.colorbar(im, ax=axes[0, i], fraction=0.046, pad=0.04, label="coefficient")
                axes[0, i].set_title(title or "State composition")
            else:
                fig.colorbar(im, ax=axes[0, i], fraction=0.046, pad=0.04)
                axes[0, i].set_title(name)
        if not single:
            suptitle(fig, title)
        return save(fig, path)


def draw(results: Mapping[str, tuple[Capture, dict[str, Any]]], sheet: Sheet) -> list[Path]:
    mesh = {k: (c, s) for k, (c, s) in results.items() if c.routing is not None}
    if not mesh:
        return []
    single = not sheet.compare
    routers = {
        k: (c.routing["write_seq"].transpose(0, 1), c.routing["read_seq"].transpose(0, 1))
        for k, (c, _) in mesh.items()
    }
    files = [
        plot_mesh_routers(
            routers,
            sheet.path("mesh_routers"),
            title=sheet.heading(
                "MeSH routers, mean over samples and tokens", "MeSH routers (mean over samples and tokens)"
            ),
            single=single,
        )
    ]
    if single:
        ((c, s),) = mesh.values()
        r, i = c.routing, c.token_index
        tok = s.get("data", {}).get("case_token_text")
        tok_desc = f"token {i}" + (f" ({tok!r})" if tok else "")
        files.append(
            plot_mesh_routers(
                {sheet.title: (r["write_tok"][0], r["read_tok"][0])},
                sheet.path("mesh_routers_token"),
                title=sheet.heading(f"MeSH routers, sample 0 at {tok_desc}"),
            )
        )
    files.append(
        plot_state_composition(
            {k: c.routing["comp_seq"] for k, (c, _) in mesh.items()},
            sheet.path("state_composition"),
            title=sheet.heading("State composition (Eq. 7)"),
            single=single,
        )
    )
    if single:
        files.append(
            plot_state_composition(
                {sheet.title: r["comp_tok"][0]},
                sheet.path("state_composition_token"),
                title=f"State composition, sample 0 at {tok_desc}",
            )
        )
    return files
