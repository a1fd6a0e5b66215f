"""``write_report``: the papers' tables of a sweep, tables per axis and plots (the ``report`` command:
``commands/report.py``).

The results table has one row per grid point (its axes other than the seed), aggregated over seeds as mean ±
std: parameters (non-embedding) and forward FLOPs per token (``model.describe.describe`` of the trial's
``config.yaml``), training tokens/s and wall-clock, validation perplexity on each named set and downstream
accuracy per task with their average (MeSH Tables 1-2), and, with ``report: {baseline: <row>}`` and several
seeds, the paired difference (same seed) of every row to the baseline with a 95 % t-interval over the seed
pairs; the ranking metric against training FLOPs and wall-clock per row (``sweep/cost.py``) and every trial by
its MLflow run name in rank order (``sweep/ranking.py``, the one definition of "best"). Every value is read
from what the trials left on disk: ``trials/<point>/sweep_result.json`` (metrics,
the study's copy only where that file is absent), ``result.json`` (wall-clock, tokens), ``config.yaml`` and
the trial's MLflow child run (per-step history: tokens/s and the learning curves). A value a row does not
have is shown as missing (—), never filled in.

Written as ``report.md``, ``report.html`` (the same report with its figures inlined: MLflow's artifact viewer
renders markdown tables but not markdown images, and shows HTML in a frame where relative image paths do not
resolve) and PNGs into the sweep's run directory, and logged to the parent MLflow run under ``report/``. A sweep
writes it at its end under a lock (``report_at_end``: one writer at a time) and prints it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from recursive_lightning import faults
from recursive_lightning import formatting as fmt
from recursive_lightning.errors import ConfigError
from recursive_lightning.files import absent, atomic_write_figure, atomic_write_text
from recursive_lightning.run_dir import SweepDir
from recursive_lightning.sweep import context_lengths, cost, curves, ranking, results, statistics, tables
from recursive_lightning.sweep.parent import close_parent
from recursive_lightning.sweep.ranking import log_ranking, summary_line
from recursive_lightning.sweep.report_html import markdown_to_html
from recursive_lightning.sweep.results import axis_table, collect, load_trials
from recursive_lightning.sweep.rows import build_rows, tokens_per_step
from recursive_lightning.sweep.servers import check_database, database_lock
from recursive_lightning.sweep.spec import SEED_AXIS, SweepSpec, load_sweep, row_names
from recursive_lightning.sweep.statistics import paired_differences
from recursive_lightning.sweep.study import file_lock
from recursive_lightning.tracking.runs import absolute_uri, check_outputs, log_artifact, log_batch
from recursive_lightning.uris import mask_url, reveal

# MLflow's artifact viewer prints a markdown image as text; report.html shows the figures there
VIEWER_HINT = " In MLflow's artifact viewer, open `report.html` to see the figures."


def _fmt(label: Any) -> str:
    return str(label)


def _plot_axis(table, axis: str, metric: str, path: Path, kind: str) -> Path:
    import matplotlib  # heavy

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy

    def num(x: Any) -> float | None:
        try:
            return None if isinstance(x, bool) else float(x)
        except (TypeError, ValueError):
            return None

    if all(num(r[0]) is not None for r in table):
        table = [(num(r[0]), *r[1:]) for r in table]
    labels = [_fmt(r[0]) for r in table]
    means = [r[1] for r in table]
    stds = [r[2] for r in table]
    fig, ax = plt.subplots(figsize=(max(4.5, 0.9 * len(table) + 2), 3.4))
    numeric = all(isinstance(r[0], int | float) and not isinstance(r[0], bool) for r in table)
    if kind == "line" or (kind == "auto" and numeric and len(table) > 2):
        order = sorted(range(len(table)), key=lambda i: table[i][0]) if numeric else range(len(table))
        xs = [table[i][0] for i in order] if numeric else list(range(len(table)))
        ax.errorbar(
            xs,
            [means[i] for i in order],
            yerr=[stds[i] for i in order],
            marker="o",
            capsize=3,
            color="#8e44ad",
        )
        if not numeric:
            ax.set_xticks(xs, [labels[i] for i in order], rotation=20, ha="right")
    else:
        best = min(range(len(means)), key=means.__getitem__)
        colors = ["#8e44ad" if i == best else "#95a5a6" for i in range(len(means))]
        ax.bar(range(len(means)), means, yerr=stds, capsize=3, color=colors)
        ax.set_xticks(range(len(means)), labels, rotation=20, ha="right")
        lo = min(m - s for m, s in zip(means, stds))
        hi = max(m + s for m, s in zip(means, stds))
        pad = 0.15 * (hi - lo + 1e-9)
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_xlabel(axis)
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.set_title(f"{metric} by {axis} (mean ± std over seeds)", fontsize=9)
    fig.tight_layout()
    atomic_write_figure(fig, path, dpi=120)
    plt.close(fig)
    return path


def _results_sections(
    trials: list[dict], axes: list[str], spec, ranked: str, tracking_uri: str, run_dir: Path, out: Path
) -> tuple[list[str], list[Path], dict[str, Any]]:
    """The papers' tables (results, downstream accuracy, paired differences to the baseline) and the
    learning-curve figure. Returns (markdown lines, figures, structured data for callers and tests)."""
    trials, problems = load_trials(run_dir, trials, spec, tracking_uri)
    rows = build_rows(trials, axes, row_names(spec.axes) if spec.search is None else ())
    main_cols, heads, shots = tables.columns(trials, ranked)
    ranks = ranking.rank(rows, ranked)
    best = ranking.best(ranks)[0].name if ranking.best(ranks)[0] is not None else None
    seeds = max((len(r.trials) for r in rows), default=0)
    results_table, table = _results_table(rows, main_cols, best)
    lines = [
        "## Results",
        "",
        f"One row per grid point, mean ± std over its seeds; ★ marks the lowest `{ranked}`. {tables.MISSING} "
        "marks a value the row's trials did not record.",
        "",
        *results_table,
        "",
        *_column_notes(trials),
        "",
    ]
    lines += _downstream_section(rows, heads, shots)
    baseline = (spec.report or {}).get("baseline")
    paired_lines, paired = _paired_section(rows, baseline, [c for c in main_cols if c.paired])
    lines += paired_lines
    said = ranking.significance(ranks, ranked, str(baseline) if baseline is not None else None, paired)
    if said:  # the star's caveat, under the results table (the line the console and MLflow print)
        lines[4 + len(results_table) : 4 + len(results_table)] = [
            "",
            f"★ `{best}`: " + "; ".join(said.values()) + ".",
        ]
    if baseline is None and seeds > 1 and len(rows) > 1:
        lines += [
            "Name a baseline row (`report: {baseline: <row>}` in the sweep file) for paired differences "
            "with confidence intervals.",
            "",
        ]
    curve_png, curve_lines = _curves_section(rows, spec, seeds, tracking_uri, out, problems)
    lines += curve_lines
    cost_png, cost_points = cost.plot(rows, ranked, out / "report_cost.png", spec.name)
    lines += cost.section(cost_png, cost_points, ranked)
    lines += ranking.runs_section(ranks, ranked)
    data = {
        "trials": trials,
        "rows": rows,
        "table": table,
        "paired": paired,
        "best": best,
        "baseline": str(baseline) if baseline is not None else None,
        "ranking": ranks,
        "results_table": results_table,
        "cost": cost_points,
    }
    return lines, [f for f in (curve_png, cost_png) if f is not None], data


def _results_table(rows: list, main_cols: list, best: str | None) -> tuple[list[str], list[dict[str, Any]]]:
    """The results table's markdown lines (★ on the best row) and its cells as data."""
    lines = [
        "| " + " | ".join(["row", "seeds", *(c.title for c in main_cols)]) + " |",
        "|" + "---|" * (2 + len(main_cols)),
    ]
    table = []
    for r in rows:
        cells = {c.key: r.values(c.key) for c in main_cols}
        table.append({"row": r.name, "seeds": len(r.trials), "values": cells})
        shown = [tables.fmt_cell(cells[c.key], c.kind) for c in main_cols]
        lines.append(
            "| " + " | ".join([r.name + (" ★" if r.name == best else ""), str(len(r.trials)), *shown]) + " |"
        )
    return lines, table


