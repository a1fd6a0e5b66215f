"""Where the probes' results go: ``probes.json`` (atomically) and the checkpoint's MLflow run, or a linked
run made for the probes when that run is not found."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recursive_lightning.files import atomic_write_text
from recursive_lightning.run_dir import RunDir
from recursive_lightning.tracking.runs import (
    client,
    create_run,
    default_tracking_uri,
    ensure_experiment,
    log_artifact,
    log_metrics,
    set_terminated,
)


def clean(x: Any) -> Any:
    """numpy/torch -> JSON types, NaN/inf -> None."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return clean(x.tolist())
    if isinstance(x, Mapping):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [clean(v) for v in x]
    if isinstance(x, np.floating | float):
        f = float(x)
        return f if math.isfinite(f) else None
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def mlflow_run(uri: str, run_dir: Path, loaded: Any) -> tuple[str, bool]:
    """(run id, created): the checkpoint's own MLflow run, or a linked run made for the probes."""
    c = client(uri)
    ids = [loaded.mlflow_run_id, RunDir(run_dir).recorded_run_id()]
    for rid in dict.fromkeys(i for i in ids if i):
        try:
            c.get_run(rid)
            return rid, False
        except Exception:
            continue
    exp_id = ensure_experiment(uri, loaded.run.name, RunDir(run_dir).artifacts)
    key = hashlib.sha256(str(Path(loaded.path).resolve()).encode()).hexdigest()[:16]
    found = c.search_runs([exp_id], filter_string=f"tags.`probe.checkpoint_id` = '{key}'", max_results=1)
    if found:
        return found[0].info.run_id, True
    tags = {
        "probe.checkpoint": str(Path(loaded.path).resolve()),
        "probe.checkpoint_id": key,
        "probe.linked_run_id": next((i for i in ids if i), "") or "",
    }
    return create_run(uri, exp_id, f"probe-{loaded.run.name}", tags=tags), True


def log_to_mlflow(
    run_dir: Path,
    loaded: Any,
    files: Sequence[Path],
    metrics: dict[str, float] | None,
    tracking_uri: str | None,
    artifact_path: str,
) -> tuple[str, str]:
    """Log ``files`` under ``artifact_path`` and ``metrics`` (at the checkpoint's step) to the run's MLflow
    run (:func:`mlflow_run`); returns (tracking URI, run id)."""
    uri = tracking_uri or default_tracking_uri(run_dir)
    run_id, created = mlflow_run(uri, run_dir, loaded)
    for f in files:
        log_artifact(uri, run_id, f, artifact_path)
    if metrics:
        log_metrics(uri, run_id, metrics, step=loaded.global_step)
    if created:
        set_terminated(uri, run_id, "FINISHED")
    return uri, run_id


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """``data`` as JSON (:func:`clean`: NaN/inf as null), written atomically."""
    atomic_write_text(path, json.dumps(clean(data), indent=1, allow_nan=False) + "\n")
    return path
