"""``run_sweep``: an Optuna study per sweep file, one MLflow child run per trial (the ``sweep`` command:
``commands/sweep.py``).

It prepares the study and its grid (``study``), the MLflow parent run (``parent``), runs workers here
(``launch``: ``--workers N`` processes) that claim and run trials (``trial``: where a trial is decided
finished), waits for trials other live processes on this machine still run, writes the report and closes the
parent run. Re-running the command resumes: finished trials are skipped, a trial whose local worker died is
put back to WAITING and resumes from its last checkpoint into the same MLflow child run; a trial whose remote
worker stopped sending heartbeats is failed and retried by Optuna's ``RetryHeartbeatStaleTrialCallback``; a
trial that raises is retried up to ``max_retries`` times and then reported.

Workers die with the command that started them (``PR_SET_PDEATHSIG``). ``SweepOutcome.exit_status``: 0 every
grid point finished, 1 one failed after its retries (the MLflow parent run ends FAILED), 3 the sweep is not
finished (a worker crashed, or trials are running elsewhere); the command exits 2 on a bad sweep file or option,
130 / 143 interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recursive_lightning import faults
from recursive_lightning.data.tokenizer import INIT_TOKENIZER
from recursive_lightning.errors import ConfigError
from recursive_lightning.files import writable_dir_problem
from recursive_lightning.run_dir import SweepDir
from recursive_lightning.sweep.checks import check_grid_data, check_late_fields
from recursive_lightning.sweep.claims import POLL_S, requeue_dead_local
from recursive_lightning.sweep.devices import device_pool, devices_needed
from recursive_lightning.sweep.launch import (
    PARENT_ENV,
    Stop,
    check_workers,
    die_with_parent,
    on_sigterm,
    sigterm_stops,
    spawn_workers,
    worker_stops_quietly,
)
from recursive_lightning.sweep.parent import close_parent, open_parent
from recursive_lightning.sweep.ranking import summary_line
from recursive_lightning.sweep.report import write_report
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
    open_storage,
    record_run_dir,
    unfinished,
)
from recursive_lightning.sweep.trial import worker
from recursive_lightning.tracking.runs import default_tracking_uri
from recursive_lightning.tracking.view import ui_hint
from recursive_lightning.training.run import prepare_corpus
from recursive_lightning.uris import MASK, STORAGE_ENV, TRACKING_ENV, mask_url, remember, reveal

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SWEEP = REPO / "ablations" / "default.yaml"
EXIT_FAILED = 1  # a grid point failed after its retries (the MLflow parent run ends FAILED)
EXIT_UNFINISHED = 3  # trials are left (a worker crashed, or trials run elsewhere): re-run or wait


def quiet_libraries(trains: bool = True) -> None:
    """Sweeps print one line per trial; silence the libraries' per-run banners. ``trains``: this process
    trains trials (a process that only coordinates workers never imports Lightning)."""
    if trains:  # lightning sets its loggers to INFO on import: import it first, then override
        import lightning.pytorch  # noqa: F401  # heavy

    for name in ("lightning.pytorch", "lightning.fabric", "mlflow", "alembic", "litdata"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(LeafSpec|__len__|litlogger|does not have many workers).*")


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
        record_run_dir(spec, run_dir, storage_url, tracking_uri, parent)
        return study, parent


def check_devices(spec: SweepSpec, pool: list[str]) -> None:
    """Refuse, before any training, a grid point that asks for more devices than this machine's pool has."""
    if not pool:
        return
    for point in spec.points():
        need = devices_needed(spec.trial_config(point), pool)
        if need > len(pool):
            raise ConfigError(
                f"{spec.at(point)}: train.devices asks for {need} "
                f"devices but this machine's device pool ({','.join(pool)}, from CUDA_VISIBLE_DEVICES or the "
                f"GPUs torch sees) has {len(pool)}; lower train.devices or run it where more GPUs are visible."
            )


def check_machine(spec: SweepSpec) -> None:
    """Refuse, before any training, a grid point this machine's kind cannot train (``parallel.check_supported``:
    e.g. ``train.cuda_graphs`` without CUDA), naming the point, instead of failing every trial of it."""
    from recursive_lightning.training.parallel import check_supported  # heavy

    for point in spec.points():
        try:
            check_supported(spec.trial_config(point).train)
        except ConfigError as e:
            raise ConfigError(f"{spec.at(point)}: {e}") from None


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


