"""Claim and bookkeeping overhead per trial of `sweep --attach` workers on one PostgreSQL study.

    .venv/bin/python benchmarks/bench_sweep_postgres.py [--workers 8] [--trials-per-worker 8] [--trial-seconds 2]

Starts a throwaway PostgreSQL cluster (fsync on, as a real one) and an `mlflow server` on a second database
of it (served artifacts), prepares a study of workers x trials-per-worker grid points, then starts the
workers as separate processes, all at once. Each worker runs the runner's real code (the `sweep` command's `main` with
`--attach`: checks of the stores, loading the study, stale-trial checks, claims, heartbeats, the trial's
directory and `sweep_result.json`, MLflow tags, the study's user attributes and `tell`) around a stand-in
for training: it creates the trial's MLflow child run under the parent, logs the config as params, sleeps
`--trial-seconds` and logs a metric (a superset of what the sweep adds to `train`, whose own MLflow logging
is counted here too). Overhead per trial = (worker's time in its claim-train-tell loop - its trials x the
sleep) / its trials; the sweep's report and closing of the parent run, once per sweep, are added per trial.
Process start-up (imports) is reported separately: it is once per worker, not per trial. Goal: under 1 %
of a 1-minute trial (0.6 s).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SLEPT: list[float] = []  # the stand-in trials' sleeps in this worker
OWN_LOGGING: list[float] = []  # the stand-in's own MLflow logging (what `train` logs anyway), seconds
sys.path.insert(0, str(ROOT))


def fake_train(trial_seconds: float, jitter: float = 0.0):
    """A stand-in for ``training.run.train`` with its MLflow side: child run under the parent, params, metric."""
    from recursive_lightning.tracking.runs import (
        create_run,
        ensure_experiment,
        log_metrics,
        log_params,
        set_terminated,
    )
    from recursive_lightning.training.run import TrainResult

    def train(cfg, run_dir, options) -> TrainResult:
        t0 = time.perf_counter()
        tracking_uri, experiment, run_name = options.tracking_uri, options.experiment, options.run_name
        tags, parent_run_id = options.tags, options.parent_run_id
        exp = ensure_experiment(tracking_uri, experiment)
        run_id = create_run(tracking_uri, exp, run_name, tags=tags, parent_run_id=parent_run_id)
        log_params(tracking_uri, run_id, cfg.flat())
        slept = trial_seconds + random.uniform(-jitter, jitter)  # trials of a sweep do not end in step
        time.sleep(slept)
        SLEPT.append(slept)
        metrics = {"val/heldout/loss": 5.0 + (hash(run_name) % 1000) / 1000, "val/heldout/ppl": 150.0}
        log_metrics(tracking_uri, run_id, metrics, step=cfg.train.max_steps)
        set_terminated(tracking_uri, run_id, "FINISHED")
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        OWN_LOGGING.append(time.perf_counter() - t0 - slept)
        return TrainResult(
            Path(run_dir), cfg.train.max_steps, 0, metrics, None, None, run_id, tracking_uri, 0.0
        )

    return train


def as_worker(args: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    from recursive_lightning.commands import sweep as sweep_command
    from recursive_lightning.sweep import runner
    from recursive_lightning.training import run

    run.train = fake_train(args.trial_seconds, args.jitter)
    timing: dict[str, float] = {}
    real_worker = runner.worker

    def timed_worker(*a, **kw) -> int:
        t, c = time.perf_counter(), time.process_time()
        timing["startup"] = t - t_start
        n = real_worker(*a, **kw)
        timing["loop"], timing["trials"] = time.perf_counter() - t - sum(SLEPT), n
        timing["cpu"] = time.process_time() - c  # this worker's CPU seconds in the loop (sleeps take none)
        timing["own_logging"] = sum(OWN_LOGGING)
        return n

    runner.worker = timed_worker
    argv = [args.sweep, "--attach", "--storage", args.storage, "--no-report"]
    if args.profile:  # where the bookkeeping's time goes: one cProfile file per worker
        import cProfile

        cProfile.runctx(
            "sweep_command.main(argv)", globals(), locals(), f"{args.profile}/worker-{os.getpid()}.prof"
        )
    else:
        sweep_command.main(argv)
    print(json.dumps(timing), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--trials-per-worker", type=int, default=8)
    p.add_argument("--trial-seconds", type=float, default=2.0)
    p.add_argument(
        "--no-sync-commit",
        action="store_true",
        help="PostgreSQL with synchronous_commit (and fsync) off: how much of the wait is the commits' disk flushes",
    )
    p.add_argument("--jitter", type=float, default=0.0, help="trial lengths uniform in seconds +- this")
    p.add_argument("--profile", help="write each worker's cProfile stats into this directory")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--sweep", help=argparse.SUPPRESS)
    p.add_argument("--storage", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        as_worker(args)
        return
    from recursive_lightning.sweep import prepare, servers
    from recursive_lightning.sweep.parent import close_parent
    from recursive_lightning.sweep.report import write_report
    from recursive_lightning.sweep.spec import load_sweep

    n = args.workers * args.trials_per_worker
    tmp = Path(tempfile.mkdtemp(prefix="bench-sweep-pg-"))
    spec_file = tmp / "sweep.yaml"
    spec_file.write_text(
        yaml.safe_dump(
            {
                "name": "bench-pg",
                "base": str(ROOT / "experiments/cpu/looped-mesh.yaml"),
                "overrides": {"model.preset": "cpu-tiny", "train.max_steps": 10},
                "axes": {"train.seed": list(range(n))},
            }
        )
    )
    with servers.LocalPostgres(fast=args.no_sync_commit) as pg:
        storage = pg.create_database("optuna")
        with servers.LocalMlflowServer(pg.create_database("mlflow"), tmp / "artifacts", workers=2) as server:
            spec = load_sweep(spec_file)
            prepare.prepare_study(spec, tmp / "run", storage, server.uri)
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
            # the runner tells its live workers on this machine by "recursive_lightning" in their command line
            cmd = [sys.executable, __file__, "--worker=recursive_lightning", "--sweep", str(spec_file)]
            cmd += ["--storage", storage]
            cmd += ["--trial-seconds", str(args.trial_seconds), "--jitter", str(args.jitter)]
            if args.profile:
                Path(args.profile).mkdir(parents=True, exist_ok=True)
                cmd += ["--profile", str(Path(args.profile).resolve())]
            t0 = time.perf_counter()
            procs = [
                subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(args.workers)
            ]
            outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
            wall = time.perf_counter() - t0
            t = time.perf_counter()
            write_report(tmp / "run", spec=spec, storage_url=storage, tracking_uri=server.uri)
            status = close_parent(spec, storage, server.uri)
            once = time.perf_counter() - t
    shutil.rmtree(tmp, ignore_errors=True)
    trials = sum(int(o["trials"]) for o in outs)
    per_trial = [o["loop"] / o["trials"] for o in outs if o["trials"]]
    cpu = [o["cpu"] / o["trials"] for o in outs if o["trials"]]
    sweep_only = [(o["loop"] - o["own_logging"]) / o["trials"] for o in outs if o["trials"]]
    overall = (sum(o["loop"] for o in outs) + once) / trials
    print(f"{args.workers} workers, {trials} trials of {args.trial_seconds:g} s on one PostgreSQL study "
          f"(parent run {status}); wall {wall:.1f} s")  # fmt: skip
    print(f"bookkeeping per trial (claim, heartbeats, MLflow child run, tell), per worker: "
          f"median {statistics.median(per_trial):.3f} s, max {max(per_trial):.3f} s")  # fmt: skip
    print(
        f"  without the stand-in's own MLflow logging (child run, params, metric: what `train` logs anyway): "
        f"median {statistics.median(sweep_only):.3f} s = {100 * statistics.median(sweep_only) / 60:.2f} % of a minute"
    )
    print(f"  of which CPU in the worker: median {statistics.median(cpu):.3f} s, max {max(cpu):.3f} s")
    print(f"report + closing the parent run, once: {once:.2f} s ({once / trials:.3f} s per trial)")
    print(f"overall per trial: {overall:.3f} s = {100 * overall / 60:.2f} % of a 1-minute trial (goal < 1 %)")
    print(f"worker start-up (imports, store checks), once per worker: median "
          f"{statistics.median(o['startup'] for o in outs):.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
