"""A sweep's results as numbers, before any markdown: the study's trials (``collect``), what their directories
and MLflow child runs hold (``load_trials``), the per-axis aggregates (``axis_table``) and the paired
differences of every row to a baseline row (``paired_differences``)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from recursive_lightning.progress import tracked  # a bar on a terminal, a line every 30 s in a log
from recursive_lightning.sweep import curves, tables
from recursive_lightning.sweep.tables import mean_std
from recursive_lightning.uris import mask_url


def _ppl_columns(rows: list[dict]) -> list[str]:
    cols = sorted({k for r in rows for k in r["metrics"] if k.endswith("/ppl") or k.startswith("eval/")})
    return [c for c in cols if not c.startswith("final/")]


def collect(storage_url: str, study_name: str) -> tuple[list[dict], list[dict], dict]:
    import optuna  # heavy
    from optuna.trial import TrialState  # heavy

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=study_name, storage=storage_url)
    done, failed = [], []
    for t in study.get_trials(deepcopy=False):
        row = {
            "number": t.number,
            # a grid trial's point is its fixed parameters (study.grid_point); a search trial's, its params
            "params": dict(t.params)
            or dict(t.user_attrs.get("point") or t.system_attrs.get("fixed_params") or {}),
            "metrics": dict(t.user_attrs.get("metrics", {})),
            "value": t.value,
            "state": t.state.name,
            "key": t.user_attrs.get("point_key"),
            "mlflow_run_id": t.user_attrs.get("mlflow_run_id"),
            "error": t.user_attrs.get("error"),
        }
        if t.state == TrialState.COMPLETE:
            done.append(row)
        elif t.state == TrialState.FAIL:
            failed.append(row)
    # a failed attempt that was retried successfully is not a failure of the sweep
    ok_keys = {r["key"] for r in done}
    failed = [r for r in failed if r["key"] not in ok_keys]
    attrs = dict(study.user_attrs)
    attrs["_unfinished"] = sum(
        t.state in (TrialState.WAITING, TrialState.RUNNING) for t in study.get_trials(deepcopy=False)
    )
    return done, failed, attrs


def axis_table(
    rows: list[dict], axis: str, metric: str
) -> tuple[list[tuple[Any, float, float, int, dict]], Any]:
    groups: dict[Any, list[dict]] = defaultdict(list)
    for r in rows:
        groups[r["params"].get(axis)].append(r)
    table = []
    for label, members in groups.items():
        vals = [m["metrics"][metric] for m in members if metric in m["metrics"]]
        if not vals:
            continue
        mean, std = mean_std(vals)
        extra = {}
        for col in _ppl_columns(members):
            cv = [m["metrics"][col] for m in members if col in m["metrics"]]
            if cv:
                extra[col] = mean_std(cv)
        table.append((label, mean, std, len(vals), extra))
    best = min(table, key=lambda r: r[1])[0] if table else None
    return table, best


def load_trials(
    run_dir: Path, trials: list[dict], spec: Any, tracking_uri: str
) -> tuple[list[dict], list[str]]:
    """The finished trials completed with what their directories hold (``tables.load_trial``) and their MLflow
    child runs' metric histories (``history``, ``tokens_per_sec``); with the trials whose history could not be
    read (their tokens/s and curves stay missing)."""
    describe_cache: dict[str, dict] = {}
    trials = [tables.load_trial(run_dir, t, spec, describe_cache) for t in trials]
    problems = []
    for t in tracked(trials, "report: trial histories", lambda _: 1, unit="trial"):
        t["history"] = {}
        if t.get("mlflow_run_id"):
            try:
                t["history"] = curves.metric_history(tracking_uri, t["mlflow_run_id"])
            except Exception as e:  # a store that cannot be read: tokens/s and curves stay missing
                problems.append(mask_url(f"trial {t['number']}: {type(e).__name__}: {e}")[:300])
        t["tokens_per_sec"] = curves.training_tokens_per_sec(t["history"])
    return trials, problems


def paired_differences(rows: list, base: Any, columns: list) -> dict[str, dict[str, Any]]:
    """Every row's paired difference (same seed) to the ``base`` row in each of ``columns``."""
    return {
        r.name: {c.key: tables.paired_difference(r, base, c.key) for c in columns}
        for r in rows
        if r is not base
    }