def _wait_for_local_trials(spec: SweepSpec, storage_url: str) -> bool:
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


def _password_hint(storage: str) -> str:
    """Where a command shown with a masked ``--storage`` finds the password."""
    if mask_url(storage) == storage:
        return ""
    return (
        f" (the password shown as {MASK}: put the URL in {STORAGE_ENV}, or the password in PGPASSWORD or "
        "~/.pgpass)"
    )


@dataclass
class SweepOptions:
    """How ``run_sweep`` runs a sweep file (the ``sweep`` command's options). ``run_dir``: where trials, stores
    and the report go (default: the study's recorded directory for ``attach``, else ``runs/sweeps/<name>``);
    ``workers``: processes on this machine (default: the file's); ``storage`` / ``tracking_uri``: the Optuna and
    MLflow stores (default: the environment's, else SQLite files in the run directory); ``attach``: join an
    existing study as a worker; ``prepare``: create the study, its grid, the parent run and the data, then stop;
    ``worker``: a worker process a sweep started; ``max_trials``: stop this worker after that many trials;
    ``report``: write the report at the end."""

    run_dir: str | os.PathLike | None = None
    workers: int | None = None
    storage: str | None = None
    tracking_uri: str | None = None
    attach: bool = False
    prepare: bool = False
    worker: bool = False
    max_trials: int | None = None
    report: bool = True


@dataclass
class SweepOutcome:
    """How a ``run_sweep`` ended. ``status``: FINISHED (every grid point finished), FAILED (one failed after its
    retries), UNFINISHED (points left: re-run or wait), PREPARED (``prepare``), DONE (a worker's part ended:
    other live workers run the last trials); ``exit_status`` the ``sweep`` command's (0, ``EXIT_FAILED``,
    ``EXIT_UNFINISHED``). ``finished`` / ``failed``: the report's trial counts, ``best_row`` and ``best`` its
    winning row and summary line, ``report`` its ``report.md`` (all None without a report); ``unfinished``: the
    grid points still waiting or running; ``storage`` and ``tracking_uri`` with their passwords masked."""

    sweep_dir: Path
    name: str
    status: str
    exit_status: int
    storage: str
    tracking_uri: str
    finished: int | None = None
    failed: int | None = None
    best_row: str | None = None
    best: str | None = None
    report: Path | None = None
    unfinished: list[str] = field(default_factory=list)


@sigterm_stops
def run_sweep(
    path: str | os.PathLike | None = None,
    run_dir: str | os.PathLike | None = None,
    options: SweepOptions | None = None,
    **fields: Any,
) -> SweepOutcome:
    """Run (or resume, or join) the sweep file ``path`` (default ``ablations/default.yaml``) into ``run_dir`` as
    ``options`` say (or their fields as keywords: ``workers=2``, ``report=False``), printing one line per trial,
    as the ``sweep`` command does. Call it from the main thread (it handles SIGTERM: the sweep stops like Ctrl-C
    and its MLflow parent run is closed)."""
    o = dataclasses.replace(options or SweepOptions(), **fields)
    if run_dir is not None:
        o.run_dir = run_dir
    with worker_stops_quietly() if o.worker else contextlib.nullcontext():
        return _run_sweep(path, o)


