"""Which worker runs which trial: a worker claims a waiting trial (WAITING -> RUNNING, recording its host and
pid), sends heartbeats while it trains, puts back the trials of dead workers on this machine and takes over
those whose remote worker stopped sending heartbeats; a sweep command waits for the trials other live processes
on this machine run (``wait_for_local_trials``)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from recursive_lightning.sweep.spec import SweepSpec
from recursive_lightning.sweep.study import claim_lock, open_storage

POLL_S = 2.0  # how often a worker looks again at running trials (of other workers, here or elsewhere)


def pid_alive(pid: int) -> bool:
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


def requeue_dead_local(study, storage, storage_url: str) -> list[int]:
    """Trials whose worker on this machine died (a killed sweep) go back to WAITING: same trial, same directory,
    resumed from its last checkpoint. In a SQLite study (every worker on this machine) a running trial that
    names no worker was claimed by a process killed before it could: it goes back too. Returns their numbers."""
    from optuna.exceptions import UpdateFinishedTrialError  # heavy
    from optuna.trial import TrialState  # heavy

    host, out = socket.gethostname(), []
    with claim_lock(storage_url):  # no claim is half done while we look
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            pid = t.system_attrs.get("pid")
            if pid is None:
                dead = storage_url.startswith("sqlite")
            else:
                dead = t.system_attrs.get("host") == host and not pid_alive(int(pid))
            # (on a server database another worker may have failed it as stale since the list was read)
            with contextlib.suppress(UpdateFinishedTrialError):
                if dead and storage.set_trial_state_values(t._trial_id, state=TrialState.WAITING):
                    out.append(t.number)
    return out


class Heartbeat:
    """Record the trial's heartbeat every ``storage.heartbeat_interval`` seconds while the body runs."""

    def __init__(self, storage, trial_id: int) -> None:
        self.storage, self.trial_id = storage, trial_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.storage.heartbeat_interval):
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


def claim(study, storage, storage_url: str, ask: bool = False) -> int | None:
    """Move one WAITING trial to RUNNING (or, with ``ask``, start a new one when none waits), record this
    process as its worker, and return its id (None when none is waiting)."""
    from optuna.exceptions import UpdateFinishedTrialError  # heavy
    from optuna.trial import TrialState  # heavy

    with claim_lock(storage_url):
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
    import sqlalchemy  # heavy
    from optuna.storages._rdb import models  # heavy
    from optuna.trial import TrialState  # heavy

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


def take_over_stale(study, storage, storage_url: str) -> int | None:
    """No grid point is waiting: watch the other workers' running trials until each is shown alive (its
    heartbeat advances: left to its worker) or taken over. A trial whose heartbeats stop goes stale after
    the grace period (Optuna fails it and enqueues its retry, ``RetryHeartbeatStaleTrialCallback``, claimed
    here); one that never sent a heartbeat (its worker died between its claim and its first beat, which Optuna
    never calls stale) is put back to WAITING once it has been seen without one for the grace period. The
    claimed trial resumes from the dead worker's last checkpoint in the shared run directory, into the same
    MLflow child run. Returns None when no trial is running or every running one has a live worker."""
    from optuna.exceptions import UpdateFinishedTrialError  # heavy
    from optuna.storages import fail_stale_trials  # heavy
    from optuna.trial import TrialState  # heavy

    grace = storage.grace_period
    first: dict[int, tuple[Any, Any]] = {}  # trial id -> (heartbeat, database time) when first seen
    alive: set[int] = set()
    announced = False
    while True:
        fail_stale_trials(study)
        trial_id = claim(study, storage, storage_url)
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
            elif beat is None and (now - seen).total_seconds() > grace:
                with claim_lock(storage_url), contextlib.suppress(UpdateFinishedTrialError):
                    storage.set_trial_state_values(tid, state=TrialState.WAITING)
            else:
                suspects.append(tid)
        if not suspects:
            return None
        # a live worker beats every heartbeat interval: say nothing until a trial has missed two beats
        late = any((now - first[t][1]).total_seconds() > 2 * storage.heartbeat_interval for t in suspects)
        if late and not announced:
            print(
                f"[sweep {study.study_name}] {len(suspects)} running trial(s) sent no recent heartbeat: watching "
                f"them up to {grace}s to take over any whose worker died",
                flush=True,
            )
            announced = True
        time.sleep(min(float(storage.heartbeat_interval), POLL_S))


def wait_for_local_trials(spec: SweepSpec, storage_url: str) -> bool:
    """Wait while trials of the study are run by other live processes on this machine (an earlier sweep
    command's workers, a concurrent sweep command). Returns True when trials are waiting again (one of those
    processes died and its trial went back to WAITING, or a retry was enqueued): run a worker again."""
    import optuna  # heavy
    from optuna.trial import TrialState  # heavy

    storage = open_storage(storage_url, spec.max_retries)
    host, announced = socket.gethostname(), False
    while True:
        study = optuna.load_study(study_name=spec.name, storage=storage)
        requeue_dead_local(study, storage, storage_url)
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
