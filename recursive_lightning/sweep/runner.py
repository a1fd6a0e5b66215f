"""``python -m recursive_lightning sweep``: an Optuna study per sweep file, one MLflow child run per trial.

Grid points are enqueued once as WAITING trials; each worker claims one (Optuna's WAITING -> RUNNING
transition, made atomic for SQLite studies by a file lock, see ``_claim_lock``), trains it with :func:`recursive_lightning.training.run.train` into
``<run-dir>/trials/<point>/`` and tells the study. Re-running the command resumes: finished trials
are skipped, a trial whose local worker died is put back to WAITING and resumes from its last
checkpoint into the same MLflow child run; a trial whose remote worker stopped sending heartbeats is
failed and retried by Optuna's ``RetryFailedTrialCallback``; a trial that raises is retried up to
``max_retries`` times and then reported.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
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

from recursive_lightning.errors import ConfigError
from recursive_lightning.sweep.spec import SweepSpec, load_sweep, point_key
from recursive_lightning.tracking import (
    atomic_write_text,
    client,
    create_run,
    default_tracking_uri,
    ensure_experiment,
    log_artifact,
    log_params,
    set_terminated,
    ui_command,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SWEEP = REPO / "ablations" / "default.yaml"
HEARTBEAT_S = 20
GRACE_S = 90


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
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prepare_study(spec: SweepSpec, run_dir: Path, storage_url: str, tracking_uri: str):
    """Create or load the study, enqueue missing grid points, make the MLflow parent run."""
    import optuna
    from optuna.trial import TrialState

    storage = _storage(storage_url, spec.max_retries)
    sampler = optuna.samplers.TPESampler(seed=0) if spec.search else None
    study = optuna.create_study(
        study_name=spec.name, storage=storage, direction="minimize", load_if_exists=True, sampler=sampler
    )
    trials = study.get_trials(deepcopy=False)
    if spec.search is None:
        present = {t.user_attrs.get("point_key") for t in trials}
        for point in spec.grid():
            key = point_key(point)
            if key not in present:
                study.enqueue_trial(point, user_attrs={"point_key": key, "attempt": 0}, skip_if_exists=False)
    # trials whose worker on this machine died (killed sweep): back to WAITING, same trial, same directory
    host = socket.gethostname()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t.system_attrs.get("host") == host and not _pid_alive(int(t.system_attrs.get("pid", -1))):
            storage.set_trial_state_values(t._trial_id, state=TrialState.WAITING)
    # the MLflow parent run of the sweep
    exp_id = ensure_experiment(tracking_uri, spec.name, run_dir / "mlartifacts")
    parent = study.user_attrs.get("mlflow_parent_run_id")
    if parent is None:
        parent = create_run(
            tracking_uri, exp_id, f"sweep:{spec.name}", tags={"sweep": spec.name, "kind": "sweep"}
        )
        study.set_user_attr("mlflow_parent_run_id", parent)
        study.set_user_attr("tracking_uri", tracking_uri)
        log_params(
            tracking_uri,
            parent,
            {
                "sweep.name": spec.name,
                "sweep.file": str(spec.path),
                "sweep.axes": json.dumps({a.name: a.labels for a in spec.axes}, default=str),
                "sweep.storage": storage_url,
                "sweep.grid_size": len(spec.grid()),
            },
        )
        if spec.path is not None:
            log_artifact(tracking_uri, parent, spec.path)
    else:  # a re-run continues the sweep: its parent run is running again
        client(tracking_uri).update_run(parent, status="RUNNING")
    if spec.path is not None:
        atomic_write_text(run_dir / "sweep.yaml", spec.path.read_text())
    atomic_write_text(
        run_dir / "sweep.json",
        json.dumps(
            {"name": spec.name, "storage": storage_url, "tracking_uri": tracking_uri, "parent_run_id": parent}
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
    with open(f"{path}.claim-lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _claim(study, storage, storage_url: str) -> int | None:
    """Move one WAITING trial to RUNNING and return its id (None when none is waiting)."""
    from optuna.trial import TrialState

    with _claim_lock(storage_url):
        for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            if storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                return t._trial_id
    return None


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


def run_trial(spec: SweepSpec, study, trial_id: int, run_dir: Path, tracking_uri: str, parent: str) -> None:
    import optuna
    from optuna.trial import TrialState

    from recursive_lightning.training.run import train

    trial = optuna.trial.Trial(study, trial_id)
    if spec.search is None:
        point = {a.name: trial.suggest_categorical(a.name, a.labels) for a in spec.axes}
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
    key = trial.user_attrs.get("point_key") or point_key(point)
    trial.set_user_attr("point_key", key)
    cfg = spec.trial_config(point)
    trial_dir = run_dir / "trials" / key
    resume = (trial_dir / "checkpoints").exists() and any((trial_dir / "checkpoints").glob("*.ckpt"))
    callbacks = []
    pruner_cb = None
    if spec.pruning.get("enabled"):
        pruner_cb = PruningCallback(trial, spec.metric, int(spec.pruning.get("warmup_steps", 0)))
        callbacks.append(pruner_cb)
    label = ", ".join(f"{k}={v}" for k, v in point.items())
    print(
        f"[sweep {spec.name}] trial {trial.number}: {label}" + (" (resuming)" if resume else ""), flush=True
    )
    tags = {
        "sweep": spec.name,
        "optuna.trial_number": str(trial.number),
        "point_key": key,
        "optuna.study": spec.name,
    }
    if _multi_process(cfg):
        result = _train_in_subprocess(cfg, trial_dir, resume, tracking_uri, spec.name, key, parent, tags)
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
        )
    metrics = dict(result.metrics)
    if spec.evaluate:  # perplexity sets and (optionally) lm-eval tasks on the finished trial
        from recursive_lightning.evaluation.run import evaluate_checkpoint, flat_metrics

        ev = spec.evaluate
        here = spec.path.parent if spec.path is not None else Path.cwd()
        ppl = {k: str((here / v).resolve()) for k, v in (ev.get("ppl") or {}).items()}
        include = ev.get("include_path")
        out = evaluate_checkpoint(
            result.last_checkpoint,
            ppl_sets=ppl or None,
            tasks=ev.get("tasks") or [],
            shots=ev.get("shots", [0]),
            limit=ev.get("limit"),
            tracking_uri=tracking_uri,
            include_path=str((here / include).resolve()) if include else None,
        )
        metrics.update(flat_metrics(out))
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri)
    c.set_tag(result.mlflow_run_id, "checkpoint", str(result.last_checkpoint))
    c.set_tag(result.mlflow_run_id, "optuna.trial_number", str(trial.number))
    trial.set_user_attr("metrics", metrics)
    trial.set_user_attr("mlflow_run_id", result.mlflow_run_id)
    trial.set_user_attr("checkpoint", str(result.last_checkpoint))
    trial.set_user_attr("config", cfg.flat())
    trial.set_user_attr("steps", result.steps)
    if pruner_cb is not None and pruner_cb.pruned:
        study.tell(trial, state=TrialState.PRUNED)
        return
    value = metrics.get(spec.metric)
    if value is None:
        raise RuntimeError(f"metric {spec.metric} was not produced by the trial (have: {sorted(metrics)})")
    study.tell(trial, float(value))


def _multi_process(cfg) -> bool:
    t = cfg.train
    devices = t.devices if isinstance(t.devices, int) else 2
    return t.strategy in ("ddp", "fsdp") or devices > 1 or t.num_nodes > 1


def _train_in_subprocess(
    cfg,
    trial_dir: Path,
    resume: bool,
    tracking_uri: str,
    experiment: str,
    key: str,
    parent: str,
    tags: dict[str, str],
):
    """A multi-device trial (DDP / FSDP2) runs as its own `train` command: Lightning's launcher re-executes
    that command once per rank, which it cannot do for a sweep worker. Pruning is not available there."""
    from recursive_lightning.training.run import TrainResult

    trial_dir.mkdir(parents=True, exist_ok=True)
    cfg_file = trial_dir / "trial.yaml"
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
    if resume:
        cmd.append("--resume")
    subprocess.run(cmd, check=True)
    r = json.loads((trial_dir / "result.json").read_text())
    return TrainResult(
        run_dir=Path(r["run_dir"]),
        steps=r["steps"],
        tokens=r["tokens"],
        metrics=r["metrics"],
        last_checkpoint=Path(r["last_checkpoint"]) if r["last_checkpoint"] else None,
        best_checkpoint=Path(r["best_checkpoint"]) if r["best_checkpoint"] else None,
        mlflow_run_id=r["mlflow_run_id"],
        tracking_uri=r["tracking_uri"],
        seconds=r["seconds"],
    )


def worker(
    spec: SweepSpec, run_dir: Path, storage_url: str, tracking_uri: str, max_trials: int | None = None
) -> int:
    """Claim and run trials until none is waiting; returns the number of trials run here."""
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
            if trial_id is None:
                break
        else:
            n = len(
                study.get_trials(
                    deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING, TrialState.PRUNED)
                )
            )
            trial_id = _claim(study, storage, storage_url)
            if trial_id is None:
                if n >= int(spec.search["n_trials"]):
                    break
                trial_id = study.ask()._trial_id
        storage.set_trial_system_attr(trial_id, "host", socket.gethostname())
        storage.set_trial_system_attr(trial_id, "pid", os.getpid())
        with _Heartbeat(storage, trial_id):
            try:
                run_trial(spec, study, trial_id, run_dir, tracking_uri, parent)
            except KeyboardInterrupt:
                raise
            except Exception as e:
                trial = storage.get_trial(trial_id)
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
                            "point_key": trial.user_attrs.get("point_key"),
                            "attempt": attempt + 1,
                            "retry_of": trial.number,
                        },
                        skip_if_exists=False,
                    )
        done += 1
    return done


def prepare_data(spec: SweepSpec) -> None:
    """Build the tokenizer and token shards of every distinct data section of the grid, once."""
    from recursive_lightning.training.run import build_datamodule

    seen = set()
    for point in spec.grid() if spec.search is None else [{}]:
        cfg = spec.trial_config(point)
        key = json.dumps(cfg.to_dict()["data"], sort_keys=True)
        if key not in seen:
            seen.add(key)
            build_datamodule(cfg).prepare_data()


def close_parent(
    spec: SweepSpec, storage_url: str, tracking_uri: str, interrupted: bool = False
) -> str | None:
    """End the sweep's MLflow parent run once no trial is waiting or running: FINISHED when every grid point
    (or, for a search, some trial) finished, FAILED when one gave up after its retries, KILLED on Ctrl-C.
    Returns the status set, or None while trials are still under way (other workers or machines)."""
    import optuna
    from optuna.trial import TrialState

    study = optuna.load_study(study_name=spec.name, storage=_storage(storage_url, spec.max_retries))
    parent = study.user_attrs.get("mlflow_parent_run_id")
    trials = study.get_trials(deepcopy=False)
    if parent is None:
        return None
    if interrupted:
        status = "KILLED"
    elif any(t.state in (TrialState.WAITING, TrialState.RUNNING) for t in trials):
        return None
    else:
        done = {
            t.user_attrs.get("point_key")
            for t in trials
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
        }
        if spec.search is None:
            ok = all(point_key(p) in done for p in spec.grid())
        else:
            ok = bool(done)
        status = "FINISHED" if ok else "FAILED"
    set_terminated(tracking_uri, parent, status)
    return status


def _spawn_workers(n: int, sweep_file: Path, run_dir: Path, storage: str, tracking: str) -> int:
    threads = max(1, (os.cpu_count() or 2) // n)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "RL_TORCH_THREADS": str(threads)}
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
    except KeyboardInterrupt:
        for p in procs:
            p.send_signal(signal.SIGINT)
        raise
    return next((c for c in codes if c), 0)  # a worker killed by a signal has a negative code


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
    p.add_argument("--attach", action="store_true", help="join an existing study (e.g. from another machine)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--max-trials", type=int, help="stop this worker after N trials")
    p.add_argument("--no-report", action="store_true", help="skip the report at the end")
    args = p.parse_args(argv)
    quiet_libraries()
    if os.environ.get("RL_TORCH_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["RL_TORCH_THREADS"]))
    sweep_file = Path(args.file)
    spec = load_sweep(sweep_file)
    run_dir = Path(args.run_dir or Path("runs") / "sweeps" / spec.name).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    storage = args.storage or default_storage(run_dir)
    tracking = args.tracking_uri or default_tracking_uri(run_dir)
    workers = args.workers if args.workers is not None else spec.workers
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, not {workers}.")
    t0 = time.time()
    if not args.attach:
        prepare_study(spec, run_dir, storage, tracking)
        print(
            f"[sweep {spec.name}] {len(spec.grid()) if spec.search is None else spec.search['n_trials']} trials; "
            f"study in {storage}; tracking {tracking}",
            flush=True,
        )
    else:
        import optuna

        try:
            optuna.load_study(study_name=spec.name, storage=_storage(storage, spec.max_retries))
        except KeyError:
            raise ConfigError(
                f"--attach: no study named '{spec.name}' in {storage}; start the sweep without --attach first."
            ) from None
    crashed = 0
    try:
        if workers > 1 and not args.worker:
            prepare_data(spec)  # tokenise once here rather than racing in every worker
            crashed = _spawn_workers(workers, sweep_file, run_dir, storage, tracking)
        else:
            worker(spec, run_dir, storage, tracking, max_trials=args.max_trials)
    except KeyboardInterrupt:
        if not args.worker:
            close_parent(spec, storage, tracking, interrupted=True)
        raise
    if args.worker:
        return 0
    if not args.no_report:
        from recursive_lightning.sweep.report import write_report

        report = write_report(run_dir, spec=spec, storage_url=storage, tracking_uri=tracking)
        print(report["markdown"])
        print(f"\nsweep finished in {time.time() - t0:.0f}s; report: {report['path']}")
    status = close_parent(spec, storage, tracking)
    if status == "FAILED":
        print(f"[sweep {spec.name}] some grid points failed after their retries; see the report", flush=True)
    print(f"compare the runs: {ui_command(tracking)}")
    if crashed:
        print(
            f"[sweep {spec.name}] a worker process exited with code {crashed}; re-run the same command to "
            "resume its trial",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0
