"""A sweep's results as numbers, before any markdown: the study's trials (``collect``), what their directories
and MLflow child runs hold (``load_trial``, ``load_trials``) and the per-axis aggregates (``axis_table``); the
paired differences of every row to a baseline row are in ``statistics``."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from recursive_lightning.config import load_run_config
from recursive_lightning.errors import ConfigError
from recursive_lightning.files import read_json
from recursive_lightning.progress import tracked  # a bar on a terminal, a line every 30 s in a log
from recursive_lightning.run_dir import RunDir, SweepDir
from recursive_lightning.sweep import curves
from recursive_lightning.sweep.rows import finite
from recursive_lightning.sweep.statistics import mean_std
from recursive_lightning.uris import mask_url

SWEEP_RESULT = RunDir.SWEEP_RESULT
DAMAGED = "damaged"  # a trial's metrics_source when its sweep_result.json is there but cannot be read


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
    out["seconds"] = finite(result.get("seconds"))
    out["data_seconds"] = finite(result.get("data_seconds"))  # part of seconds: one-off data preparation
    out["tokens"] = finite(result.get("tokens"))
    out["steps"] = finite(result.get("steps"))
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


def load_trials(
    run_dir: Path, trials: list[dict], spec: Any, tracking_uri: str
) -> tuple[list[dict], list[str]]:
    """The finished trials completed with what their directories hold (``load_trial``) and their MLflow
    child runs' metric histories (``history``, ``tokens_per_sec``); with the trials whose history could not be
    read (their tokens/s and curves stay missing)."""
    describe_cache: dict[str, dict] = {}
    trials = [load_trial(run_dir, t, spec, describe_cache) for t in trials]
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
