"""CPU study: Mela against Transformer++ by context length, on the embedded corpus and on one
real long document.

1. The sweep ``ablations/cpu/mela-context.yaml`` (the package's ``sweep`` command, resumable): cpu-mela and
   cpu-transformerpp (same parameter count, same recipe), seeds 0 and 1, trained at 256 tokens on the embedded
   corpus; each trial's ``evaluate:`` scores the corpus's held-out split at 256 to 4,096 tokens (1x to 16x), the
   same 8,192 tokens at every length, into its MLflow child run and the sweep's report.
2. Every trial's last checkpoint scored the same way on a real long document: the IDLE user guide that ships
   with Python (``idlelib/help.html`` as plain text; ``--long-text PATH`` for another), which no model trained on.
3. ``results.json``, ``table.md`` and ``mela_context_study.png`` (one panel per text, mean over seeds with the
   min-max band, log axes, training length marked) in ``--out``.

    .venv/bin/python benchmarks/study_mela_context.py --out /tmp/mela-context --figure docs/img/mela_context_study.png
    .venv/bin/python benchmarks/study_mela_context.py --out /tmp/mela-smoke --steps 4 --lengths 256,512   # smoke
"""

from __future__ import annotations

import argparse
import html.parser
import importlib.util
import json
import math
import os
import shutil
import statistics
import sys
from pathlib import Path

os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from studies import run_study_sweep  # noqa: E402  (benchmarks/ is the script's folder)

SWEEP = ROOT / "ablations" / "cpu" / "mela-context.yaml"
LABELS = {"mela": "Mela (cpu-mela)", "transformerpp": "Transformer++ (cpu-transformerpp)"}


class _Text(html.parser.HTMLParser):
    """The visible text of an HTML page, one line per block."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs) -> None:
        self._skip += tag in ("script", "style", "head")
        if tag in ("p", "div", "li", "dt", "dd", "h1", "h2", "h3", "h4", "pre", "br", "tr"):
            self.parts.append("\n")

    def handle_endtag(self, tag) -> None:
        self._skip -= tag in ("script", "style", "head")

    def handle_data(self, data) -> None:
        if not self._skip:
            self.parts.append(data)


def idle_user_guide() -> str:
    """The IDLE user guide shipped in the Python installation's ``idlelib``, as plain text."""
    spec = importlib.util.find_spec("idlelib")
    page = Path(spec.submodule_search_locations[0]) / "help.html" if spec else None
    if page is None or not page.is_file():
        raise SystemExit(
            "this Python installation has no idlelib/help.html (some distributions package IDLE apart); pass "
            "--long-text PATH with another long plain-text document."
        )
    p = _Text()
    p.feed(page.read_text(encoding="utf-8"))
    lines = [" ".join(line.split()) for line in "".join(p.parts).splitlines()]
    return "\n".join(line for line in lines if line) + "\n"


def run_sweep(out: Path, steps: int | None, lengths: list[int], max_tokens: int) -> Path:
    evaluate = {"context_lengths": lengths, "ctx_max_tokens": max_tokens}
    return run_study_sweep(SWEEP, out, steps, evaluate)[0]


def trials(run_dir: Path) -> list[dict]:
    out = []
    for f in sorted((run_dir / "trials").glob("*/sweep_result.json")):
        r = json.loads(f.read_text())
        model = "transformerpp" if "transformerpp" in str(r["config"].get("model.preset")) else "mela"
        out.append({**r, "model": model, "seed": int(r["config"]["train.seed"]), "dir": f.parent})
    return out


def ctx_ppl(metrics: dict, lengths: list[int]) -> dict[int, float]:
    return {L: metrics[f"eval/ppl_ctx/{L}"] for L in lengths if f"eval/ppl_ctx/{L}" in metrics}


def long_text_ppl(t: dict, text: Path, lengths: list[int], max_tokens: int) -> dict[int, float]:
    from recursive_lightning.evaluation.options import EvalOptions
    from recursive_lightning.evaluation.run import evaluate_checkpoint

    res = evaluate_checkpoint(
        t["dir"] / "checkpoints" / Path(t["checkpoint"]).name,
        EvalOptions(
            ppl_sets={"long": str(text)},
            tasks=[],
            context_lengths=lengths,
            ctx_set="long",
            ctx_max_tokens=max_tokens,
            out_dir=t["dir"] / "eval-long-document",
            mlflow=False,  # its eval/ppl_ctx/<L> would overwrite the held-out ones in the trial's run
        ),
    )
    return {int(L): r["ppl"] for L, r in res["ppl_ctx"]["lengths"].items() if "ppl" in r}


