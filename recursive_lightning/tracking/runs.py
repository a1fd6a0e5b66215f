"""MLflow helpers: SQLite tracking inside the run directory, run ids kept beside checkpoints."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shlex
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

from recursive_lightning.errors import UserError
from recursive_lightning.files import atomic_write_text, writable_dir_problem
from recursive_lightning.run_dir import RunDir, SweepDir
from recursive_lightning.tracking.sqlite_store import create_store
from recursive_lightning.tracking.stores import check_tracking_server, sqlite_file_problem
from recursive_lightning.uris import mask_url, reveal

RUN_ID_FILE = RunDir.RUN_ID
TRACKING_URI_FILE = RunDir.TRACKING_URI  # where that run lives (a sweep's trials log to the sweep's store)


def sqlite_parts(uri: str) -> tuple[str, str] | None:
    """(path, query) of a ``sqlite:///`` URI; None for other stores and in-memory databases."""
    if not uri.startswith("sqlite:///"):
        return None
    path, sep, query = uri[len("sqlite:///") :].partition("?")
    if not path or path == ":memory:":
        return None
    return path, sep + query


def absolute_uri(uri: str, base: str | os.PathLike | None = None) -> str:
    """``uri`` with a relative SQLite path resolved against ``base`` (default: the current directory)."""
    parts = sqlite_parts(uri)
    if parts is None or os.path.isabs(parts[0]):
        return uri
    path = os.path.normpath(os.path.join(os.path.abspath(base or os.getcwd()), parts[0]))
    return f"sqlite:///{path}{parts[1]}"


def portable_uri(uri: str, directory: str | os.PathLike) -> str:
    """The form of ``uri`` to keep in ``directory``: a SQLite database inside the directory, or beside one of
    its ancestors (a sweep's store, seen from a trial directory), is kept relative to the directory, so that
    moving or copying the directory (or the sweep around it) takes its tracking store along."""
    uri = absolute_uri(uri)
    parts = sqlite_parts(uri)
    if parts is None:
        return uri
    d = Path(os.path.abspath(directory))
    db = Path(parts[0])
    # inside the directory; or the store of a sweep directory around it (a trial directory): the sweep
    # moves as a whole. A store elsewhere (a shared database passed with --tracking-uri) stays absolute.
    if d in db.parents or (db.parent in d.parents and SweepDir.is_sweep(db.parent)):
        return f"sqlite:///{os.path.relpath(db, d)}{parts[1]}"
    return uri


def record_tracking_uri(run_dir: str | os.PathLike, uri: str) -> None:
    """Keep ``uri`` in ``run_dir`` (relative where it points inside it, see ``portable_uri``; its password masked,
    filled in again when read back: ``default_tracking_uri``)."""
    atomic_write_text(RunDir(run_dir).tracking_uri_file, mask_url(portable_uri(uri, run_dir)))


def default_tracking_uri(run_dir: str | os.PathLike) -> str:
    """The tracking store a run directory's MLflow run was created in, else SQLite inside the directory.

    A recorded relative SQLite path is resolved against the directory's current location; a recorded masked
    password is filled in from this command's options or the environment (``uris.reveal``)."""
    run_dir = Path(run_dir).resolve()
    recorded = RunDir(run_dir).tracking_uri_file
    if recorded.is_file():
        uri = absolute_uri(recorded.read_text().strip(), base=run_dir)
        parts = sqlite_parts(uri)
        if parts is not None and not Path(parts[0]).exists():
            # recorded as an absolute path (before paths were kept relative) by a directory since moved: the
            # store it took along, in the directory or in the sweep directory around it
            name = Path(parts[0]).name
            for d in (run_dir, *(a for a in run_dir.parents if SweepDir.is_sweep(a))):
                if (d / name).is_file():
                    return f"sqlite:///{d / name}{parts[1]}"
            if RunDir(run_dir).recorded_run_id():  # opening it would make an empty store and a new run there
                raise UserError(
                    f"the MLflow store '{parts[0]}' that '{recorded}' names does not exist; put it back, or "
                    "pass the store the run was logged to with --tracking-uri."
                )
        return reveal(uri)
    return f"sqlite:///{RunDir(run_dir).mlflow_db}"


