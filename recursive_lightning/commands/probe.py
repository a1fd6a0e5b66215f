"""``python -m recursive_lightning probe``: the papers' diagnostic probes of a checkpoint, or of several with
``--compare`` (``probes.run``: ``probe_checkpoint``, ``probe_compare``), and the line that says where the figures
and ``probes.json`` went."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from recursive_lightning.errors import ArgumentParser, UserError
from recursive_lightning.probes.run import DEFAULT_TOKEN_INDEX, ProbeOptions, probe_checkpoint, probe_compare
from recursive_lightning.validation import check_device


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="recursive_lightning probe",
        description="Diagnostic probes of a checkpoint (MeSH Sec. 2/4.1, App. E.8/F; SpiralFormer Sec. 4): "
        "figures and probes.json.",
    )
    p.add_argument("checkpoint", nargs="?", help="a .ckpt file or a run directory")
    p.add_argument(
        "--compare",
        nargs="+",
        metavar="RUN_DIR",
        help="probe several run dirs (or one sweep dir) and draw the figures side by side",
    )
    p.add_argument(
        "--data",
        help="text file, folder, glob, hf:<dataset> or embedded (default: the run's data.path, else the embedded corpus)",
    )
    p.add_argument(
        "--samples", type=int, default=500, help="number of sequences (default 500, as in the papers)"
    )
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the run's data.seq_len)")
    p.add_argument(
        "--batch-size",
        type=int,
        help="sequences per forward (default 16, fewer if the recorded attention maps would pass ~8 GB)",
    )
    p.add_argument("--out", help="output directory (default <run_dir>/probes, or <sweep>/probes_compare)")
    p.add_argument(
        "--token-index",
        type=int,
        default=DEFAULT_TOKEN_INDEX,
        help="token position of the MeSH router/composition case study (default 27, clipped to the sequence)",
    )
    p.add_argument("--kernel", choices=("rbf", "linear"), default="rbf", help="CKA kernel (default rbf)")
    p.add_argument(
        "--cka-tokens",
        type=int,
        default=0,
        help="evenly spaced token positions per sample used for CKA (default 0 = all tokens)",
    )
    p.add_argument("--no-attention", action="store_true", help="skip the attention probes")
    p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default sqlite:///<run_dir>/mlflow.db)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _check_args(args: argparse.Namespace) -> None:
    if bool(args.checkpoint) == bool(args.compare):
        raise UserError("pass either one CHECKPOINT or --compare RUN_DIR [RUN_DIR ...], not both or neither.")
    for name in ("samples", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}.")
    if args.seq_len is not None and args.seq_len < 2:
        raise UserError(f"--seq-len must be at least 2, not {args.seq_len}.")
    if args.cka_tokens < 0 or args.cka_tokens == 1:
        raise UserError(f"--cka-tokens must be 0 (all tokens) or at least 2, not {args.cka_tokens}.")


def _device(name: str | None) -> torch.device:
    if name:
        check_device(name)
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    _check_args(args)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    device = _device(args.device)
    options = ProbeOptions(
        data=args.data,
        samples=args.samples,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        out=args.out,
        token_index=args.token_index,
        kernel=args.kernel,
        cka_tokens=args.cka_tokens,
        attention=not args.no_attention,
        mlflow=not args.no_mlflow,
        tracking_uri=args.tracking_uri,
        progress=not args.no_progress,
    )
    if args.compare:
        print(probe_compare(args.compare, options, device))
    else:
        print(probe_checkpoint(args.checkpoint, options, device))
    return 0
