"""CPU study: does a looped model "think longer with the same weights"? Fixed against sampled loop
steps in training, perplexity at 1-8 loop steps at test time.

1. The sweep ``ablations/cpu/test-time-depth.yaml`` (the package's ``sweep`` command, resumable): cpu-tiny,
   ``2+2R4+2`` with the ``anchor`` topology, trained with K = 4 loop steps at every step (``fixed``) or with a
   Poisson-lognormal number of mean 4, gradients through the last 4 (``sampled``, ``train.loops``), seeds 0 and 1;
   each trial's ``evaluate:`` scores the embedded held-out split at 1, 2, 3, 4, 5, 6 and 8 loop steps
   (``eval/loops_<k>/ppl/heldout`` in its MLflow run).
2. ``results.json``, ``table.md`` and the figure (perplexity against test-time loop steps, mean over seeds with
   the min-max band, training mean marked) in ``--out``.

    .venv/bin/python benchmarks/study_depth.py --out /tmp/depth-study --figure docs/img/depth_study.png
    .venv/bin/python benchmarks/study_depth.py --out /tmp/depth-smoke --steps 4      # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from studies import run_study_sweep  # noqa: E402  (benchmarks/ is the script's folder)

SWEEP = ROOT / "ablations" / "cpu" / "test-time-depth.yaml"
LABELS = {"fixed": "fixed K = 4 in training", "sampled": "sampled, mean 4 (Poisson-lognormal, backprop 4)"}


def trials(run_dir: Path, loops: list[int]) -> list[dict]:
    out = []
    for f in sorted((run_dir / "trials").glob("*/sweep_result.json")):
        r = json.loads(f.read_text())
        m = r["metrics"]
        out.append(
            {
                "training": "sampled" if r["config"].get("train.loops") else "fixed",
                "seed": int(r["config"]["train.seed"]),
                "ppl": {
                    k: m[f"eval/loops_{k}/ppl/heldout"] for k in loops if f"eval/loops_{k}/ppl/heldout" in m
                },
                "flops": {
                    k: m[f"eval/loops_{k}/flops_forward_per_token"]
                    for k in loops
                    if f"eval/loops_{k}/flops_forward_per_token" in m
                },
            }
        )
    return out


def summarise(rows: list[dict]) -> dict[str, dict[int, tuple[float, float, float]]]:
    """training -> loop steps -> (mean, min, max) over seeds."""
    out: dict[str, dict[int, tuple[float, float, float]]] = {}
    for name in LABELS:
        per = [r["ppl"] for r in rows if r["training"] == name]
        if per:
            out[name] = {
                k: (statistics.fmean(v), min(v), max(v))
                for k in sorted(set.intersection(*(set(p) for p in per)))
                for v in [[p[k] for p in per]]
            }
    return out


def table(summary: dict, loops: list[int], trained: int) -> list[str]:
    head = " | ".join(f"**{k}**" if k == trained else str(k) for k in loops)
    lines = [f"| training | {head} |", "|---" * (len(loops) + 1) + "|"]
    for name, pts in summary.items():
        cells = [f"{pts[k][0]:.1f} ({pts[k][1]:.1f}-{pts[k][2]:.1f})" if k in pts else "" for k in loops]
        lines.append(f"| {LABELS[name]} | " + " | ".join(cells) + " |")
    return lines


def figure(summary: dict, trained: int, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    from recursive_lightning.files import atomic_write_figure

    fig = Figure(figsize=(6.4, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name, pts in summary.items():
        xs = [k for k in sorted(pts) if math.isfinite(pts[k][0])]
        ax.plot(xs, [pts[k][0] for k in xs], marker="o", ms=4, lw=1.6, label=LABELS[name])
        ax.fill_between(xs, [pts[k][1] for k in xs], [pts[k][2] for k in xs], alpha=0.2)
    ax.axvline(trained, color="0.35", ls="--", lw=1, label=f"trained K (mean) = {trained}")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:.4g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel("loop steps at test time")
    ax.set_ylabel("held-out perplexity (2 seeds: mean, min-max)")
    ax.set_title("cpu-tiny 2+2R4+2, anchor: fixed vs sampled loop steps", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write_figure(fig, path, dpi=130)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/studies/test-time-depth", help="where the sweep and the results go")
    p.add_argument(
        "--steps", type=int, help="train this many steps instead of the sweep file's (a smoke run)"
    )
    p.add_argument("--figure", help="also write the figure here (default: only in --out)")
    args = p.parse_args()
    out = Path(args.out).resolve()
    run_dir, raw = run_study_sweep(SWEEP, out, args.steps)
    loops = list(raw["evaluate"]["loops"])
    rows = trials(run_dir, loops)
    summary = summarise(rows)
    trained = 4
    lines = table(summary, loops, trained)
    (out / "results.json").write_text(json.dumps({"trials": rows, "loops": loops}, indent=1, default=str))
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    figure(summary, trained, out / "depth_study.png")
    if args.figure:
        figure(summary, trained, Path(args.figure))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