def ui_command(run_dir: str | os.PathLike, tracking_uri: str) -> str:
    """How to look at a run or sweep directory's runs in the MLflow UI."""
    if tracking_uri.startswith(("http://", "https://")):
        return f"open {mask_url(tracking_uri)} in a browser"
    shown = os.path.relpath(run_dir)
    if shown.startswith(".."):  # outside the current directory: its full path
        shown = str(run_dir)
    return f"python -m recursive_lightning ui {shlex.quote(shown)}"  # a path with spaces: as a shell reads it


# MLflow 3 opens an experiment without this tag on its GenAI overview (traces, prompts): ours are model training
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"


ARTIFACT_ROOT_TAG = "recursive_lightning.artifact_root"  # artifact root relative to the SQLite file's folder
_relocated: set[str] = set()


def relocate_artifacts(tracking_uri: str, root: str | os.PathLike | None = None) -> None:
    """Point the artifact roots of a moved or copied SQLite store back beside it.

    MLflow keeps absolute artifact URIs in the database; an experiment created by ``ensure_experiment`` with
    its artifacts beside the database carries ``ARTIFACT_ROOT_TAG`` (the root relative to the database's
    folder), and where that no longer matches the database's location its experiment and runs are rewritten,
    so a moved directory does not write artifacts to its old path, nor a copy into the original's.

    ``root``: the folder the roots are relative to, when the database read is a private copy of the one in
    that folder (``ui`` on a read-only directory)."""
    parts = sqlite_parts(tracking_uri)
    if parts is None or tracking_uri in _relocated:
        return
    _relocated.add(tracking_uri)
    db = Path(parts[0])
    if not db.is_file():
        return
    try:
        con = sqlite3.connect(db, timeout=60)
        try:
            rows = con.execute(
                "SELECT e.experiment_id, e.artifact_location, t.value FROM experiments e "
                "JOIN experiment_tags t ON t.experiment_id = e.experiment_id WHERE t.key = ?",
                (ARTIFACT_ROOT_TAG,),
            ).fetchall()
            for exp_id, location, rel in rows:
                want = (Path(root or db.parent).resolve() / rel).as_uri()
                if location == want:
                    continue
                with con:
                    con.execute(
                        "UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) "
                        "WHERE experiment_id = ? AND substr(artifact_uri, 1, ?) = ?",
                        (want, len(location) + 1, exp_id, len(location), location),
                    )
                    con.execute(
                        "UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?", (want, exp_id)
                    )
        finally:
            con.close()
    except sqlite3.Error:  # a fresh (table-less) or read-only database: nothing to do or nothing we can do
        pass


def tracking_store_problem(tracking_uri: str) -> str | None:
    """Why a SQLite tracking store (and the artifacts beside it) cannot be written, or None."""
    parts = sqlite_parts(absolute_uri(tracking_uri))
    if parts is None:
        return None
    db = Path(parts[0])
    problem = writable_dir_problem(db.parent)
    if problem is None and db.is_file() and not os.access(db, os.W_OK):
        problem = f"'{db}' is read-only"
    # a store that is there but empty or damaged: MLflow would make a new one in it, or fail in a traceback
    return problem or sqlite_file_problem(db, table="runs", owner="MLflow's")


def client(tracking_uri: str):
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow  # heavy
    from mlflow.tracking import MlflowClient  # heavy

    parts = sqlite_parts(absolute_uri(tracking_uri))
    if parts is not None:  # a new store: a copy of a migrated empty one instead of MLflow's migrations
        create_store(parts[0])
    relocate_artifacts(tracking_uri)
    mlflow.set_tracking_uri(tracking_uri)
    return MlflowClient(tracking_uri=tracking_uri)


