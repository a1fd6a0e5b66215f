"""``python -m recursive_lightning sweep``: an Optuna study per sweep file, one MLflow child run per trial.

Grid points are enqueued once as WAITING trials; each worker claims one (Optuna's WAITING -> RUNNING
transition, made atomic for SQLite studies by a file lock, see ``_claim_lock``), trains it with :func:`recursive_lightning.training.run.train` into
``<run-dir>/trials/<point>/`` and tells the study. Re-running the command resumes: finished trials
are skipped, a trial whose local worker died is put back to WAITING and resumes from its last
checkpoint into the same MLflow child run; a trial whose remote worker stopped sending heartbeats is
failed and retried by Optuna's ``RetryFailedTrialCallback``; a trial that raises is retried up to
``max_retries`` times and then reported.

A finished trial is never trained twice: ``trials/<point>/sweep_result.json`` (written atomically before the
study is told) and ``result.json`` (written by ``train``) hold its result, and a trial whose training reached
``max_steps`` without either has its last checkpoint validated again. Workers die with the command that
started them (``PR_SET_PDEATHSIG``), and a re-run waits for trials that live processes on this machine are
still running before it reports. Exit status: 0 every grid point finished, 1 one failed after its retries
(the MLflow parent run ends FAILED), 3 the sweep is not finished (a worker crashed, or trials are running
elsewhere); 2 a bad sweep file or option; 130 / 143 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from recursive_lightning import faults
from recursive_lightning.errors import ConfigError
from recursive_lightning.files import atomic_write_text, read_json, writable_dir_problem
from recursive_lightning.processes import parent_death_signal
from recursive_lightning.sweep.devices import CPU, device_pool, devices_needed, hold_devices
from recursive_lightning.sweep.servers import check_stores, database_lock, recorded_study
from recursive_lightning.sweep.spec import SweepSpec, load_sweep, point_key
from recursive_lightning.tracking.runs import (
    client,
    create_run,
    default_tracking_uri,
    ensure_experiment,
    log_artifact,
    log_params,
    portable_uri,
    set_tags,
    set_terminated,
)
from recursive_lightning.tracking.view import ui_hint
from recursive_lightning.uris import mask_url

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SWEEP = REPO / "ablations" / "default.yaml"
# a trial whose worker sent no heartbeat for GRACE_S is failed and retried (workers on other machines);
# RECURSIVE_LIGHTNING_HEARTBEAT="INTERVAL,GRACE" (whole seconds) sets both, e.g. for a cluster or the tests
_HB = os.environ.get("RECURSIVE_LIGHTNING_HEARTBEAT", "20,90").split(",")
HEARTBEAT_S, GRACE_S = int(_HB[0]), int(_HB[-1]) if len(_HB) > 1 else 90
POLL_S = 2.0  # how often a re-run looks whether trials of live processes on this machine have ended
PARENT_ENV = "RECURSIVE_LIGHTNING_SWEEP_PARENT"  # the pid of the sweep command that spawned a worker
SWEEP_RESULT = "sweep_result.json"  # a trial's result as the sweep records it, before telling the study
RESOLVED_ATTR = "resolved_spec"  # study attribute: the resolved config of every grid point the study ran
# config fields that may differ between runs of one sweep without changing any result
NEUTRAL_KEYS = {"train.progress", "train.keep_host_memory", "data.cache_dir", "data.num_workers"}
EXIT_FAILED = 1  # a grid point failed after its retries (the MLflow parent run ends FAILED)
EXIT_UNFINISHED = 3  # trials are left (a worker crashed, or trials run elsewhere): re-run or wait


def quiet_libraries() -> None:
    """Sweeps print one line per trial; silence the libraries' per-run banners."""
    import logging
    import warnings

    import lightning.pytorch  # noqa: F401  (it sets its loggers to INFO on import; override after)

    for name in ("lightning.pytorch", "lightning.fabric", "mlflow", "alembic", "litdata"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(LeafSpec|__len__|litlogger|does not have many workers).*")


def default_storage(run_dir: Path) -> str:
    return f"sqlite:///{run_dir.resolve() / 'optuna.db'}"


def _storage(url: str, max_retries: int):
    import warnings

    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 120}}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # a trial whose worker stops sending heartbeats is failed and re-enqueued (same params) up to max_retries
    return RDBStorage(
        url,
        heartbeat_interval=HEARTBEAT_S,
        grace_period=GRACE_S,
        heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=max_retries),
        **kwargs,
    )


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process of this package (a reused pid or a zombie is not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc here: trust the signal check
    return b"recursive_lightning" in cmdline


@contextlib.contextmanager
def _file_lock(path: str | Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _requeue_dead_local(study, storage, storage_url: str) -> list[int]:
    """Trials whose worker on this machine died (a killed sweep) go back to WAITING: same trial, same directory,
    resumed from its last checkpoint. In a SQLite study (every worker on this machine) a running trial that
    names no worker was claimed by a process killed before it could: it goes back too. Returns their numbers."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    host, out = socket.gethostname(), []
    with _claim_lock(storage_url):  # no claim is half done while we look
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            pid = t.system_attrs.get("pid")
            if pid is None:
                dead = storage_url.startswith("sqlite")
            else:
                dead = t.system_attrs.get("host") == host and not _pid_alive(int(pid))
            # (on a server database another worker may have failed it as stale since the list was read)
            with contextlib.suppress(UpdateFinishedTrialError):
                if dead and storage.set_trial_state_values(t._trial_id, state=TrialState.WAITING):
                    out.append(t.number)
    return out


def resolved_spec(spec: SweepSpec) -> dict[str, Any]:
    """What decides a sweep's results: its metric, search, pruning and evaluation, and every grid point's config."""
    points = spec.grid() if spec.search is None else [{}]
    out = {
        "fields": {
            "metric": spec.metric,
            "search": spec.search,
            "evaluate": spec.evaluate,
            "pruning": spec.pruning,
        },
        "points": {point_key(p): spec.trial_config(p).flat() for p in points},
    }
    return json.loads(json.dumps(out, sort_keys=True, default=str))


def grid_point(trial, spec: SweepSpec) -> dict[str, Any]:
    """The grid point a (frozen) trial of a grid study stands for, in the spec's axis order: the fixed
    parameters it was enqueued with (``params`` for trials of studies from before the grid could grow)."""
    fixed = {
        **trial.params,
        **(trial.system_attrs.get("fixed_params") or {}),
        **trial.user_attrs.get("point", {}),
    }
    return {a.name: fixed[a.name] for a in spec.axes}


def _spec_changes(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(fields whose value changed, grid points no longer in the sweep) between two ``resolved_spec``s. Fields
    only one side has (added to the config since) are not compared."""
    changed = {k for k, v in new["fields"].items() if k in old.get("fields", {}) and old["fields"][k] != v}
    for key, flat in new["points"].items():
        before = old["points"].get(key)
        if before is not None:
            changed |= {k for k in flat.keys() & before.keys() - NEUTRAL_KEYS if flat[k] != before[k]}
    removed = sorted(set(old["points"]) - set(new["points"]))
    return sorted(changed), removed


def _study_axes(study) -> set[str] | None:
    """The axis names of a grid study's trials (None when it has none yet)."""
    names: set[str] = set()
    for t in study.get_trials(deepcopy=False):
        names |= (
            set(t.params)
            | set(t.system_attrs.get("fixed_params") or {})
            | set(t.user_attrs.get("point") or {})
        )
    return names or None


def edited_sweep_advice(spec: SweepSpec, run_dir: Path, storage_url: str | None) -> str:
    """What to do with a sweep file that cannot continue a study: on a server database the conflict is the
    study, named after the sweep, in that shared database (a new --run-dir alone meets the same study)."""
    kept = run_dir / "sweep.yaml"
    if storage_url is None or storage_url.startswith("sqlite"):
        return (
            f"run the edited sweep into a new --run-dir, or restore the file it was run with (kept as {kept})"
        )
    return (
        f"the study '{spec.name}' in the shared database {mask_url(storage_url)} holds the old grid, so give the "
        f"edited sweep a new `name:` (a new study there) and a new --run-dir, or pass --storage with a new "
        f"database, or restore the file it was run with (kept as {kept})"
    )


def check_unchanged(
    spec: SweepSpec, study, run_dir: Path, record: bool, storage_url: str | None = None
) -> None:
    """Refuse, in one sentence, to continue a sweep directory with a sweep file that changes the config of a
    grid point it already holds (or drops points, or adds or drops an axis): its finished trials would be
    reported as results of the edited file. Added grid points (more seeds, a value or a row of an axis) are
    fine: only they are trained. ``record`` stores the new file's grid."""
    new = resolved_spec(spec)
    raw = study.user_attrs.get(RESOLVED_ATTR)
    if raw is not None:
        old = json.loads(raw)
    elif spec.search is None:  # a grid study from before this check: the configs its trials recorded
        points = {
            t.user_attrs["point_key"]: t.user_attrs["config"]
            for t in study.get_trials(deepcopy=False)
            if "config" in t.user_attrs and "point_key" in t.user_attrs
        }
        old = {"fields": {}, "points": json.loads(json.dumps(points, default=str))} if points else None
    else:
        old = None
    axes_before = _study_axes(study) if spec.search is None else None
    if axes_before is not None:
        axes_now = {a.name for a in spec.axes}
        added, dropped = sorted(axes_now - axes_before), sorted(axes_before - axes_now)
        if added or dropped:
            what = "; ".join(
                [f"new axis {', '.join(added)}"] * bool(added)
                + [f"axis {', '.join(dropped)} removed"] * bool(dropped)
            )
            raise ConfigError(
                f"sweep '{spec.name}' in '{run_dir}' was run with the axes {', '.join(sorted(axes_before))} "
                f"({what}: every earlier grid point would change, not only new ones be added); "
                f"{edited_sweep_advice(spec, run_dir, storage_url)}."
            )
    if old is not None:
        changed, removed = _spec_changes(old, new)
        if changed or removed:
            what = []
            if changed:
                shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
                what.append(f"{shown} changed")
            if removed:
                what.append(f"grid point{'s' if len(removed) > 1 else ''} {', '.join(removed[:4])} removed")
            raise ConfigError(
                f"sweep '{spec.name}' in '{run_dir}' was run with a different sweep file ({'; '.join(what)}), "
                f"so its results are not this file's; {edited_sweep_advice(spec, run_dir, storage_url)}."
            )
        new = {"fields": new["fields"], "points": {**old["points"], **new["points"]}}
    if record and (raw is None or json.loads(raw) != new):
        study.set_user_attr(RESOLVED_ATTR, json.dumps(new, sort_keys=True))


def prepare_study(spec: SweepSpec, run_dir: Path, storage_url: str, tracking_uri: str):
    """Create or load the study, enqueue missing grid points, make the MLflow parent run.

    One command at a time does this for a run directory (a file lock in it): a second ``sweep`` started on the
    same fresh directory waits until the study, the MLflow store and the parent run exist, then joins the
    sweep as more workers (creating the stores concurrently fails inside SQLAlchemy)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    # across machines on one PostgreSQL study, an advisory lock in its database (servers.database_lock)
    with _file_lock(run_dir / ".sweep.lock"), database_lock(storage_url, spec.name):
        return _prepare_study(spec, run_dir, storage_url, tracking_uri)


def _prepare_study(spec: SweepSpec, run_dir: Path, storage_url: str, tracking_uri: str):
    import optuna

    info = run_dir / "sweep.json"
    if info.is_file():
        held = json.loads(info.read_text()).get("name")
        if held and held != spec.name:
            raise ConfigError(
                f"'{run_dir}' holds the sweep '{held}', not '{spec.name}'; run '{spec.name}' into its own --run-dir."
            )
    storage = _storage(storage_url, spec.max_retries)
    sampler = optuna.samplers.TPESampler(seed=0) if spec.search else None
    study = optuna.create_study(
        study_name=spec.name, storage=storage, direction="minimize", load_if_exists=True, sampler=sampler
    )
    check_unchanged(spec, study, run_dir, record=True, storage_url=storage_url)
    trials = study.get_trials(deepcopy=False)
    if spec.search is None:
        present = {t.user_attrs.get("point_key") for t in trials}
        for point in spec.grid():
            key = point_key(point)
            if key not in present:
                # the point is a fixed parameter set read back by run_trial, never suggested from a distribution:
                # a grown grid (one more seed, a new row) needs no change to earlier trials' distributions
                study.enqueue_trial(
                    point, user_attrs={"point_key": key, "attempt": 0, "point": point}, skip_if_exists=False
                )
    _requeue_dead_local(study, storage, storage_url)
    # the MLflow parent run of the sweep
    exp_id = ensure_experiment(tracking_uri, spec.name, run_dir / "mlartifacts")
    parent = study.user_attrs.get("mlflow_parent_run_id")
    if parent is None:
        parent = create_run(
            tracking_uri, exp_id, f"sweep:{spec.name}", tags={"sweep": spec.name, "kind": "sweep"}
        )
        study.set_user_attr("mlflow_parent_run_id", parent)
        study.set_user_attr("tracking_uri", tracking_uri)
        study.set_user_attr("run_dir", str(run_dir))  # where `sweep --attach` workers put trials by default
        log_params(
            tracking_uri,
            parent,
            {
                "sweep.name": spec.name,
                "sweep.file": str(spec.path),
                "sweep.axes": json.dumps({a.name: a.labels for a in spec.axes}, default=str),
                "sweep.storage": mask_url(storage_url),
                "sweep.grid_size": len(spec.grid()),
            },
        )
        if spec.path is not None:
            log_artifact(tracking_uri, parent, spec.path)
    else:  # a re-run continues the sweep: its parent run is running again
        client(tracking_uri).update_run(parent, status="RUNNING")
        # run in a moved or copied sweep directory: attached workers find it, and its store, where it lies now
        for k, v in (("tracking_uri", tracking_uri), ("run_dir", str(run_dir))):
            if study.user_attrs.get(k) != v:
                study.set_user_attr(k, v)
    if spec.path is not None:
        atomic_write_text(run_dir / "sweep.yaml", spec.path.read_text())
    atomic_write_text(
        run_dir / "sweep.json",
        json.dumps(
            {
                "name": spec.name,
                # stores inside the sweep directory are kept relative to it: a moved copy finds its own
                "storage": portable_uri(storage_url, run_dir),
                "tracking_uri": portable_uri(tracking_uri, run_dir),
                "parent_run_id": parent,
                # the kept sweep.yaml's relative paths (base:, evaluate.ppl) resolve from here
                "sweep_dir": str(spec.path.parent.resolve()) if spec.path is not None else None,
            }
        ),
    )
    return study, parent


class _Heartbeat:
    def __init__(self, storage, trial_id: int) -> None:
        self.storage, self.trial_id = storage, trial_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.storage.record_heartbeat(self.trial_id)
            except Exception:
                pass

    def __enter__(self):
        self.storage.record_heartbeat(self.trial_id)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()


@contextlib.contextmanager
def _claim_lock(storage_url: str) -> Iterator[None]:
    """Serialise claims of the workers that share one SQLite study.

    Optuna checks WAITING before setting RUNNING under ``SELECT ... FOR UPDATE``, which SQLite ignores, and
    pysqlite runs that SELECT outside the write transaction: two processes both read WAITING and both claim
    the trial (then train it twice into one directory). A file lock beside the database makes the check and
    the set one step. Server databases (PostgreSQL, MySQL; several machines) lock the row themselves."""
    path = storage_url.removeprefix("sqlite:///") if storage_url.startswith("sqlite:///") else ""
    if not path or path == ":memory:":
        yield
        return
    with _file_lock(f"{path}.claim-lock"):
        yield


def _claim(study, storage, storage_url: str, ask: bool = False) -> int | None:
    """Move one WAITING trial to RUNNING (or, with ``ask``, start a new one when none waits), record this
    process as its worker, and return its id (None when none is waiting)."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    with _claim_lock(storage_url):
        trial_id = None
        for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            try:
                claimed = storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING)
            except UpdateFinishedTrialError:  # claimed and finished by another worker since the list was read
                continue  # (a server database: workers claim without the file lock)
            if claimed:
                trial_id = t._trial_id
                break
        if trial_id is None and ask:
            trial_id = study.ask()._trial_id
        if trial_id is not None:
            storage.set_trial_system_attr(trial_id, "host", socket.gethostname())
            storage.set_trial_system_attr(trial_id, "pid", os.getpid())
    return trial_id


def _running_heartbeats(storage, study_id: int):
    """(the database server's clock, {trial id: last heartbeat or None} of the study's running trials)."""
    import sqlalchemy
    from optuna.storages._rdb import models
    from optuna.trial import TrialState

    with storage.scoped_session() as session:
        now = session.execute(sqlalchemy.func.now()).scalar().replace(tzinfo=None)
        rows = (
            session.query(models.TrialModel.trial_id, models.TrialHeartbeatModel.heartbeat)
            .outerjoin(
                models.TrialHeartbeatModel, models.TrialHeartbeatModel.trial_id == models.TrialModel.trial_id
            )
            .filter(models.TrialModel.state == TrialState.RUNNING, models.TrialModel.study_id == study_id)
            .all()
        )
    return now, {tid: (beat.replace(tzinfo=None) if beat is not None else None) for tid, beat in rows}


def _take_over(study, storage, storage_url: str) -> int | None:
    """No grid point is waiting: watch the other workers' running trials until each is shown alive (its
    heartbeat advances: left to its worker) or taken over. A trial whose heartbeats stop goes stale after
    GRACE_S (Optuna fails it and enqueues its retry, ``RetryHeartbeatStaleTrialCallback``, claimed here); one
    that never sent a heartbeat (its worker died between its claim and its first beat, which Optuna never
    calls stale) is put back to WAITING once it has been seen without one for GRACE_S. The claimed trial
    resumes from the dead worker's last checkpoint in the shared run directory, into the same MLflow child
    run. Returns None when no trial is running or every running one has a live worker."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.storages import fail_stale_trials
    from optuna.trial import TrialState

    first: dict[int, tuple[Any, Any]] = {}  # trial id -> (heartbeat, database time) when first seen
    alive: set[int] = set()
    announced = False
    while True:
        fail_stale_trials(study)
        trial_id = _claim(study, storage, storage_url)
        if trial_id is not None:
            return trial_id
        now, beats = _running_heartbeats(storage, study._study_id)
        suspects = []
        for tid, beat in beats.items():
            if tid in alive:
                continue
            beat0, seen = first.setdefault(tid, (beat, now))
            if beat is not None and (beat0 is None or beat > beat0):
                alive.add(tid)  # its worker is beating
            elif beat is None and (now - seen).total_seconds() > GRACE_S:
                with _claim_lock(storage_url), contextlib.suppress(UpdateFinishedTrialError):
                    storage.set_trial_state_values(tid, state=TrialState.WAITING)
            else:
                suspects.append(tid)
        if not suspects:
            return None
        if not announced:
            print(
                f"[sweep {study.study_name}] {len(suspects)} running trial(s) sent no recent heartbeat: watching "
                f"them up to {GRACE_S}s to take over any whose worker died",
                flush=True,
            )
            announced = True
        time.sleep(min(float(HEARTBEAT_S), POLL_S))


class PruningCallback:
    """Report the validation loss by global step to Optuna; stop the trainer when the pruner says so."""

    def __new__(cls, trial, monitor: str, warmup_steps: int):
        import lightning as L

        class _Cb(L.Callback):
            pruned = False

            def on_validation_end(self, trainer, pl_module) -> None:
                value = trainer.callback_metrics.get(monitor)
                if value is None or trainer.sanity_checking:
                    return
                trial.report(float(value), step=trainer.global_step)
                if trainer.global_step >= warmup_steps and trial.should_prune():
                    self.pruned = True
                    trainer.should_stop = True

        return _Cb()


def _fault_callback(cfg):
    """Test-only: the named fault points inside training (see ``recursive_lightning.faults``)."""
    import lightning as L

    t = cfg.train

    class _Faults(L.Callback):
        fired = False

        def on_train_batch_end(self, trainer, *args) -> None:
            if not self.fired and t.checkpoint_every < trainer.global_step < t.max_steps:
                self.fired = True  # once per trial, after its first checkpoint
                faults.point("mid_training")

        def on_validation_start(self, trainer, pl_module) -> None:
            if trainer.global_step >= t.max_steps:  # last.ckpt at max_steps is written, no result yet
                faults.point("final_validation")

        def on_fit_end(self, trainer, pl_module) -> None:  # after the last checkpoint, before result.json
            faults.point("after_last_checkpoint")

    return _Faults()


def _same_config(a: dict[str, Any], b: dict[str, Any]) -> bool:
    a, b = json.loads(json.dumps(a, default=str)), json.loads(json.dumps(b, default=str))
    return all(a[k] == b[k] for k in a.keys() & b.keys() - NEUTRAL_KEYS)


def _has_val(metrics: dict[str, Any]) -> bool:
    return any(k.startswith("val/") for k in metrics)


def _finished_result(cfg, trial_dir: Path):
    """The TrainResult of a trial whose ``train`` finished (its ``result.json`` has validation metrics at
    ``max_steps``), or None."""
    from recursive_lightning.training.run import TrainResult

    r = read_json(trial_dir / "result.json")
    if r is None or int(r.get("steps") or 0) < cfg.train.max_steps or not _has_val(r.get("metrics") or {}):
        return None
    try:  # its checkpoints where the trial directory lies now (a moved or copied sweep)
        return TrainResult.from_dict(r, trial_dir)
    except (KeyError, TypeError, ValueError):
        return None


def _validate_last_checkpoint(cfg, result):
    """A trial that trained to ``max_steps`` but has no validation metrics (killed between its last checkpoint
    and its result): validate that checkpoint, as training's final validation would have, and record it."""
    import lightning as L

    from recursive_lightning.tracking.runs import log_metrics
    from recursive_lightning.training import parallel
    from recursive_lightning.training.checkpoint import latest_good
    from recursive_lightning.training.module import RecursiveLMModule
    from recursive_lightning.training.run import build_datamodule

    ckpt = latest_good(result.run_dir / "checkpoints")
    if ckpt is None:
        return result
    L.seed_everything(cfg.train.seed, workers=True, verbose=False)
    dm = build_datamodule(cfg, result.run_dir)
    dm.prepare_data()
    dm.setup("fit")
    module = RecursiveLMModule(cfg.to_dict(), val_names=("heldout",), tokenizer_json=dm.tokenizer.to_str())
    t = cfg.train
    trainer = L.Trainer(
        accelerator=t.accelerator,
        devices=1,
        precision=parallel.resolve_precision(t, t.accelerator),
        limit_val_batches=cfg.data.val_batches,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
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
    atomic_write_text(result.run_dir / "result.json", json.dumps(result.to_dict(), indent=2))
    return result


def run_trial(spec: SweepSpec, study, trial_id: int, run_dir: Path, tracking_uri: str, parent: str) -> None:
    import optuna
    from optuna.trial import TrialState

    from recursive_lightning.training.run import rebased, train

    trial = optuna.trial.Trial(study, trial_id)
    if spec.search is None:
        point = grid_point(study._storage.get_trial(trial_id), spec)
    else:
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
    key = trial.user_attrs.get("point_key")
    if key is None:  # a grid point is enqueued with its key; a trial of a search gets it here
        key = point_key(point)
        trial.set_user_attr("point_key", key)
    cfg = spec.trial_config(point)
    flat = cfg.flat()
    trial_dir = run_dir / "trials" / key
    label = ", ".join(f"{k}={v}" for k, v in point.items())
    # what is on disk decides: the sweep's record of the finished trial, else train's result, else train
    # (resuming from the last checkpoint); a kill at any instant loses at most the work since a checkpoint
    record = read_json(trial_dir / SWEEP_RESULT)
    if record is not None and not _same_config(record.get("config") or {}, flat):
        record = None
    if (
        record is not None
    ):  # recorded before the sweep directory was moved or copied: its checkpoint is here now
        record["checkpoint"] = str(rebased(record["checkpoint"], record.get("trial_dir"), trial_dir))
    result = None if record is not None else _finished_result(cfg, trial_dir)
    pruned = bool(record and record.get("pruned"))
    if record is not None or result is not None:
        print(
            f"[sweep {spec.name}] trial {trial.number}: {label} (finished before; its result is kept)",
            flush=True,
        )
    if record is None:
        if result is None:
            resume = (trial_dir / "checkpoints").exists() and any((trial_dir / "checkpoints").glob("*.ckpt"))
            callbacks = []
            pruner_cb = None
            if spec.pruning.get("enabled"):
                pruner_cb = PruningCallback(trial, spec.metric, int(spec.pruning.get("warmup_steps", 0)))
                callbacks.append(pruner_cb)
            if faults.active():
                callbacks.append(_fault_callback(cfg))
            print(
                f"[sweep {spec.name}] trial {trial.number}: {label}" + (" (resuming)" if resume else ""),
                flush=True,
            )
            tags = {
                "sweep": spec.name,
                "optuna.trial_number": str(trial.number),
                "point_key": key,
                "optuna.study": spec.name,
            }
            faults.point("before_training")
            pool = device_pool()

            def waiting() -> None:
                print(
                    f"[sweep {spec.name}] trial {trial.number}: waiting for {need} free device(s) of "
                    f"{','.join(pool)} (other workers hold them)",
                    flush=True,
                )

            need = devices_needed(cfg, pool)
            # the trial's devices, held while it trains: its `train` process sees only them
            with hold_devices(run_dir, pool, need, on_wait=waiting) as held:
                tags["devices"] = ",".join(held) or CPU
                faults.point("devices_held")
                if held or _multi_process(cfg):
                    result = _train_in_subprocess(
                        cfg, trial_dir, resume, tracking_uri, spec.name, key, parent, tags, point, held
                    )
                else:
                    result = train(
                        cfg,
                        trial_dir,
                        resume=resume,
                        tracking_uri=tracking_uri,
                        experiment=spec.name,
                        run_name=key,
                        parent_run_id=parent,
                        tags=tags,
                        callbacks=callbacks,
                        params=axis_params(point, flat),
                    )
                pruned = pruner_cb is not None and pruner_cb.pruned
                if not pruned and not _has_val(result.metrics) and result.steps >= cfg.train.max_steps:
                    if not held and not _multi_process(cfg):
                        result = _validate_last_checkpoint(cfg, result)
        faults.point("after_result_write")
        metrics = dict(result.metrics)
        if spec.evaluate:  # perplexity sets and (optionally) lm-eval tasks on the finished trial
            from recursive_lightning.evaluation.options import EvalOptions
            from recursive_lightning.evaluation.run import evaluate_checkpoint, flat_metrics

            # evaluate: paths are relative to the sweep file
            here = spec.path.parent if spec.path is not None else Path.cwd()
            out = evaluate_checkpoint(
                result.last_checkpoint, EvalOptions.from_sweep(spec.evaluate, here, tracking_uri)
            )
            metrics.update(flat_metrics(out))
        record = {
            "point_key": key,
            "metrics": metrics,
            "pruned": pruned,
            "steps": result.steps,
            "mlflow_run_id": result.mlflow_run_id,
            "checkpoint": str(result.last_checkpoint),
            "trial_dir": str(trial_dir.resolve()),
            "config": flat,
        }
        atomic_write_text(trial_dir / SWEEP_RESULT, json.dumps(record, indent=2, default=str))
    faults.point("before_tell")
    # one request: with a tracking server each is a round trip (issue 21's bookkeeping per trial)
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
    if pruned:
        study.tell(trial, state=TrialState.PRUNED)
        faults.point("after_tell")
        return
    value = metrics.get(spec.metric)
    if value is None:
        raise RuntimeError(f"metric {spec.metric} was not produced by the trial (have: {sorted(metrics)})")
    study.tell(trial, float(value))
    faults.point("after_tell")


def slurm_launcher(cfg, environ: dict[str, str] | None = None) -> list[str]:
    """Inside a SLURM allocation (a job-array task running ``sweep --attach``) a multi-device trial's ranks are
    started by ``srun`` as a job step, one task per device on ``train.num_nodes`` nodes, which Lightning's
    SLURM environment then reads (as for ``train`` under ``srun``); elsewhere Lightning starts the ranks on
    this machine itself ([] here)."""
    env = os.environ if environ is None else environ
    srun = shutil.which("srun", path=env.get("PATH"))
    if "SLURM_JOB_ID" not in env or srun is None:
        return []
    t = cfg.train
    if isinstance(t.devices, int):
        per_node = t.devices
    else:  # "auto" / a list: the GPUs this allocation gives each node
        per_node = int(str(env.get("SLURM_GPUS_ON_NODE") or "1").split("(")[0] or 1)
    nodes = int(t.num_nodes)
    return [
        srun,  # a path: the die-with-the-worker wrapper execs it without a PATH search
        f"--nodes={nodes}",
        f"--ntasks={nodes * per_node}",
        f"--ntasks-per-node={per_node}",
        # each rank this job's --cpus-per-task, whatever srun's version inherits (22.05 none, 23.11 all)
        f"--cpus-per-task={env.get('SLURM_CPUS_PER_TASK') or 1}",
        "--kill-on-bad-exit=1",
        "--export=ALL",
    ]


def axis_params(point: dict[str, Any], flat: dict[str, Any]) -> dict[str, Any]:
    """A grid point as params of its child run, so the runs can be grouped and compared by each axis: a named
    axis (``variant: {mesh: {...}}``) as ``axis.variant=mesh``; an axis that is a config field
    (``model.buffer``, ``train.seed``, a search space's fields) is that field's param already. The ``axis.``
    prefix puts them first where MLflow orders params by name (the compare view's parallel-coordinates plot
    starts with the first three params that differ between the runs)."""
    return {f"axis.{k}": v for k, v in point.items() if k not in flat}


def _multi_process(cfg) -> bool:
    t = cfg.train
    devices = t.devices if isinstance(t.devices, int) else 2
    return t.strategy in ("ddp", "fsdp") or devices > 1 or t.num_nodes > 1


# run argv[2:] with PR_SET_PDEATHSIG = SIGKILL (kept across execve), unless the parent argv[1] is already gone
_DIE_WITH_PARENT_EXEC = (
    "import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9, 0, 0, 0); "
    "os.getppid() == int(sys.argv[1]) or os._exit(137); os.execv(sys.argv[2], sys.argv[2:])"
)


def _train_in_subprocess(
    cfg,
    trial_dir: Path,
    resume: bool,
    tracking_uri: str,
    experiment: str,
    key: str,
    parent: str,
    tags: dict[str, str],
    point: dict[str, Any],
    devices: list[str] | None = None,
):
    """A multi-device trial (DDP / FSDP2) runs as its own `train` command: Lightning's launcher re-executes
    that command once per rank, which it cannot do for a sweep worker. So does every trial given ``devices``
    of the pool (its ``CUDA_VISIBLE_DEVICES``: a process's CUDA devices are fixed when it first uses CUDA).
    Pruning is not available there."""
    from recursive_lightning.training.run import TrainResult

    trial_dir.mkdir(parents=True, exist_ok=True)
    cfg_file = trial_dir / "trial.yaml"
    if devices:  # its devices, renumbered 0 .. d-1 inside it: a count (ids or `auto` would name others)
        cfg = copy.deepcopy(cfg)
        cfg.train.devices = len(devices)
    atomic_write_text(cfg_file, cfg.to_yaml())
    cmd = [
        sys.executable,
        "-m",
        "recursive_lightning",
        "train",
        "--config",
        str(cfg_file),
        "--run-dir",
        str(trial_dir),
        "--tracking-uri",
        tracking_uri,
        "--experiment",
        experiment,
        "--run-name",
        key,
        "--parent-run-id",
        parent,
    ]
    cmd += [f"--tag={k}={v}" for k, v in tags.items()]
    cmd += [f"--param={k}={v}" for k, v in axis_params(point, cfg.flat()).items()]
    if resume:
        cmd.append("--resume")
    cmd = [*slurm_launcher(cfg), *cmd]
    if sys.platform.startswith("linux"):  # the train command dies with this worker, as the worker does
        cmd = [sys.executable, "-c", _DIE_WITH_PARENT_EXEC, str(os.getpid()), *cmd]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(devices)} if devices else None
    proc = subprocess.Popen(cmd, env=env)
    try:
        code = proc.wait()
    except BaseException as e:
        # SIGTERM / Ctrl-C to this worker (SLURM's --signal=B: reaches only the worker): the `train` step stops
        # at a step boundary too (srun passes the signal on to every rank), and is waited for
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT if type(e) is KeyboardInterrupt else signal.SIGTERM)
        proc.wait()
        raise
    if code:
        raise subprocess.CalledProcessError(code, cmd)
    return TrainResult.from_dict(json.loads((trial_dir / "result.json").read_text()), trial_dir)


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
    import optuna
    from optuna.storages import fail_stale_trials
    from optuna.trial import TrialState

    storage = _storage(storage_url, spec.max_retries)
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
            trial_id = _claim(study, storage, storage_url)
            if trial_id is None and take_over:
                trial_id = _take_over(study, storage, storage_url)
            if trial_id is None:
                break
            faults.point("after_claim")  # claimed, no heartbeat sent yet
        else:
            n = len(
                study.get_trials(
                    deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING, TrialState.PRUNED)
                )
            )
            trial_id = _claim(study, storage, storage_url, ask=n < int(spec.search["n_trials"]))
            if trial_id is None:
                break
        with _Heartbeat(storage, trial_id):
            try:
                run_trial(spec, study, trial_id, run_dir, tracking_uri, parent)
            except (KeyboardInterrupt, SystemExit):
                # stopped (Ctrl-C; SIGTERM: a scheduler's pre-emption): the trial waits again, and the next worker
                # resumes it from its last checkpoint into the same child run without waiting out its heartbeats
                with contextlib.suppress(Exception):
                    storage.set_trial_state_values(trial_id, state=TrialState.WAITING)
                raise
            except Exception as e:
                if _stop_requested.is_set():
                    # an error raised while the trial was stopping (a library turning the signal into an exception
                    # of its own, a teardown cut short): a pre-emption, not a failure that spends a retry
                    with contextlib.suppress(Exception):
                        storage.set_trial_state_values(trial_id, state=TrialState.WAITING)
                    raise _Stop() from e
                trial = storage.get_trial(trial_id)
                # taken from this worker (its heartbeats were late): its new worker finds any result on disk
                if trial.state != TrialState.RUNNING:
                    print(
                        f"[sweep {spec.name}] trial {trial.number} was taken over elsewhere ({trial.state.name})",
                        file=sys.stderr,
                        flush=True,
                    )
                    done += 1
                    continue
                attempt = int(trial.user_attrs.get("attempt", 0))
                msg = f"{type(e).__name__}: {e}"
                print(f"[sweep {spec.name}] trial {trial.number} failed: {msg}", file=sys.stderr, flush=True)
                storage.set_trial_user_attr(trial_id, "error", msg[:2000])
                storage.set_trial_user_attr(trial_id, "traceback", traceback.format_exc()[-4000:])
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
        done += 1
    return done


