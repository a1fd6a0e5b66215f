"""What the MLflow UI opens on: the runs table ranked best first, the classic (machine-learning) view, and the
sweep's parent run leading to its report.

Only MLflow's own mechanisms are used, no patched UI:

- a **shared view** of the runs table: the experiment tag ``mlflow.sharedViewState.<key>`` holds a JSON view
  state and the link carries ``viewStateShareKey=<key>`` (what MLflow's Share button writes). MLflow 3.17 reads
  the search facets ``searchFilter``, ``orderByKey``, ``orderByAsc`` and the table state ``selectedColumns`` and
  ``columnOrder`` from it (column keys ``params.`name``` / ``metrics.`name```), the grouping ``groupBy``
  (``{aggregateFunction: min|average|max, groupByKeys: [{mode: param|tag|dataset, groupByData}]}``),
  ``groupsExpanded`` and ``useGroupedValuesInCharts``, and the chart view's ``compareRunCharts`` /
  ``compareRunSections`` / ``globalLineChartConfig`` (its bundle's list of shareable keys); the rest keeps its
  defaults.
- ``workflowType=machine_learning`` on every link: MLflow 3.17 opens an experiment or a run in its GenAI view
  otherwise (the browser's last choice, GenAI on a first visit), whatever the experiment's kind tag says. On a
  server that runs our MLflow app (``ui`` does; ``mlflow_app.py``), the printed links open through its page
  ``/recursive-lightning/classic``, which also stores the classic view as the browser's choice for that
  address, so that runs opened from MLflow's own table (whose links carry no ``workflowType``) stay classic.
- the parent run's description (tag ``mlflow.note.content``, markdown): the report's table and a link to
  ``report.html`` among the run's artifacts.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import quote

from recursive_lightning.run_dir import SweepDir
from recursive_lightning.tracking.mlflow_app import CLASSIC_PAGE, WORKFLOW_KEY
from recursive_lightning.tracking.runs import client, set_experiment_tag, ui_command
from recursive_lightning.uris import mask_url

SHARED_VIEW_TAG = "mlflow.sharedViewState."  # MLflow's experiment tag prefix of a shared runs-table view
VIEW_KEY = "ranked"  # our share key: the runs table ranked by the report's metric
ML_VIEW = "workflowType=machine_learning"
NOTE_TAG = "mlflow.note.content"  # a run's description in MLflow's UI (markdown)
TRAIN_NOTE_HEAD = "**Trained to step "  # how a `train` run's own description begins (train_note)
RANKED_TAG = "report.metric"  # on a sweep's parent run: the metric the report ranks by (lower is better)
ROW_PREFIX = "row/"  # on a trial's run: ``row/<ranked>``, the mean of the metric over its grid point's seeds
RANK = "report/rank"  # on a trial's run: its place in the report's order (1: the best row's best seed)
TOKENS_PER_SEC = "train/tokens_per_sec"  # a training run's per-step throughput (its last step in the table)
# a sweep trial's throughput as its report states it: the tokens of its logged training steps over their summed
# step time (``sweep/curves.py: training_tokens_per_sec``), logged by the report; the table shows it instead
RUN_TOKENS_PER_SEC = "report/train_tokens_per_sec"
# cost beside the ranking metric: parameters, forward FLOPs per token (both logged when a run is created,
# ``training/mlflow_run.py: cost_metrics``) and training FLOPs so far (``train/flops``, logged every step)
COST_METRICS = ("cost/params_non_embedding", "cost/fwd_flops_per_token", "train/flops")
FLOPS = "train/flops"  # the chart view's x-axis of the ranking metric's curve
SEED_PARAM = "train.seed"
# the ranking metric of runs without a report (a `train` experiment): the first of these a run has
RANKING_FALLBACK = ("val/heldout/ppl", "val/heldout/loss", "train/loss")
# params shown for `train` runs when none differ between the experiment's runs
TRAIN_PARAMS = ("model.preset", "model.layout", "model.topology")
MAX_VARYING_PARAMS = 6
MAX_NOTE_RUNS = 12  # trials linked from the parent's description
NOTE_LIMIT = 8000  # MLflow's limit on a run tag's value (mlflow.utils.validation.MAX_TAG_VAL_LENGTH)
MAX_RUN_LINKS = 3  # run pages `ui` prints for an experiment without a sweep


def param_column(name: str) -> str:
    return f"params.`{name}`"


def metric_column(name: str) -> str:
    return f"metrics.`{name}`"


def experiment_url(base: str, experiment_id: str, view_key: str | None = VIEW_KEY, page: str = "/") -> str:
    """The experiment's runs table (``base`` = the server's address, "" for a link inside the UI; ``page``:
    the server's page that opens the UI's route, ``CLASSIC_PAGE`` on a server that has it)."""
    share = f"viewStateShareKey={quote(view_key)}&" if view_key else ""
    return f"{base}{page}#/experiments/{experiment_id}/runs?{share}{ML_VIEW}"


def run_url(base: str, experiment_id: str, run_id: str, artifact: str | None = None, page: str = "/") -> str:
    """A run's page, or one of its artifacts opened in the artifact viewer, in the classic view."""
    path = f"/artifacts/{quote(artifact)}" if artifact else ""
    return f"{base}{page}#/experiments/{experiment_id}/runs/{run_id}{path}?{ML_VIEW}"