def _column_notes(trials: list[dict]) -> list[str]:
    """What the results table's columns are read from, and whose numbers the trials without a readable record
    of their own show."""
    lines = [
        "- **params (non-emb.)** and **fwd FLOPs/token**: `model.describe.describe` of the trial's "
        "`config.yaml` at its training length (2 FLOPs per multiply-accumulate, attention at full L×L; the "
        "forward of one sequence over its tokens).",
        "- **train tokens/s**: tokens of the logged training steps over their summed step time (harmonic mean "
        "of the child run's per-step `train/tokens_per_sec` history; validation and checkpointing excluded), "
        "logged on the trial's run as `report/train_tokens_per_sec`, the column MLflow's runs table shows.",
        "- **wall-clock**: `seconds` of the trial's `result.json` less its `data_seconds` (its `train` command: "
        "training, validation, checkpoints; not the sweep's `evaluate:`; a resumed trial's seconds summed over "
        "its segments). **data prep**: its `data_seconds`, the corpus, tokenizer and shards set up before "
        "training, one-off work that the first trial on a corpus does and later ones read back.",
        "- perplexities: `val/<set>/ppl` from training's final validation, `eval/ppl/<name>` from the sweep's "
        "`evaluate:`; accuracies in %.",
    ]
    damaged = [t["number"] for t in trials if t["metrics_source"] == results.DAMAGED]
    if damaged:  # a record that is there but cannot be read (cut short, edited): the study's copy stands in
        lines.append(
            f"- trial(s) {', '.join(map(str, damaged))}: `{results.SWEEP_RESULT}` is damaged (not a JSON object): "
            "their metrics are the Optuna study's copy."
        )
    elsewhere = [
        t["number"] for t in trials if t["metrics_source"] not in (results.SWEEP_RESULT, results.DAMAGED)
    ]
    if elsewhere:  # trained where this directory cannot see (another machine): say whose numbers these are
        lines.append(
            f"- trial(s) {', '.join(map(str, elsewhere))} have no `{results.SWEEP_RESULT}` in this directory "
            "(trained on another machine?): their metrics are the Optuna study's copy, their wall-clock, "
            "parameters and FLOPs what this directory and the sweep file give."
        )
    return lines


