"""The report's perplexity-by-context-length section: each grid point's ``eval/ppl_ctx/<L>`` (the sweep's
``evaluate: context_lengths``), mean over its seeds, as a table and one figure; with a baseline row, each row's
paired difference to it at every length and the change of that difference from the shortest to the longest
length (the long-context direction of Mela Fig. 4: a gap that widens as the context grows beyond the training
length), with the same t-intervals as the report's paired table (``statistics.paired_difference``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recursive_lightning import formatting as fmt
from recursive_lightning.config import DataConfig
from recursive_lightning.sweep import tables
from recursive_lightning.sweep.rows import Row
from recursive_lightning.sweep.statistics import paired_difference

CTX_PREFIX = "eval/ppl_ctx/"


def lengths_of(metrics: dict[str, float]) -> dict[int, float]:
    """{context length: perplexity} of one trial's metrics."""
    return {
        int(k[len(CTX_PREFIX) :]): v
        for k, v in metrics.items()
        if k.startswith(CTX_PREFIX) and k[len(CTX_PREFIX) :].isdigit()
    }


def growth(shortest: int, longest: int):
    """A trial's perplexity at ``longest`` less its perplexity at ``shortest`` (None when either is missing)."""

    def value(trial: dict[str, Any]) -> float | None:
        ppl = lengths_of(trial.get("metrics") or {})
        return ppl[longest] - ppl[shortest] if shortest in ppl and longest in ppl else None

    return value


def paired_lines(rows: Sequence[Row], baseline: str, lengths: list[int]) -> list[str]:
    """The paired table: row − baseline at each length, then the growth column (row's ppl(L_max) − ppl(L_min)
    less the baseline's). Empty when the baseline has no trial with these metrics."""
    base = next((r for r in rows if r.name == baseline), None)
    if base is None or not lengths:
        return []
    lo, hi = lengths[0], lengths[-1]
    head = ["row", "pairs", *map(str, lengths)] + ([f"change {lo} → {hi}"] if hi > lo else [])
    lines = [
        f"Row − `{baseline}` on the same seed at each length, mean over the seed pairs [95 % t-interval], "
        "saying whether it excludes 0"
        + (
            f"; **change {lo} → {hi}**: the row's ppl({hi}) − ppl({lo}) less the baseline's, positive when the "
            "gap to the baseline widens as the context grows."
            if hi > lo
            else "."
        ),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        if r is base:
            continue
        diffs = [paired_difference(r, base, f"{CTX_PREFIX}{L}") for L in lengths]
        if hi > lo:
            diffs.append(paired_difference(r, base, growth(lo, hi)))
        n = max((d["n"] for d in diffs if d), default=0)
        lines.append(
            "| " + " | ".join([r.name, str(n), *(tables.fmt_difference(d, "ppl") for d in diffs)]) + " |"
        )
    return [*lines, ""]


def section(
    trials: list[dict],
    axes: list[str],
    spec,
    out: Path,
    rows: Sequence[Row] = (),
    baseline: str | None = None,
) -> tuple[Path | None, list[str]]:
    """(the figure, the markdown lines) of the section; (None, []) when no trial has ``eval/ppl_ctx/<L>``."""
    series: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for t in trials:
        label = ", ".join(str(t["params"].get(a)) for a in axes if a in t["params"]) or str(t["key"])
        for length, v in lengths_of(t["metrics"]).items():
            series[label][length].append(v)
    if not series:
        return None, []
    means = {label: {L: sum(v) / len(v) for L, v in pts.items()} for label, pts in series.items()}
    lengths = sorted({L for pts in means.values() for L in pts})
    train_len = (spec.base.get("data") or {}).get("seq_len", DataConfig.seq_len)
    from recursive_lightning.evaluation.context_plot import plot_ppl_by_context  # heavy

    png = plot_ppl_by_context(
        means,
        out / "report_ppl_by_context.png",
        train_length=train_len,
        title=f"{spec.name}: perplexity by context length",
    )
    lines = [
        "## Perplexity by context length",
        "",
        f"`eval/ppl_ctx/<L>` of each trial, mean over seeds; trained at {train_len} tokens.",
        "",
        "| " + " | ".join([" / ".join(axes) or "trial", *map(str, lengths)]) + " |",
        "|" + "---|" * (1 + len(lengths)),
    ]
    for label, pts in means.items():
        lines.append(
            "| " + " | ".join([label, *(fmt.ppl(pts[L]) if L in pts else "" for L in lengths)]) + " |"
        )
    lines.append("")
    if baseline is not None:
        lines += paired_lines(rows, baseline, lengths)
    return png, [*lines, f"![perplexity by context length]({png.name})", ""]
