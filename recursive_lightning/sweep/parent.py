"""The sweep's MLflow parent run: created with the study (its id kept as the study's user attribute
``mlflow_parent_run_id``), running again on every re-run, and closed FINISHED, FAILED or KILLED by whichever
process ends the last trial (or stops the sweep)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from recursive_lightning import faults
from recursive_lightning.run_dir import SweepDir
from recursive_lightning.sweep.spec import SweepSpec, point_key
from recursive_lightning.sweep.study import load_study
from recursive_lightning.tracking.runs import (
    client,
    create_run,
    ensure_experiment,
    log_artifact,
    log_params,
    set_terminated,
)
from recursive_lightning.uris import mask_url


def open_parent(spec: SweepSpec, study, run_dir: Path, storage_url: str, tracking_uri: str) -> str:
    """The id of the sweep's MLflow parent run: made (with the sweep's params and file) on the first run of the
    sweep, set RUNNING again by a re-run, which records where the sweep directory and its store lie now."""
    exp_id = ensure_experiment(tracking_uri, spec.name, SweepDir(run_dir).artifacts)
    parent = study.user_attrs.get("mlflow_parent_run_id")
    if parent is None:
        parent = create_run(
            tracking_uri, exp_id, f"sweep:{spec.name}", tags={"sweep": spec.name, "kind": "sweep"}
        )
        try:  # until the study records it, a stop would leave a RUNNING run that no re-run knows of
            faults.point("parent_created")
            study.set_user_attr("mlflow_parent_run_id", parent)
        except BaseException:
            with contextlib.suppress(Exception):
                set_terminated(tracking_uri, parent, "KILLED")
            raise
        study.set_user_attr("tracking_uri", mask_url(tracking_uri))  # its password filled in where read
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
        for k, v in (("tracking_uri", mask_url(tracking_uri)), ("run_dir", str(run_dir))):
            if study.user_attrs.get(k) != v:
                study.set_user_attr(k, v)
    return parent


def sweep_state(spec: SweepSpec, study) -> str | None:
    """FINISHED when every grid point (or, for a search, some trial) finished, FAILED when one gave up after
    its retries, None while trials are waiting or running (here, in other processes or on other machines)."""
    from optuna.trial import TrialState  # heavy

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
    study = load_study(spec, storage_url)
    parent = study.user_attrs.get("mlflow_parent_run_id")
    if parent is None:
        return None
    status = sweep_state(spec, study)
    if interrupted and status is None:
        status = "KILLED"
    if status is not None:
        set_terminated(tracking_uri, parent, status)
    return status