def check_devices(spec: SweepSpec, pool: list[str]) -> None:
    """Refuse, before any training, a grid point that asks for more devices than this machine's pool has."""
    if not pool:
        return
    for point in spec.grid() if spec.search is None else [{}]:
        need = devices_needed(spec.trial_config(point), pool)
        if need > len(pool):
            where = ", ".join(f"{k}={v}" for k, v in point.items())
            raise ConfigError(
                f"sweep '{spec.name}'"
                + (f" at {where}" if where else "")
                + f": train.devices asks for {need} "
                f"devices but this machine's device pool ({','.join(pool)}, from CUDA_VISIBLE_DEVICES or the "
                f"GPUs torch sees) has {len(pool)}; lower train.devices or run it where more GPUs are visible."
            )


def prepare_data(spec: SweepSpec) -> None:
    """Build the tokenizer and token shards of every distinct data section of the grid, once."""
    from recursive_lightning.training.run import build_datamodule
    from recursive_lightning.training.uptrain import INIT_TOKENIZER

    seen = set()
    for point in spec.grid() if spec.search is None else [{}]:
        cfg = spec.trial_config(point)
        key = json.dumps(cfg.to_dict()["data"], sort_keys=True)
        if cfg.data.tokenizer.strip() == INIT_TOKENIZER:
            continue  # an uptraining trial's tokenizer is its source's, copied when the trial starts
        if key not in seen:
            seen.add(key)
            build_datamodule(cfg).prepare_data()


