"""The MLflow run of a training run: one experiment per config name, one run per run directory (created with
its params, config, ``describe`` counts and corpus, or continued on a resume), system metrics while it
trains, and its final status."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException

from recursive_lightning.config import RunConfig
from recursive_lightning.errors import ConfigError, Terminated
from recursive_lightning.files import atomic_write_text
from recursive_lightning.model.describe import describe
from recursive_lightning.run_dir import RunDir
from recursive_lightning.tracking import view
from recursive_lightning.tracking.runs import (
    absolute_uri,
    client,
    create_run,
    default_tracking_uri,
    ensure_experiment,
    log_artifact_text,
    log_corpus,
    log_metrics,
    log_params,
    param_value,
    record_tracking_uri,
    set_tags,
    set_terminated,
    to_json,
    unlogged_points,
)
from recursive_lightning.tracking.stores import check_tracking_store
from recursive_lightning.training.loop_flops import expected_training_flops
from recursive_lightning.training.options import TrainOptions
from recursive_lightning.uris import mask_url


def open_run(
    cfg: RunConfig,
    run_dir: Path,
    corpus: dict[str, Any],
    options: TrainOptions,
    *,
    closer: RunCloser | None = None,
) -> tuple[str, str]:
    """(tracking URI, run id) of ``run_dir``'s MLflow run: the one it records (marked RUNNING again), else a new
    one with ``run_params`` and ``params`` (a sweep's axes), ``tags``, the config and ``describe`` counts as
    artifacts and ``corpus`` (``TextDataModule.corpus_summary()``) as its datasets. On a resume a param whose
    value changed becomes a ``resumed/<param>`` tag. ``closer`` learns the run the moment it is RUNNING."""
    given = bool(options.tracking_uri)
    tracking_uri = absolute_uri(options.tracking_uri) if given else default_tracking_uri(run_dir)
    # a server or database that does not answer, a password it lacks (the run directory records the URL
    # masked), a SQLite file that is damaged: one sentence now, not MLflow's minutes of retries and a traceback
    check_tracking_store(tracking_uri, "--tracking-uri" if given else f"of '{run_dir}'")
    id_file = RunDir(run_dir).run_id_file
    if (
        options.parent_run_id and not id_file.exists()
    ):  # MLflow would file the new run under a parent not there
        _check_parent_exists(tracking_uri, options.parent_run_id)
    exp_id = ensure_experiment(tracking_uri, options.experiment or cfg.name, RunDir(run_dir).artifacts)
    if id_file.exists():
        run_id = id_file.read_text().strip()
        _check_run_exists(tracking_uri, run_id, run_dir)
        _claim_run(tracking_uri, run_id, run_dir)
        client(tracking_uri).update_run(run_id, status="RUNNING")  # a resumed (or extended) run runs again
        if closer is not None:
            closer.opened(tracking_uri, run_id)
    else:
        run_id = create_run(
            tracking_uri,
            exp_id,
            options.run_name or cfg.name,
            tags={"run_dir": str(run_dir), **(options.tags or {})},
            parent_run_id=options.parent_run_id,
        )
        if closer is not None:
            closer.opened(tracking_uri, run_id)
        record_tracking_uri(run_dir, tracking_uri)  # before the id: eval / resume find the run
        atomic_write_text(id_file, run_id)
        stats = describe(cfg.model, seq_len=cfg.data.seq_len)
        if cfg.train.loops is not None:  # sampled-loop training: expected training FLOPs per token
            stats.update(expected_training_flops(cfg.model, cfg.data.seq_len, cfg.train.loops))
        log_params(tracking_uri, run_id, {**run_params(cfg, stats), **(options.params or {})})
        log_metrics(tracking_uri, run_id, cost_metrics(stats))  # columns that sort and chart
        log_artifact_text(tracking_uri, run_id, RunDir.CONFIG, cfg.to_yaml())
        log_artifact_text(tracking_uri, run_id, "describe.json", to_json(stats))
        log_corpus(tracking_uri, run_id, corpus)
    if options.resume:  # a value changed by the resume (a larger max_steps) is kept as a tag
        _tag_changed_params(tracking_uri, run_id, cfg)
    return tracking_uri, run_id


def run_params(cfg: RunConfig, stats: dict[str, Any]) -> dict[str, Any]:
    """A run's MLflow params, each once: the resolved config (``model.*`` as ``ModelConfig.resolved``,
    ``data.*``, ``train.*``) and what ``describe`` counts that no field states (``describe.params_*``,
    ``describe.flops_*``, the loop steps)."""
    flat = {**cfg.flat(), "data.path": cfg.data.path or "embedded"}  # None: the embedded corpus
    # an option left unset (None) acts as absent: not shown as "None"
    out: dict[str, Any] = {k: v for k, v in flat.items() if not k.startswith("model.") and v is not None}
    out.update({f"model.{k}": v for k, v in cfg.model.resolved().items()})
    # describe() repeats some config fields (layout, buffer, seq_len, ...; its batch_size is a batch of one)
    fields = {k.split(".")[-1] for k in flat} | {"flops_convention"}
    out.update({f"describe.{k}": v for k, v in stats.items() if k not in fields})
    return out


def cost_metrics(stats: dict[str, Any]) -> dict[str, float]:
    """A run's cost as metrics (MLflow's table sorts and charts metrics, not params): ``cost/params``,
    ``cost/params_non_embedding`` and ``cost/fwd_flops_per_token`` (``describe``'s forward FLOPs of one
    sequence over its tokens), and ``cost/train_flops_per_token`` (3 x forward; under ``train.loops`` the
    expectation over the distribution), the factor of the cumulative ``train/flops`` it logs per step."""
    fwd = stats["flops_forward"] / stats["seq_len"]
    return {
        "cost/params": float(stats["params_total"]),
        "cost/params_non_embedding": float(stats["params_non_embedding"]),
        "cost/fwd_flops_per_token": float(fwd),
        "cost/train_flops_per_token": float(stats.get("flops_train_per_token_expected") or 3 * fwd),
    }


def _check_parent_exists(tracking_uri: str, parent_run_id: str) -> None:
    try:
        client(tracking_uri).get_run(parent_run_id)
    except MlflowException:
        raise ConfigError(
            f"--parent-run-id '{parent_run_id}' is not a run in the tracking store {mask_url(tracking_uri)}; pass "
            "the id of a run there (e.g. a sweep's parent run, with its --tracking-uri), or leave it out."
        ) from None


def _check_run_exists(tracking_uri: str, run_id: str, run_dir: Path) -> None:
    try:
        client(tracking_uri).get_run(run_id)
    except MlflowException:
        raise ConfigError(
            f"the MLflow run {run_id} of '{run_dir}' is not in {mask_url(tracking_uri)}; pass the store it was "
            "logged to with --tracking-uri, or train into a new --run-dir."
        ) from None


def check_run_owner(run_dir: Path, options: TrainOptions) -> None:
    """Before a resume writes anything: the MLflow run ``run_dir`` records is not another live directory's
    (``_claim_run``)."""
    run_id = RunDir(run_dir).recorded_run_id()
    if run_id is None:
        return
    given = bool(options.tracking_uri)
    tracking_uri = absolute_uri(options.tracking_uri) if given else default_tracking_uri(run_dir)
    check_tracking_store(tracking_uri, "--tracking-uri" if given else f"of '{run_dir}'")
    _check_run_exists(tracking_uri, run_id, run_dir)
    _claim_run(tracking_uri, run_id, run_dir, retag=False)


def _claim_run(tracking_uri: str, run_id: str, run_dir: Path, retag: bool = True) -> None:
    """A run directory copied or moved to ``run_dir`` keeps its MLflow run: its ``run_dir`` tag is set to the new
    path, so that the tag leads to the checkpoints that continue it. Refused while the directory the tag names
    still exists and logs to this same run in this same store: two directories would then write one run's
    history (a copy that has its own SQLite store holds its own copy of the run, and takes it over)."""
    old = client(tracking_uri).get_run(run_id).data.tags.get("run_dir")
    if not old or Path(old) == run_dir:
        return
    other = RunDir(old)
    if (
        other.path.is_dir()
        and other.recorded_run_id() == run_id
        and default_tracking_uri(old) == tracking_uri
    ):
        raise ConfigError(
            f"--resume: the MLflow run {run_id} in {mask_url(tracking_uri)} is the run of '{old}', which still "
            f"exists and logs to it; resume '{old}' instead, or move (not copy) it to '{run_dir}'."
        )
    if retag:
        set_tags(tracking_uri, run_id, {"run_dir": str(run_dir)})


def _tag_changed_params(tracking_uri: str, run_id: str, cfg: RunConfig) -> None:
    """MLflow refuses to change a param: a value a resume changed (``--resume --max-steps N`` extends a finished
    run) becomes the tag ``resumed/<param>`` (the latest value); the first value stays the param."""
    existing = client(tracking_uri).get_run(run_id).data.params
    changed = {
        f"resumed/{k}": v
        for k, v in run_params(cfg, {}).items()
        if k in existing and existing[k] != param_value(v)
    }
    set_tags(tracking_uri, run_id, changed)


class RunCloser:
    """The end of a run this command set RUNNING, whatever stops the command after that instant (set-up, fit,
    the summary): its status says what happened. A run whose ``result.json`` is written (a finished run, or one
    extended by ``--resume --max-steps``) is FINISHED again, its recorded result standing; otherwise KILLED for
    Ctrl-C or SIGTERM, FAILED for an error. Only ``rank_zero`` writes it."""

    def __init__(self, run_dir: Path, rank_zero: bool = True) -> None:
        self.run_dir, self.rank_zero = run_dir, rank_zero
        self.run: tuple[str, str] | None = None

    def opened(self, tracking_uri: str, run_id: str) -> None:
        self.run = (tracking_uri, run_id)

    def __enter__(self) -> RunCloser:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> bool:
        if error is None or self.run is None or not self.rank_zero:
            return False
        if RunDir(self.run_dir).result.is_file():
            status = "FINISHED"
        elif isinstance(error, (Terminated, KeyboardInterrupt)):
            status = "KILLED"
        else:
            status = "FAILED"
        try:
            set_terminated(*self.run, status=status)
        except Exception as e:  # the store failing too (a full disk): the command's error is shown
            print(
                mask_url(f"warning: could not mark the MLflow run {self.run[1]} {status} ({e})"),
                file=sys.stderr,
            )
        return False


@contextlib.contextmanager
def tracked(tracking_uri: str, run_id: str, resumed: bool, rank_zero: bool) -> Iterator[None]:
    """The block that trains: system metrics while it runs (``rank_zero`` only); how the run ends when it
    raises is :class:`RunCloser`'s."""
    monitor = _system_metrics(tracking_uri, run_id, resumed) if rank_zero else None
    try:
        yield
    finally:
        if monitor is not None:
            monitor.finish()


