"""``python -m recursive_lightning eval CHECKPOINT``: its arguments (made into ``EvalOptions``) and the tables it
prints.

    python -m recursive_lightning eval runs/cpu-looped-mesh                   # the default tasks, 0/5-shot
    python -m recursive_lightning eval runs/x/checkpoints/last.ckpt --ppl wiki=wiki.txt \\
        --context-lengths 256,512,1024,2048 --tasks lambada_openai,piqa --shots 0 --limit 200
    python -m recursive_lightning eval runs/cpu-looped-mesh --ppl wiki=wiki.txt --tasks none --loops 1,2,4,8
    python -m recursive_lightning eval runs/cpu-looped-mesh --ppl wiki=wiki.txt --tasks none --loops 8 --exit-kl 5e-4,1e-3

CHECKPOINT is a ``.ckpt`` file or a run directory (its newest good checkpoint); what is evaluated and where the
results go: evaluation/run.py (``evaluate_checkpoint``, with the ``EvalOptions`` these arguments make). Without ``--tasks`` the tasks are ``DEFAULT_TASKS`` (evaluation/downstream.py); a
default task whose data cannot be had (a Hub dataset not cached on an offline machine) is skipped, and one line
says which and why; a task named explicitly that cannot be had is an error.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from recursive_lightning import formatting as fmt
from recursive_lightning.errors import ArgumentParser, UserError
from recursive_lightning.evaluation.downstream import DEFAULT_ALIAS, DEFAULT_TASKS, NOT_ACCURACY, PAPER_METRIC
from recursive_lightning.evaluation.options import EXIT_MAX_TOKENS, EvalOptions, check_context_lengths
from recursive_lightning.evaluation.run import evaluate_checkpoint
from recursive_lightning.uris import mask_url
from recursive_lightning.validation import is_example_limit


def print_report(result: dict[str, Any]) -> None:
    """The result as tables on the terminal (rich where it is installed), and where it was written."""
    rows_ppl = [
        (n, fmt.ppl(r["ppl"]), f"{r['bits_per_byte']:.4f}", str(r["tokens"]))
        for n, r in result["ppl"].items()
    ]
    ctx = result.get("ppl_ctx", {}).get("lengths", {})
    rows_ctx = [
        (L, fmt.ppl(r["ppl"]), fmt.ppl(r["ppl_last"]), str(r["segments"]), "yes" if r["extrapolated"] else "")
        if "ppl" in r
        else (L, "-", "-", "-", f"skipped: {r['skipped']}")
        for L, r in ctx.items()
    ]
    shots, rows_task = _task_rows(result)
    rows_depth, header_depth = _depth_rows(result)
    rows_exit, header_exit, title_exit = _exit_rows(result)
    title = f"{result['run_name']} @ step {result['global_step']} ({Path(result['checkpoint']).name})"
    tables = [
        ("perplexity", ("set", "ppl", "bits/byte", "tokens"), rows_ppl),
        (
            f"perplexity by context length ({result.get('ppl_ctx', {}).get('set', '')})",
            ("L", "ppl", "ppl last block", "segments", "beyond max_seq_len"),
            rows_ctx,
        ),
        ("downstream accuracy (%)", ("task", "metric", *[f"{k}-shot" for k in shots]), rows_task),
        ("test-time depth", header_depth, rows_depth),
        (title_exit, header_exit, rows_exit),
    ]
    try:
        from rich.console import Console  # optional
        from rich.table import Table  # optional

        console = Console()
        console.print(f"[bold]{title}[/bold]")
        for name, header, rows in tables:
            if rows:
                table = Table(title=name)
                for h in header:
                    table.add_column(h)
                for r in rows:
                    table.add_row(*map(str, r))
                console.print(table)
        console.print(f"results: {result['json_path']}")
        for plot in _plots(result):
            console.print(f"plot: {plot}")
        if result.get("mlflow"):
            where = mask_url(result["mlflow"]["tracking_uri"])  # a password in the URL is never printed
            console.print(f"MLflow run {result['mlflow']['run_id']} in {where}")
    except ImportError:
        print(title)
        for name, header, rows in tables:
            if rows:
                print(f"\n{name}\n" + "\t".join(header))
                for r in rows:
                    print("\t".join(map(str, r)))
        print(f"results: {result['json_path']}")
        for plot in _plots(result):
            print(f"plot: {plot}")


def _task_rows(result: dict[str, Any]) -> tuple[list[str], list[tuple[str, ...]]]:
    """The downstream table: the few-shot counts, and one row per task (the papers' tasks first) with its metric
    and its value at each count, then the average."""
    shots = list(result["headline"])
    tasks = sorted(
        {t for k in shots for t in result["headline"][k]},
        key=lambda t: (t not in PAPER_METRIC, list(PAPER_METRIC).index(t) if t in PAPER_METRIC else 0, t),
    )
    rows_task = []
    for t in tasks:
        cells = []
        metric = ""
        for k in shots:
            h = result["headline"][k].get(t)
            cells.append(
                fmt.accuracy(h["value"])
                if h and not any(x in h["metric"] for x in NOT_ACCURACY)
                else (f"{h['value']:.3f}" if h else "-")
            )
            metric = h["metric"] if h else metric
        rows_task.append((t, metric, *cells))
    if shots:
        rows_task.append(
            (
                "average",
                "",
                *[fmt.accuracy(result["avg"][k]) if result["avg"][k] is not None else "-" for k in shots],
            )
        )
    return shots, rows_task


def _plots(result: dict[str, Any]) -> list[str]:
    return [p for p in (result.get("ppl_ctx", {}).get("plot"), (result.get("depth") or {}).get("plot")) if p]


def _depth_rows(result: dict[str, Any]) -> tuple[list[tuple[str, ...]], tuple[str, ...]]:
    """The test-time depth table: one row per count (the trained one starred), its forward FLOPs per token,
    the perplexity of every set and the average accuracy at every few-shot count."""
    depth = result.get("depth") or {}
    counts = depth.get("counts", {})
    if not counts:
        return [], ()
    sets = list(next(iter(counts.values()))["ppl"])
    shots = list(next(iter(counts.values())).get("avg", {}))
    header = (depth["dial"].replace("_", "-"), "FLOPs/token", *[f"ppl {s}" for s in sets])
    header += tuple(f"acc {k}-shot" for k in shots)
    rows = []
    for k, e in counts.items():
        star = " (trained)" if int(k) == depth["trained"] else ""
        acc = [fmt.accuracy(e["avg"][s]) if e["avg"][s] is not None else "-" for s in shots]
        rows.append(
            (
                f"{k}{star}",
                fmt.flops(e["flops_forward_per_token"]),
                *[fmt.ppl(e["ppl"][s]["ppl"]) for s in sets],
                *acc,
            )
        )
    return rows, header


def _exit_rows(result: dict[str, Any]) -> tuple[list[tuple[str, ...]], tuple[str, ...], str]:
    """The adaptive exit table: the reference (no exit, every loop step) and one row per threshold, its mean
    loop steps per token and the perplexity of every set on the same tokens."""
    section = result.get("adaptive_exit") or {}
    if not section:
        return [], (), ""
    sets = list(section["reference"])
    header = ("exit KL", "loop steps/token", *[f"ppl {s}" for s in sets])
    rows = [("none", str(section["max_loops"]), *[fmt.ppl(section["reference"][s]["ppl"]) for s in sets])]
    for key, e in section["thresholds"].items():
        rows.append((key, f"{e['mean_loops']:.2f}", *[fmt.ppl(e["ppl"][s]["ppl"]) for s in sets]))
    tokens = ", ".join(f"{s} {n['tokens']}" for s, n in section["sets"].items())
    title = f"adaptive exit (at most {section['max_loops']} loop steps; tokens scored: {tokens})"
    return rows, header, title


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(
            f"{what} must be a comma-separated list of KL thresholds in nats, not '{text}'; e.g. {what} 5e-4,1e-3."
        ) from None


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(f"{what} must be a comma-separated list of integers, not '{text}'.") from None


def _limit(text: str | None) -> int | float | None:
    if text is None:
        return None
    try:
        v = float(text)
    except ValueError:
        raise UserError(
            f"--limit must be a number of examples (or a fraction below 1), not '{text}'."
        ) from None
    if not is_example_limit(v):
        raise UserError(
            f"--limit must be a whole number of examples >= 1 or a fraction between 0 and 1, not {text}."
        )
    return int(v) if v >= 1 else v


def _split_tasks(values: Iterable[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [t for v in values for t in v.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="recursive_lightning eval",
        description="Perplexity, perplexity by context length and lm-eval downstream accuracy of a checkpoint.",
    )
    p.add_argument("checkpoint", help="a .ckpt file or a run directory (its newest good checkpoint)")
    p.add_argument(
        "--ppl",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a perplexity text set: .txt (one document), .jsonl/.json ('text' fields) or a folder; repeatable",
    )
    p.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        help=f"lm-eval tasks, comma- or space-separated (default: {','.join(DEFAULT_TASKS)}, each skipped with a note when "
        "its data cannot be had; 'default' names that list); 'none' for no tasks",
    )
    p.add_argument("--shots", default="0,5", help="few-shot counts, comma-separated (default 0,5)")
    p.add_argument("--limit", default=None, help="at most N examples per task (a fraction if below 1)")
    _add_context_options(p)
    _add_depth_options(p)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass (default 16)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--out", default=None, help="folder of the JSON result (default <run_dir>/eval)")
    p.add_argument(
        "--tracking-uri", default=None, help="MLflow tracking URI (default sqlite:///<run_dir>/mlflow.db)"
    )
    p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    p.add_argument(
        "--include-path",
        action="append",
        default=[],
        metavar="DIR",
        help="folder of local task YAMLs; repeatable",
    )
    return p


def _add_context_options(p: argparse.ArgumentParser) -> None:
    """Perplexity by context length and the sliding window."""
    p.add_argument(
        "--context-lengths",
        default=None,
        help="e.g. 1024,4096,16384: perplexity of a --ppl set at each length",
    )
    p.add_argument(
        "--ctx-ppl",
        default=None,
        metavar="NAME",
        help="the --ppl set for --context-lengths (default: the first)",
    )
    p.add_argument(
        "--ctx-block", type=int, default=128, help="last-block size of the context-length table (default 128)"
    )
    p.add_argument(
        "--ctx-max-tokens", type=int, default=None, help="scored tokens per context length (default: all)"
    )
    p.add_argument(
        "--ctx-mode",
        choices=("stream", "documents"),
        default="stream",
        help="stream: the --ppl set joined into one token stream, cut into segments of each length (default); "
        "documents: one segment from the start of each document at least that long",
    )
    p.add_argument(
        "--stride",
        type=int,
        default=None,
        help="sliding-window stride in tokens (default: the window, disjoint)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="window / context in tokens (default: the model's max_seq_len)",
    )


def _add_depth_options(p: argparse.ArgumentParser) -> None:
    """Test-time depth and adaptive exit."""
    p.add_argument(
        "--loops",
        default=None,
        help="test-time depth of a looped model: loop counts, e.g. 1,2,4,8 (each --ppl set and task again at "
        "each; docs/test-time-depth.md)",
    )
    p.add_argument(
        "--h-cycles",
        default=None,
        help="test-time depth of a Mela model: high-level cycle counts H', e.g. 1,2,4",
    )
    p.add_argument(
        "--exit-kl",
        default=None,
        metavar="KL[,KL...]",
        help="adaptive exit of a looped model: KL thresholds in nats, e.g. 5e-4,1e-3; each --ppl set scored token "
        "by token with each, at most --loops loop steps (default: trained), beside the same tokens without exit",
    )
    p.add_argument(
        "--exit-max-tokens",
        type=int,
        default=EXIT_MAX_TOKENS,
        help=f"tokens of each --ppl set scored with --exit-kl (default {EXIT_MAX_TOKENS}; token by token: slow)",
    )


def options_from_args(args: argparse.Namespace) -> EvalOptions:
    """The ``EvalOptions`` of the command line (``--device`` default: cuda if available, else cpu)."""
    tasks = _split_tasks(args.tasks)
    device = args.device
    if device is None:
        import torch  # heavy

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return EvalOptions(
        ppl_sets=args.ppl,
        tasks=[DEFAULT_ALIAS] if tasks is None else tasks,
        shots=_ints(args.shots, "--shots"),
        limit=_limit(args.limit),
        context_lengths=None
        if args.context_lengths is None
        else check_context_lengths(_ints(args.context_lengths, "--context-lengths")),
        ctx_set=args.ctx_ppl,
        ctx_block=args.ctx_block,
        ctx_max_tokens=args.ctx_max_tokens,
        ctx_mode=args.ctx_mode,
        stride=args.stride,
        max_length=args.max_length,
        batch_size=args.batch_size,
        device=device,
        include_path=args.include_path or None,
        out_dir=args.out,
        tracking_uri=args.tracking_uri,
        mlflow=not args.no_mlflow,
        loops=None if args.loops is None else _ints(args.loops, "--loops"),
        h_cycles=None if args.h_cycles is None else _ints(args.h_cycles, "--h-cycles"),
        exit_kl=None if args.exit_kl is None else _floats(args.exit_kl, "--exit-kl"),
        exit_max_tokens=args.exit_max_tokens,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print_report(evaluate_checkpoint(args.checkpoint, options_from_args(args), show=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