def _downstream_section(rows: list, heads: dict, shots: list) -> list[str]:
    """MeSH Table 2: each task's headline accuracy per row and shot count, and their average."""
    if not heads:
        return []
    tasks = sorted({task for task, _ in heads})
    lines = [
        "## Downstream accuracy (%)",
        "",
        "MeSH Table 2 layout: each task's headline metric (acc_norm or acc, named in the header), mean ± std "
        "over seeds; Avg. is `eval/avg/<k>shot` as `eval` logged it.",
        "",
    ]
    metric_of = {t: sorted({heads[k].rsplit("/", 1)[1] for k in heads if k[0] == t}) for t in tasks}
    head = ["row", "shots", *(f"{t} ({'/'.join(metric_of[t])})" for t in tasks), "Avg."]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        for k in shots:
            cells = [r.name, f"{k}-shot"]
            cells += [
                tables.fmt_cell(r.values(heads[(t, k)]), "acc") if (t, k) in heads else tables.MISSING
                for t in tasks
            ]
            cells.append(tables.fmt_cell(r.values(f"eval/avg/{k}shot"), "acc"))
            lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _paired_section(
    rows: list, baseline: Any, diff_cols: list
) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """The paired differences of every row to the ``baseline`` row with their t-intervals: (markdown lines, the
    differences by row); nothing without a baseline, a sentence while the baseline has no finished trial."""
    if baseline is None:
        return [], {}
    base = next((r for r in rows if r.name == str(baseline)), None)
    lines = [f"## Paired difference to `{baseline}`", ""]
    if base is None:
        return [*lines, f"The baseline row `{baseline}` has no finished trial yet: no differences.", ""], {}
    level = round(100 * statistics.CONFIDENCE)
    lines += [
        f"Row − `{baseline}` on the same seed, mean over the seed pairs [{level} % Student-t interval: "
        f"mean ± t({(1 + statistics.CONFIDENCE) / 2:.3f}, n−1) · sd/√n over the n pairs]; lower perplexity and "
        "higher accuracy (points) are better; each cell says whether its interval excludes 0 (**bold**: "
        "the rows are distinguishable) or includes it. An interval needs two pairs.",
        "",
        "| " + " | ".join(["row", "pairs", *(c.title for c in diff_cols)]) + " |",
        "|" + "---|" * (2 + len(diff_cols)),
    ]
    paired = paired_differences(rows, base, diff_cols)
    for name, diffs in paired.items():
        n = max((d["n"] for d in diffs.values() if d), default=0)
        cells = [name, str(n), *(tables.fmt_difference(diffs[c.key], c.kind) for c in diff_cols)]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""], paired


