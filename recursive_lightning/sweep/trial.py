"""One trial's life: a worker claims it (WAITING -> RUNNING), sends heartbeats while it trains, decides from
what is on disk whether it already finished, records its result and tells the study; a failed trial is
retried up to ``max_retries`` times, a stopped one waits again, and a trial whose worker died is taken over.

A finished trial is never trained twice: ``trials/<point>/sweep_result.json`` (written atomically before the
study is told) and ``result.json`` (written by ``train``) hold its result, and a trial whose training reached
``max_steps`` without either has its last checkpoint validated again (``finished_before``, ``run_trial``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from recursive_lightning import faults
from recursive_lightning.evaluation.options import EvalOptions
from recursive_lightning.evaluation.run import evaluate_checkpoint, flat_metrics
from recursive_lightning.files import atomic_write_text, read_json
from recursive_lightning.run_dir import RunDir, SweepDir
from recursive_lightning.sweep.claims import Heartbeat, claim, take_over_stale
from recursive_lightning.sweep.launch import Stop, stop_requested, train_trial
from recursive_lightning.sweep.spec import SweepSpec, point_key
from recursive_lightning.sweep.study import NEUTRAL_KEYS, grid_point, open_storage
from recursive_lightning.sweep.trial_callbacks import PruningCallback, fault_callback
from recursive_lightning.tracking.runs import log_metrics, set_tags, set_terminated
from recursive_lightning.training.options import TrainOptions
from recursive_lightning.training.result import TrainResult, rebased
from recursive_lightning.training.run import build_datamodule
from recursive_lightning.training.run_lock import describe_holder, run_dir_lock
from recursive_lightning.uris import mask_url

SWEEP_RESULT = RunDir.SWEEP_RESULT  # a trial's result as the sweep records it, before telling the study


def axis_params(point: dict[str, Any], flat: dict[str, Any]) -> dict[str, Any]:
    """A grid point as params of its child run, so the runs can be grouped and compared by each axis: a named
    axis (``variant: {mesh: {...}}``) as ``axis.variant=mesh``; an axis that is a config field
    (``model.buffer``, ``train.seed``, a search space's fields) is that field's param already. The ``axis.``
    prefix puts them first where MLflow orders params by name (the compare view's parallel-coordinates plot
    starts with the first three params that differ between the runs)."""
    return {f"axis.{k}": v for k, v in point.items() if k not in flat}


def _same_config(a: dict[str, Any], b: dict[str, Any]) -> bool:
    a, b = json.loads(json.dumps(a, default=str)), json.loads(json.dumps(b, default=str))
    return all(a[k] == b[k] for k in a.keys() & b.keys() - NEUTRAL_KEYS)


def _has_val(metrics: dict[str, Any]) -> bool:
    return any(k.startswith("val/") for k in metrics)


def finished_before(cfg, trial_dir: Path) -> tuple[dict[str, Any] | None, TrainResult | None]:
    """Whether a trial finished before, as what is on disk says (a kill at any instant loses at most the work
    since a checkpoint): (the sweep's record ``sweep_result.json`` of this config, None) when there is one, else
    (None, ``train``'s result) when it reached ``max_steps`` with validation metrics, else (None, None): train."""
    record = read_json(RunDir(trial_dir).sweep_result)
    if record is not None and not _same_config(record.get("config") or {}, cfg.flat()):
        record = None
    if record is not None:
        # recorded before the sweep directory was moved or copied: its checkpoint is here now
        record["checkpoint"] = str(rebased(record["checkpoint"], record.get("trial_dir"), trial_dir))
        return record, None
    return None, _finished_result(cfg, trial_dir)


def _finished_result(cfg, trial_dir: Path) -> TrainResult | None:
    """The TrainResult of a trial whose ``train`` finished (its ``result.json`` has validation metrics at
    ``max_steps``), or None."""
    r = read_json(RunDir(trial_dir).result)
    if r is None or int(r.get("steps") or 0) < cfg.train.max_steps or not _has_val(r.get("metrics") or {}):
        return None
    try:  # its checkpoints where the trial directory lies now (a moved or copied sweep)
        return TrainResult.from_dict(r, trial_dir)
    except (KeyError, TypeError, ValueError):
        return None


def validate_last_checkpoint(cfg, result: TrainResult) -> TrainResult:
    """A trial that trained to ``max_steps`` but has no validation metrics (killed between its last checkpoint
    and its result): validate that checkpoint, as training's final validation would have, and record it."""
    import lightning as L  # heavy

    from recursive_lightning.training.checkpoint import latest_good  # heavy
    from recursive_lightning.training.module import RecursiveLMModule  # heavy
    from recursive_lightning.training.trainer import build_trainer  # heavy

    ckpt = latest_good(RunDir(result.run_dir).checkpoints)
    if ckpt is None:
        return result
    L.seed_everything(cfg.train.seed, workers=True, verbose=False)
    dm = build_datamodule(cfg, result.run_dir)
    dm.prepare_data()
    dm.setup("fit")
    module = RecursiveLMModule(cfg.to_dict(), val_names=("heldout",), tokenizer_json=dm.tokenizer.to_str())
    trainer = build_trainer(cfg, validate_only=True)
    trainer.validate(module, datamodule=dm, ckpt_path=str(ckpt), weights_only=False, verbose=False)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    log_metrics(
        result.tracking_uri,
        result.mlflow_run_id,
        {f"final/{k}": v for k, v in metrics.items()},
        step=result.steps,
    )
    set_terminated(result.tracking_uri, result.mlflow_run_id, "FINISHED")
    result.metrics = metrics
    result.save()
    return result


def _evaluate(spec: SweepSpec, result: TrainResult, tracking_uri: str) -> dict[str, Any]:
    """The sweep's ``evaluate:`` (perplexity sets, optionally lm-eval tasks) on a finished trial's checkpoint;
    its paths are relative to the sweep file."""
    here = spec.path.parent if spec.path is not None else Path.cwd()
    options = EvalOptions.from_sweep(spec.evaluate, here, tracking_uri)
    return flat_metrics(evaluate_checkpoint(result.last_checkpoint, options))


def _suggest(trial, spec: SweepSpec) -> dict[str, Any]:
    """A search trial's point, sampled from the sweep's ``search.space``."""
    point = {}
    for name, dist in spec.search["space"].items():
        if "choices" in dist:
            point[name] = trial.suggest_categorical(name, list(dist["choices"]))
        elif isinstance(dist["low"], int) and isinstance(dist["high"], int) and not dist.get("log"):
            point[name] = trial.suggest_int(name, dist["low"], dist["high"], step=dist.get("step", 1))
        else:
            point[name] = trial.suggest_float(
                name, float(dist["low"]), float(dist["high"]), log=bool(dist.get("log"))
            )
    return point


def run_trial(spec: SweepSpec, study, trial_id: int, run_dir: Path, tracking_uri: str, parent: str) -> None:
    """Run one claimed trial to its end and tell the study: unless it finished before (``finished_before``) it
    trains, resuming from its last checkpoint; its result is recorded (``sweep_result.json``) before the study
    is told. The trial directory is held for it (``run_lock``): another process still writing it (a worker
    whose claim went stale while it kept training, a ``train`` into it) is waited for, and what it finished is
    then found on disk."""
    import optuna  # heavy

    trial = optuna.trial.Trial(study, trial_id)
    point = (
        grid_point(study._storage.get_trial(trial_id), spec) if spec.search is None else _suggest(trial, spec)
    )
    key = trial.user_attrs.get("point_key")
    if key is None:  # a grid point is enqueued with its key; a trial of a search gets it here
        key = point_key(point)
        trial.set_user_attr("point_key", key)
    trial_dir = SweepDir(run_dir).trial(key).path

    def waiting(holder: dict) -> None:
        print(
            f"[sweep {spec.name}] trial {trial.number}: waiting for its directory {trial_dir}, held by "
            f"{describe_holder(holder)}",
            flush=True,
        )

    with run_dir_lock(trial_dir, on_wait=waiting):
        _run_held(spec, study, trial, point, key, run_dir, tracking_uri, parent)


def _run_held(
    spec: SweepSpec, study, trial, point: dict, key: str, run_dir: Path, tracking_uri: str, parent: str
) -> None:
    """``run_trial`` once the trial directory is held: the result it finished before, else trained (and
    evaluated) now; then told to the study."""
    cfg = spec.trial_config(point)
    trial_dir = SweepDir(run_dir).trial(key).path
    label = ", ".join(f"{k}={v}" for k, v in point.items())
    record, result = finished_before(cfg, trial_dir)
    if record is not None or result is not None:
        print(
            f"[sweep {spec.name}] trial {trial.number}: {label} (finished before; its result is kept)",
            flush=True,
        )
    if record is None:
        pruned = False
        if result is None:
            result, pruned = _train(spec, trial, cfg, point, key, run_dir, tracking_uri, parent, label)
        faults.point("after_result_write")
        record = _record_result(spec, cfg, key, trial_dir, result, pruned, tracking_uri)
    _tell(spec, study, trial, record, cfg.flat(), tracking_uri)


def _train(
    spec: SweepSpec,
    trial,
    cfg,
    point: dict,
    key: str,
    run_dir: Path,
    tracking_uri: str,
    parent: str,
    label: str,
) -> tuple[TrainResult, bool]:
    """Train the trial (resuming from its checkpoints) into its MLflow child run under ``parent``, with the
    pruning and fault callbacks it needs: (its result, whether it was pruned). A trial trained here that ended
    without a validation at its last step is validated there again."""
    trial_dir = SweepDir(run_dir).trial(key).path
    resume = RunDir(trial_dir).has_checkpoint_files()
    callbacks = []
    pruner_cb = None
    if spec.pruning.get("enabled"):
        pruner_cb = PruningCallback(trial, spec.metric, int(spec.pruning.get("warmup_steps", 0)))
        callbacks.append(pruner_cb)
    if faults.active():
        callbacks.append(fault_callback(cfg))
    print(
        f"[sweep {spec.name}] trial {trial.number}: {label}" + (" (resuming)" if resume else ""), flush=True
    )
    tags = {
        "sweep": spec.name,
        "optuna.trial_number": str(trial.number),
        "point_key": key,
        "optuna.study": spec.name,
    }
    faults.point("before_training")
    options = TrainOptions(
        resume=resume,
        tracking_uri=tracking_uri,
        experiment=spec.name,
        run_name=key,
        parent_run_id=parent,
        tags=tags,
        callbacks=callbacks,
        params=axis_params(point, cfg.flat()),
    )
    who = f"[sweep {spec.name}] trial {trial.number}"
    result, in_process = train_trial(cfg, trial_dir, run_dir, options, who)
    pruned = pruner_cb is not None and pruner_cb.pruned
    if in_process and not pruned and not _has_val(result.metrics) and result.steps >= cfg.train.max_steps:
        result = validate_last_checkpoint(cfg, result)
    return result, pruned


def _record_result(
    spec: SweepSpec, cfg, key: str, trial_dir: Path, result: TrainResult, pruned: bool, tracking_uri: str
) -> dict[str, Any]:
    """The sweep's record of a finished trial (its metrics with the ``evaluate:`` block's), kept in its
    directory before the study is told."""
    metrics = dict(result.metrics)
    if spec.evaluate:  # perplexity sets and (optionally) lm-eval tasks on the finished trial
        metrics.update(_evaluate(spec, result, tracking_uri))
    record = {
        "point_key": key,
        "metrics": metrics,
        "pruned": pruned,
        "steps": result.steps,
        "mlflow_run_id": result.mlflow_run_id,
        "checkpoint": str(result.last_checkpoint),
        "trial_dir": str(trial_dir.resolve()),
        "config": cfg.flat(),
    }
    atomic_write_text(RunDir(trial_dir).sweep_result, json.dumps(record, indent=2, default=str))
    return record


def _tell(spec: SweepSpec, study, trial, record: dict[str, Any], flat: dict, tracking_uri: str) -> None:
    """Tag the trial's MLflow run, keep the record on the Optuna trial and tell the study its value (or that
    it was pruned)."""
    from optuna.trial import TrialState  # heavy

    faults.point("before_tell")
    # one request: with a tracking server each is a round trip (the per-trial bookkeeping)
    set_tags(
        tracking_uri,
        record["mlflow_run_id"],
        {"checkpoint": record["checkpoint"], "optuna.trial_number": trial.number},
    )
    metrics = record["metrics"]
    trial.set_user_attr("metrics", metrics)
    trial.set_user_attr("mlflow_run_id", record["mlflow_run_id"])
    trial.set_user_attr("checkpoint", record["checkpoint"])
    trial.set_user_attr("config", flat)
    trial.set_user_attr("steps", record["steps"])
    if record.get("pruned"):
        study.tell(trial, state=TrialState.PRUNED)
        faults.point("after_tell")
        return
    value = metrics.get(spec.metric)
    if value is None:
        raise RuntimeError(f"metric {spec.metric} was not produced by the trial (have: {sorted(metrics)})")
    study.tell(trial, float(value))
    faults.point("after_tell")


def _failed(spec: SweepSpec, study, storage, trial_id: int, e: Exception) -> None:
    """A trial raised: record its error and fail it, enqueueing its retry while it has retries left; one no
    longer this worker's (taken over elsewhere: its new worker finds any result on disk) is left as it is."""
    from optuna.trial import TrialState  # heavy

    trial = storage.get_trial(trial_id)
    if trial.state != TrialState.RUNNING:  # taken from this worker (its heartbeats were late)
        print(
            f"[sweep {spec.name}] trial {trial.number} was taken over elsewhere ({trial.state.name})",
            file=sys.stderr,
            flush=True,
        )
        return
    attempt = int(trial.user_attrs.get("attempt", 0))
    msg = mask_url(f"{type(e).__name__}: {e}")  # shown in the report: a URL in it without its password
    print(f"[sweep {spec.name}] trial {trial.number} failed: {msg}", file=sys.stderr, flush=True)
    storage.set_trial_user_attr(trial_id, "error", msg[:2000])
    storage.set_trial_user_attr(trial_id, "traceback", mask_url(traceback.format_exc())[-4000:])
    study.tell(trial.number, state=TrialState.FAIL)
    if attempt < spec.max_retries:
        params = trial.params or dict(trial.system_attrs.get("fixed_params", {}))
        study.enqueue_trial(
            params,
            user_attrs={
                **({"point": trial.user_attrs["point"]} if "point" in trial.user_attrs else {}),
                "point_key": trial.user_attrs.get("point_key"),
                "attempt": attempt + 1,
                "retry_of": trial.number,
            },
            skip_if_exists=False,
        )


def worker(
    spec: SweepSpec,
    run_dir: Path,
    storage_url: str,
    tracking_uri: str,
    max_trials: int | None = None,
    take_over: bool = False,
) -> int:
    """Claim and run trials until none is waiting; returns the number of trials run here. With ``take_over``
    (``sweep --attach``: workers on several machines) it then takes over the trials of dead workers."""
    import optuna  # heavy
    from optuna.storages import fail_stale_trials  # heavy
    from optuna.trial import TrialState  # heavy

    storage = open_storage(storage_url, spec.max_retries)
    study = optuna.load_study(
        study_name=spec.name,
        storage=storage,
        sampler=optuna.samplers.TPESampler(seed=os.getpid()) if spec.search else None,
    )
    parent = study.user_attrs["mlflow_parent_run_id"]
    done = 0
    while max_trials is None or done < max_trials:
        fail_stale_trials(study)
        if spec.search is None:
            trial_id = claim(study, storage, storage_url)
            if trial_id is None and take_over:
                trial_id = take_over_stale(study, storage, storage_url)
            if trial_id is None:
                break
            faults.point("after_claim")  # claimed, no heartbeat sent yet
        else:
            n = len(
                study.get_trials(
                    deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING, TrialState.PRUNED)
                )
            )
            trial_id = claim(study, storage, storage_url, ask=n < int(spec.search["n_trials"]))
            if trial_id is None:
                break
        with Heartbeat(storage, trial_id):
            try:
                run_trial(spec, study, trial_id, run_dir, tracking_uri, parent)
            except (KeyboardInterrupt, SystemExit):
                # stopped (Ctrl-C; SIGTERM: a scheduler's pre-emption): the trial waits again, and the next worker
                # resumes it from its last checkpoint into the same child run without waiting out its heartbeats
                with contextlib.suppress(Exception):
                    storage.set_trial_state_values(trial_id, state=TrialState.WAITING)
                raise
            except Exception as e:
                if stop_requested.is_set():
                    # an error raised while the trial was stopping (a library turning the signal into an exception
                    # of its own, a teardown cut short): a pre-emption, not a failure that spends a retry
                    with contextlib.suppress(Exception):
                        storage.set_trial_state_values(trial_id, state=TrialState.WAITING)
                    raise Stop() from e
                _failed(spec, study, storage, trial_id, e)
        done += 1
    return done