def _run_sweep(path: str | os.PathLike | None, o: SweepOptions) -> SweepOutcome:
    """``run_sweep`` with its options gathered in ``o``."""
    # the store URLs default to the environment's (how a sweep hands them to its workers, off their command
    # lines); one given as the package shows it (its password masked) takes its password from there (uris.reveal)
    o.storage = reveal(remember(o.storage or os.environ.get(STORAGE_ENV)))
    o.tracking_uri = reveal(remember(o.tracking_uri or os.environ.get(TRACKING_ENV)))
    quiet_libraries(trains=False)
    _quiet_progress_bars(o)
    sweep_file = Path(path if path is not None else DEFAULT_SWEEP)
    spec = _checked_spec(sweep_file, o)
    faults.point("sweep_checked")  # tests: a stop while the sweep starts, before it writes anything
    run_dir, storage, tracking = _locations(spec, o)
    workers = o.workers if o.workers is not None else spec.workers
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, not {workers}.")
    # Lightning's banners silenced where this process trains; one that spawns workers or only prepares does not
    # import it
    quiet_libraries(trains=o.worker or (workers == 1 and not o.prepare))
    t0 = time.time()
    if o.worker:
        die_with_parent(int(os.environ.get(PARENT_ENV) or os.getppid()))
    outcome = _Outcome(spec, sweep_file, run_dir, storage, tracking, o)
    if not o.attach:
        prepare_study(spec, run_dir, storage, tracking)
        if o.prepare:
            return _prepared(spec, sweep_file, outcome)
        trials = len(spec.grid()) if spec.search is None else spec.search["n_trials"]
        print(
            f"[sweep {spec.name}] {trials} trials; study in {mask_url(storage)}; tracking {mask_url(tracking)}",
            flush=True,
        )
    # SIGTERM (a scheduler, or the command stopping its workers) ends the sweep like Ctrl-C: the parent run is
    # closed KILLED instead of staying RUNNING
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    if o.worker:
        worker(spec, run_dir, storage, tracking, max_trials=o.max_trials, take_over=not o.max_trials)
        return outcome.made("DONE", 0)
    try:
        crashed, report, status = _run_and_report(spec, sweep_file, run_dir, storage, tracking, o, workers)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(ui_hint(run_dir, tracking))
    return outcome.ended(status, crashed, report, time.time() - t0)


def _quiet_progress_bars(o: SweepOptions) -> None:
    """Per-request progress bars (lm-eval, our evaluator) of parallel workers interleave into noise in a log:
    off for workers and logs (the sweep prints one line per trial instead); ``RL_TORCH_THREADS`` applied."""
    if o.worker or not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
    if os.environ.get("RL_TORCH_THREADS"):
        import torch  # heavy

        torch.set_num_threads(int(os.environ["RL_TORCH_THREADS"]))


def _checked_spec(sweep_file: Path, o: SweepOptions) -> SweepSpec:
    """The sweep file, read and checked with the options before any work: its late fields, the counts, the
    study an attached worker joins, the devices and what this machine can train."""
    spec = load_sweep(sweep_file)
    check_late_fields(spec, sweep_file.parent, str(sweep_file))  # read after training: checked now
    check_grid_data(spec)  # a data.path every trial would fail on
    if o.workers is not None and o.workers < 1:  # before the run directory is made
        raise ConfigError(f"--workers must be >= 1, not {o.workers}.")
    if not o.worker and not o.prepare:  # the processes this command would start here
        check_workers(o.workers if o.workers is not None else spec.workers)
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


def _locations(spec: SweepSpec, o: SweepOptions) -> tuple[Path, str, str]:
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


def _prepared(spec: SweepSpec, sweep_file: Path, outcome: _Outcome) -> SweepOutcome:
    """``prepare``: the data too, then how to start the workers that attach."""
    prepare_data(spec)
    print(
        f"[sweep {spec.name}] prepared in {outcome.run_dir}; start workers (on any machine that reaches the "
        f"stores and this directory) with: sweep {sweep_file} --attach --storage {mask_url(outcome.storage)}"
        f"{_password_hint(outcome.storage)}",
        flush=True,
    )
    return outcome.made("PREPARED", 0)


def _run_and_report(
    spec: SweepSpec,
    sweep_file: Path,
    run_dir: Path,
    storage: str,
    tracking: str,
    o: SweepOptions,
    workers: int,
) -> tuple[int, dict[str, Any] | None, str]:
    """Run the trials (here, or in ``workers`` processes), write the report and close the parent run: (the exit
    code of a crashed worker process, else 0; the report; the parent run's status). Whatever stops it (Ctrl-C,
    SIGTERM, a crash) closes the parent run first."""
    crashed, report = 0, None
    try:
        if workers > 1:
            prepare_data(spec)  # tokenise once here rather than racing in every worker
        while True:
            if workers > 1:
                crashed = spawn_workers(workers, sweep_file, run_dir, storage, tracking)
            else:
                take_over = o.attach and not o.max_trials
                worker(spec, run_dir, storage, tracking, max_trials=o.max_trials, take_over=take_over)
            # trials that other live processes on this machine run are waited for, not reported as missing
            if crashed or o.max_trials or not _wait_for_local_trials(spec, storage):
                break
        # the report and the parent's end stay under the SIGTERM handler: a pre-emption while the report is
        # written closes the parent too
        if o.report:
            report = _report(spec, run_dir, storage, tracking)
        faults.point("before_close_parent")
        return crashed, report, close_parent(spec, storage, tracking)
    except BaseException as e:  # Ctrl-C, SIGTERM (train stops at a step boundary), a crash: the sweep stopped
        # the parent ends as its grid stands (FINISHED once every point finished, whatever stopped this command);
        # an attached worker stopping with points unfinished (pre-empted) leaves it to the workers still running
        close_parent(spec, storage, tracking, interrupted=not o.attach)
        how = (
            "stopped by SIGTERM"
            if isinstance(e, Stop)
            else "interrupted"
            if isinstance(e, KeyboardInterrupt)
            else "stopped"
        )
        print(f"[sweep {spec.name}] {how}; re-run the same command to resume it", file=sys.stderr, flush=True)
        if isinstance(e, KeyboardInterrupt):  # said once, here: not again by the command (nor by a trial)
            raise SystemExit(getattr(e, "EXIT_CODE", 130)) from None
        raise