def _curves_section(
    rows: list, spec: Any, seeds: int, tracking_uri: str, out: Path, problems: list[str]
) -> tuple[Path | None, list[str]]:
    """The learning-curve figure of every row with a metric history, and its section."""
    curve_rows = {
        r.name: [
            {
                "history": t["history"],
                "tokens_per_step": tokens_per_step(t) or 0.0,
                "steps": t.get("steps"),
                "flops_per_token": cost.training_flops_per_token(t),
            }
            for t in r.trials
            if t["history"]
        ]
        for r in rows
    }
    curve_rows = {k: v for k, v in curve_rows.items() if v}
    png = curves.plot_learning_curves(
        curve_rows, out / "report_learning_curves.png", title=f"{spec.name}: learning curves"
    )
    lines = ["## Learning curves", ""]
    if png is not None:
        band = "min-max over the seeds as a band" if seeds > 1 else "one seed per row"
        lines += [
            "Training loss and validation perplexity against tokens seen, and validation perplexity against "
            "training FLOPs (tokens × the trial's training FLOPs per token, as the cost section counts them: the "
            "loss-compute frontier of SpiralFormer Fig. 2), read from each trial's MLflow child run: the mean "
            f"over a row's seeds as the line, {band}.",
            "",
            f"![learning curves]({png.name})",
            "",
        ]
    else:
        lines += [f"No trial has a metric history in {mask_url(tracking_uri)}.", ""]
    if problems:
        lines += ["Could not read the history of: " + "; ".join(problems), ""]
    return png, lines