def ensure_experiment(tracking_uri: str, name: str, artifact_root: str | os.PathLike | None = None) -> str:
    """The experiment id for ``name``, creating it (with artifacts beside a SQLite database) if needed."""
    c = client(tracking_uri)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        if exp.tags.get(EXPERIMENT_KIND_TAG) is None:  # made before the tag was set
            c.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return exp.experiment_id
    location, tags = None, {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
    if artifact_root is not None and tracking_uri.startswith("sqlite:"):
        root = Path(artifact_root).resolve()
        location = root.as_uri()
        parts = sqlite_parts(tracking_uri)
        if parts is not None and Path(parts[0]).parent in (root, *root.parents):
            tags[ARTIFACT_ROOT_TAG] = os.path.relpath(root, Path(parts[0]).parent)
    try:
        return c.create_experiment(name, artifact_location=location, tags=tags)
    except Exception:  # created concurrently by another worker
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def set_experiment_tag(tracking_uri: str, experiment_id: str, key: str, value: str) -> None:
    client(tracking_uri).set_experiment_tag(experiment_id, key, value)


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


def param_value(value: Any) -> str:
    """A value as MLflow stores it as a param (text, at most 6,000 characters; a database URL's password
    masked)."""
    return mask_url(str(value))[:6000]


def log_params(tracking_uri: str, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param  # heavy

    c = client(tracking_uri)
    existing = c.get_run(run_id).data.params
    items = [Param(k, param_value(v)) for k, v in params.items() if k not in existing]
    for i in range(0, len(items), 100):
        c.log_batch(run_id, params=items[i : i + 100])


def set_tags(tracking_uri: str, run_id: str, tags: dict[str, Any]) -> None:
    """Several tags in one request (one round trip to a tracking server, one transaction)."""
    from mlflow.entities import RunTag  # heavy

    items = [RunTag(k, mask_url(str(v))) for k, v in tags.items()]
    for i in range(0, len(items), 100):
        client(tracking_uri).log_batch(run_id, tags=items[i : i + 100])


def log_metrics(tracking_uri: str, run_id: str, metrics: dict[str, float], step: int | None = None) -> None:
    from mlflow.entities import Metric  # heavy

    c = client(tracking_uri)
    now = int(time.time() * 1000)
    items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items() if v is not None]
    for i in range(0, len(items), 500):
        c.log_batch(run_id, metrics=items[i : i + 500])


def log_batch(
    tracking_uri: str,
    run_id: str,
    metrics: dict[str, float] | None = None,
    tags: dict[str, Any] | None = None,
) -> None:
    """Metrics (at step 0) and tags of one run in one request (one transaction; one round trip to a tracking
    server). These are a run's current values (a report's rank, a row's mean): a metric whose latest value is
    already this one is not logged again, so a report run again adds no point to its history; a changed value
    is a new step-0 point, the latest, which the runs table and the charts show."""
    from mlflow.entities import Metric, RunTag  # heavy

    c = client(tracking_uri)
    metrics = {k: float(v) for k, v in (metrics or {}).items()}
    if metrics:
        latest = c.get_run(run_id).data.metrics
        metrics = {k: v for k, v in metrics.items() if not _same_value(latest.get(k), v)}
    if not metrics and not tags:
        return
    now = int(time.time() * 1000)
    c.log_batch(
        run_id,
        metrics=[Metric(k, v, now, 0) for k, v in metrics.items()],
        tags=[RunTag(k, mask_url(str(v))) for k, v in (tags or {}).items()],
    )


def unlogged_points(tracking_uri: str, run_id: str, metrics: dict[str, float], step: int) -> dict[str, float]:
    """The ``metrics`` whose history does not already end with this value at this ``step`` (a run resumed
    with no step left to train reaches the same end again: its final point is not logged twice)."""
    c = client(tracking_uri)
    out = {}
    for key, value in metrics.items():
        history = c.get_metric_history(run_id, key)
        last = max(history, key=lambda m: (m.step, m.timestamp)) if history else None
        if last is None or last.step != step or not _same_value(last.value, float(value)):
            out[key] = value
    return out


def _same_value(logged: float | None, value: float) -> bool:
    """Whether a metric's logged value is ``value`` (NaN equal to NaN)."""
    return logged is not None and (logged == value or (math.isnan(logged) and math.isnan(value)))


def log_corpus(tracking_uri: str, run_id: str, corpus: dict[str, Any]) -> None:
    """The corpus as the run's dataset inputs (MLflow's Datasets column and the run's "Datasets used"): one per
    split (context ``training`` / ``validation``), digest = corpus and tokenizer fingerprints, profile = its
    documents and tokens. ``corpus`` is ``TextDataModule.corpus_summary()``."""
    from mlflow.entities import Dataset, DatasetInput, InputTag  # heavy

    if corpus["kind"] == "hf":
        source_type, source = "hugging_face", {"path": corpus["location"]}
    else:
        source_type, source = "local", {"uri": corpus["location"]}
    digest = f"{corpus['corpus_fingerprint'] or ''}{(corpus['tokenizer_fingerprint'] or '')[:8]}"[:36]
    inputs = []
    for split, context in (("train", "training"), ("heldout", "validation")):
        profile = {
            **corpus["splits"][split],
            "tokenizer": corpus["tokenizer"],
            "vocab_size": corpus["vocab_size"],
            "corpus_fingerprint": corpus["corpus_fingerprint"],
        }
        dataset = Dataset(
            name=f"{corpus['name']}/{split}",
            digest=digest or "unknown",
            source_type=source_type,
            source=json.dumps(source),
            profile=json.dumps(profile),
        )
        inputs.append(DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)]))
    from mlflow.exceptions import MlflowException  # heavy

    try:
        client(tracking_uri).log_inputs(run_id, datasets=inputs)
    except MlflowException as e:
        # MLflow's store looks a dataset up, then inserts it: two trials of one experiment starting together can
        # both insert (UNIQUE constraint on experiment, name, digest). The second try finds the winner's row.
        if "unique constraint" not in str(e).lower():
            raise
        client(tracking_uri).log_inputs(run_id, datasets=inputs)


