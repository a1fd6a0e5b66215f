"""``train()``: one config, one run directory, one MLflow run, exact resume (the ``train`` command's parsing and
printing: ``commands/train.py``).

The run directory's layout (``config.yaml``, ``checkpoints/``, the MLflow run's id and store, ``result.json``,
the writer's lock) is ``run_dir.RunDir``'s; a ``resume`` of a finished run validates its last checkpoint again
and rewrites the same metrics; a second ``train`` into a directory another process writes is refused.

``train`` runs in phases: the run directory and the checkpoint it resumes from (training/resume.py), the data,
the MLflow run (training/mlflow_run.py), the model, the trainer and fit (training/trainer.py), the summary
(final metrics, result.json).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import sys
import time
from pathlib import Path
from typing import Any

from recursive_lightning import faults
from recursive_lightning import threads as thread_policy
from recursive_lightning.config import RunConfig
from recursive_lightning.errors import ConfigError
from recursive_lightning.files import default_cache_dir
from recursive_lightning.run_dir import RunDir
from recursive_lightning.training.host import TRAIN_BYTES_PER_PARAM, check_fits_in_memory, keep_freed_memory
from recursive_lightning.training.options import TrainOptions
from recursive_lightning.training.result import TrainResult
from recursive_lightning.training.run_lock import first_rank, run_dir_lock


def build_datamodule(cfg: RunConfig, run_dir: str | os.PathLike | None = None):
    """The data module of ``cfg``; with the run's ``run_dir``, ``data.tokenizer: init`` (an uptraining run) is
    the copy of its source's tokenizer kept there (``uptrain.tokenizer_spec``)."""
    from recursive_lightning.data.datamodule import TextDataModule  # heavy
    from recursive_lightning.training import uptrain  # heavy

    d = cfg.data
    cache = d.cache_dir or default_cache_dir()
    return TextDataModule(
        data=d.path,
        tokenizer=d.tokenizer if run_dir is None else uptrain.tokenizer_spec(cfg, Path(run_dir)),
        seq_len=d.seq_len,
        batch_size=d.batch_size,
        cache_dir=cache,
        seed=cfg.train.seed,
        val_batches=d.val_batches,
        num_workers=d.num_workers,
        val_fraction=d.val_fraction,
    )


def prepare_corpus(cfg: RunConfig) -> None:
    """Build (or find in the cache) the tokenizer and token shards ``build_datamodule(cfg)`` reads, without
    importing Lightning (a sweep's coordinating process)."""
    from recursive_lightning.data.prepare import build_corpus  # heavy

    d = cfg.data
    build_corpus(d.path, d.tokenizer, d.cache_dir or default_cache_dir(), d.val_fraction)


def train(
    cfg: RunConfig, run_dir: str | os.PathLike, options: TrainOptions | None = None, **fields: Any
) -> TrainResult:
    """Train ``cfg`` into ``run_dir`` as ``options`` say (or their fields as keywords: ``resume=True``,
    ``tracking_uri=...``); with ``resume`` continue from its newest good checkpoint.

    Another live process writing ``run_dir`` is refused in one sentence (``run_lock.RunDirBusy``)."""
    options = dataclasses.replace(options or TrainOptions(), **fields)
    run_dir = Path(run_dir).resolve()
    check_before_writing(cfg)  # a refusal the config alone decides: before the lock makes any folder
    # one writer per run directory; a multi-device run's further ranks write through its first
    with run_dir_lock(run_dir) if first_rank() else contextlib.nullcontext():
        return _train(cfg, run_dir, options)


def check_before_writing(cfg: RunConfig) -> None:
    """The refusals that need only ``cfg`` and this machine (a setting it cannot run, a model its memory cannot
    train), run before the run directory's lock creates any folder: a refused run leaves nothing on disk."""
    from recursive_lightning.training import parallel  # heavy

    parallel.check_supported(cfg.train)
    _check_memory(cfg)