def entry_page(base: str) -> str:
    """``CLASSIC_PAGE`` where the server at ``base`` runs our MLflow app, else "/" (MLflow's own page)."""
    try:
        with urllib.request.urlopen(f"{base}{CLASSIC_PAGE}", timeout=10) as r:
            return CLASSIC_PAGE if r.status == 200 and WORKFLOW_KEY.encode() in r.read() else "/"
    except OSError:
        return "/"


def _is_sweep_parent(run: Any) -> bool:
    return run.data.tags.get("kind") == "sweep"


def ranking_metric(runs: Sequence[Any]) -> str | None:
    """The report's ranking metric (its parent run's ``report.metric`` tag), else the first of
    ``RANKING_FALLBACK`` some run has."""
    for r in runs:
        if _is_sweep_parent(r) and r.data.tags.get(RANKED_TAG):
            return r.data.tags[RANKED_TAG]
    have = {k for r in runs for k in r.data.metrics}
    return next((m for m in RANKING_FALLBACK if m in have), None)


def _axis_params(runs: Sequence[Any]) -> list[str]:
    """One param per grid axis (``axis.<name>`` for a named axis, the field for a config-field axis, the seed
    last), from the parents' ``sweep.axes``; for runs outside a sweep the params that differ between them."""
    children = [r for r in runs if not _is_sweep_parent(r)]
    have = {k for r in children for k in r.data.params}
    out: list[str] = []
    for parent in (r for r in runs if _is_sweep_parent(r)):
        try:
            axes = json.loads(parent.data.params.get("sweep.axes", "{}"))
        except ValueError:
            axes = {}
        for name in axes:
            for key in (f"axis.{name}", name):
                if key in have and key not in out:
                    out.append(key)
                    break
    if out:
        return sorted(out, key=lambda k: k == "train.seed")  # the seed after the axes it repeats
    varying = sorted(k for k in have if len({r.data.params.get(k) for r in children}) > 1)
    varying = [k for k in varying if not k.startswith(("describe.", "data.cache", "sweep."))]
    if varying:
        return varying[:MAX_VARYING_PARAMS]
    return [k for k in TRAIN_PARAMS if k in have]


def _accuracy_metrics(runs: Sequence[Any]) -> list[str]:
    """Downstream accuracy where evaluated: the average over tasks per shot count (``eval/avg/<k>shot``)."""
    have = {k for r in runs for k in r.data.metrics}
    return sorted(k for k in have if k.startswith("eval/avg/"))


