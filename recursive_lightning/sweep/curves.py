"""Learning curves of a sweep: training loss and validation perplexity against tokens seen, one line per report
row, the seeds of a row as a band.

The per-step history is read back from each trial's MLflow child run (``get_metric_history`` of the sweep's
tracking store, the SQLite ``mlflow.db`` inside the sweep directory): what the trial logged while it trained,
not a copy kept elsewhere. A step logged twice (steps trained again after a resume) counts once, with its
last value.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from recursive_lightning.files import atomic_write_figure
from recursive_lightning.tracking.runs import client

VAL_PPL = re.compile(r"^val/([^/]+)/ppl$")


def metric_history(
    tracking_uri: str, run_id: str, keys: Sequence[str] | None = None
) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} of one MLflow run: ``keys`` (default ``train/loss``, ``train/tokens_per_sec``
    and every ``val/<set>/ppl`` the run has). A step logged more than once keeps its latest value."""
    c = client(tracking_uri)
    if keys is None:
        have = c.get_run(run_id).data.metrics
        keys = ["train/loss", "train/tokens_per_sec", *sorted(k for k in have if VAL_PPL.match(k))]
    out: dict[str, dict[int, float]] = {}
    for key in keys:
        points = sorted(c.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
        series = {int(m.step): float(m.value) for m in points}  # the latest of a repeated step wins
        if series:
            out[key] = series
    return out


def training_tokens_per_sec(history: Mapping[str, Mapping[int, float]]) -> float | None:
    """Training throughput of a run: the harmonic mean of its per-step ``train/tokens_per_sec``, i.e. the
    tokens of those steps over their summed step time (every step has the same tokens). Validation and
    checkpointing are not inside any step's time; the step right after each of them (timed from its own start,
    its backward's wait included or not) weighs as one step of many."""
    values = [v for v in history.get("train/tokens_per_sec", {}).values() if math.isfinite(v) and v > 0]
    if not values:
        return None
    return len(values) / sum(1.0 / v for v in values)


def _running_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def against_tokens(entry: Mapping[str, Any], key: str) -> dict[float, float]:
    """{tokens seen: value} of one run's metric ``key``. ``entry``: ``{"history": {metric: {step: value}},
    "tokens_per_step": float, "steps": the run's optimizer steps}``.

    A training step s logs the loss of batch s: s + 1 steps' tokens. Lightning logs a validation inside fit
    at step G - 1 after G optimizer steps, and one run after fit (train's final validation when max_steps is
    not a multiple of val_every) at G = max_steps: min(step + 1, steps) steps' tokens."""
    series = entry["history"].get(key, {})
    tps, total = float(entry["tokens_per_step"]), int(entry.get("steps") or 0)
    cap = total if key.startswith("val/") and total else None
    return {(min(s + 1, cap) if cap else s + 1) * tps: v for s, v in sorted(series.items())}


def against_flops(entry: Mapping[str, Any], key: str) -> dict[float, float]:
    """{training FLOPs so far: value} of one run's metric ``key``: ``against_tokens`` scaled by the entry's
    ``flops_per_token`` (training FLOPs per token, ``sweep.cost.training_flops_per_token``)."""
    per_token = float(entry["flops_per_token"])
    return {n * per_token: v for n, v in against_tokens(entry, key).items()}


def _band(per_seed: list[dict[float, float]]) -> tuple[list[float], list[float], list[float], list[float]]:
    """x, mean, min, max over the seeds that logged each x."""
    steps = sorted({s for series in per_seed for s in series})
    mean, lo, hi = [], [], []
    for s in steps:
        vals = [series[s] for series in per_seed if s in series and math.isfinite(series[s])]
        if not vals:
            vals = [math.nan]
        mean.append(sum(vals) / len(vals))
        lo.append(min(vals))
        hi.append(max(vals))
    return steps, mean, lo, hi


def _tokens_formatter():
    from matplotlib.ticker import FuncFormatter  # heavy

    def fmt(v: float, _: Any) -> str:
        for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
            if abs(v) >= scale:
                return f"{v / scale:.4g}{suffix}"
        return f"{v:.4g}"

    return FuncFormatter(fmt)


def plot_learning_curves(
    rows: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str | os.PathLike,
    title: str = "learning curves",
) -> Path | None:
    """One PNG: training loss and validation perplexity (log scale) against tokens seen and, when the entries
    carry ``flops_per_token`` (training FLOPs per token, ``sweep.cost``), validation perplexity against training
    FLOPs in a third panel (rows of different compute per token side by side, SpiralFormer Fig. 2 left).

    ``rows``: row name -> one entry per seed (see ``against_tokens``). A row's line is the mean over its seeds,
    its band the min-max over them; training loss is a trailing running mean of each seed's per-step loss
    (window in the panel title) before that. Returns None when no row has any history. Written atomically (a
    temporary file renamed over ``path``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # heavy
    from matplotlib.figure import Figure  # heavy

    n_steps = max(
        (len(e["history"].get("train/loss", {})) for seeds in rows.values() for e in seeds), default=0
    )
    sets = sorted(
        {
            m.group(1)
            for seeds in rows.values()
            for e in seeds
            for k in e["history"]
            if (m := VAL_PPL.match(k))
        }
    )
    if n_steps == 0 and not sets:
        return None
    window = max(1, round(n_steps / 25))
    with_flops = any(e.get("flops_per_token") for seeds in rows.values() for e in seeds)
    panels = 3 if with_flops else 2
    fig = Figure(figsize=(6.0 * panels, 4.4))
    FigureCanvasAgg(fig)
    ax_loss, ax_ppl = fig.add_subplot(1, panels, 1), fig.add_subplot(1, panels, 2)
    ax_flops = fig.add_subplot(1, panels, 3) if with_flops else None
    late: list[float] = []  # training-loss values after the first 10 % of steps
    ppl_values: list[float] = []
    for color, (label, seeds) in zip([f"C{i % 10}" for i in range(len(rows))], rows.items()):
        late += _draw_training_loss(ax_loss, label, seeds, color, window)
        ppl_values += _draw_val_ppl(ax_ppl, ax_flops, label, seeds, color, sets)
    _label_loss_panel(ax_loss, late, window)
    _label_ppl_panels(ax_ppl, ax_flops, sets, ppl_values)
    for ax, xlabel in ((ax_loss, "tokens seen"), (ax_ppl, "tokens seen"), (ax_flops, "training FLOPs")):
        if ax is None:
            continue
        ax.set_xlabel(xlabel)
        ax.xaxis.set_major_formatter(_tokens_formatter())
        ax.grid(True, alpha=0.3, ls="--")
    max_seeds = max((len(s) for s in rows.values()), default=0)
    band = "lines: mean over seeds, bands: min-max over seeds" if max_seeds > 1 else "one seed per row"
    _title_and_legend(fig, ax_loss, ax_ppl, f"{title} ({band})", panels)
    return atomic_write_figure(fig, path, dpi=130)


def _draw_training_loss(
    ax: Any, label: str, seeds: Sequence[Mapping[str, Any]], color: str, window: int
) -> list[float]:
    """A row's training loss (each seed's running mean over ``window`` steps; mean line, min-max band); returns
    its values after the first 10 % of tokens, which set the panel's y range."""
    per_seed = []
    for e in seeds:
        series = against_tokens(e, "train/loss")
        xs = sorted(series)
        per_seed.append(dict(zip(xs, _running_mean([series[x] for x in xs], window))))
    x, mean, lo, hi = _band(per_seed)
    if not x:
        return []
    start = max(1, len(x) // 10)
    ax.plot(x, mean, color=color, lw=1.5, label=f"{label} (n={len(seeds)})")
    if len(seeds) > 1:
        ax.fill_between(x, lo, hi, color=color, alpha=0.2, lw=0)
    return [v for v in lo[start:] + hi[start:] if math.isfinite(v)]


def _draw_val_ppl(
    ax_ppl: Any, ax_flops: Any, label: str, seeds: Sequence[Mapping[str, Any]], color: str, sets: list[str]
) -> list[float]:
    """A row's validation perplexity on each set (one line style per set) against tokens and, with ``ax_flops``,
    against training FLOPs; returns the plotted values (the panels' log range)."""
    values: list[float] = []
    for style, name in zip(["-", "--", ":", "-."] * 4, sets):
        by_tokens = [against_tokens(e, f"val/{name}/ppl") for e in seeds]
        x, mean, lo, hi = _band(by_tokens)
        if not x:
            continue
        values += [v for v in lo + hi if math.isfinite(v) and v > 0]
        tag = label if len(sets) == 1 else f"{label}, {name}"
        by_flops = [against_flops(e, f"val/{name}/ppl") for e in seeds if e.get("flops_per_token")]
        for ax, per_seed in ((ax_ppl, by_tokens), (ax_flops, by_flops)):
            x, mean, lo, hi = _band(per_seed) if ax is not None else ([], [], [], [])
            if not x:
                continue
            ax.plot(x, mean, color=color, ls=style, lw=1.5, marker="o", ms=3.5, label=tag)
            if len(per_seed) > 1:
                ax.fill_between(x, lo, hi, color=color, alpha=0.2, lw=0)
    return values


def _label_loss_panel(ax: Any, late: list[float], window: int) -> None:
    """The training-loss panel's y range from 10 % of tokens on (the drop from ln V would flatten the
    differences between rows) and its titles."""
    if late:
        lo, hi = min(late), max(late)
        pad = 0.08 * (hi - lo or abs(hi) or 1.0)
        ax.set_ylim(lo - pad, hi + pad)
    smooth = f"running mean over {window} steps, " if window > 1 else ""
    ax.set_title(f"training loss ({smooth}y axis from 10 % of tokens)", fontsize=9)
    ax.set_ylabel("training loss (nats/token)")


def _label_ppl_panels(ax_ppl: Any, ax_flops: Any, sets: list[str], values: list[float]) -> None:
    """The perplexity panels' log scale (minor ticks labelled within a decade) and titles."""
    from matplotlib.ticker import FuncFormatter, NullFormatter  # heavy

    which = f"val/{sets[0]}/ppl" if len(sets) == 1 else "val/<set>/ppl"
    plain = FuncFormatter(lambda v, _: f"{v:.4g}")
    lo, hi = (min(values), max(values)) if values else (1.0, 1.0)
    for ax, against in ((ax_ppl, "tokens"), (ax_flops, "training FLOPs")):
        if ax is None:
            continue
        ax.set_title(f"validation perplexity {which} against {against} (log scale)", fontsize=9)
        ax.set_ylabel("perplexity")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain if hi / lo < 10 else NullFormatter())


def _title_and_legend(fig: Any, ax_loss: Any, ax_ppl: Any, title: str, panels: int) -> None:
    """The figure's title and one legend to the right of the panels (the loss panel's rows, else the
    perplexity panel's)."""
    handles, labels = ax_loss.get_legend_handles_labels()
    if not handles:
        handles, labels = ax_ppl.get_legend_handles_labels()
    fig.suptitle(title, fontsize=10)
    if handles:
        fig.legend(
            handles,
            labels,
            loc="center left",
            bbox_to_anchor=(1 - 0.17 * 2 / panels, 0.5),
            fontsize=8,
            frameon=False,
        )
    fig.tight_layout(rect=(0, 0, 1 - 0.18 * 2 / panels, 1))