def summarise(rows: list[dict], key: str) -> dict[str, dict[int, tuple[float, float, float]]]:
    """model -> L -> (mean, min, max) over seeds."""
    out: dict[str, dict[int, tuple[float, float, float]]] = {}
    for model in LABELS:
        per = [r[key] for r in rows if r["model"] == model]
        if not per:
            continue
        out[model] = {
            L: (statistics.fmean(v), min(v), max(v))
            for L in sorted(set.intersection(*(set(p) for p in per)))
            for v in [[p[L] for p in per]]
        }
    return out


def table(summary: dict, lengths: list[int], train_len: int, title: str) -> list[str]:
    head = " | ".join(f"{L} ({L // train_len}×)" if L >= train_len else str(L) for L in lengths)
    lines = [
        f"**{title}**",
        "",
        f"| model | {head} | {lengths[-1]} / {lengths[0]} |",
        "|---" * (len(lengths) + 2) + "|",
    ]
    for model, pts in summary.items():
        cells = [f"{pts[L][0]:.1f} ({pts[L][1]:.1f}-{pts[L][2]:.1f})" if L in pts else "" for L in lengths]
        ratio = (
            pts[lengths[-1]][0] / pts[lengths[0]][0] if lengths[0] in pts and lengths[-1] in pts else math.nan
        )
        lines.append(f"| {LABELS[model]} | " + " | ".join(cells) + f" | {ratio:.2f}× |")
    return lines + [""]


def figure(panels: dict[str, dict], train_len: int, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    from recursive_lightning.files import atomic_write_figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    for i, (title, summary) in enumerate(panels.items()):
        ax = fig.add_subplot(1, len(panels), i + 1)
        ticks: set[int] = {train_len}
        for model, pts in summary.items():
            xs = [L for L in sorted(pts) if math.isfinite(pts[L][0])]
            ticks.update(xs)
            ax.plot(xs, [pts[L][0] for L in xs], marker="o", ms=4, lw=1.6, label=LABELS[model])
            ax.fill_between(xs, [pts[L][1] for L in xs], [pts[L][2] for L in xs], alpha=0.2)
        ax.axvline(train_len, color="0.35", ls="--", lw=1, label="training length")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(sorted(ticks)))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels(
            [f"{t // 1024}K" if t >= 1024 and t % 1024 == 0 else str(t) for t in sorted(ticks)]
        )
        plain = FuncFormatter(lambda v, _: f"{v:.4g}")  # 300, 400: no 3x10^2 on the log axis
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("perplexity (seeds: mean, min-max band)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write_figure(fig, path, dpi=130)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/studies/mela-context", help="where the sweep and the results go")
    p.add_argument(
        "--steps", type=int, help="train this many steps instead of the sweep file's (a smoke run)"
    )
    p.add_argument("--lengths", default="256,512,1024,2048,4096", help="context lengths, comma-separated")
    p.add_argument("--figure", help="also copy the PNG here (e.g. docs/img/mela_context_study.png)")
    p.add_argument("--max-tokens", type=int, default=8192, help="tokens scored at every length")
    p.add_argument(
        "--long-text", help="a long plain-text document (default: the IDLE user guide of this Python)"
    )
    args = p.parse_args()
    out = Path(args.out).resolve()
    lengths = sorted(int(x) for x in args.lengths.split(","))
    text = Path(args.long_text) if args.long_text else out / "idle-user-guide.txt"
    if not args.long_text:
        out.mkdir(parents=True, exist_ok=True)
        text.write_text(idle_user_guide())
    run_dir = run_sweep(out, args.steps, lengths, args.max_tokens)
    rows = trials(run_dir)
    for t in rows:
        t["heldout"] = ctx_ppl(t["metrics"], lengths)
        t["long"] = long_text_ppl(t, text, lengths, args.max_tokens)
        print(f"{t['point_key']}: held-out {t['heldout']}; long document {t['long']}", flush=True)
    train_len = int(rows[0]["config"]["data.seq_len"])
    held, long = summarise(rows, "heldout"), summarise(rows, "long")
    name = "IDLE user guide" if not args.long_text else Path(args.long_text).name
    lines = table(held, lengths, train_len, "embedded corpus, held-out split")
    lines += table(
        long, lengths, train_len, f"{name} (one long document, {len(text.read_text()):,} characters)"
    )
    md = "\n".join(lines)
    (out / "table.md").write_text(md)
    figure(
        {"embedded corpus (held-out)": held, f"{name} (long document)": long},
        train_len,
        out / "mela_context_study.png",
    )
    keep = ("point_key", "model", "seed", "steps", "heldout", "long", "mlflow_run_id", "checkpoint")
    (out / "results.json").write_text(
        json.dumps(
            {"lengths": lengths, "train_len": train_len, "trials": [{k: t[k] for k in keep} for t in rows]},
            indent=2,
        )
    )
    print(md)
    if args.figure:
        shutil.copyfile(out / "mela_context_study.png", args.figure)
    print(f"figure: {out / 'mela_context_study.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
