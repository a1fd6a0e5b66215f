"""The sweep report's results tables (MeSH Tables 1-2): one row per grid point, aggregated over its seeds, and
the paired difference of every row to a baseline row.

Every value comes from what a trial left on disk (see ``load_trial``); a value a row lacks is ``None`` here
and shown as missing in the report, never filled in.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recursive_lightning import formatting as fmt
from recursive_lightning.config import load_run_config
from recursive_lightning.errors import ConfigError
from recursive_lightning.evaluation.downstream import headline
from recursive_lightning.files import read_json
from recursive_lightning.run_dir import RunDir, SweepDir
from recursive_lightning.sweep.spec import SEED_AXIS, row_name

TASK_METRIC = re.compile(r"^eval/(?P<task>[^/]+)/(?P<shots>\d+)shot/(?P<metric>[^/]+)$")
AVG_METRIC = re.compile(r"^eval/avg/(?P<shots>\d+)shot$")
NOT_TASKS = {"avg", "ppl", "bpb", "ppl_ctx", "ppl_ctx_last"}
MISSING = "—"
CONFIDENCE = 0.95  # of the paired differences' t-intervals
SWEEP_RESULT = RunDir.SWEEP_RESULT
DAMAGED = "damaged"  # a trial's metrics_source when its sweep_result.json is there but cannot be read


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


# --------------------------------------------------------------------------------------------- trials
def load_trial(
    run_dir: Path, row: dict[str, Any], spec: Any, describe_cache: dict[str, dict]
) -> dict[str, Any]:
    """Complete a finished trial's row (from the study) with what its directory holds.

    ``metrics``: ``trials/<point>/sweep_result.json`` (the sweep's record: training's final validation plus
    ``evaluate:``), else the study's copy; ``seconds`` / ``data_seconds`` / ``tokens`` / ``steps``: ``result.json`` (written by
    ``train``); ``describe``: parameters and FLOPs counted by ``model.describe.describe`` on the trial's
    ``config.yaml`` (else the sweep file's config of the point); ``mlflow_run_id`` from the record."""
    trial = SweepDir(run_dir).trial(str(row.get("key")))
    record = read_json(trial.sweep_result)
    result = read_json(trial.result) or {}
    out = dict(row)
    out["trial_dir"] = trial.path
    if record is not None and isinstance(record.get("metrics"), dict):
        # a value that is not a number (an edited or damaged file) is missing, as a value left out
        numbers = {
            k: float(v)
            for k, v in record["metrics"].items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        out["metrics"] = numbers
        out["metrics_source"] = SWEEP_RESULT
    else:  # a record that is there but cannot be read is damaged, not a trial trained elsewhere
        out["metrics_source"] = DAMAGED if trial.sweep_result.exists() else "optuna study"
    out["mlflow_run_id"] = (
        (record or {}).get("mlflow_run_id") or result.get("mlflow_run_id") or row.get("mlflow_run_id")
    )
    out["seconds"] = _finite(result.get("seconds"))
    out["data_seconds"] = _finite(result.get("data_seconds"))  # part of seconds: one-off data preparation
    out["tokens"] = _finite(result.get("tokens"))
    out["steps"] = _finite(result.get("steps"))
    cfg = _trial_config(trial, row, spec)
    out["config"] = cfg
    out["describe"] = _describe(cfg, describe_cache) if cfg is not None else None
    return out


def _trial_config(trial: RunDir, row: dict[str, Any], spec: Any):
    if trial.config.is_file():
        try:
            return load_run_config(trial.config)
        except ConfigError:
            pass
    try:
        return spec.trial_config(row["params"])
    except (ConfigError, KeyError, TypeError):
        return None


def _describe(cfg: Any, cache: dict[str, dict]) -> dict[str, Any] | None:
    from recursive_lightning.model.describe import describe  # heavy

    d = cfg.to_dict()
    key = json.dumps(
        [d["model"], cfg.data.seq_len, d["train"].get("loops")],
        sort_keys=True,
        default=str,
    )
    if key not in cache:
        try:
            cache[key] = describe(cfg.model, seq_len=cfg.data.seq_len)
            if cfg.train.loops is not None:  # sampled-loop training: its expected training FLOPs per token
                from recursive_lightning.training.loop_flops import expected_training_flops  # heavy

                cache[key].update(expected_training_flops(cfg.model, cfg.data.seq_len, cfg.train.loops))
        except Exception:  # a config the counter cannot build: the columns stay missing
            cache[key] = None
    return cache[key]


def tokens_per_step(trial: dict[str, Any]) -> float | None:
    """Tokens one optimizer step consumed: ``result.json``'s tokens over steps, else the config's
    batch × sequence × accumulation (one device)."""
    if trial.get("tokens") and trial.get("steps"):
        return trial["tokens"] / trial["steps"]
    cfg = trial.get("config")
    if cfg is None:
        return None
    return float(cfg.data.batch_size * cfg.data.seq_len * cfg.train.accumulate)


# --------------------------------------------------------------------------------------------- columns
@dataclass
class Column:
    key: str  # the per-trial value: a metric name, or one of the derived keys below
    title: str
    kind: str  # "count", "flops", "rate", "seconds", "ppl", "acc"
    paired: bool = False  # part of the paired-difference table


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
        return _finite(d.get("params_non_embedding"))
    if key == "flops_per_token":
        f, n = _finite(d.get("flops_forward")), d.get("seq_len")
        return f / n if f is not None and n else None
    if key == "tokens_per_sec":
        return _finite(trial.get("tokens_per_sec"))
    if key == "seconds":  # the train command's wall-clock less its data preparation (reported apart)
        s = _finite(trial.get("seconds"))
        return s - (_finite(trial.get("data_seconds")) or 0.0) if s is not None else None
    if key == "data_seconds":
        return _finite(trial.get("data_seconds"))
    v = _finite((trial.get("metrics") or {}).get(key))
    if v is not None and is_accuracy(key):
        return 100.0 * v  # accuracies in %, as the papers print them
    return v


def is_accuracy(key: str) -> bool:
    m = TASK_METRIC.match(key)
    return bool(AVG_METRIC.match(key) or (m and m["task"] not in NOT_TASKS))


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


# --------------------------------------------------------------------------------------------- statistics
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
    if d["lo"] > 0 or d["hi"] < 0:
        return f"**{text}** excludes 0"
    return f"{text} includes 0"