def _forget_artifact_repo(run_id: str) -> None:
    """MLflow caches a run's artifact location by run id alone, across stores: a copied directory's run (the
    same id in another store) would write into the original's artifacts within one process."""
    try:
        from mlflow.tracking._tracking_service import utils  # optional

        utils._artifact_repos_cache.pop(run_id, None)
    except (ImportError, AttributeError):
        pass


def log_artifact_text(
    tracking_uri: str, run_id: str, name: str, text: str, subdir: str | None = None
) -> None:
    c = client(tracking_uri)
    _forget_artifact_repo(run_id)
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / name
        p.write_text(text)
        c.log_artifact(run_id, str(p), artifact_path=subdir)


def log_artifact(tracking_uri: str, run_id: str, path: str | os.PathLike, subdir: str | None = None) -> None:
    c = client(tracking_uri)
    _forget_artifact_repo(run_id)
    if Path(path).is_dir():
        c.log_artifacts(run_id, str(path), artifact_path=subdir)
    else:
        c.log_artifact(run_id, str(path), artifact_path=subdir)


def set_terminated(tracking_uri: str, run_id: str, status: str = "FINISHED") -> None:
    # MLflow prints "View run ... / View experiment ..." at every end of a server-backed run (a sweep worker's
    # trial, then its parent): the commands print their own links once instead
    with contextlib.redirect_stdout(io.StringIO()):
        client(tracking_uri).set_terminated(run_id, status=status)


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True, default=str)


def check_outputs(
    command: str,
    out: str | os.PathLike,
    out_given: bool,
    tracking_uri: str | None = None,
    tracking_options: str = "--no-mlflow, or --tracking-uri URI",
) -> None:
    """Refuse in one sentence, before any work, when ``command`` could not write its results to ``out``
    (``--out``, or its default inside the run directory) or its MLflow run to ``tracking_uri`` (None: no
    tracking)."""
    problem = writable_dir_problem(out)
    if problem is not None:
        if out_given:
            raise UserError(
                f"--out '{out}' cannot take the results of {command}: {problem}; pass a folder you can write to."
            )
        raise UserError(
            f"{command} writes its results to '{out}' in the run directory by default, but {problem}; pass "
            f"--out DIR to write them elsewhere (and {tracking_options}, for the MLflow run)."
        )
    if tracking_uri is not None and tracking_uri.split("://", 1)[0].lower() in ("http", "https"):
        check_tracking_server(tracking_uri)  # a server that does not answer: one sentence in seconds
    if tracking_uri is not None:
        problem = tracking_store_problem(tracking_uri)
        if problem is not None:
            raise UserError(
                f"{command} cannot log to the MLflow store {mask_url(tracking_uri)}: {problem}; pass {tracking_options} "
                "to log elsewhere."
            )