def _report(spec: SweepSpec, run_dir: Path, storage: str, tracking: str) -> dict[str, Any]:
    """Write the report (one writer at a time: workers on several machines may end together and the report's
    files have fixed names) and print it with its path and the best row."""
    with file_lock(SweepDir(run_dir).report_lock), database_lock(storage, f"{spec.name}/report"):
        report = write_report(run_dir, spec=spec, storage_url=storage, tracking_uri=tracking)
    print(report["markdown"])
    print(f"\nreport: {report['path']}")
    print(f"best: {summary_line(report)}")
    return report


@dataclass
class _Outcome:
    """What every ``SweepOutcome`` of one ``run_sweep`` shares, and how each ending makes one (and says it)."""

    spec: SweepSpec
    sweep_file: Path
    run_dir: Path
    storage: str
    tracking: str
    options: SweepOptions

    def made(self, status: str, exit_status: int, **more: Any) -> SweepOutcome:
        # the stores as the package shows them: a password stays out of reprs and logs
        storage, tracking = mask_url(self.storage), mask_url(self.tracking)
        return SweepOutcome(self.run_dir, self.spec.name, status, exit_status, storage, tracking, **more)

    def ended(self, status: str, crashed: int, report: dict[str, Any] | None, seconds: float) -> SweepOutcome:
        """The parent run's ``status`` said: finished, failed, or the grid points left and how to finish them."""
        name = self.spec.name
        counts = {}
        if report is not None:
            counts = {
                "finished": len(report["rows"]),
                "failed": len(report["failed"]),
                "best_row": report["best_row"],
                "best": summary_line(report),
                "report": Path(report["path"]),
            }
        if status == "FINISHED":
            print(f"[sweep {name}] finished in {seconds:.0f}s", flush=True)
            return self.made("FINISHED", 0, **counts)
        if status == "FAILED":
            print(
                f"[sweep {name}] FAILED: some grid points failed after their retries; see the report",
                file=sys.stderr,
                flush=True,
            )
            return self.made("FAILED", EXIT_FAILED, **counts)
        pending = unfinished(self.spec, self.storage)
        left = pending["waiting"] + pending["running"]
        o = self.options
        if o.attach and not crashed and pending["running"] and not pending["waiting"] and not o.max_trials:
            # a scheduler's worker is done: live workers (their heartbeats advance) run the last trials
            print(
                f"[sweep {name}] this worker is done: no grid point is waiting and live workers run "
                f"{', '.join(pending['running'])}; the worker that ends the last trial closes the sweep",
                flush=True,
            )
            return self.made("DONE", 0, unfinished=left, **counts)
        print(self._how_to_finish(crashed, left), file=sys.stderr, flush=True)
        return self.made("UNFINISHED", EXIT_UNFINISHED, unfinished=left, **counts)

    def _how_to_finish(self, crashed: int, left: list[str]) -> str:
        o, storage = self.options, self.storage
        again = (
            f"sweep {self.sweep_file} --attach --storage {mask_url(storage)}"
            if o.attach
            else f"sweep {self.sweep_file} --run-dir {self.run_dir}"
            + (f" --storage {mask_url(storage)}" if o.storage else "")
        )
        why = (
            f"a worker process exited with code {crashed}"
            if crashed
            else "trials are still waiting or running (other machines or --max-trials)"
        )
        shown = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
        return (
            f"[sweep {self.spec.name}] not finished: {why}; unfinished grid point(s) {shown or '(none named)'}: run "
            f"`{again}`{_password_hint(storage)} to finish them (the report is partial until then)"
        )
