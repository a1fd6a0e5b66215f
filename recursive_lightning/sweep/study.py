"""A sweep's Optuna study: its storage (SQLite file or PostgreSQL server), the locks around it, its grid and the
grid's growth, and the run directory that records it (``sweep.json``, ``sweep.yaml``).

A grid point is a WAITING trial enqueued with the point as fixed parameters and user attribute ``point``
(``point_key`` names its directory); a grown grid (one more seed, a new row) only enqueues the new points.
The study's ``resolved_spec`` attribute holds the config of every grid point it ran: a sweep file that would
change one of them is refused (``check_unchanged``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from recursive_lightning.errors import ConfigError
from recursive_lightning.files import atomic_write_text, read_json
from recursive_lightning.run_dir import SweepDir
from recursive_lightning.sweep.spec import SweepSpec, point_key
from recursive_lightning.tracking.runs import portable_uri
from recursive_lightning.uris import mask_url


def heartbeat_from_env() -> tuple[int, int]:
    """(heartbeat interval, grace period) in seconds from ``RECURSIVE_LIGHTNING_HEARTBEAT="INTERVAL,GRACE"``
    (whole seconds, e.g. for a cluster or the tests; default 20, 90)."""
    parts = os.environ.get("RECURSIVE_LIGHTNING_HEARTBEAT", "20,90").split(",")
    return int(parts[0]), int(parts[-1]) if len(parts) > 1 else 90


# a trial whose worker sent no heartbeat for GRACE_S is failed and retried (workers on other machines); the
# storage carries both (``storage.heartbeat_interval``, ``storage.grace_period``) to the workers that use it
HEARTBEAT_S, GRACE_S = heartbeat_from_env()
RESOLVED_ATTR = "resolved_spec"  # study attribute: the resolved config of every grid point the study ran
# config fields that may differ between runs of one sweep without changing any result
NEUTRAL_KEYS = {"train.progress", "train.keep_host_memory", "data.cache_dir", "data.num_workers"}


def default_storage(run_dir: Path) -> str:
    return f"sqlite:///{SweepDir(run_dir.resolve()).optuna_db}"


def open_storage(url: str, max_retries: int):
    """The study's Optuna RDB storage, with heartbeats: a trial whose worker stops sending them is failed and
    re-enqueued (same params) up to ``max_retries`` times."""
    import optuna  # heavy
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback  # heavy

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 120}}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return RDBStorage(
        url,
        heartbeat_interval=HEARTBEAT_S,
        grace_period=GRACE_S,
        heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=max_retries),
        **kwargs,
    )


def load_study(spec: SweepSpec, storage_url: str):
    """The sweep's existing study (KeyError when there is none)."""
    import optuna  # heavy

    return optuna.load_study(study_name=spec.name, storage=open_storage(storage_url, spec.max_retries))


