"""MLflow helpers: SQLite tracking inside the run directory, run ids kept beside checkpoints."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

RUN_ID_FILE = "mlflow_run_id"
TRACKING_URI_FILE = "mlflow_tracking_uri"  # where that run lives (a sweep's trials log to the sweep's store)


def default_tracking_uri(run_dir: str | os.PathLike) -> str:
    """The tracking store a run directory's MLflow run was created in, else SQLite inside the directory."""
    recorded = Path(run_dir) / TRACKING_URI_FILE
    if recorded.is_file():
        return recorded.read_text().strip()
    return f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def ui_command(tracking_uri: str) -> str:
    if tracking_uri.startswith("sqlite:"):
        return f"mlflow ui --backend-store-uri {tracking_uri}"
    return f"open {tracking_uri} in a browser"


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates it private
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def client(tracking_uri: str):
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(tracking_uri)
    return MlflowClient(tracking_uri=tracking_uri)


def ensure_experiment(tracking_uri: str, name: str, artifact_root: str | os.PathLike | None = None) -> str:
    """The experiment id for ``name``, creating it (with artifacts beside a SQLite database) if needed."""
    c = client(tracking_uri)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if artifact_root is not None and tracking_uri.startswith("sqlite:"):
        location = Path(artifact_root).resolve().as_uri()
    try:
        return c.create_experiment(name, artifact_location=location)
    except Exception:  # created concurrently by another worker
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def create_run(
    tracking_uri: str,
    experiment_id: str,
    run_name: str,
    tags: dict[str, str] | None = None,
    parent_run_id: str | None = None,
) -> str:
    c = client(tracking_uri)
    tags = dict(tags or {})
    tags["mlflow.runName"] = run_name
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    return c.create_run(experiment_id, tags=tags, run_name=run_name).info.run_id


def log_params(tracking_uri: str, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param

    c = client(tracking_uri)
    existing = c.get_run(run_id).data.params
    items = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in existing]
    for i in range(0, len(items), 100):
        c.log_batch(run_id, params=items[i : i + 100])


def log_metrics(tracking_uri: str, run_id: str, metrics: dict[str, float], step: int | None = None) -> None:
    import time

    from mlflow.entities import Metric

    c = client(tracking_uri)
    now = int(time.time() * 1000)
    items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items() if v is not None]
    for i in range(0, len(items), 500):
        c.log_batch(run_id, metrics=items[i : i + 500])


def log_artifact_text(
    tracking_uri: str, run_id: str, name: str, text: str, subdir: str | None = None
) -> None:
    c = client(tracking_uri)
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / name
        p.write_text(text)
        c.log_artifact(run_id, str(p), artifact_path=subdir)


def log_artifact(tracking_uri: str, run_id: str, path: str | os.PathLike, subdir: str | None = None) -> None:
    c = client(tracking_uri)
    if Path(path).is_dir():
        c.log_artifacts(run_id, str(path), artifact_path=subdir)
    else:
        c.log_artifact(run_id, str(path), artifact_path=subdir)


def set_terminated(tracking_uri: str, run_id: str, status: str = "FINISHED") -> None:
    client(tracking_uri).set_terminated(run_id, status=status)


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True, default=str)