def _train(cfg: RunConfig, run_dir: Path, options: TrainOptions) -> TrainResult:
    import lightning as L  # heavy

    from recursive_lightning.training import mlflow_run  # heavy
    from recursive_lightning.training import resume as run_dir_state  # heavy

    t0 = time.time()
    if cfg.train.keep_host_memory:
        keep_freed_memory()
    # ---- the run directory and the checkpoint it resumes from
    run_dir_state.prepare_run_dir(cfg, run_dir, options.resume)
    resume_from = run_dir_state.resume_checkpoint(cfg, run_dir, options.resume, options.ckpt_path)
    mlflow_run.check_run_owner(run_dir, options)  # a copy still sharing its MLflow run: before any write
    run_dir_state.keep_config(cfg, run_dir)
    source = _uptraining_source(cfg, run_dir, resume_from)
    L.seed_everything(cfg.train.seed, workers=True, verbose=False)
    dm = _datamodule(cfg, run_dir, source)
    # from the instant its MLflow run is RUNNING, whatever stops this command closes it (mlflow_run.RunCloser)
    with mlflow_run.RunCloser(run_dir, rank_zero=first_rank()) as closer:
        return _fit_and_summarise(cfg, run_dir, dm, source, resume_from, t0, closer, options)


def _fit_and_summarise(
    cfg: RunConfig,
    run_dir: Path,
    dm: Any,
    source: Any,
    resume_from: str | None,
    t0: float,
    closer: Any,
    options: TrainOptions,
) -> TrainResult:
    """The MLflow run opened (``closer`` told the instant it is RUNNING), the model, the trainer, fit and the
    summary."""
    import lightning as L  # heavy

    from recursive_lightning.training import mlflow_run  # heavy
    from recursive_lightning.training import resume as run_dir_state  # heavy
    from recursive_lightning.training.module import RecursiveLMModule  # heavy
    from recursive_lightning.training.step_logger import step_once_logger  # heavy
    from recursive_lightning.training.trainer import build_trainer, fit  # heavy
    from recursive_lightning.training.wallclock import WallClock  # heavy

    # ---- MLflow: one experiment per config name, one run per run directory
    tracking_uri, run_id = mlflow_run.open_run(cfg, run_dir, dm.corpus_summary(), options, closer=closer)
    faults.point("run_opened")  # tests: Ctrl-C during the set-up, after the run is RUNNING
    L.seed_everything(cfg.train.seed, workers=True, verbose=False)  # init: not what data prep consumed
    module = RecursiveLMModule(cfg.to_dict(), val_names=("heldout",), tokenizer_json=dm.tokenizer.to_str())
    thread_policy.apply_for(cfg.model)  # inside a CLI command (recursive_lightning/threads.py)
    module.mlflow_run_id = run_id
    # ---- the trainer, and fit
    clock = WallClock(t0, data=dm.prep_seconds)
    resumed = resume_from is not None
    trainer = build_trainer(
        cfg,
        run_dir,
        # a resumed run retrains the steps since its last checkpoint: each step's metrics are logged once
        logger=step_once_logger(options.experiment or cfg.name, tracking_uri, run_id, resumed=resumed),
        callbacks=[
            clock,
            *_run_callbacks(cfg, module, source, tracking_uri, run_id),
            *(options.callbacks or []),
        ],
        precision=run_dir_state.resumed_precision(cfg, resume_from),
    )
    with mlflow_run.tracked(tracking_uri, run_id, resumed, rank_zero=trainer.is_global_zero):
        fit(trainer, module, dm, resume_from, cfg, run_dir)
    return _summarise(trainer, cfg, run_dir, clock, tracking_uri, run_id)


def _summarise(
    trainer: Any, cfg: RunConfig, run_dir: Path, clock: Any, tracking_uri: str, run_id: str
) -> TrainResult:
    """The run's result: final metrics logged (a finished run resumed without training keeps the ones it
    recorded), the run FINISHED and ``result.json`` written (rank zero)."""
    from recursive_lightning.training import mlflow_run  # heavy
    from recursive_lightning.training import resume as run_dir_state  # heavy
    from recursive_lightning.training.trainer import best_checkpoint, val_metrics  # heavy

    last = RunDir(run_dir).last_checkpoint
    d, steps = cfg.data, trainer.global_step
    trained = steps != clock.start_step
    val = val_metrics(trainer)
    # a finished run resumed without training: result.json's record stands, read once (metrics it never
    # replaces with empty ones; seconds it timed to its end, where the checkpoint stopped at its last save)
    recorded = run_dir_state.previous_result(run_dir, steps) if not val or not trained else {}
    metrics = val or dict(recorded.get("metrics") or {})
    seconds, segments = clock.run_totals(steps)
    data_seconds = clock.data_seconds(steps)
    if not trained:
        seconds, segments = recorded.get("seconds", seconds), recorded.get("segments", segments)
        data_seconds = recorded.get("data_seconds", data_seconds)
    result = TrainResult(
        run_dir=run_dir,
        steps=steps,
        tokens=steps * d.batch_size * d.seq_len * cfg.train.accumulate * trainer.world_size,
        metrics=metrics,
        last_checkpoint=last if last.exists() else None,
        best_checkpoint=best_checkpoint(trainer, run_dir),
        mlflow_run_id=run_id,
        tracking_uri=tracking_uri,
        seconds=seconds,
        segment_steps=steps - clock.start_step,
        segment_seconds=clock.segment_seconds(),
        segments=segments,
        data_seconds=data_seconds,
    )
    if trainer.is_global_zero:
        mlflow_run.finish_run(tracking_uri, run_id, metrics, steps, result.tokens, result.seconds)
        result.save()
    return result


