"""One definition of "best" for a sweep: the report's ranking metric (lower is better), mean over a grid point's
seeds. The report's ★, the parent run's ``best_row`` / ``best_trial`` / ``best/<metric>``, the CLI summary, the
trials' ``row/<metric>`` (what MLflow's runs table is sorted by) and the parent's description all read it here.

The best trial is the best row's trial with the lowest value of the metric (its best seed): a trial of another
row with a lower single value is never named best.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from recursive_lightning import formatting as fmt
from recursive_lightning.sweep.rows import Row, trial_value
from recursive_lightning.sweep.spec import SEED_AXIS
from recursive_lightning.sweep.statistics import CONFIDENCE, excludes_zero, mean_std, paired_difference
from recursive_lightning.tracking import view
from recursive_lightning.tracking.runs import client, log_batch


@dataclass
class Ranked:
    """A report row with its mean and std of the ranking metric over its seeds; ``trials`` best first."""

    name: str
    mean: float | None
    std: float | None
    trials: list[dict[str, Any]] = field(default_factory=list)


def rank(rows: Sequence[Row], metric: str) -> list[Ranked]:
    """Rows best (lowest mean over seeds) first; rows without the metric last, in their order."""
    out = []
    for r in rows:
        scored = [(v, t) for t in r.trials if (v := trial_value(t, metric)) is not None]
        mean, std = mean_std([v for v, _ in scored]) if scored else (None, None)
        trials = [t for _, t in sorted(scored, key=lambda p: p[0])]
        trials += [t for t in r.trials if trial_value(t, metric) is None]
        out.append(Ranked(r.name, mean, std, trials))
    return sorted(out, key=lambda x: (x.mean is None, x.mean if x.mean is not None else 0.0))


def best(ranking: Sequence[Ranked]) -> tuple[Ranked | None, dict[str, Any] | None]:
    """(the best row, its best trial), or (None, None) when no row has the metric."""
    if not ranking or ranking[0].mean is None:
        return None, None
    return ranking[0], ranking[0].trials[0]


def run_name(trial: dict[str, Any]) -> str:
    """The trial's name in MLflow's runs table (its child run is named by its grid point's key)."""
    return str(trial.get("key"))


def summary(
    ranking: Sequence[Ranked],
    metric: str,
    baseline: str | None = None,
    paired: Mapping[str, Mapping[str, Any]] | None = None,
) -> str:
    """The one line the sweep prints and the parent's description opens with: the best row, its best trial and
    whether it is distinguishable from the runner-up and from the baseline row (:func:`significance`)."""
    row, trial = best(ranking)
    if row is None:
        return f"no finished trial has `{metric}`"
    n = sum(trial_value(t, metric) is not None for t in row.trials)
    said = "".join(f"; {s}" for s in significance(ranking, metric, baseline, paired).values())
    return (
        f"`{metric}` {row.mean:.4g} ± {row.std:.2g} (mean ± std over {n} seed(s)); "
        f"its best trial is the run `{run_name(trial)}`{said}"
    )


def verdict(d: Mapping[str, Any] | None, other: str) -> str:
    """Whether a paired difference (``statistics.paired_difference``: best row − ``other``) tells the rows apart:
    distinguishable only where its t-interval excludes zero; one common seed: no interval exists."""
    if d is None:
        return f"no seed in common with {other}: no paired difference"
    if d["lo"] is None:
        return f"one seed in common with {other} ({d['mean']:+.4g}): no interval exists"
    real = excludes_zero(d)
    return (
        f"{'distinguishable' if real else 'not distinguishable'} from {other} (paired "
        f"{d['mean']:+.4g} [{d['lo']:+.4g}, {d['hi']:+.4g}], {CONFIDENCE:.0%} t-interval over {d['n']} seeds)"
    )


def significance(
    ranking: Sequence[Ranked],
    metric: str,
    baseline: str | None = None,
    paired: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, str]:
    """{"runner_up": ..., "baseline": ...}: the best row against the second (:func:`against_runner_up`) and
    against the report's baseline row, read from the report's paired differences to it (``paired``: {row:
    {metric: difference}}, computed once by the report). The best row that is the baseline says so; a
    runner-up that is the baseline is named once."""
    row, _ = best(ranking)
    if row is None:
        return {}
    out = {}
    runner = against_runner_up(ranking, metric, baseline, paired)
    if runner:
        out["runner_up"] = runner.removeprefix("; ")
    if baseline is None or (len(ranking) > 1 and ranking[1].name == baseline and ranking[1].mean is not None):
        return out
    if row.name == baseline:
        out["baseline"] = "it is the baseline row"
    else:
        out["baseline"] = verdict((paired or {}).get(row.name, {}).get(metric), f"the baseline `{baseline}`")
    return out


def against_runner_up(
    ranking: Sequence[Ranked],
    metric: str,
    baseline: str | None = None,
    paired: Mapping[str, Mapping[str, Any]] | None = None,
) -> str:
    """ "; not distinguishable from the runner-up `anchor` (paired -5.25 [-55.7, +45.2] ...)": the best row minus
    the second over the seeds both finished, with the report's paired t-interval (``statistics.paired_difference``;
    the report's own where the runner-up is its ``baseline``); distinguishable only where the interval
    excludes zero. With one common seed no interval exists, and the line says so; nothing when there is no
    runner-up."""
    if len(ranking) < 2 or ranking[0].mean is None or ranking[1].mean is None:
        return ""
    other = ranking[1]
    if other.name == baseline:
        who = f"the runner-up `{other.name}` (the baseline)"
        if paired is not None and metric in paired.get(ranking[0].name, {}):
            return "; " + verdict(paired[ranking[0].name][metric], who)
    else:
        who = f"the runner-up `{other.name}`"
    d = paired_difference(ranking[0], other, metric)  # type: ignore[arg-type]  # Ranked has a Row's trials
    return "; " + verdict(d, who)


def summary_line(report: dict[str, Any]) -> str:
    """The sweep's CLI summary of a ``write_report`` result: the best row and its numbers."""
    row, _ = best(report["ranking"])
    failed = report.get("failed") or []
    if row is None and failed and not report.get("rows"):  # no metric anywhere because no trial finished
        return (
            f"none: every trial failed ({len(failed)} of {len(failed)}); their errors are listed under "
            f'"Failed trials" in {report["path"]}, and each trial\'s files are in its folder under trials/'
        )
    line = summary(report["ranking"], report["ranked"], report.get("baseline"), report.get("paired"))
    return f"`{row.name}` — {line}" if row else line


def runs_section(ranking: Sequence[Ranked], metric: str) -> list[str]:
    """The report's list of trials by the names MLflow shows, in the order of MLflow's ranked runs table
    (``report/rank``)."""
    lines = [
        "## Runs",
        "",
        f"Every trial by its MLflow run name, in the order of the runs table `ui` opens (its `report/rank`): by "
        f"the row's mean `{metric}` over its seeds (`row/{metric}`), then by the trial's own.",
        "",
        f"| rank | run | row | seed | {metric} | row mean |",
        "|---|---|---|---|---|---|",
    ]
    place = 0
    for r in ranking:
        for t in r.trials:
            v = trial_value(t, metric)
            place += v is not None and r.mean is not None
            cells = [
                str(place) if v is not None and r.mean is not None else "—",
                f"`{run_name(t)}`",
                r.name,
                str(t["params"].get(SEED_AXIS, "")),
                fmt.metric(metric, v) if v is not None else "—",  # one format per quantity
                fmt.metric(metric, r.mean) if r.mean is not None else "—",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def log_ranking(
    tracking_uri: str,
    parent: str,
    ranking: Sequence[Ranked],
    metric: str,
    table: Sequence[str],
    baseline: str | None = None,
    paired: Mapping[str, Mapping[str, Any]] | None = None,
    trial_metrics: Mapping[str, Mapping[str, float]] | None = None,
) -> None:
    """Write the ranking to MLflow: ``row/<metric>``, ``report/rank`` (1 = best), ``trial_metrics`` ({run id:
    {metric: value}}, the report's per-trial numbers) and a description on each trial's run (the best trial's
    says whether its row is distinguishable, :func:`significance`); the parent's tags (``best_row``,
    ``best_trial``, ``best_trial_run_id``, ``report.metric``, ``best.vs_runner_up`` / ``best.vs_baseline``),
    metric ``best/<metric>`` (the best row's mean) and description (``tracking.view.parent_note``); and the
    experiment's ranked view of its runs table."""
    c = client(tracking_uri)
    exp_id = c.get_run(parent).info.experiment_id
    said = significance(ranking, metric, baseline, paired)
    place = 0
    for r in ranking:
        if r.mean is None:
            continue
        for t in r.trials:
            value = trial_value(t, metric)
            if value is None:
                continue
            place += 1
            if t.get("mlflow_run_id"):
                note = view.trial_note(
                    exp_id, parent, r.name, t["params"].get(SEED_AXIS), place, metric, value, r.mean
                )
                if place == 1 and said:  # the best trial's page names the winner with its caveat
                    note += f". Best row `{r.name}`: " + "; ".join(said.values()) + "."
                log_batch(
                    tracking_uri,
                    t["mlflow_run_id"],
                    {
                        view.ROW_PREFIX + metric: r.mean,
                        view.RANK: place,
                        **(trial_metrics or {}).get(t["mlflow_run_id"], {}),
                    },
                    {view.NOTE_TAG: note},
                )
    row, trial = best(ranking)
    tags: dict[str, Any] = {view.RANKED_TAG: metric}
    metrics = {}
    if row is not None:
        tags.update(best_row=row.name, best_trial=str(trial.get("key")))
        tags.update({f"best.vs_{k}": v for k, v in said.items()})
        if trial.get("mlflow_run_id"):
            tags["best_trial_run_id"] = trial["mlflow_run_id"]
        metrics[f"best/{metric}"] = row.mean
    tags[view.NOTE_TAG] = view.parent_note(
        exp_id,
        parent,
        metric,
        row.name if row is not None else None,
        summary(ranking, metric, baseline, paired),
        table,
        [(run_name(t), t.get("mlflow_run_id")) for r in ranking for t in r.trials],
    )
    log_batch(tracking_uri, parent, metrics, tags)
    view.publish_views(tracking_uri, [exp_id])