def runs_view(runs: Sequence[Any]) -> dict[str, Any] | None:
    """The view state of an experiment's runs table: one column per grid axis, the ranking metric (and its
    mean over the grid point's seeds and the trial's place in the report's order, which it is sorted by where
    the report logged them), downstream accuracy
    where evaluated and training tokens/s; sorted best (lowest) first. None for an experiment without runs."""
    if not runs:
        return None
    ranked = ranking_metric(runs)
    have = {k for r in runs for k in r.data.metrics}
    metrics: list[str] = []
    order = None
    if ranked is not None:
        row = ROW_PREFIX + ranked
        metrics += [m for m in (RANK, row) if m in have]
        metrics.append(ranked)
        order = RANK if RANK in have else ranked
    metrics += [m for m in COST_METRICS if m in have]
    metrics += _accuracy_metrics(runs)
    if RUN_TOKENS_PER_SEC in have or TOKENS_PER_SEC in have:
        metrics.append(RUN_TOKENS_PER_SEC if RUN_TOKENS_PER_SEC in have else TOKENS_PER_SEC)
    columns = [param_column(p) for p in _axis_params(runs)] + [metric_column(m) for m in metrics]
    view: dict[str, Any] = {
        "searchFilter": "",
        "selectedColumns": columns,
        "columnOrder": columns,  # the axes first (MLflow otherwise puts every metric before the params)
    }
    # a sweep's parent carries no trial metric: sorted by one, it comes last and MLflow lists its trials flat
    # above it (MLflow 3.17 leaves a shared view's runsExpanded out, so the view does not set it)
    if order is not None:
        view.update(orderByKey=metric_column(order), orderByAsc=True)
    groups = grid_groups(runs)
    if groups:  # a group's seed column would show the mean of its seeds; a trial's name carries its seed
        view["selectedColumns"] = view["columnOrder"] = [c for c in columns if c != param_column(SEED_PARAM)]
    view.update(groups)
    if ranked is not None:
        view.update(ranking_charts(ranked, [] if groups else _axis_params(runs), have))
    return view


def grid_groups(runs: Sequence[Any]) -> dict[str, Any]:
    """A sweep's runs table grouped by grid point (MLflow 3's run grouping, view-state keys ``groupBy`` /
    ``groupsExpanded`` / ``useGroupedValuesInCharts``): one group per combination of the axis params other than
    the seed, its metrics averaged over the seeds, the seeds folded under it; the groups keep the table's order
    (the best row first). Nothing for runs outside a sweep, a search or a sweep of seeds only."""
    names: set[str] = set()
    for parent in (r for r in runs if _is_sweep_parent(r)):
        try:
            names |= set(json.loads(parent.data.params.get("sweep.axes", "{}")))
        except ValueError:
            pass
    # a grid's axes only (a search's trials each have their own point)
    keys = [p for p in _axis_params(runs) if p != SEED_PARAM and p.removeprefix("axis.") in names]
    if not keys:
        return {}
    # MLflow's id of a group: "param.<key>.<value>" per grouping key, joined by ","; a group missing from
    # groupsExpanded opens expanded
    folded = {
        ",".join(f"param.{k}.{r.data.params[k]}" for k in keys): False
        for r in runs
        if all(k in r.data.params for k in keys)
    }
    return {
        "groupBy": {
            "aggregateFunction": "average",
            "groupByKeys": [{"mode": "param", "groupByData": k} for k in keys],
        },
        "groupsExpanded": folded,
        "useGroupedValuesInCharts": True,
    }