def sweep_state(spec: SweepSpec, study) -> str | None:
    """FINISHED when every grid point (or, for a search, some trial) finished, FAILED when one gave up after
    its retries, None while trials are waiting or running (here, in other processes or on other machines)."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    if any(t.state in (TrialState.WAITING, TrialState.RUNNING) for t in trials):
        return None
    done = {
        t.user_attrs.get("point_key") for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
    }
    if spec.search is None:
        ok = all(point_key(p) in done for p in spec.grid())
    else:
        ok = bool(done)
    return "FINISHED" if ok else "FAILED"


def close_parent(
    spec: SweepSpec, storage_url: str, tracking_uri: str, interrupted: bool = False
) -> str | None:
    """End the sweep's MLflow parent run once no trial is waiting or running (see ``sweep_state``), KILLED on
    an interrupt that leaves grid points unfinished. Returns the status set, or None while trials are still
    under way (other workers or machines): whichever process ends the last trial closes it. The status is the
    grid's as it now stands: a command that stops or fails after every point finished leaves it FINISHED."""
    import optuna

    study = optuna.load_study(study_name=spec.name, storage=_storage(storage_url, spec.max_retries))
    parent = study.user_attrs.get("mlflow_parent_run_id")
    if parent is None:
        return None
    status = sweep_state(spec, study)
    if interrupted and status is None:
        status = "KILLED"
    if status is not None:
        set_terminated(tracking_uri, parent, status)
    return status


