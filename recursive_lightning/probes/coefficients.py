"""Static/dynamic combination coefficients per loop step (MeSH App. E.3): summary and figure."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
import numpy as np

from recursive_lightning.probes.figures import (
    STYLE,
    Sheet,
    draw_heatmap,
    mean_std,
    new_fig,
    save,
    state_label,
)

if TYPE_CHECKING:
    from recursive_lightning.probes.captured import Capture

COEFFICIENT_TERMS = ("core", "residual", "anchor", "anchor_emb")  # order of Combination.INIT


def summarize(cap: Capture, meta: dict[str, Any]) -> dict[str, Any]:
    if cap.coefficients is None:
        return {"coefficients": None}
    m, s = mean_std(cap.coefficients)
    return {
        "coefficients": {
            "terms": list(COEFFICIENT_TERMS),
            "states": [f"h({t + 1})" for t in range(m.shape[0])],
            "mean": m,
            "std": s,
        }
    }


def plot_coefficients(models: Mapping[str, dict[str, Any]], path: Path, title: str | None = None) -> Path:
    """Heatmap(s) of the static/dynamic combination coefficients (state x term), ``{model: summary
    ["coefficients"]}``; one model gets ``title`` on its panel, several their names and ``title`` above."""
    mats = {k: np.asarray(v["mean"], dtype=float) for k, v in models.items()}
    m = len(mats)
    nr = max(a.shape[0] for a in mats.values())
    with matplotlib.rc_context(STYLE):
        fig, axes = new_fig(1, m, (m * 4.2, 0.45 * nr + 1.8))
        for i, (name, mat) in enumerate(mats.items()):
            vmax = float(np.nanmax(np.abs(mat))) if mat.size else 1.0
            rows = [state_label(s) for s in models[name]["states"]]
            im = draw_heatmap(
                axes[0, i],
                mat,
                rows,
                list(COEFFICIENT_TERMS),
                cmap="RdBu_r",
                vmin=-vmax,
                vmax=vmax,
                annotate=True,
            )
            fig.colorbar(im, ax=axes[0, i], fraction=0.046, pad=0.04)
            axes[0, i].set_title(name if m > 1 else (title or "Combination coefficients"))
            axes[0, i].set_xlabel("term")
        if m > 1 and title:
            fig.suptitle(title)
        return save(fig, path)


def draw(results: Mapping[str, tuple[Capture, dict[str, Any]]], sheet: Sheet) -> list[Path]:
    coef = {k: s["coefficients"] for k, (_, s) in results.items() if s.get("coefficients")}
    if not coef:
        return []
    title = sheet.heading("Coefficients", "Combination coefficients")
    return [plot_coefficients(coef, sheet.path("coefficients"), title=title)]