def _check_memory(cfg: RunConfig) -> None:
    """Refuse a model this machine's memory cannot train (``host.check_fits_in_memory``): weights, gradients
    and AdamW's moments in host memory for a CPU run; a run on an accelerator builds its float32 weights here."""
    import torch  # heavy

    from recursive_lightning.model.describe import describe  # heavy

    t = cfg.train
    on_cpu = t.accelerator == "cpu" or (t.accelerator == "auto" and not torch.cuda.is_available())
    params = describe(cfg.model, seq_len=cfg.data.seq_len)["params_total"]
    check_fits_in_memory(params, TRAIN_BYTES_PER_PARAM if on_cpu else 4)


def _uptraining_source(cfg: RunConfig, run_dir: Path, resume_from: str | None) -> Any:
    """The pretrained source of an uptraining run (``train.init_from``, training/uptrain.py), read only when the
    run starts at step 0 (its tokenizer kept in ``run_dir``); else None."""
    if not cfg.train.init_from or resume_from is not None:
        return None
    from recursive_lightning.training import uptrain  # heavy

    source = uptrain.load_source(cfg.train.init_from)
    uptrain.keep_tokenizer(cfg, source, run_dir)
    return source


def _datamodule(cfg: RunConfig, run_dir: Path, source: Any) -> Any:
    """The run's data module, set up for fit; its tokenizer checked against an uptraining ``source`` and the
    model's vocabulary, and a Mela memory that cannot learn at this length warned of."""
    t = time.time()
    dm = build_datamodule(cfg, run_dir)
    try:
        dm.prepare_data()
        dm.setup("fit")
    except OSError as e:  # a read-only or foreign cache: one sentence, not a traceback from deep in data prep
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise ConfigError(
            f"data.cache_dir '{dm.cache_dir}' cannot take the run's corpus, tokenizer and token shards "
            f"({e.strerror}: '{e.filename}'); set data.cache_dir to a folder you can write to."
        ) from None
    dm.prep_seconds = time.time() - t  # one-off: the first run on a corpus builds it (training/wallclock.py)
    if source is not None:
        from recursive_lightning.training import uptrain  # heavy

        uptrain.check_tokenizer(cfg, source, dm.tokenizer)
    vocab = dm.vocab_size
    if vocab > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size {cfg.model.vocab_size} is smaller than the tokenizer's vocabulary ({vocab}); "
            f"set model.vocab_size >= {vocab} or use a smaller data.tokenizer."
        )
    if cfg.model.arch == "mela":  # a memory that cannot learn at this length says so (Mela)
        from recursive_lightning.model.mela.model import memory_gradient_warning  # heavy

        warning = memory_gradient_warning(cfg.model, cfg.data.seq_len)
        if warning:
            print(warning, file=sys.stderr, flush=True)
    return dm


def _run_callbacks(cfg: RunConfig, module: Any, source: Any, tracking_uri: str, run_id: str) -> list:
    """The callbacks an uptraining run (its record in every checkpoint) and a partly frozen run need."""
    from recursive_lightning.training import uptrain  # heavy

    out = []
    if cfg.train.init_from:  # the record rides in every checkpoint; a resume restores it from there
        record = uptrain.initialise_from(module.model, source, cfg.train.init_strategy) if source else None
        if record is not None:
            uptrain.log_record(tracking_uri, run_id, record)
        out.append(uptrain.Record(record))
    if cfg.train.train_only_steps:
        from recursive_lightning.training.partial import TrainOnly  # heavy

        out.append(TrainOnly(cfg.train.train_only, cfg.train.train_only_steps))
    return out
