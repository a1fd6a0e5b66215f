"""``python -m recursive_lightning sweep``: the options parsed into ``SweepOptions``, the sweep run
(``sweep.runner.run_sweep``), its exit status returned: 0 every grid point finished, 1 one failed after its
retries (the MLflow parent run ends FAILED), 3 the sweep is not finished (a worker crashed, or trials are running
elsewhere); 2 a bad sweep file or option; 130 / 143 interrupted."""

from __future__ import annotations

import argparse

from recursive_lightning.errors import ArgumentParser
from recursive_lightning.sweep.runner import DEFAULT_SWEEP, SweepOptions, run_sweep


def main(argv: list[str]) -> int:
    """``python -m recursive_lightning sweep``: the options parsed, the sweep run, its exit status returned."""
    p = ArgumentParser(
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
    options = SweepOptions(
        run_dir=args.run_dir,
        workers=args.workers,
        storage=args.storage,
        tracking_uri=args.tracking_uri,
        attach=args.attach,
        prepare=args.prepare,
        worker=args.worker,
        max_trials=args.max_trials,
        report=not args.no_report,
    )
    return run_sweep(args.file, options=options).exit_status
