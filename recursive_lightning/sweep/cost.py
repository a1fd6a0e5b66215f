"""Which grid point wins per FLOP and per second: the report's ranking metric against training compute and
against wall-clock, one point per grid point, mean ± std over its seeds on both axes (error bars).

Training FLOPs of a trial = 3 × forward FLOPs per token × training tokens: the backward pass costs twice the
forward (Kaplan et al. 2020's C ≈ 6N per token, with the forward's 2N counted by ``model.describe.describe``,
attention included); the tokens are ``result.json``'s. Wall-clock is ``result.json``'s ``seconds``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from recursive_lightning import formatting as fmt
from recursive_lightning.files import atomic_write_figure
from recursive_lightning.sweep.tables import Row, mean_std, trial_value

BACKWARD_FACTOR = 3.0  # forward + backward ≈ 3 forwards


def training_flops(trial: dict[str, Any]) -> float | None:
    """3 × forward FLOPs/token × tokens; with sampled loop steps (``train.loops``) the expected training FLOPs
    per token over the distribution (``training/loop_flops.py``: forward at the sampled depth, backward over the
    differentiated part) × tokens."""
    tokens = trial.get("tokens")
    sampled = (trial.get("describe") or {}).get("flops_train_per_token_expected")
    if sampled and tokens:
        return float(sampled) * tokens
    per_token = trial_value(trial, "flops_per_token")
    return BACKWARD_FACTOR * per_token * tokens if per_token and tokens else None


def points(rows: Sequence[Row], metric: str) -> list[dict[str, Any]]:
    """Per row: mean ± std over its seeds of training FLOPs, wall-clock seconds and ``metric`` (rows with
    the metric; an axis a row lacks is None)."""
    out = []
    for r in rows:
        ys = [v for t in r.trials if (v := trial_value(t, metric)) is not None]
        if not ys:
            continue
        p: dict[str, Any] = {"row": r.name, "n": len(ys), "metric": mean_std(ys)}
        for key, fn in (("flops", training_flops), ("seconds", lambda t: trial_value(t, "seconds"))):
            xs = [v for t in r.trials if (v := fn(t)) is not None]
            p[key] = mean_std(xs) if xs else None
        out.append(p)
    return out


def plot(
    rows: Sequence[Row], metric: str, path: Path, title: str
) -> tuple[Path | None, list[dict[str, Any]]]:
    """The two panels as one PNG (None when no row has the metric and a cost)."""
    pts = points(rows, metric)
    if not any(p["flops"] or p["seconds"] for p in pts):
        return None, pts
    import matplotlib  # heavy

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    best = min(pts, key=lambda p: p["metric"][0])["row"]
    colors = plt.get_cmap("tab10")
    for ax, key, label in (
        (axes[0], "flops", "training FLOPs (3 × forward FLOPs/token × tokens; sampled loops: expected)"),
        (axes[1], "seconds", "wall-clock (s, the trial's train command)"),
    ):
        shown = [p for p in pts if p[key]]
        for i, p in enumerate(shown):
            (x, xs), (y, ys) = p[key], p["metric"]
            ax.errorbar(
                x,
                y,
                xerr=xs,
                yerr=ys,
                marker="*" if p["row"] == best else "o",
                markersize=9,
                capsize=3,
                color=colors(i % 10),
                label=p["row"],
            )
            ax.annotate(p["row"], (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        xs_all = [p[key][0] for p in shown]
        if xs_all and min(xs_all) > 0 and max(xs_all) / min(xs_all) > 10:
            ax.set_xscale("log")
        ax.set_xlabel(label, fontsize=9)
        ax.set_ylabel(f"{metric} (lower is better)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_title("per FLOP", fontsize=9)
    axes[1].set_title("per second", fontsize=9)
    fig.suptitle(f"{title}: mean ± std over seeds (error bars on both axes); ★ best row", fontsize=10)
    fig.tight_layout()
    atomic_write_figure(fig, path, dpi=110)
    plt.close(fig)
    return path, pts


def _whole(x: float) -> str:
    return f"{x:,.0f}"  # wall-clock: whole seconds


def section(png: Path | None, pts: Sequence[dict[str, Any]], metric: str) -> list[str]:
    """The report's markdown for the figure, with its numbers as a table."""
    if png is None:
        return []

    def cell(v: tuple[float, float] | None, show: Callable[[float], str]) -> str:
        """mean ± std in the quantity's one format (``recursive_lightning.formatting``); no ± 0."""
        if v is None:
            return "—"
        mean, std = v
        return show(mean) if show(std) == show(0.0) else f"{show(mean)} ± {show(std)}"

    lines = [
        "## Cost: per FLOP and per second",
        "",
        f"`{metric}` against training compute (3 × forward FLOPs/token × training tokens) and against the "
        "trial's wall-clock, one point per grid point, mean ± std over its seeds on both axes.",
        "",
        f"| row | seeds | training FLOPs | wall-clock (s) | {metric} |",
        "|---|---|---|---|---|",
    ]
    for p in pts:
        lines.append(
            f"| {p['row']} | {p['n']} | {cell(p['flops'], fmt.flops)} | {cell(p['seconds'], _whole)} | "
            f"{cell(p['metric'], lambda x: fmt.metric(metric, x))} |"
        )
    return [*lines, "", f"![{metric} against training FLOPs and wall-clock]({png.name})", ""]