def _wait_for_local_trials(spec: SweepSpec, storage_url: str) -> bool:
    """Wait while trials of the study are run by other live processes on this machine (an earlier sweep
    command's workers, a concurrent sweep command). Returns True when trials are waiting again (one of those
    processes died and its trial went back to WAITING, or a retry was enqueued): run a worker again."""
    import optuna
    from optuna.trial import TrialState

    storage = _storage(storage_url, spec.max_retries)
    host, announced = socket.gethostname(), False
    while True:
        study = optuna.load_study(study_name=spec.name, storage=storage)
        _requeue_dead_local(study, storage, storage_url)
        if study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            return True
        live = [
            t
            for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if t.system_attrs.get("host") == host and int(t.system_attrs.get("pid", -1)) != os.getpid()
        ]
        if not live:
            return False
        if not announced:
            pids = sorted({int(t.system_attrs["pid"]) for t in live})
            print(
                f"[sweep {spec.name}] waiting for {len(live)} trial(s) that process(es) "
                f"{', '.join(map(str, pids))} on this machine are running",
                flush=True,
            )
            announced = True
        time.sleep(POLL_S)


def _unfinished(spec: SweepSpec, storage_url: str) -> dict[str, list[str]]:
    """The grid points of trials still waiting and still running."""
    import optuna
    from optuna.trial import TrialState

    study = optuna.load_study(study_name=spec.name, storage=_storage(storage_url, spec.max_retries))
    out: dict[str, list[str]] = {"waiting": [], "running": []}
    for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING)):
        key = str(t.user_attrs.get("point_key") or f"trial {t.number}")
        out["waiting" if t.state == TrialState.WAITING else "running"].append(key)
    return out