def _axis_sections(
    rows: list[dict], axes: list[str], ranked: str, out: Path, plot: str
) -> tuple[list[str], list[Path]]:
    """One table and figure per axis: the ranked metric and the other perplexities by the axis's value."""
    lines, figures = [], []
    for axis in axes:
        table, best = axis_table(rows, axis, ranked)
        if not table:
            continue
        extra_cols = sorted({c for r in table for c in r[4] if c != ranked})
        lines += [
            f"## By {axis}",
            "",
            "| " + " | ".join([axis, ranked, "n"] + extra_cols) + " |",
            "|" + "---|" * (3 + len(extra_cols)),
        ]
        order = (
            sorted(table, key=lambda r: (str(type(r[0])), r[0]))
            if all(not isinstance(r[0], str) for r in table)
            else table
        )
        for label, mean, std, n, extra in order:
            star = " ★" if label == best else ""
            cells = [
                f"{_fmt(label)}{star}",
                tables.fmt_mean_std(mean, std, lambda v, u=ranked: fmt.metric(u, v)),
                str(n),
            ]
            cells += [
                tables.fmt_mean_std(*extra[c], lambda v, c=c: fmt.metric(c, v)) if c in extra else ""
                for c in extra_cols
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        safe = "".join(c if c.isalnum() else "_" for c in axis)
        png = _plot_axis(table, axis, ranked, out / f"report_{safe}.png", plot)
        figures.append(png)
        lines += [f"![{axis}]({png.name})", ""]
    return lines, figures


def _sweep_record(run_dir: Path) -> dict[str, Any]:
    """The ``sweep.json`` of a sweep directory (one sentence for a directory that is not one)."""
    info_file = SweepDir(run_dir).info
    if not Path(run_dir).is_dir():
        what = "is a file, not a sweep directory" if Path(run_dir).is_file() else absent(run_dir)
        raise ConfigError(f"--run-dir '{run_dir}' {what}; pass the --run-dir of a sweep.")
    if not info_file.exists():
        raise ConfigError(
            f"'{run_dir}' is not a sweep directory (no {SweepDir.INFO}); pass the --run-dir of a sweep."
        )
    return json.loads(info_file.read_text())


def _header(spec: Any, done: int, failed: int, unfinished: int, ppl_metric: str) -> list[str]:
    """The report's title, the sweep's description, the trial counts and, while trials are left, that it is
    partial."""
    lines = [f"# Sweep `{spec.name}`", ""]
    if spec.description:
        lines += [spec.description, ""]
    lines += [
        f"{done} finished trials"
        + (f", {failed} failed" if failed else "")
        + f"; metric `{ppl_metric}` (lower is better), mean ± std over seeds; ★ marks the best row."
        + VIEWER_HINT,
        "",
    ]
    if failed and not done:  # no metric below: because no trial finished, not because one went unrecorded
        lines += [
            f"**Every trial failed** ({failed} of {failed}), so no metric was recorded: each one's error is "
            "listed under *Failed trials* below, and its files are in its folder under `trials/`.",
            "",
        ]
    if unfinished:  # never present a sweep that is still running as a finished one
        lines += [
            f"**The sweep is not finished**: {unfinished} trial(s) are still waiting or running; this report is "
            "partial.",
            "",
        ]
    return lines


def _failed_section(failed: list[dict]) -> list[str]:
    if not failed:
        return []
    return [
        "## Failed trials",
        "",
        *(f"- trial {r['number']} ({r['key']}): {r['error']}" for r in failed),
        "",
    ]


def _log_to_parent(
    tracking_uri: str,
    parent: str,
    files: list[Path],
    rows: list[dict],
    failed: list[dict],
    data: dict,
    ranked: str,
) -> None:
    """Log the report's files, the ranking and the trial counts to the sweep's MLflow parent run (the report on
    disk stands when this fails: a warning)."""
    try:
        for f in files:
            log_artifact(tracking_uri, parent, f, subdir=SweepDir.REPORT_ARTIFACTS)
        if rows:
            log_ranking(
                tracking_uri,
                parent,
                data["ranking"],
                ranked,
                data["results_table"],
                data["baseline"],
                data["paired"],
                {t["mlflow_run_id"]: cost.trial_metrics(t) for t in rows if t.get("mlflow_run_id")},
            )
            log_batch(tracking_uri, parent, {"trials/finished": len(rows), "trials/failed": len(failed)})
    except Exception as e:  # the report on disk is still complete
        print(mask_url(f"warning: could not log the report to MLflow ({e})"))


def write_report(
    run_dir: str | Path,
    spec=None,
    storage_url: str | None = None,
    tracking_uri: str | None = None,
    log: bool = True,
    out: str | Path | None = None,
) -> dict:
    """Write ``report.md``, ``report.html`` and the figures into ``out`` (default ``run_dir``); with ``log``
    also log them (and the best trial's metric) to the sweep's MLflow parent run."""
    run_dir = Path(run_dir).resolve()
    out_given = out is not None
    out = Path(out).resolve() if out is not None else run_dir
    info = _sweep_record(run_dir)
    # recorded with their passwords masked: filled in from this command or the environment (uris.reveal)
    storage_url = storage_url or reveal(absolute_uri(info["storage"], base=run_dir))
    tracking_uri = tracking_uri or reveal(absolute_uri(info["tracking_uri"], base=run_dir))
    check_database(storage_url, "the study", "Optuna storage")  # a server that is down: one sentence
    # a read-only sweep directory (shared storage, a copy): one sentence before any work, not a traceback after it
    check_outputs("report", out, out_given, tracking_uri if log else None, tracking_options="--no-mlflow")
    out.mkdir(parents=True, exist_ok=True)
    if spec is None:
        origin = info.get("sweep_dir")
        # the sweep file's base: config may stay behind when the directory moves; the trials hold their configs
        spec = load_sweep(
            SweepDir(run_dir).spec, origin if origin and Path(origin).is_dir() else None, base_needed=False
        )
    rows, failed, attrs = collect(storage_url, info["name"])
    unfinished = attrs.pop("_unfinished", 0)
    faults.point("during_report")
    ppl_metric = spec.metric.replace("/loss", "/ppl")
    axes = [a.name for a in spec.axes if a.name != SEED_AXIS] or sorted(
        {k for r in rows for k in r["params"]} - {SEED_AXIS}
    )
    lines = _header(spec, len(rows), len(failed), unfinished, ppl_metric)
    ranked = ppl_metric if any(ppl_metric in r["metrics"] for r in rows) else spec.metric
    result_lines, figures, data = _results_sections(rows, axes, spec, ranked, tracking_uri, run_dir, out)
    rows = data["trials"]  # the trials' values as their directories hold them
    axis_lines, axis_figures = _axis_sections(
        rows, axes, ranked, out, (spec.report or {}).get("plot", "auto")
    )
    lines += result_lines + axis_lines
    figures += axis_figures
    ctx_png, ctx_lines = context_lengths.section(rows, axes, spec, out, data["rows"], data["baseline"])
    if ctx_png is not None:
        figures.append(ctx_png)
        lines += ctx_lines
    lines += _failed_section(failed)
    md = "\n".join(lines)
    path, html_path = SweepDir.report_files(out)
    atomic_write_text(path, md)
    atomic_write_text(
        html_path, markdown_to_html(md.replace(VIEWER_HINT, ""), out, title=f"sweep {spec.name}")
    )
    parent = attrs.get("mlflow_parent_run_id") or info.get("parent_run_id")
    if parent and log:
        _log_to_parent(tracking_uri, parent, [path, html_path, *figures], rows, failed, data, ranked)
        # every point ended but a command stopped before closing the parent (a pre-emption): closed as its grid
        # stands; a sweep still under way is left to its workers
        close_parent(spec, storage_url, tracking_uri)
    return {
        "path": path,
        "html": html_path,
        "markdown": md,
        "figures": figures,
        "rows": rows,
        "table": data["table"],
        "paired": data["paired"],
        "baseline": data["baseline"],
        "best_row": data["best"],
        "ranking": data["ranking"],
        "ranked": ranked,
        "cost": data["cost"],
        "failed": failed,
        "unfinished": unfinished,
    }


def report_at_end(spec: SweepSpec, run_dir: Path, storage: str, tracking: str) -> dict[str, Any]:
    """Write the report (one writer at a time: workers on several machines may end together and the report's
    files have fixed names) and print it with its path and the best row."""
    with file_lock(SweepDir(run_dir).report_lock), database_lock(storage, f"{spec.name}/report"):
        report = write_report(run_dir, spec=spec, storage_url=storage, tracking_uri=tracking)
    print(report["markdown"])
    print(f"\nreport: {report['path']}")
    print(f"best: {summary_line(report)}")
    return report