def _system_metrics(tracking_uri: str, run_id: str, resumed: bool) -> Any:
    """MLflow's system metrics (CPU, memory, disk, network; GPU utilisation and memory where NVML finds a GPU)
    every 10 s into the run's System metrics tab, continuing the steps of a resumed run. Off with
    ``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=false``; the interval is ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL``."""
    if os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "").lower() in ("false", "0"):
        return None
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor  # optional

        monitor = SystemMetricsMonitor(run_id, resume_logging=resumed, tracking_uri=tracking_uri)
    except ImportError:  # psutil missing: train without them rather than fail
        return None
    monitor.start()
    return monitor


def finish_run(
    tracking_uri: str, run_id: str, metrics: dict[str, float], step: int, tokens: int, seconds: float
) -> None:
    """The final validation metrics as ``final/<metric>`` at ``step``, the run's description saying what it
    reached (``tracking.view.train_note``; a description of a sweep's or the researcher's own stays); the run
    FINISHED."""
    final = unlogged_points(tracking_uri, run_id, {f"final/{k}": v for k, v in metrics.items()}, step)
    log_metrics(tracking_uri, run_id, final, step=step)
    if view.ours_to_replace(client(tracking_uri).get_run(run_id).data.tags.get(view.NOTE_TAG)):
        set_tags(tracking_uri, run_id, {view.NOTE_TAG: view.train_note(metrics, step, tokens, seconds)})
    set_terminated(tracking_uri, run_id, "FINISHED")
