"""Which grid point wins per FLOP and per second: the report's ranking metric against training compute and
against wall-clock, one point per grid point, mean ± std over its seeds on both axes (error bars).

Training FLOPs of a trial = 3 × forward FLOPs per token × training tokens: the backward pass costs twice the
forward (Kaplan et al. 2020's C ≈ 6N per token, with the forward's 2N counted by ``model.describe.describe``,
attention included); the tokens are ``result.json``'s. Wall-clock is ``result.json``'s ``seconds`` less its
``data_seconds`` (one-off data preparation, in the report's results table apart).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from recursive_lightning import formatting as fmt
from recursive_lightning.files import atomic_write_figure
from recursive_lightning.sweep import tables
from recursive_lightning.sweep.rows import Row, trial_value
from recursive_lightning.sweep.statistics import mean_std
from recursive_lightning.tracking.view import RUN_TOKENS_PER_SEC

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


def training_flops_per_token(trial: dict[str, Any]) -> float | None:
    """``training_flops`` per training token (the factor of the learning curves' FLOPs axis)."""
    flops, tokens = training_flops(trial), trial.get("tokens")
    return flops / tokens if flops and tokens else None


def trial_metrics(trial: dict[str, Any]) -> dict[str, float]:
    """What the report logs on a trial's run so that MLflow's table shows the report's number: its training
    tokens/s (``tracking.view.RUN_TOKENS_PER_SEC``, the report's ``train tokens/s``)."""
    tps = trial_value(trial, "tokens_per_sec")
    return {RUN_TOKENS_PER_SEC: tps} if tps is not None else {}


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
        (axes[1], "seconds", "wall-clock (s, the trial's train command less its data preparation)"),
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
        _readable_axis(ax, xs_all, key)
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


NARROW = 0.01  # rows whose mean cost differs by less than this fraction: the axis starts at zero


def narrow(pts: Sequence[dict[str, Any]], key: str) -> bool:
    """Whether the rows' mean ``key`` (flops, seconds) differ by under ``NARROW`` of the largest: a figure
    would stretch that range over its width, so its axis starts at zero and the table carries the values."""
    xs = [p[key][0] for p in pts if p.get(key)]
    return len(xs) > 1 and max(xs) > 0 and (max(xs) - min(xs)) / max(xs) < NARROW


def _readable_axis(ax: Any, xs: Sequence[float], key: str) -> None:
    """Tick labels in the quantity's own format (FLOPs with an SI prefix, seconds to four digits; no offset or
    exponent label above the axis), at most four; a sub-percent range drawn from zero (:func:`narrow`)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator  # heavy

    show = (
        fmt.flops if key == "flops" else (lambda v: f"{v:,.4g}")
    )  # seconds: ticks closer than a second apart
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: show(v) if v else "0"))
    if ax.get_xscale() == "linear":
        ax.xaxis.set_major_locator(MaxNLocator(4))
    if narrow([{key: (x, 0.0)} for x in xs], key):
        ax.set_xlim(0, 1.15 * max(xs))


def _whole(x: float) -> str:
    return f"{x:,.0f}"  # wall-clock: whole seconds


def section(png: Path | None, pts: Sequence[dict[str, Any]], metric: str) -> list[str]:
    """The report's markdown for the figure, with its numbers as a table."""
    if png is None:
        return []

    def cell(v: tuple[float, float] | None, show: Callable[[float], str]) -> str:
        """mean ± std in the quantity's one format (``recursive_lightning.formatting``); no ± 0."""
        return tables.MISSING if v is None else tables.fmt_mean_std(*v, show)

    close = narrow(pts, "flops")  # three digits would print one number: each row's excess over the least too
    lines = [
        "## Cost: per FLOP and per second",
        "",
        f"`{metric}` against training compute (3 × forward FLOPs/token × training tokens) and against the "
        "trial's wall-clock, one point per grid point, mean ± std over its seeds on both axes.",
        "",
        f"| row | seeds | training FLOPs |{' vs the least |' if close else ''} wall-clock (s) | {metric} |",
        "|---|---|---|" + ("---|" if close else "") + "---|---|",
    ]
    least = min((p["flops"][0] for p in pts if p["flops"]), default=None)
    for p in pts:
        rel = f" {100 * (p['flops'][0] / least - 1):+.2f} % |" if p["flops"] else f" {tables.MISSING} |"
        lines.append(
            f"| {p['row']} | {p['n']} | {cell(p['flops'], fmt.flops)} |{rel if close else ''} "
            f"{cell(p['seconds'], _whole)} | {cell(p['metric'], lambda x: fmt.metric(metric, x))} |"
        )
    said = [
        f"the rows' mean {what} differ by under {NARROW:.0%}: the figure draws that axis from zero, the table "
        "gives the values"
        for key, what in (("flops", "training FLOPs"), ("seconds", "wall-clock"))
        if narrow(pts, key)
    ]
    text = "; ".join(said)
    notes = ["", text[:1].upper() + text[1:] + "."] if said else []
    return [*lines, *notes, "", f"![{metric} against training FLOPs and wall-clock]({png.name})", ""]
