"""The report's rows: one row per grid point, its finished trials over the seeds (``build_rows``), and a trial's
value of a report column (``trial_value``: a metric, or a count derived from what the trial left on disk).

A value a trial lacks is ``None`` here and shown as missing in the report, never filled in.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from recursive_lightning.sweep.spec import SEED_AXIS, row_name

TASK_METRIC = re.compile(r"^eval/(?P<task>[^/]+)/(?P<shots>\d+)shot/(?P<metric>[^/]+)$")
AVG_METRIC = re.compile(r"^eval/avg/(?P<shots>\d+)shot$")
NOT_TASKS = {"avg", "ppl", "bpb", "ppl_ctx", "ppl_ctx_last"}


def finite(v: Any) -> float | None:
    """``v`` as a float when it is a finite number (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


@dataclass
class Row:
    name: str
    params: dict[str, Any]
    trials: list[dict[str, Any]] = field(default_factory=list)

    def values(self, key: str) -> list[float | None]:
        return [trial_value(t, key) for t in self.trials]


def trial_value(trial: dict[str, Any], key: str) -> float | None:
    d = trial.get("describe") or {}
    if key == "params_non_embedding":
        return finite(d.get("params_non_embedding"))
    if key == "flops_per_token":
        f, n = finite(d.get("flops_forward")), d.get("seq_len")
        return f / n if f is not None and n else None
    if key == "tokens_per_sec":
        return finite(trial.get("tokens_per_sec"))
    if key == "seconds":  # the train command's wall-clock less its data preparation (reported apart)
        s = finite(trial.get("seconds"))
        return s - (finite(trial.get("data_seconds")) or 0.0) if s is not None else None
    if key == "data_seconds":
        return finite(trial.get("data_seconds"))
    v = finite((trial.get("metrics") or {}).get(key))
    if v is not None and is_accuracy(key):
        return 100.0 * v  # accuracies in %, as the papers print them
    return v


def is_accuracy(key: str) -> bool:
    m = TASK_METRIC.match(key)
    return bool(AVG_METRIC.match(key) or (m and m["task"] not in NOT_TASKS))


def tokens_per_step(trial: dict[str, Any]) -> float | None:
    """Tokens one optimizer step consumed: ``result.json``'s tokens over steps, else the config's
    batch × sequence × accumulation (one device)."""
    if trial.get("tokens") and trial.get("steps"):
        return trial["tokens"] / trial["steps"]
    cfg = trial.get("config")
    if cfg is None:
        return None
    return float(cfg.data.batch_size * cfg.data.seq_len * cfg.train.accumulate)


def build_rows(trials: Sequence[dict[str, Any]], axes: Sequence[str], order: Sequence[str] = ()) -> list[Row]:
    """Trials grouped by their axes other than the seed; rows in ``order`` first (the grid's), then as seen."""
    rows: dict[str, Row] = {}
    for t in trials:
        params = {k: v for k, v in t["params"].items() if k != SEED_AXIS}
        name = row_name(params, list(axes)) or "all"
        rows.setdefault(name, Row(name, params)).trials.append(t)
    for r in rows.values():
        r.trials.sort(key=lambda t: str(t["params"].get(SEED_AXIS)))
    rank = {n: i for i, n in enumerate(order)}
    return sorted(rows.values(), key=lambda r: rank.get(r.name, len(rank)))