def ranking_charts(ranked: str, axes: Sequence[str], have: set[str]) -> dict[str, Any]:
    """The chart view's first section (MLflow's ``compareRunCharts`` / ``compareRunSections`` view state, what
    its chart view saves): the ranking metric per run (or grid point) against its training FLOPs where the runs
    log them (a scatter: both axes span the values, where MLflow's bars start at 0 and hide a 10 % difference),
    else a bar per run; ``axes`` against it (parallel coordinates; none for a grouped table, whose groups MLflow
    draws no such chart for); its curve and the training loss's (per group: the mean with a min-max band).
    MLflow adds its own charts of every other metric in sections after it."""
    section = "rl-ranking"
    base = {"runsCountToCompare": 10, "metricSectionId": section, "deleted": False, "isGenerated": False}
    first: dict[str, Any] = (
        {
            "uuid": "rl-cost",
            "type": "SCATTER",
            "xaxis": {"key": FLOPS, "type": "METRIC"},
            "yaxis": {"key": ranked, "type": "METRIC"},
            "displayName": f"{ranked} against {FLOPS}",
        }
        if FLOPS in have
        else {"uuid": "rl-bar", "type": "BAR", "metricKey": ranked, "displayName": ranked}
    )
    charts: list[dict[str, Any]] = [
        {**base, **first},
    ]
    if axes:  # MLflow draws no parallel coordinates for grouped runs (a group has no params): ungrouped only
        charts.append(
            {
                **base,
                "uuid": "rl-axes",
                "type": "PARALLEL",
                "selectedParams": list(axes),
                "selectedMetrics": [ranked],
                "showAllRuns": False,
                "displayName": f"grid axes → {ranked}",
            }
        )
    # the curves against training FLOPs where the runs log them (MLflow's metric x-axis: the x value of a
    # point is the x metric's value at the same step), else against the step
    x = {"xAxisKey": "metric", "selectedXAxisMetricKey": FLOPS} if FLOPS in have else {"xAxisKey": "step"}
    for key in (ranked, "train/loss"):
        if key in have:
            charts.append(
                {
                    **base,
                    "uuid": f"rl-curve-{key}",
                    "type": "LINE",
                    "metricKey": key,
                    "displayName": f"{key} against {FLOPS}" if FLOPS in have else key,
                    "lineSmoothness": 0,
                    "scaleType": "linear",
                    **x,
                    "xAxisScaleType": "linear",
                    "useGlobalXaxisKey": FLOPS not in have,
                    "useGlobalLineSmoothing": True,
                }
            )
    sections = [
        {
            "uuid": section,
            "name": f"Ranking: {ranked}",
            "display": True,
            "isReordered": False,
            "deleted": False,
            "isGenerated": False,
        }
    ]
    # isAccordionReordered: MLflow keeps the sections in this order (else it sorts them by name) and adds its
    # own after them
    return {"compareRunCharts": charts, "compareRunSections": sections, "isAccordionReordered": True}


def publish_views(tracking_uri: str, experiment_ids: Iterable[str] | None = None) -> dict[str, str]:
    """Write the ranked view (``runs_view``) of each experiment (default: all) as its shared view; returns
    {experiment id: share key} of those that have runs."""
    c = client(tracking_uri)
    ids = (
        list(experiment_ids)
        if experiment_ids is not None
        else [e.experiment_id for e in c.search_experiments()]
    )
    out = {}
    for exp_id in ids:
        runs = c.search_runs([exp_id], max_results=5000)
        view = runs_view(runs)
        if view is None:
            continue
        text = json.dumps(view, sort_keys=True)
        if c.get_experiment(exp_id).tags.get(SHARED_VIEW_TAG + VIEW_KEY) != text:
            set_experiment_tag(tracking_uri, exp_id, SHARED_VIEW_TAG + VIEW_KEY, text)
        out[exp_id] = VIEW_KEY
    return out


def experiment_links(tracking_uri: str, base_url: str, page: str = "/") -> list[str]:
    """The lines ``ui`` prints: each experiment's ranked runs table and, for a sweep, its parent run (the page
    that leads to the report); views published first (``publish_views``). ``page``: see :func:`entry_page`."""
    c = client(tracking_uri)
    try:
        keys: dict[str, str | None] = dict(publish_views(tracking_uri))
    except Exception:  # a store this user may read but not tag: the runs table unranked, still classic
        keys = {
            e.experiment_id: None
            for e in c.search_experiments()
            if c.search_runs([e.experiment_id], max_results=1)
        }
    lines = []
    for exp in c.search_experiments():
        if exp.experiment_id not in keys:
            continue
        url = experiment_url(base_url, exp.experiment_id, keys[exp.experiment_id], page)
        lines.append(f"  {exp.name}: {url}")
        parents = c.search_runs([exp.experiment_id], filter_string="tags.kind = 'sweep'", max_results=10)
        shown = parents or c.search_runs([exp.experiment_id], max_results=MAX_RUN_LINKS + 1)
        for r in shown[:MAX_RUN_LINKS]:
            what = " (the report)" if _is_sweep_parent(r) else ""
            lines.append(
                f"    {r.info.run_name}{what}: {run_url(base_url, exp.experiment_id, r.info.run_id, page=page)}"
            )
    return lines


