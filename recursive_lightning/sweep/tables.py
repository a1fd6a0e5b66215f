"""The sweep report's results tables (MeSH Tables 1-2) as text: which columns they show (``columns``: the
headline metric of each downstream task) and each cell's format (``fmt_cell``: mean ± std over a row's seeds;
``fmt_difference``: a paired difference to the baseline row with its interval). The numbers come from
``results`` (a trial's record), ``rows`` (a grid point's trials) and ``statistics`` (means, paired intervals);
a value a row lacks is shown as missing, never filled in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from recursive_lightning import formatting as fmt
from recursive_lightning.evaluation.downstream import headline
from recursive_lightning.sweep.rows import AVG_METRIC, NOT_TASKS, TASK_METRIC
from recursive_lightning.sweep.statistics import excludes_zero, mean_std

MISSING = "—"


# --------------------------------------------------------------------------------------------- columns
@dataclass
class Column:
    key: str  # the per-trial value: a metric name, or one of the derived keys below
    title: str
    kind: str  # "count", "flops", "rate", "seconds", "ppl", "acc"
    paired: bool = False  # part of the paired-difference table


def headline_metrics(trials: Sequence[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """(task, shots) -> the metric key the papers report for it (``evaluation.downstream.headline``: acc_norm for
    PIQA, HellaSwag, ARC, SciQ; acc for LAMBADA, WinoGrande, cMMLU; else acc, acc_norm, exact_match)."""
    names: dict[tuple[str, str], dict[str, float]] = {}
    for t in trials:
        for k in t.get("metrics") or {}:
            m = TASK_METRIC.match(k)
            if m and m["task"] not in NOT_TASKS:
                names.setdefault((m["task"], m["shots"]), {})[m["metric"]] = 0.0
    out = {}
    for (task, shots), metrics in sorted(names.items(), key=lambda kv: (int(kv[0][1]), kv[0][0])):
        h = headline(task, {m: v for m, v in metrics.items() if "stderr" not in m})
        if h is not None:
            out[(task, shots)] = f"eval/{task}/{shots}shot/{h[0]}"
    return out


def columns(
    trials: Sequence[dict[str, Any]], ranked: str
) -> tuple[list[Column], dict[tuple[str, str], str], list[str]]:
    """(results-table columns, (task, shots) -> headline metric key, shot counts)."""
    keys = {k for t in trials for k in (t.get("metrics") or {})}
    ppl = [ranked] if ranked in keys else []
    ppl += sorted(k for k in keys if k.startswith("val/") and k.endswith("/ppl") and k != ranked)
    ppl += sorted(k for k in keys if k.startswith("eval/ppl/"))
    shots = sorted({m["shots"] for k in keys if (m := AVG_METRIC.match(k))}, key=int)
    heads = headline_metrics(trials)
    shots = sorted(set(shots) | {s for _, s in heads}, key=int)
    main = [
        Column("params_non_embedding", "params (non-emb.)", "count"),
        Column("flops_per_token", "fwd FLOPs/token", "flops"),
        Column("tokens_per_sec", "train tokens/s", "rate"),
        Column("seconds", "wall-clock (s)", "seconds"),
        Column("data_seconds", "data prep (s)", "seconds"),
        *(Column(k, k, "ppl", True) for k in ppl),
        *(Column(f"eval/avg/{s}shot", f"avg acc {s}-shot (%)", "acc", True) for s in shots),
    ]
    return main, heads, shots


# --------------------------------------------------------------------------------------------- formatting
def fmt_value(v: float, kind: str) -> str:
    """One format per quantity (``recursive_lightning.formatting``): FLOPs ``1.23 GFLOPs``, perplexity ``2060.50``
    or ``3.40e+09`` beyond its bound, accuracy as a percentage."""
    if kind == "count":
        return f"{v:,.0f}"
    if kind == "flops":
        return fmt.flops(v)
    if kind in ("rate", "seconds"):
        return f"{v:,.0f}"
    if kind == "ppl":
        return fmt.ppl(v)
    return f"{v:.2f}"


def fmt_cell(values: Sequence[float | None], kind: str) -> str:
    """mean ± std over the seeds that have the value; "(m/n seeds)" when some lack it; missing when none."""
    have = [v for v in values if v is not None]
    if not have:
        return MISSING
    m, s = mean_std(have)
    text = fmt_mean_std(m, s, lambda v: fmt_value(v, kind))
    if len(have) < len(values):
        text += f" ({len(have)}/{len(values)} seeds)"
    return text


def fmt_mean_std(mean: float, std: float, show: Callable[[float], str]) -> str:
    """``mean ± std`` in the quantity's one format ``show``; the mean alone where the std shows as zero (one
    seed, or seeds that agree to the digits shown): "5", never "5 ± 0"."""
    return show(mean) if show(std) == show(0.0) else f"{show(mean)} ± {show(std)}"


def fmt_signed(v: float, kind: str) -> str:
    text = fmt_value(abs(v), kind)
    if text == fmt_value(0.0, kind):  # no "−0.00" for a difference that rounds to zero
        return text
    return ("+" if v > 0 else "−") + text


def fmt_difference(d: dict[str, Any] | None, kind: str) -> str:
    if d is None:
        return MISSING
    text = fmt_signed(d["mean"], kind)
    if d["lo"] is None:
        return text + " (1 pair, no interval)"
    text = f"{text} [{fmt_signed(d['lo'], kind)}, {fmt_signed(d['hi'], kind)}]"
    if excludes_zero(d):
        return f"**{text}** excludes 0"
    return f"{text} includes 0"
