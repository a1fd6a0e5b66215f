"""The report's statistics over seeds: mean and sample standard deviation (``mean_std``), and each row's paired
difference to a baseline row on the same seeds with its two-sided Student-t interval (``paired_difference``,
``paired_differences``) and whether that interval excludes zero (``excludes_zero``). The report's tables,
its ranking's verdicts and its context-length section all read them here."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from recursive_lightning.sweep.rows import Row, trial_value
from recursive_lightning.sweep.spec import SEED_AXIS

CONFIDENCE = 0.95  # of the paired differences' t-intervals


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    s = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return m, s


def paired_difference(
    row: Row, base: Row, key: str | Callable[[dict[str, Any]], float | None], confidence: float = CONFIDENCE
) -> dict[str, Any] | None:
    """The difference row - baseline of ``key`` (a ``trial_value`` key, or a function of a trial) over the
    seeds both rows finished (same seed, one pair each): its mean and the two-sided Student-t interval
    mean ± t_{(1+c)/2, n-1} · sd / √n (None for n = 1)."""
    from scipy import stats  # heavy

    value = key if callable(key) else (lambda t: trial_value(t, key))
    mine = {t["params"].get(SEED_AXIS): value(t) for t in row.trials}
    theirs = {t["params"].get(SEED_AXIS): value(t) for t in base.trials}
    seeds = sorted(
        (s for s in mine.keys() & theirs.keys() if mine[s] is not None and theirs[s] is not None), key=str
    )
    if not seeds:
        return None
    d = [mine[s] - theirs[s] for s in seeds]
    m, sd = mean_std(d)
    out = {"n": len(d), "mean": m, "sd": sd, "seeds": seeds, "differences": d, "lo": None, "hi": None}
    if len(d) > 1:
        half = float(stats.t.ppf((1 + confidence) / 2, len(d) - 1)) * sd / math.sqrt(len(d))
        out["lo"], out["hi"] = m - half, m + half
    return out


def excludes_zero(d: Mapping[str, Any]) -> bool:
    """Whether a paired difference's interval excludes zero: the rows are told apart (False without an
    interval)."""
    return d["lo"] is not None and (d["lo"] > 0 or d["hi"] < 0)


def paired_differences(rows: list, base: Any, columns: list) -> dict[str, dict[str, Any]]:
    """Every row's paired difference (same seed) to the ``base`` row in each of ``columns``."""
    return {
        r.name: {c.key: paired_difference(r, base, c.key) for c in columns} for r in rows if r is not base
    }