def _die_with_parent(parent_pid: int) -> None:
    """A worker must not train unattended once the sweep command that started it is gone: on Linux the
    kernel SIGKILLs it when its parent dies (as if it had been killed with it; its trial is resumed from its
    last checkpoint by the next run of the sweep); elsewhere a thread watches the parent."""
    if not parent_death_signal(signal.SIGKILL):

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent_pid:  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


def _spawn_workers(n: int, sweep_file: Path, run_dir: Path, storage: str, tracking: str) -> int:
    threads = max(1, (os.cpu_count() or 2) // n)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "RL_TORCH_THREADS": str(threads),
        PARENT_ENV: str(os.getpid()),
    }
    cmd = [
        sys.executable,
        "-m",
        "recursive_lightning",
        "sweep",
        str(sweep_file),
        "--attach",
        "--worker",
        "--run-dir",
        str(run_dir),
        "--storage",
        storage,
        "--tracking-uri",
        tracking,
        "--no-report",
    ]
    procs = [subprocess.Popen(cmd, env=env) for _ in range(n)]
    try:
        codes = [p.wait() for p in procs]
    except BaseException:  # Ctrl-C / SIGTERM: stop the workers at a step boundary and wait for them
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        raise
    return next((c for c in codes if c), 0)  # a worker killed by a signal has a negative code


