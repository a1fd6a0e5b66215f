"""``python -m recursive_lightning train``: one config, one run directory, one MLflow run, exact resume.

Run directory layout::

    <run-dir>/config.yaml          the fully resolved config (resume uses it)
    <run-dir>/checkpoints/         last.ckpt, step=NNNNNN.ckpt (two newest), best.ckpt
    <run-dir>/mlflow.db            SQLite tracking store (unless --tracking-uri points elsewhere)
    <run-dir>/mlartifacts/         MLflow artifacts of the SQLite store
    <run-dir>/mlflow_run_id        the MLflow run this directory logs to (a resume continues it)
    <run-dir>/mlflow_tracking_uri  the store of that run; a SQLite file inside the directory (or the store of
                                   the sweep around it) is kept relative, so the directory can be moved or copied
    <run-dir>/result.json          final metrics, written (atomically) when training finishes; a --resume of a
                                   finished run validates its last checkpoint again and rewrites the same metrics
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recursive_lightning import threads as thread_policy
from recursive_lightning.config import RunConfig, load_run_config, load_yaml
from recursive_lightning.errors import ConfigError, Terminated
from recursive_lightning.tracking.runs import (
    RUN_ID_FILE,
    absolute_uri,
    atomic_write_text,
    client,
    create_run,
    default_tracking_uri,
    ensure_experiment,
    log_artifact_text,
    log_corpus,
    log_params,
    param_value,
    record_tracking_uri,
    set_tags,
    set_terminated,
    to_json,
    ui_command,
    writable_dir_problem,
)

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "experiments" / "cpu" / "looped-mesh.yaml"


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    tokens: int
    metrics: dict[str, float]
    last_checkpoint: Path | None
    best_checkpoint: Path | None
    mlflow_run_id: str
    tracking_uri: str
    seconds: float  # wall-clock of the run: the sum of its segments (training/wallclock.py)
    extra: dict[str, Any] = field(default_factory=dict)
    segment_steps: int | None = None  # steps this command trained (None: the whole run)
    segment_seconds: float | None = None
    segments: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "steps": self.steps,
            "tokens": self.tokens,
            "metrics": self.metrics,
            "last_checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "best_checkpoint": str(self.best_checkpoint) if self.best_checkpoint else None,
            "mlflow_run_id": self.mlflow_run_id,
            "tracking_uri": self.tracking_uri,
            "seconds": self.seconds,
            "segments": self.segments,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], run_dir: Path) -> TrainResult:
        """A ``result.json`` read back from ``run_dir`` where it lies now: paths recorded inside the run directory
        at the time (the checkpoints) follow it when it was moved or copied, and the tracking store is the one
        the directory records (``default_tracking_uri``). Raises KeyError / TypeError / ValueError on a
        damaged record."""
        old = d.get("run_dir")

        def here(path: str | None) -> Path | None:
            return None if not path else rebased(path, old, run_dir)

        return cls(
            run_dir=run_dir,
            steps=int(d["steps"]),
            tokens=int(d["tokens"]),
            metrics={k: float(v) for k, v in d["metrics"].items()},
            last_checkpoint=here(d.get("last_checkpoint")),
            best_checkpoint=here(d.get("best_checkpoint")),
            mlflow_run_id=str(d["mlflow_run_id"]),
            tracking_uri=default_tracking_uri(run_dir),
            seconds=float(d.get("seconds") or 0.0),
            segments=int(d.get("segments") or 1),
        )


def rebased(path: str | os.PathLike, old_dir: str | os.PathLike | None, new_dir: str | os.PathLike) -> Path:
    """``path``, recorded while its directory was ``old_dir``, where that directory lies now (``new_dir``); a path
    outside ``old_dir`` (or with no ``old_dir`` recorded) as it was."""
    if old_dir:
        try:
            return Path(new_dir) / Path(path).relative_to(old_dir)
        except ValueError:
            pass
    return Path(path)


def build_datamodule(cfg: RunConfig, run_dir: str | os.PathLike | None = None):
    """The data module of ``cfg``; with the run's ``run_dir``, ``data.tokenizer: init`` (an uptraining run) is
    the copy of its source's tokenizer kept there (``uptrain.tokenizer_spec``)."""
    from recursive_lightning.data.datamodule import TextDataModule
    from recursive_lightning.training import uptrain

    d = cfg.data
    cache = (
        d.cache_dir
        or os.environ.get("RECURSIVE_LIGHTNING_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "recursive_lightning"
    )
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


def _check_checkpoint_config(ckpt: dict, cfg: RunConfig, path: str) -> None:
    """A --ckpt-path must come from a run of this config (model and data); else litdata and the optimiser
    fail deep inside Lightning (e.g. "item_loader state doesn't match")."""
    extra = ckpt.get("recursive_lightning") or {}
    if not extra.get("run"):
        return
    try:
        theirs = RunConfig.from_dict(extra["run"]).flat()
    except ConfigError:
        return
    ours = cfg.flat()
    for k in ours:
        if (k.startswith("model.") or k.startswith("data.")) and k != "data.num_workers":
            if k in theirs and theirs[k] != ours[k]:
                raise ConfigError(
                    f"--ckpt-path '{path}' was written by a run with {k} {theirs[k]!r}, but this run has "
                    f"{ours[k]!r}; pass a checkpoint of this run (or train that config instead)."
                )


def _check_same_config(saved: RunConfig, cfg: RunConfig, run_dir: Path) -> None:
    a, b = saved.flat(), cfg.flat()
    for k in a:
        if k.startswith("train.") and k in (
            "train.max_steps",
            "train.progress",
            "train.keep_host_memory",
            "train.devices",
            "train.accelerator",
        ):
            continue
        if a.get(k) != b.get(k):
            raise ConfigError(
                f"--resume: {k} is {b.get(k)!r} but the run in '{run_dir}' was started with {a.get(k)!r}; "
                "resume with the same config or use a new --run-dir."
            )


def train(
    cfg: RunConfig,
    run_dir: str | os.PathLike,
    *,
    resume: bool = False,
    ckpt_path: str | None = None,
    tracking_uri: str | None = None,
    experiment: str | None = None,
    run_name: str | None = None,
    parent_run_id: str | None = None,
    tags: dict[str, str] | None = None,
    callbacks: list | None = None,
    params: dict[str, Any] | None = None,
) -> TrainResult:
    """Train ``cfg`` into ``run_dir``; with ``resume`` continue from its newest good checkpoint.

    ``params``: MLflow params beside the config's (a sweep's axes)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from recursive_lightning.model.describe import describe
    from recursive_lightning.training import parallel
    from recursive_lightning.training.checkpoint import AtomicCheckpointIO, latest_good, read_checkpoint
    from recursive_lightning.training.host import keep_freed_memory
    from recursive_lightning.training.module import RecursiveLMModule
    from recursive_lightning.training.step_logger import step_once_logger

    t0 = time.time()
    parallel.check_supported(cfg.train)
    if cfg.train.keep_host_memory:
        keep_freed_memory()
    run_dir = Path(run_dir).resolve()
    ckpt_dir = run_dir / "checkpoints"
    saved_cfg = run_dir / "config.yaml"
    problem = writable_dir_problem(run_dir)
    if problem is not None:
        raise ConfigError(
            f"--run-dir '{run_dir}' cannot hold the run: {problem}; choose a folder you can write to."
        )
    if resume and saved_cfg.exists():
        saved = RunConfig.from_dict(load_yaml(saved_cfg))
        _check_same_config(saved, cfg, run_dir)
        if (
            saved.flat() != cfg.flat()
        ):  # e.g. a larger --max-steps extends the run: resume uses it from now on
            atomic_write_text(saved_cfg, cfg.to_yaml())
    if not resume and latest_good(ckpt_dir) is not None:
        raise ConfigError(
            f"--run-dir '{run_dir}' already holds checkpoints; pass --resume to continue it or choose a new --run-dir."
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    if not saved_cfg.exists():
        atomic_write_text(saved_cfg, cfg.to_yaml())

    resume_from: str | None = ckpt_path
    if resume_from is not None and not Path(resume_from).is_dir():
        # an explicit --ckpt-path: one sentence if it is damaged or was written by a different run
        _check_checkpoint_config(read_checkpoint(resume_from), cfg, resume_from)
    if resume and resume_from is None:
        last = ckpt_dir / "last.ckpt"
        if last.exists() or any(ckpt_dir.glob("step*.ckpt")):
            good = latest_good(ckpt_dir)
            if last.exists() and good != last:
                read_checkpoint(last)  # raises one sentence naming the damaged file and the good one
            resume_from = str(good) if good else None  # latest_good already checked it reads
        else:
            print(
                f"train --resume: '{run_dir}' holds no checkpoint yet; training from step 0.",
                file=sys.stderr,
                flush=True,
            )

    source = None  # uptraining (training/uptrain.py): the source is read only when the run starts at step 0
    if cfg.train.init_from:
        from recursive_lightning.training import uptrain

        if resume_from is None:
            source = uptrain.load_source(cfg.train.init_from)
            uptrain.keep_tokenizer(cfg, source, run_dir)
    L.seed_everything(cfg.train.seed, workers=True, verbose=False)
    dm = build_datamodule(cfg, run_dir)
    dm.prepare_data()
    dm.setup("fit")
    if source is not None:
        uptrain.check_tokenizer(cfg, source, dm.tokenizer)
    vocab = dm.vocab_size
    if vocab > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size {cfg.model.vocab_size} is smaller than the tokenizer's vocabulary ({vocab}); "
            f"set model.vocab_size >= {vocab} or use a smaller data.tokenizer."
        )

    if cfg.model.arch == "mela":  # a memory that cannot learn at this length says so (Mela, issue 31)
        from recursive_lightning.model.mela.model import memory_gradient_warning

        warning = memory_gradient_warning(cfg.model, cfg.data.seq_len)
        if warning:
            print(warning, file=sys.stderr, flush=True)

    # ---- MLflow: one experiment per config name, one run per run directory
    tracking_uri = absolute_uri(tracking_uri) if tracking_uri else default_tracking_uri(run_dir)
    exp_id = ensure_experiment(tracking_uri, experiment or cfg.name, run_dir / "mlartifacts")
    id_file = run_dir / RUN_ID_FILE
    if id_file.exists():
        run_id = id_file.read_text().strip()
        _check_run_exists(tracking_uri, run_id, run_dir)
        client(tracking_uri).update_run(run_id, status="RUNNING")  # a resumed (or extended) run runs again
    else:
        run_id = create_run(
            tracking_uri,
            exp_id,
            run_name or cfg.name,
            tags={"run_dir": str(run_dir), **(tags or {})},
            parent_run_id=parent_run_id,
        )
        record_tracking_uri(run_dir, tracking_uri)  # before the id: eval / resume find the run
        atomic_write_text(id_file, run_id)
        stats = describe(cfg.model, seq_len=cfg.data.seq_len)
        log_params(tracking_uri, run_id, {**run_params(cfg, stats), **(params or {})})
        log_artifact_text(tracking_uri, run_id, "config.yaml", cfg.to_yaml())
        log_artifact_text(tracking_uri, run_id, "describe.json", to_json(stats))
        log_corpus(tracking_uri, run_id, dm.corpus_summary())
    if id_file.exists() and resume:  # a value changed by the resume (a larger max_steps) is kept as a tag
        _tag_changed_params(tracking_uri, run_id, cfg)

    L.seed_everything(
        cfg.train.seed, workers=True, verbose=False
    )  # init must not depend on what data prep consumed
    module = RecursiveLMModule(cfg.to_dict(), val_names=("heldout",), tokenizer_json=dm.tokenizer.to_str())
    thread_policy.apply_for(cfg.model)  # inside a CLI command (recursive_lightning/threads.py)
    module.mlflow_run_id = run_id
    extra_cbs = []
    if cfg.train.init_from:  # the record rides in every checkpoint; a resume restores it from there
        record = uptrain.initialise_from(module.model, source, cfg.train.init_strategy) if source else None
        if record is not None:
            uptrain.log_record(tracking_uri, run_id, record)
        extra_cbs.append(uptrain.Record(record))
    if cfg.train.train_only_steps:
        from recursive_lightning.training.partial import TrainOnly

        extra_cbs.append(TrainOnly(cfg.train.train_only, cfg.train.train_only_steps))
    # a resumed run retrains the steps since its last checkpoint: each step's metrics are logged once
    logger = step_once_logger(experiment or cfg.name, tracking_uri, run_id, resumed=resume_from is not None)

    t = cfg.train
    periodic = ModelCheckpoint(
        dirpath=ckpt_dir,
        filename="step={step:06d}",
        auto_insert_metric_name=False,
        every_n_train_steps=t.checkpoint_every,
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last=True,
        enable_version_counter=False,
    )
    best = ModelCheckpoint(
        dirpath=ckpt_dir,
        filename="best",
        monitor="val/heldout/loss",
        mode="min",
        save_top_k=1,
        auto_insert_metric_name=False,
        enable_version_counter=False,
    )
    from recursive_lightning.training.wallclock import WallClock

    clock = WallClock(t0)
    cbs = [periodic, best, clock, *extra_cbs, *(callbacks or [])]
    if t.progress:
        from lightning.pytorch.callbacks import TQDMProgressBar

        cbs.append(TQDMProgressBar(refresh_rate=max(1, min(10, t.max_steps // 50))))
    strategy = parallel.resolve_strategy(t)
    plugins = [AtomicCheckpointIO()] if strategy in ("auto", "ddp") else []
    trainer = L.Trainer(
        default_root_dir=str(run_dir),
        max_steps=t.max_steps,
        max_epochs=-1,
        val_check_interval=t.val_every,
        check_val_every_n_epoch=None,
        limit_val_batches=cfg.data.val_batches,
        num_sanity_val_steps=0,
        log_every_n_steps=t.log_every,
        gradient_clip_val=t.grad_clip if t.strategy != "fsdp" else None,
        accumulate_grad_batches=t.accumulate,
        precision=parallel.resolve_precision(t, t.accelerator),
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=strategy,
        plugins=plugins,
        logger=logger,
        callbacks=cbs,
        enable_progress_bar=t.progress,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    status = "FAILED"
    monitor = (
        _system_metrics(tracking_uri, run_id, resumed=resume_from is not None)
        if trainer.is_global_zero
        else None
    )
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=resume_from, weights_only=False)
        # a final validation at the last step, unless one just ran there in this process (a resumed finished
        # run trains no step and validates its last checkpoint again, so its result is never lost)
        if trainer.global_step % t.val_every != 0 or not _val_metrics(trainer):
            trainer.validate(module, datamodule=dm, verbose=False)
        status = "FINISHED"
    except SIGTERMException:  # Lightning stops at the next step (or validation batch) and raises SystemExit()
        status = "KILLED"
        raise Terminated(
            f"train: stopped by SIGTERM at step {trainer.global_step}; the run is resumable from its last "
            f"checkpoint: --run-dir {run_dir} --resume."
        ) from None
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except SystemExit as e:
        # Lightning turns Ctrl-C inside fit into sys.exit(1) after its own shutdown (trainer/call.py): report it
        # as the interrupt it was (exit 130, run KILLED), not as a failure
        if trainer.interrupted and e.code == 1 and not isinstance(e, SIGTERMException):
            status = "KILLED"
            raise KeyboardInterrupt from None
        raise
    finally:
        if monitor is not None:
            monitor.finish()
        if trainer.is_global_zero and status != "FINISHED":
            set_terminated(tracking_uri, run_id, status=status)
    metrics = _val_metrics(trainer)
    if not metrics:  # never erase a finished run's recorded result
        metrics = _previous_metrics(run_dir, trainer.global_step)
    if trainer.is_global_zero:
        from recursive_lightning.tracking.runs import log_metrics

        log_metrics(
            tracking_uri, run_id, {f"final/{k}": v for k, v in metrics.items()}, step=trainer.global_step
        )
        set_terminated(tracking_uri, run_id, "FINISHED")
    last = ckpt_dir / "last.ckpt"
    tokens = trainer.global_step * cfg.data.batch_size * cfg.data.seq_len * t.accumulate * trainer.world_size
    result = TrainResult(
        run_dir=run_dir,
        steps=trainer.global_step,
        tokens=tokens,
        metrics=metrics,
        last_checkpoint=last if last.exists() else None,
        # a copied or moved run restores the old folder's path with the callback's state: the file is here
        best_checkpoint=ckpt_dir / Path(best.best_model_path).name if best.best_model_path else None,
        mlflow_run_id=run_id,
        tracking_uri=tracking_uri,
        seconds=clock.seconds(),
        segment_steps=trainer.global_step - clock.start_step,
        segment_seconds=clock.segment_seconds(),
        segments=clock.segments + 1,
    )
    if trainer.is_global_zero:
        atomic_write_text(run_dir / "result.json", json.dumps(result.to_dict(), indent=2))
    return result


def _system_metrics(tracking_uri: str, run_id: str, resumed: bool):
    """MLflow's system metrics (CPU, memory, disk, network; GPU utilisation and memory where NVML finds a GPU)
    every 10 s into the run's System metrics tab, continuing the steps of a resumed run. Off with
    ``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=false``; the interval is ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL``."""
    import logging

    if os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "").lower() in ("false", "0"):
        return None
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, resume_logging=resumed, tracking_uri=tracking_uri)
    except ImportError:  # psutil missing: train without them rather than fail
        return None
    monitor.start()
    return monitor


def _val_metrics(trainer) -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}


def _previous_metrics(run_dir: Path, steps: int) -> dict[str, float]:
    try:
        old = json.loads((run_dir / "result.json").read_text())
    except (OSError, ValueError):
        return {}
    return dict(old.get("metrics") or {}) if old.get("steps") == steps else {}


def _check_run_exists(tracking_uri: str, run_id: str, run_dir: Path) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client(tracking_uri).get_run(run_id)
    except MlflowException:
        raise ConfigError(
            f"the MLflow run {run_id} of '{run_dir}' is not in {tracking_uri}; pass the store it was logged "
            "to with --tracking-uri, or train into a new --run-dir."
        ) from None


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


def _tag_changed_params(tracking_uri: str, run_id: str, cfg: RunConfig) -> None:
    """MLflow refuses to change a param: a value a resume changed (``--resume --max-steps N`` extends a finished
    run) becomes the tag ``resumed/<param>`` (the latest value); the first value stays the param."""
    c = client(tracking_uri)
    existing = c.get_run(run_id).data.params
    changed = {
        f"resumed/{k}": v
        for k, v in run_params(cfg, {}).items()
        if k in existing and existing[k] != param_value(v)
    }
    set_tags(tracking_uri, run_id, changed)


def summary_line(r: TrainResult) -> str:
    from recursive_lightning import formatting as fmt

    ppl = ", ".join(
        f"{k.removeprefix('val/')}={fmt.ppl(v)}" for k, v in r.metrics.items() if k.endswith("/ppl")
    )
    if r.segments > 1 and r.segment_steps is not None:  # a resumed run: what this command did, then the run
        done = (
            f"trained {r.segment_steps} steps in {r.segment_seconds:.0f}s, the run now at step {r.steps} "
            f"({r.tokens:,} tokens, {r.seconds:.0f}s over {r.segments} segments)"
        )
    else:
        done = f"trained {r.steps} steps ({r.tokens:,} tokens) in {r.seconds:.0f}s"
    return (
        f"{done}; val {ppl or 'n/a'}; "
        f"checkpoint {r.last_checkpoint}; MLflow run {r.mlflow_run_id} ({ui_command(r.run_dir, r.tracking_uri)})"
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="recursive_lightning train",
        description="Train one config.",
        epilog="Any config field can be overridden: --model.topology mesh --train.lr 3e-4",
    )
    p.add_argument(
        "--config",
        default=None,
        help=f"run YAML (default {DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parents[2])})",
    )
    p.add_argument("--data", help="text file, folder, glob or hf:<dataset> (default: the embedded corpus)")
    p.add_argument(
        "--max-steps",
        type=int,
        help="train.max_steps; with --resume of a finished run, a larger value extends it",
    )
    p.add_argument(
        "--run-dir", default=None, help="checkpoints, tracking DB and artifacts (default runs/<name>)"
    )
    p.add_argument(
        "--resume", action="store_true", help="continue the run in --run-dir from its last good checkpoint"
    )
    p.add_argument("--ckpt-path", help="resume from this checkpoint instead of the newest")
    p.add_argument("--checkpoint-every", type=int, help="steps between checkpoints")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default sqlite:///<run-dir>/mlflow.db)")
    p.add_argument("--experiment", help="MLflow experiment name (default: the config's name)")
    p.add_argument("--seed", type=int, help="train.seed: initialisation and data order (default 0)")
    p.add_argument("--parent-run-id", help="MLflow parent run (sweeps start multi-device trials this way)")
    p.add_argument("--run-name", help="MLflow run name (default: the config's name)")
    p.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE", help="MLflow tag of a new run")
    p.add_argument(
        "--init-from",
        help="train.init_from: start from a pretrained vanilla model (a checkpoint or run dir of ours, a local "
        "HF GPT-NeoX/LLaMA dir, a Hub name); its tokenizer comes with it",
    )
    p.add_argument(
        "--init-strategy", help="train.init_strategy: stepwise (default), average, lower, select:LAYERS"
    )
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="MLflow param of a new run (sweep axes)",
    )
    args, rest = p.parse_known_args(argv)
    config = args.config or (str(DEFAULT_CONFIG) if DEFAULT_CONFIG.exists() else None)
    overrides = list(rest)
    for flag, key in (
        ("data", "data.path"),
        ("max_steps", "train.max_steps"),
        ("checkpoint_every", "train.checkpoint_every"),
        ("seed", "train.seed"),
        ("init_from", "train.init_from"),
        ("init_strategy", "train.init_strategy"),
    ):
        if getattr(args, flag) is not None:
            overrides += [f"--{key}", str(getattr(args, flag))]
    if args.init_from is not None:
        from recursive_lightning.training.uptrain import cli_overrides

        overrides = cli_overrides(args.init_from, config, overrides)
    cfg = load_run_config(config, overrides)
    run_dir = Path(args.run_dir or Path("runs") / cfg.name)
    if args.resume and not run_dir.exists():
        raise ConfigError(
            f"--resume: run directory '{run_dir}' does not exist; start the run without --resume first."
        )
    if args.resume and (run_dir / "config.yaml").exists() and not args.config:
        cfg = load_run_config(run_dir / "config.yaml", overrides)
    tags = dict(t.split("=", 1) for t in args.tag if "=" in t)
    from recursive_lightning.validation import undo_on_refusal

    with undo_on_refusal(run_dir):  # a refused run leaves nothing behind (no config.yaml, no tracking store)
        result = train(
            cfg,
            run_dir,
            resume=args.resume,
            ckpt_path=args.ckpt_path,
            tracking_uri=args.tracking_uri,
            experiment=args.experiment,
            run_name=args.run_name,
            parent_run_id=args.parent_run_id,
            tags=tags,
            params=dict(t.split("=", 1) for t in args.param if "=" in t),
        )
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    if rank_zero_only.rank == 0:  # DDP / FSDP: every rank returns here, one line is enough
        print(summary_line(result))
    return 0