@contextlib.contextmanager
def file_lock(path: str | Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def claim_lock(storage_url: str) -> Iterator[None]:
    """Serialise claims of the workers that share one SQLite study.

    Optuna checks WAITING before setting RUNNING under ``SELECT ... FOR UPDATE``, which SQLite ignores, and
    pysqlite runs that SELECT outside the write transaction: two processes both read WAITING and both claim
    the trial (then train it twice into one directory). A file lock beside the database makes the check and
    the set one step. Server databases (PostgreSQL, MySQL; several machines) lock the row themselves."""
    path = storage_url.removeprefix("sqlite:///") if storage_url.startswith("sqlite:///") else ""
    if not path or path == ":memory:":
        yield
        return
    with file_lock(f"{path}.claim-lock"):
        yield


def resolved_spec(spec: SweepSpec) -> dict[str, Any]:
    """What decides a sweep's results: its metric, search, pruning and evaluation, and every grid point's config."""
    points = spec.points()
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
    kept = SweepDir(run_dir).spec
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


def check_run_dir_holds(spec: SweepSpec, run_dir: Path) -> None:
    """Refuse a run directory that holds another sweep (its ``sweep.json`` names it)."""
    info = SweepDir(run_dir).info
    if info.is_file():
        held = json.loads(info.read_text()).get("name")
        if held and held != spec.name:
            raise ConfigError(
                f"'{run_dir}' holds the sweep '{held}', not '{spec.name}'; run '{spec.name}' into its own --run-dir."
            )


def create_study(spec: SweepSpec, run_dir: Path, storage_url: str):
    """Create or load the sweep's study (refused when the sweep file changed a grid point it holds), record
    the file's grid and enqueue the grid points it lacks. Returns (study, storage)."""
    import optuna  # heavy

    storage = open_storage(storage_url, spec.max_retries)
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
    return study, storage


def record_run_dir(spec: SweepSpec, run_dir: Path, storage_url: str, tracking_uri: str, parent: str) -> None:
    """Keep the sweep file (``sweep.yaml``) and where its stores and MLflow parent run are (``sweep.json``) in
    the run directory."""
    if spec.path is not None:
        atomic_write_text(SweepDir(run_dir).spec, spec.path.read_text())
    atomic_write_text(
        SweepDir(run_dir).info,
        json.dumps(
            {
                "name": spec.name,
                # stores inside the sweep directory are kept relative to it: a moved copy finds its own; a
                # password is masked (filled in again where read: uris.reveal)
                "storage": mask_url(portable_uri(storage_url, run_dir)),
                "tracking_uri": mask_url(portable_uri(tracking_uri, run_dir)),
                "parent_run_id": parent,
                # the kept sweep.yaml's relative paths (base:, evaluate.ppl) resolve from here
                "sweep_dir": str(spec.path.parent.resolve()) if spec.path is not None else None,
            }
        ),
    )


def unfinished(spec: SweepSpec, storage_url: str) -> dict[str, list[str]]:
    """The grid points of trials still waiting and still running."""
    from optuna.trial import TrialState  # heavy

    study = load_study(spec, storage_url)
    out: dict[str, list[str]] = {"waiting": [], "running": []}
    for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING)):
        key = str(t.user_attrs.get("point_key") or f"trial {t.number}")
        out["waiting" if t.state == TrialState.WAITING else "running"].append(key)
    return out


def _no_study(spec: SweepSpec, storage: str) -> ConfigError:
    return ConfigError(
        f"--attach: no study named '{spec.name}' in {mask_url(storage)}; start the sweep without --attach first."
    )


def check_study_file_exists(spec: SweepSpec, storage: str) -> None:
    """A refused ``--attach`` leaves nothing behind: a SQLite study file that does not exist is not created."""
    if storage.startswith("sqlite:///") and storage != "sqlite:///:memory:":
        if not Path(storage.removeprefix("sqlite:///")).is_file():
            raise _no_study(spec, storage)


def attached_study(spec: SweepSpec, storage: str):
    """The study an ``--attach`` worker joins (one sentence when there is none)."""
    check_study_file_exists(spec, storage)
    try:
        return load_study(spec, storage)
    except KeyError:
        raise _no_study(spec, storage) from None


def check_attach_dir(spec: SweepSpec, study, run_dir: Path) -> None:
    """Refuse, in one sentence, an ``--attach`` worker whose run directory is not the study's: another sweep's
    directory, or the study's path where this machine does not see the shared directory (its trials would
    train elsewhere into duplicate child runs). The study's directory holds ``sweep.json`` naming the sweep
    and its MLflow parent run."""
    info = read_json(SweepDir(run_dir).info)
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


def check_study_dir(spec: SweepSpec, storage: str, run_dir: Path) -> None:
    """Refuse, in one sentence, a run directory other than the one an existing study (``--storage``) runs in
    while that directory still holds it (its ``sweep.json`` names the sweep): the study would be re-pointed to
    the new directory, its trials and report split between the two. A study whose directory was moved (the
    recorded one holds it no more) follows it."""
    if storage.startswith("sqlite:///") and not Path(storage.removeprefix("sqlite:///")).is_file():
        return  # no study yet (opening the file would create it)
    try:
        study = load_study(spec, storage)
    except KeyError:
        return
    recorded = study.user_attrs.get("run_dir")
    if not recorded or Path(recorded).resolve() == run_dir.resolve():
        return
    info = read_json(SweepDir(recorded).info)
    if not isinstance(info, dict) or info.get("name") != spec.name:
        return
    # an edited file meets the study wherever it runs: that conflict, and its fix (a new `name:`), first
    check_unchanged(spec, study, run_dir, record=False, storage_url=storage)
    raise ConfigError(
        f"--run-dir '{run_dir}': the study '{spec.name}' in {mask_url(storage)} runs in '{recorded}'; pass "
        f"--run-dir {recorded} to continue it there, or give the sweep file a new `name:` to start another study."
    )