def _no_study(spec: SweepSpec, storage: str) -> ConfigError:
    return ConfigError(
        f"--attach: no study named '{spec.name}' in {mask_url(storage)}; start the sweep without --attach first."
    )


def _study_file_exists(spec: SweepSpec, storage: str) -> None:
    """A refused ``--attach`` leaves nothing behind: a SQLite study file that does not exist is not created."""
    if storage.startswith("sqlite:///") and storage != "sqlite:///:memory:":
        if not Path(storage.removeprefix("sqlite:///")).is_file():
            raise _no_study(spec, storage)


def _attached_study(spec: SweepSpec, storage: str):
    import optuna

    _study_file_exists(spec, storage)
    try:
        return optuna.load_study(study_name=spec.name, storage=_storage(storage, spec.max_retries))
    except KeyError:
        raise _no_study(spec, storage) from None


def check_attach_dir(spec: SweepSpec, study, run_dir: Path) -> None:
    """Refuse, in one sentence, an ``--attach`` worker whose run directory is not the study's: another sweep's
    directory, or the study's path where this machine does not see the shared directory (its trials would
    train elsewhere into duplicate child runs). The study's directory holds ``sweep.json`` naming the sweep
    and its MLflow parent run."""
    info = read_json(run_dir / "sweep.json")
    recorded = study.user_attrs.get("run_dir")
    parent = study.user_attrs.get("mlflow_parent_run_id")
    if info is None:
        raise ConfigError(
            f"--attach: the run directory '{run_dir}' does not hold the sweep '{spec.name}' (no sweep.json: not "
            f"the study's directory{f' {recorded}' if recorded else ''}, or its shared file system is not mounted "
            "here); pass --run-dir with the study's directory as this machine sees it."
        )
    if info.get("name") != spec.name or (parent and info.get("parent_run_id") != parent):
        raise ConfigError(
            f"--attach: the run directory '{run_dir}' holds another sweep ('{info.get('name')}', parent run "
            f"{info.get('parent_run_id')}), not the study '{spec.name}' (parent run {parent}); pass --run-dir "
            f"with the study's directory{f' ({recorded})' if recorded else ''} or leave it out."
        )


