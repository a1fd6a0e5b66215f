"""Wall time of a new SQLite tracking store, as ``train`` and ``sweep`` make one: MLflow's own creation (its
schema migrations) against a copy of the migrated empty store (``tracking/sqlite_store.py``), interleaved over
``--reps`` rounds in one process; medians.

    python benchmarks/bench_store.py --reps 5

Each store is opened with an MLflow client and its experiments listed (what the first use of a store does)."""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    from mlflow.tracking import MlflowClient

    from recursive_lightning.tracking.runs import client
    from recursive_lightning.tracking.sqlite_store import create_store

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    times: dict[str, list[float]] = {"MLflow's migrations": [], "copy of the migrated store": []}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        create_store(Path(tmp) / "warm.db", cache)  # the template, made once per MLflow version
        for i in range(args.reps):
            t0 = time.perf_counter()
            MlflowClient(f"sqlite:///{tmp}/mlflow-{i}.db").search_experiments()
            times["MLflow's migrations"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            create_store(Path(tmp) / f"copy-{i}.db", cache)
            client(f"sqlite:///{tmp}/copy-{i}.db").search_experiments()
            times["copy of the migrated store"].append(time.perf_counter() - t0)
    for label, ts in times.items():
        print(f"{label:28s} median {statistics.median(ts) * 1000:8.1f} ms  (min {min(ts) * 1000:.1f})")
    ratio = statistics.median(times["MLflow's migrations"]) / statistics.median(
        times["copy of the migrated store"]
    )
    print(f"speed-up {ratio:.0f}x")


if __name__ == "__main__":
    main()
