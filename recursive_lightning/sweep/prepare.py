"""What a sweep does before its first trial: the sweep file and the options checked (``checked_spec``), the run
directory and the stores found and checked (``locations``), the study with its grid and the MLflow parent run
(``prepare_study``), the data (``prepare_data``). ``sweep --prepare`` stops after them."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from recursive_lightning import faults
from recursive_lightning.data.tokenizer import INIT_TOKENIZER
from recursive_lightning.errors import ConfigError
from recursive_lightning.files import writable_dir_problem
from recursive_lightning.run_dir import SweepDir
from recursive_lightning.sweep.checks import check_grid_data, check_late_fields
from recursive_lightning.sweep.claims import requeue_dead_local
from recursive_lightning.sweep.devices import check_devices, check_machine, device_pool
from recursive_lightning.sweep.launch import check_workers
from recursive_lightning.sweep.options import SweepOptions
from recursive_lightning.sweep.parent import close_parent, open_parent
from recursive_lightning.sweep.servers import check_stores, database_lock, recorded_study
from recursive_lightning.sweep.spec import SweepSpec, load_sweep
from recursive_lightning.sweep.study import (
    attached_study,
    check_attach_dir,
    check_run_dir_holds,
    check_study_dir,
    check_study_file_exists,
    check_unchanged,
    create_study,
    default_storage,
    file_lock,
    record_run_dir,
)
from recursive_lightning.tracking.runs import default_tracking_uri
from recursive_lightning.training.run import prepare_corpus


def checked_spec(sweep_file: Path, o: SweepOptions) -> SweepSpec:
    """The sweep file, read and checked with the options before any work: its late fields, the counts, the
    study an attached worker joins, the devices and what this machine can train."""
    spec = load_sweep(sweep_file)
    check_late_fields(spec, sweep_file.parent, str(sweep_file))  # read after training: checked now
    check_grid_data(spec)  # a data.path every trial would fail on
    if o.workers is not None and o.workers < 1:  # before the run directory is made
        raise ConfigError(f"--workers must be >= 1, not {o.workers}.")
    if not o.worker and not o.prepare:  # the processes this command would start here
        check_workers(o.workers if o.workers is not None else spec.workers, len(device_pool()))
    if o.attach and o.storage:
        check_study_file_exists(spec, o.storage)  # opening a missing SQLite file would create it
    if o.max_trials is not None and o.max_trials < 1:
        raise ConfigError(
            f"--max-trials must be >= 1, not {o.max_trials}; leave it out to run until no grid point is left."
        )
    check_devices(spec, device_pool())  # one sentence before any work
    if not o.prepare:  # what this machine trains: combinations its kind refuses, before the first trial
        check_machine(spec)
    return spec


def locations(spec: SweepSpec, o: SweepOptions) -> tuple[Path, str, str]:
    """(run directory, study storage, tracking store) of the sweep, each checked before anything is written;
    the run directory made. An attached worker finds the directory and store the study was prepared with."""
    recorded = recorded_study(o.storage, spec.name, o.tracking_uri) if o.attach and o.storage else {}
    run_dir = Path(o.run_dir or recorded.get("run_dir") or Path("runs") / "sweeps" / spec.name).resolve()
    storage = o.storage or default_storage(run_dir)
    tracking = o.tracking_uri or recorded.get("tracking_uri") or default_tracking_uri(run_dir)
    problem = writable_dir_problem(run_dir)
    if problem is not None:  # a file, or read-only storage: one sentence, before any work
        raise ConfigError(
            f"the sweep's run directory '{run_dir}' cannot hold its trials: {problem}; pass --run-dir with a "
            "folder you can write to."
        )
    check_stores(storage, tracking)  # one sentence for a store the sweep cannot reach, before any work
    if o.storage and not o.attach:  # an existing study is not re-pointed to another directory
        check_study_dir(spec, storage, run_dir)
    if o.attach:  # the study, its grid and its run directory, checked before anything is written
        study = attached_study(spec, storage)
        check_unchanged(spec, study, run_dir, record=False, storage_url=storage)
        check_attach_dir(spec, study, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, storage, tracking


def prepare_study(spec: SweepSpec, run_dir: Path, storage_url: str, tracking_uri: str):
    """Create or load the study, enqueue missing grid points, make the MLflow parent run. Returns (study,
    parent run id).

    One command at a time does this for a run directory (a file lock in it): a second ``sweep`` started on the
    same fresh directory waits until the study, the MLflow store and the parent run exist, then joins the
    sweep as more workers (creating the stores concurrently fails inside SQLAlchemy)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    # across machines on one PostgreSQL study, an advisory lock in its database (servers.database_lock)
    with file_lock(SweepDir(run_dir).sweep_lock), database_lock(storage_url, spec.name):
        check_run_dir_holds(spec, run_dir)
        study, storage = create_study(spec, run_dir, storage_url)
        requeue_dead_local(study, storage, storage_url)
        parent = open_parent(spec, study, run_dir, storage_url, tracking_uri)
        try:
            faults.point("parent_opened")  # tests: a stop with the parent run RUNNING, before any trial
            record_run_dir(spec, run_dir, storage_url, tracking_uri, parent)
        except BaseException:  # SIGTERM, Ctrl-C, a failure: the parent this command opened is closed
            with contextlib.suppress(Exception):
                close_parent(spec, storage_url, tracking_uri, interrupted=True)
            raise
        return study, parent


def prepare_data(spec: SweepSpec) -> None:
    """Build the tokenizer and token shards of every distinct data section of the grid, once."""
    seen = set()
    for point in spec.points():
        cfg = spec.trial_config(point)
        key = json.dumps(cfg.to_dict()["data"], sort_keys=True)
        if cfg.data.tokenizer.strip() == INIT_TOKENIZER:
            continue  # an uptraining trial's tokenizer is its source's, copied when the trial starts
        if key not in seen:
            seen.add(key)
            prepare_corpus(cfg)
