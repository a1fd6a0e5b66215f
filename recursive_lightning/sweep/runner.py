"""``run_sweep``: an Optuna study per sweep file, one MLflow child run per trial (the ``sweep`` command:
``commands/sweep.py``).

It checks the sweep file and its options and prepares the study, its grid, the MLflow parent run and the data
(``prepare``), runs workers here (``launch``: ``--workers N`` processes) that claim and run trials (``trial``:
where a trial is decided finished), waits for trials other live processes on this machine still run
(``claims``), writes the report (``report``) and closes the parent run (``parent``); how it ended is its
``SweepOutcome`` (``outcome``). Re-running the command resumes: finished trials are skipped, a trial whose local
worker died is put back to WAITING and resumes from its last checkpoint into the same MLflow child run; a trial
whose remote worker stopped sending heartbeats is failed and retried by Optuna's
``RetryHeartbeatStaleTrialCallback``; a trial that raises is retried up to ``max_retries`` times and then
reported.

Workers die with the command that started them (``PR_SET_PDEATHSIG``). ``SweepOutcome.exit_status``: 0 every
grid point finished, 1 one failed after its retries (the MLflow parent run ends FAILED), 3 the sweep is not
finished (a worker crashed, or trials are running elsewhere); the command exits 2 on a bad sweep file or option,
130 / 143 interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from recursive_lightning import faults
from recursive_lightning.errors import ConfigError
from recursive_lightning.sweep.claims import wait_for_local_trials
from recursive_lightning.sweep.launch import (
    PARENT_ENV,
    Stop,
    die_with_parent,
    on_sigterm,
    sigterm_stops,
    spawn_workers,
    worker_stops_quietly,
)
from recursive_lightning.sweep.options import SweepOptions
from recursive_lightning.sweep.outcome import Outcomes, SweepOutcome, password_hint
from recursive_lightning.sweep.parent import close_parent
from recursive_lightning.sweep.prepare import checked_spec, locations, prepare_data, prepare_study
from recursive_lightning.sweep.report import report_at_end
from recursive_lightning.sweep.spec import SweepSpec
from recursive_lightning.sweep.trial import worker
from recursive_lightning.tracking.view import ui_hint
from recursive_lightning.uris import STORAGE_ENV, TRACKING_ENV, mask_url, remember, reveal

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SWEEP = REPO / "ablations" / "default.yaml"


def quiet_libraries(trains: bool = True) -> None:
    """Sweeps print one line per trial; silence the libraries' per-run banners. ``trains``: this process
    trains trials (a process that only coordinates workers never imports Lightning)."""
    if trains:  # lightning sets its loggers to INFO on import: import it first, then override
        import lightning.pytorch  # noqa: F401  # heavy

    for name in ("lightning.pytorch", "lightning.fabric", "mlflow", "alembic", "litdata"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(LeafSpec|__len__|litlogger|does not have many workers).*")


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
    spec = checked_spec(sweep_file, o)
    faults.point("sweep_checked")  # tests: a stop while the sweep starts, before it writes anything
    run_dir, storage, tracking = locations(spec, o)
    workers = o.workers if o.workers is not None else spec.workers
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, not {workers}.")
    # Lightning's banners silenced where this process trains; one that spawns workers or only prepares does not
    # import it
    quiet_libraries(trains=o.worker or (workers == 1 and not o.prepare))
    t0 = time.time()
    if o.worker:
        die_with_parent(int(os.environ.get(PARENT_ENV) or os.getppid()))
    outcome = Outcomes(spec, sweep_file, run_dir, storage, tracking, o)
    if not o.attach:
        prepare_study(spec, run_dir, storage, tracking)  # stopped inside, it closes the parent run it opened
        if o.prepare:
            return _prepared(spec, sweep_file, outcome)
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


def _prepared(spec: SweepSpec, sweep_file: Path, outcome: Outcomes) -> SweepOutcome:
    """``prepare``: the data too, then how to start the workers that attach."""
    prepare_data(spec)
    print(
        f"[sweep {spec.name}] prepared in {outcome.run_dir}; start workers (on any machine that reaches the "
        f"stores and this directory) with: sweep {sweep_file} --attach --storage {mask_url(outcome.storage)}"
        f"{password_hint(outcome.storage)}",
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
        if not o.attach:
            trials = len(spec.grid()) if spec.search is None else spec.search["n_trials"]
            print(
                f"[sweep {spec.name}] {trials} trials; study in {mask_url(storage)}; tracking {mask_url(tracking)}",
                flush=True,
            )
        if workers > 1:
            prepare_data(spec)  # tokenise once here rather than racing in every worker
        while True:
            if workers > 1:
                crashed = spawn_workers(workers, sweep_file, run_dir, storage, tracking)
            else:
                take_over = o.attach and not o.max_trials
                worker(spec, run_dir, storage, tracking, max_trials=o.max_trials, take_over=take_over)
            # trials that other live processes on this machine run are waited for, not reported as missing
            if crashed or o.max_trials or not wait_for_local_trials(spec, storage):
                break
        # the report and the parent's end stay under the SIGTERM handler: a pre-emption while the report is
        # written closes the parent too
        if o.report:
            report = report_at_end(spec, run_dir, storage, tracking)
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