def parent_note(
    experiment_id: str,
    parent_run_id: str,
    ranked: str,
    best_row: str | None,
    best_line: str,
    table: Sequence[str],
    runs: Sequence[tuple[str, str | None]],
) -> str:
    """The sweep's parent run's description: the winner, a link to ``report.html`` (relative: it opens on
    whatever address serves the UI), the report's results table and its trials' run pages."""
    report = run_url("", experiment_id, parent_run_id, SweepDir.REPORT_HTML_ARTIFACT)
    shown = [
        f"[{name}]({run_url('', experiment_id, rid)})" if rid else name for name, rid in runs[:MAX_NOTE_RUNS]
    ]
    if len(runs) > MAX_NOTE_RUNS:
        shown.append(f"… {len(runs) - MAX_NOTE_RUNS} more in the runs table")
    lines = [
        (f"**Best: `{best_row}`** — {best_line}" if best_row is not None else "No finished trial yet."),
        "",
        f"**[Open the report (report.html)]({report})**: the paper's table, paired differences, learning "
        f"curves, `{ranked}` against training FLOPs and wall-clock.",
        "",
        *table,
        "",
        "Trials, best first: " + ", ".join(shown),
    ]
    return fit_note(lines)


def fit_note(lines: Sequence[str], limit: int = NOTE_LIMIT) -> str:
    """``lines`` joined, whole lines dropped from the end (the table's last rows) to fit MLflow's tag limit,
    with a line saying so."""
    text = "\n".join(lines)
    if len(text) <= limit:
        return text
    cut = "\n\n(cut to fit MLflow's description; the report has every row)"
    kept: list[str] = []
    for line in lines:
        if len("\n".join([*kept, line])) + len(cut) > limit:
            break
        kept.append(line)
    return "\n".join(kept) + cut


def trial_note(
    experiment_id: str,
    parent_run_id: str,
    row: str,
    seed: Any,
    rank: int,
    metric: str,
    value: float,
    row_mean: float,
) -> str:
    """A trial's description: its grid point, its place in the report's order and a link to the report."""
    report = run_url("", experiment_id, parent_run_id, SweepDir.REPORT_HTML_ARTIFACT)
    seed_text = f", seed {seed}" if seed is not None else ""
    return (
        f"Grid point **`{row}`**{seed_text}: rank **{rank}** in the sweep's report; `{metric}` {value:.4g} "
        f"(the row's mean over its seeds {row_mean:.4g}). [The sweep's report]({report})"
    )


def train_note(metrics: dict[str, float], steps: int, tokens: int, seconds: float) -> str:
    """A `train` run's description: what it reached, above MLflow's metrics table (which lists a run's
    ``system/*`` metrics before its model metrics): the validation metrics, ranking metrics first."""
    first = [k for k in RANKING_FALLBACK if k in metrics and k.startswith("val/")]
    shown = first + sorted(k for k in metrics if k.startswith("val/") and k not in first)
    values = ", ".join(
        f"`{k}` **{metrics[k]:.4g}**" if i == 0 else f"`{k}` {metrics[k]:.4g}" for i, k in enumerate(shown)
    )
    return f"{TRAIN_NOTE_HEAD}{steps:,}** ({tokens:,} tokens in {seconds:,.0f} s)" + (
        f". Validation: {values}." if values else "; no validation yet."
    )


def ours_to_replace(note: str | None) -> bool:
    """Whether a run's description may be (re)written by ``train``: none yet, or a :func:`train_note` (a
    sweep's trial note or the researcher's own text stays)."""
    return not note or note.startswith(TRAIN_NOTE_HEAD)


def server_links(tracking_uri: str) -> list[str]:
    """For a store served by its own tracking server (``http(s)://``): the ranked links on that server."""
    base = tracking_uri.rstrip("/")
    # the links printed: a password in the address masked
    return experiment_links(tracking_uri, mask_url(base), entry_page(base))


def ui_hint(run_dir: str, tracking_uri: str) -> str:
    """What the sweep prints at its end: the ``ui`` command of its directory, or, on a tracking server, the
    ranked links themselves."""
    if tracking_uri.startswith(("http://", "https://")):
        try:
            return "open the runs in the MLflow UI:\n" + "\n".join(server_links(tracking_uri))
        except Exception:  # the server went away: its address still helps
            pass
    return f"compare the runs in the MLflow UI: {ui_command(run_dir, tracking_uri)}"
