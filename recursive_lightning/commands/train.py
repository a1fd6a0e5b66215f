"""``python -m recursive_lightning train``: one config into one run directory (``training.run.train``), exact
resume with ``--resume``; prints the summary line. A second ``train`` into a directory another process writes is
refused; SIGTERM outside a training step stops it as Ctrl-C does, resumable."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

from recursive_lightning import formatting as fmt
from recursive_lightning import interrupts
from recursive_lightning.config import RunConfig, load_run_config
from recursive_lightning.errors import ArgumentParser, ConfigError, Terminated, UserError
from recursive_lightning.files import writable_dir_problem
from recursive_lightning.run_dir import RunDir
from recursive_lightning.tracking.runs import ui_command
from recursive_lightning.training.options import TrainOptions, check_resume_flags
from recursive_lightning.training.result import TrainResult
from recursive_lightning.training.run import check_before_writing, train
from recursive_lightning.training.run_lock import first_rank, run_dir_lock
from recursive_lightning.uris import TRACKING_ENV, remember, reveal
from recursive_lightning.validation import undo_on_refusal

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "experiments" / "cpu" / "looped-mesh.yaml"


def _pairs(flag: str, values: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` flags (MLflow tags, params) as a dict; one without ``=`` or a key is refused."""
    for v in values:
        if "=" not in v or not v.split("=", 1)[0]:
            raise UserError(f"{flag} {v!r} needs KEY=VALUE, e.g. {flag} note=baseline.")
    return dict(v.split("=", 1) for v in values)


def summary_line(r: TrainResult) -> str:
    """The line ``train`` prints when it ends: what it trained, the validation perplexities, the checkpoint and
    how to look at the MLflow run."""
    ppl = ", ".join(
        f"{k.removeprefix('val/')}={fmt.ppl(v)}" for k, v in r.metrics.items() if k.endswith("/ppl")
    )
    if r.segment_steps == 0 and r.steps > 0:  # resumed at its max_steps: nothing trained, validated again
        done = (
            f"trained no step: the run was already at step {r.steps}, its max_steps (raise --max-steps to "
            f"continue it); {r.tokens:,} tokens, {r.seconds:.0f}s over {r.segments} segment(s)"
        )
    elif r.segments > 1 and r.segment_steps is not None:  # a resumed run: this command's part, then the run
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


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM outside a training step (the set-up, the data's preparation, the summary): ``Terminated`` there,
    so that the run directory's lock, a directory with nothing of value in it and the MLflow run are closed as
    for Ctrl-C. Inside ``trainer.fit`` Lightning's handler calls this one too, and stops at the next step."""
    if signal.getsignal(signal.SIGTERM) is not _on_sigterm or interrupts.defer_in_hook(signum, frame):
        return
    raise Terminated(
        "train: stopped by SIGTERM outside a training step; run the same command again (with --resume where "
        "the run directory holds its MLflow run)."
    )


def _parser() -> ArgumentParser:
    p = ArgumentParser(
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
    return p


def _run_config(args: argparse.Namespace, rest: list[str]) -> tuple[RunConfig, Path]:
    """The run config (``--config`` or, on ``--resume``, the run's own, with the flags and ``--section.field``
    overrides) and the run directory, checked before any lock or file."""
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
        from recursive_lightning.training.uptrain import cli_overrides  # heavy

        overrides = cli_overrides(args.init_from, config, overrides)
    own = RunDir(args.run_dir).config if args.resume and not args.config and args.run_dir else None
    # a resume takes the overrides onto the run's own config (below): checked against the default config, they
    # would be refused for a model the run does not have
    cfg = None if own is not None and own.is_file() else load_run_config(config, overrides)
    run_dir = Path(args.run_dir or Path("runs") / cfg.name)
    problem = writable_dir_problem(run_dir)
    if problem is not None:  # a file, a read-only folder, a link that leads nowhere: before any lock or file
        raise ConfigError(
            f"--run-dir '{run_dir}' cannot hold the run: {problem}; choose a folder you can write to."
        )
    if args.resume and not run_dir.exists():
        raise ConfigError(
            f"--resume: run directory '{run_dir}' does not exist; start the run without --resume first."
        )
    if args.resume and RunDir(run_dir).config.exists() and not args.config:
        cfg = load_run_config(RunDir(run_dir).config, overrides, kept_by=run_dir)
    elif args.resume and not args.config and RunDir(run_dir).holds_run():
        # the default config would resume another model (a size mismatch deep in the checkpoint's loading)
        raise ConfigError(
            f"--resume: '{run_dir}' holds a run but not its config.yaml, the config it was started with; put "
            "config.yaml back, or pass that config with --config."
        )
    return cfg or load_run_config(config, overrides), run_dir


def main(argv: list[str]) -> int:
    args, rest = _parser().parse_known_args(argv)
    check_resume_flags(args.resume, args.ckpt_path, args.init_from)
    cfg, run_dir = _run_config(args, rest)
    tags, params = _pairs("--tag", args.tag), _pairs("--param", args.param)
    check_before_writing(cfg)  # before the lock makes the run directory (and its parents)
    # the tracking URI defaults to the environment's (how a sweep worker hands it to its `train` process, off the
    # command line); a masked password (as files and other commands show it) is filled in from there
    tracking_uri = reveal(remember(args.tracking_uri or os.environ.get(TRACKING_ENV)))
    # one writer per run directory, taken before anything is written to it; then a refused run leaves nothing
    # behind (no config.yaml, no tracking store), nor does one stopped before its MLflow run was opened
    lock = run_dir_lock(run_dir) if first_rank() else contextlib.nullcontext()
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with lock, undo_on_refusal(run_dir, kept_on_stop_by=RunDir.RUN_ID):
            options = TrainOptions(
                resume=args.resume,
                ckpt_path=args.ckpt_path,
                tracking_uri=tracking_uri,
                experiment=args.experiment,
                run_name=args.run_name,
                parent_run_id=args.parent_run_id,
                tags=tags,
                params=params,
            )
            result = train(cfg, run_dir, options)
    finally:
        signal.signal(signal.SIGTERM, previous)
    from lightning.pytorch.utilities.rank_zero import rank_zero_only  # heavy

    if rank_zero_only.rank == 0:  # DDP / FSDP: every rank returns here, one line is enough
        print(summary_line(result))
    return 0