class _Stop(KeyboardInterrupt):
    """SIGTERM to the sweep command: stop like Ctrl-C, exit 143."""


_stop_requested = threading.Event()  # SIGTERM seen by this process, whoever's handler acted on it


def _on_sigterm(signum, frame) -> None:
    _stop_requested.set()
    if signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        return  # inside trainer.fit Lightning's handler (which calls this one) stops at the next step boundary
    raise _Stop()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="recursive_lightning sweep", description="Run an ablation sweep (Optuna + MLflow)."
    )
    p.add_argument(
        "file", nargs="?", default=str(DEFAULT_SWEEP), help="sweep YAML (default ablations/default.yaml)"
    )
    p.add_argument(
        "--run-dir", help="where trials, optuna.db, mlflow.db and the report go (default runs/sweeps/<name>)"
    )
    p.add_argument(
        "--workers", type=int, help="worker processes on this machine (default: the sweep file's, else 1)"
    )
    p.add_argument(
        "--storage",
        help="Optuna RDB URL (default sqlite:///<run-dir>/optuna.db; PostgreSQL for several machines)",
    )
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default sqlite:///<run-dir>/mlflow.db)")
    p.add_argument(
        "--attach",
        action="store_true",
        help="join an existing study as a worker (another machine, a scheduler's job): its run directory and "
        "tracking store default to the study's",
    )
    p.add_argument(
        "--prepare",
        action="store_true",
        help="create the study, its grid, the MLflow parent run and the data shards, then exit (before "
        "starting `--attach` workers from a scheduler)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--max-trials", type=int, help="stop this worker after N trials")
    p.add_argument("--no-report", action="store_true", help="skip the report at the end")
    args = p.parse_args(argv)
    quiet_libraries()
    if args.worker or not sys.stderr.isatty():
        # per-request progress bars (lm-eval, our evaluator) of parallel workers interleave into noise in a
        # log; the sweep prints one line per trial instead
        os.environ.setdefault("TQDM_DISABLE", "1")
    if os.environ.get("RL_TORCH_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["RL_TORCH_THREADS"]))
    sweep_file = Path(args.file)
    spec = load_sweep(sweep_file)
    from recursive_lightning.validation import check_late_fields  # read after training: checked now

    check_late_fields(spec, sweep_file.parent, str(sweep_file))
    if args.workers is not None and args.workers < 1:  # before the run directory is made
        raise ConfigError(f"--workers must be >= 1, not {args.workers}.")
    if args.attach and args.storage:
        _study_file_exists(spec, args.storage)  # opening a missing SQLite file would create it
    if args.max_trials is not None and args.max_trials < 1:
        raise ConfigError(
            f"--max-trials must be >= 1, not {args.max_trials}; leave it out to run until no grid point is left."
        )
    check_devices(spec, device_pool())  # one sentence before any work
    # an attached worker finds the run directory and tracking store the study was prepared with
    recorded = (
        recorded_study(args.storage, spec.name, args.tracking_uri) if args.attach and args.storage else {}
    )
    run_dir = Path(args.run_dir or recorded.get("run_dir") or Path("runs") / "sweeps" / spec.name).resolve()
    storage = args.storage or default_storage(run_dir)
    tracking = args.tracking_uri or recorded.get("tracking_uri") or default_tracking_uri(run_dir)
    problem = writable_dir_problem(run_dir)
    if problem is not None:  # a file, or read-only storage: one sentence, before any work
        raise ConfigError(
            f"the sweep's run directory '{run_dir}' cannot hold its trials: {problem}; pass --run-dir with a "
            "folder you can write to."
        )
    check_stores(storage, tracking)  # one sentence for a store the sweep cannot reach, before any work
    if args.attach:  # the study, its grid and its run directory, checked before anything is written
        study = _attached_study(spec, storage)
        check_unchanged(spec, study, run_dir, record=False, storage_url=storage)
        check_attach_dir(spec, study, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    workers = args.workers if args.workers is not None else spec.workers
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, not {workers}.")
    t0 = time.time()
    if args.worker:
        _die_with_parent(int(os.environ.get(PARENT_ENV) or os.getppid()))
    if not args.attach:
        prepare_study(spec, run_dir, storage, tracking)
        if args.prepare:
            prepare_data(spec)
            print(
                f"[sweep {spec.name}] prepared in {run_dir}; start workers (on any machine that reaches the stores "
                f"and this directory) with: sweep {sweep_file} --attach --storage {mask_url(storage)}",
                flush=True,
            )
            return 0
        print(
            f"[sweep {spec.name}] {len(spec.grid()) if spec.search is None else spec.search['n_trials']} trials; "
            f"study in {mask_url(storage)}; tracking {mask_url(tracking)}",
            flush=True,
        )
    # SIGTERM (a scheduler, or the command stopping its workers) ends the sweep like Ctrl-C: the parent run is
    # closed KILLED instead of staying RUNNING
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    if args.worker:
        worker(spec, run_dir, storage, tracking, max_trials=args.max_trials, take_over=not args.max_trials)
        return 0
    crashed = 0
    try:
        if workers > 1:
            prepare_data(spec)  # tokenise once here rather than racing in every worker
        while True:
            if workers > 1:
                crashed = _spawn_workers(workers, sweep_file, run_dir, storage, tracking)
            else:
                take_over = args.attach and not args.max_trials
                worker(spec, run_dir, storage, tracking, max_trials=args.max_trials, take_over=take_over)
            # trials that other live processes on this machine run are waited for, not reported as missing
            if crashed or args.max_trials or not _wait_for_local_trials(spec, storage):
                break
    except BaseException as e:  # Ctrl-C, SIGTERM (train stops at a step boundary), a crash: the sweep stopped
        if not args.attach:  # an attached worker stopping (pre-empted) does not end a sweep others still run
            close_parent(spec, storage, tracking, interrupted=True)
        print(
            f"[sweep {spec.name}] stopped; re-run the same command to resume it", file=sys.stderr, flush=True
        )
        if isinstance(e, _Stop):
            raise SystemExit(143) from None
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not args.no_report:
        from recursive_lightning.sweep.ranking import summary_line
        from recursive_lightning.sweep.report import write_report

        # one writer at a time: workers on several machines may end together (the report's files have fixed names)
        with _file_lock(run_dir / ".report.lock"), database_lock(storage, f"{spec.name}/report"):
            report = write_report(run_dir, spec=spec, storage_url=storage, tracking_uri=tracking)
        print(report["markdown"])
        print(f"\nreport: {report['path']}")
        print(f"best: {summary_line(report)}")
    faults.point("before_close_parent")
    status = close_parent(spec, storage, tracking)
    print(ui_hint(run_dir, tracking))
    if status == "FINISHED":
        print(f"[sweep {spec.name}] finished in {time.time() - t0:.0f}s", flush=True)
        return 0
    if status == "FAILED":
        print(
            f"[sweep {spec.name}] FAILED: some grid points failed after their retries; see the report",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_FAILED
    unfinished = _unfinished(spec, storage)
    if (
        args.attach
        and not crashed
        and unfinished["running"]
        and not unfinished["waiting"]
        and not args.max_trials
    ):
        # a scheduler's worker is done: live workers (their heartbeats advance) run the last trials
        print(
            f"[sweep {spec.name}] this worker is done: no grid point is waiting and live workers run "
            f"{', '.join(unfinished['running'])}; the worker that ends the last trial closes the sweep",
            flush=True,
        )
        return 0
    left = unfinished["waiting"] + unfinished["running"]
    again = (
        f"sweep {sweep_file} --attach --storage {mask_url(storage)}"
        if args.attach
        else f"sweep {sweep_file} --run-dir {run_dir}"
        + (f" --storage {mask_url(storage)}" if args.storage else "")
    )
    why = (
        f"a worker process exited with code {crashed}"
        if crashed
        else "trials are still waiting or running (other machines or --max-trials)"
    )
    shown = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
    print(
        f"[sweep {spec.name}] not finished: {why}; unfinished grid point(s) {shown or '(none named)'}: run "
        f"`{again}` to finish them (the report is partial until then)",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_UNFINISHED
