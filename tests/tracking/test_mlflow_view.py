"""What a researcher sees first in MLflow, checked in a real browser (headless Chromium, skipped where none is
installed): the link `ui` prints opens the sweep's runs table ranked best first with one column per axis and
the ranking metric; the parent's page (classic view) leads to the report; one definition of "best" across
the report, the parent run's tags and the sweep's summary; the report's cost figure."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import ENV, run_sweep, sweep_file

from recursive_lightning.tracking.mlflow_app import CLASSIC_PAGE
from recursive_lightning.tracking.runs import client
from recursive_lightning.tracking.view import (
    NOTE_TAG,
    SHARED_VIEW_TAG,
    VIEW_KEY,
    ours_to_replace,
    train_note,
)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def ranked_sweep(tmp_path_factory, data_cache):
    """Two rows x two seeds, 4 steps; returns (run dir, the sweep's printed output)."""
    tmp = tmp_path_factory.mktemp("view")
    rows = {"base": {"model.topology": "base"}, "mesh": {"model.topology": "mesh"}}
    spec = sweep_file(tmp, data_cache, rows, seeds=(0, 1), steps=4)
    run_dir = tmp / "sweep"
    p = run_sweep([spec, "--run-dir", run_dir])
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out
    return run_dir, out


def _report(run_dir: Path) -> tuple[list[dict], str]:
    """The sweep's trials as the report ranks them (from report.md's Runs table) and its best row."""
    md = (run_dir / "report.md").read_text()
    section = md.split("## Runs", 1)[1].split("\n## ", 1)[0]
    runs = []
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].isdigit():
            runs.append({"rank": int(cells[0]), "run": cells[1], "row": cells[2], "value": float(cells[4])})
    best_row = next(line.split("|")[1].strip()[:-2] for line in md.splitlines() if " ★ |" in line)
    return runs, best_row


def test_one_definition_of_best(ranked_sweep):
    """The report's ★ row, the parent's best_row / best_trial / best/<metric>, the trials' report/rank and
    the sweep's printed summary agree: the row with the lowest mean over seeds, its lowest seed. Fails with
    the old `best_trial` (the single lowest trial of any row) when another row's seed is lower."""
    run_dir, out = ranked_sweep
    runs, best_row = _report(run_dir)
    assert [r["rank"] for r in runs] == list(range(1, 5))
    means = {}
    for r in runs:
        means.setdefault(r["row"], []).append(r["value"])
    means = {k: sum(v) / len(v) for k, v in means.items()}
    assert best_row == min(means, key=means.get)
    assert runs[0]["row"] == best_row and runs[0]["value"] == min(
        r["value"] for r in runs if r["row"] == best_row
    )
    info = json.loads((run_dir / "sweep.json").read_text())
    c = client(f"sqlite:///{run_dir / 'mlflow.db'}")
    parent = c.get_run(info["parent_run_id"])
    assert parent.data.tags["best_row"] == best_row
    assert parent.data.tags["best_trial"] == runs[0]["run"]
    assert parent.data.metrics["best/val/heldout/ppl"] == pytest.approx(means[best_row], rel=1e-3)
    for child in c.search_runs([parent.info.experiment_id]):
        if child.info.run_id == parent.info.run_id:
            continue
        mine = next(r for r in runs if r["run"] == child.info.run_name)
        assert child.data.metrics["report/rank"] == mine["rank"]
    assert f"best: `{best_row}`" in out and runs[0]["run"] in out.split("best: ", 1)[1].splitlines()[0]
    # the parent's description: the winner, the report's table, a link to report.html
    note = parent.data.tags["mlflow.note.content"]
    assert (
        f"**Best: `{best_row}`**" in note
        and "artifacts/report/report.html?workflowType=machine_learning" in note
    )
    assert "| row | seeds |" in note


def test_report_plots_the_ranking_metric_against_flops_and_wall_clock(ranked_sweep):
    """Per row: training FLOPs = 3 x forward FLOPs/token (describe of the trial's config.yaml) x its tokens
    (result.json) and wall-clock (result.json's seconds less its data_seconds), mean over the seeds, as the
    figure's table says."""
    from recursive_lightning.config import load_run_config
    from recursive_lightning.model.describe import describe

    run_dir, _ = ranked_sweep
    md = (run_dir / "report.md").read_text()
    assert (run_dir / "report_cost.png").stat().st_size > 10_000
    section = md.split("## Cost: per FLOP and per second", 1)[1].split("\n## ", 1)[0]
    head = [c.strip() for c in next(ln for ln in section.splitlines() if ln.startswith("| row |")).split("|")]
    for row in ("base", "mesh"):
        cells = dict(
            zip(head, next(ln for ln in section.splitlines() if ln.startswith(f"| {row} |")).split("|"))
        )
        flops, seconds = [], []
        for d in (run_dir / "trials").iterdir():
            if d.name.startswith(f"{row}-"):
                result = json.loads((d / "result.json").read_text())
                cfg = load_run_config(d / "config.yaml")
                per_token = describe(cfg.model, seq_len=cfg.data.seq_len)["flops_forward"] / cfg.data.seq_len
                flops.append(3 * per_token * result["tokens"])
                seconds.append(
                    result["seconds"] - result["data_seconds"]
                )  # less its one-off data preparation
        assert len(flops) == 2
        value, unit = cells["training FLOPs"].split("±")[0].split()  # one format per quantity: "1.55 TFLOPs"
        scale = {"kFLOPs": 1e3, "MFLOPs": 1e6, "GFLOPs": 1e9, "TFLOPs": 1e12, "PFLOPs": 1e15}[unit]
        assert float(value) * scale == pytest.approx(sum(flops) / 2, rel=5e-3)  # three significant digits
        wall = float(cells["wall-clock (s)"].split("±")[0].replace(",", ""))
        assert wall == pytest.approx(sum(seconds) / 2, abs=0.5)


def _dom(url: str, width: int = 2400, profile: Path | None = None) -> str:
    """The page as headless Chromium renders it: in a fresh profile (a first visit, GenAI MLflow's default),
    or in ``profile``, a browser that keeps what earlier pages stored."""
    with tempfile.TemporaryDirectory() as fresh:
        profile = profile or fresh
        out = subprocess.run(
            [
                CHROMIUM,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={width},1200",
                "--virtual-time-budget=30000",
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
    return out.stdout


def _groups(dom: str) -> dict[str, list[float]]:
    """{grid point: the numbers of its row} of a runs table grouped by ``axis.variant``, in table order."""
    out: dict[str, list[float]] = {}
    starts = [(m.start(), m.group(1)) for m in re.finditer(r'row-id="param\.axis\.variant\.([^"]+)"', dom)]
    for (pos, name), (end, _) in zip(starts, [*starts[1:], (len(dom), "")]):
        text = _text(dom[pos:end].split(">", 1)[-1])
        out.setdefault(name, []).extend(float(v) for v in re.findall(r"\b\d+\.\d+\b", text))
    return out


def _text(html: str) -> str:
    """A page's text: tags dropped, entities decoded, white space collapsed."""
    import html as html_lib

    return re.sub(r"\s+", " ", html_lib.unescape(re.sub(r"<[^>]+>", " ", html))).replace(" :", ":")


def _lines(proc: subprocess.Popen, n: int, timeout: float = 120) -> list[str]:
    """The first ``n`` lines ``proc`` prints, or as many as it printed within ``timeout`` seconds."""
    import select
    import time

    lines, deadline = [], time.monotonic() + timeout
    while len(lines) < n and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.decode(errors="replace"))
    return lines + [""] * (n - len(lines))


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed")
def test_ui_links_open_the_ranked_runs_table_and_classic_run_pages(ranked_sweep):
    run_dir, _ = ranked_sweep
    runs, best_row = _report(run_dir)
    ui = subprocess.Popen(
        [sys.executable, "-m", "recursive_lightning", "ui", str(run_dir), "--port", "5410"],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        bufsize=0,  # unbuffered: select() sees every line not yet read
        start_new_session=True,
    )
    try:
        lines = _lines(ui, 3)
        assert lines[0].startswith("MLflow UI at"), "".join(lines)
        assert all(": http" in ln for ln in lines[1:]), "".join(lines)  # the table's link, the parent's
        table_url = lines[1].split(": ", 1)[1].strip()
        parent_url = lines[2].split(": ", 1)[1].strip()
        assert "viewStateShareKey=" in table_url and "workflowType=machine_learning" in table_url
        assert lines[2].strip().startswith("sweep:") and "workflowType=machine_learning" in parent_url
        assert f"{CLASSIC_PAGE}#/" in table_url and f"{CLASSIC_PAGE}#/" in parent_url  # through our page
        base = table_url.split(CLASSIC_PAGE, 1)[0]

        browser = run_dir.parent / "browser"  # one profile: the table first, then a run clicked in it
        dom = _dom(table_url, profile=browser)
        names = [r["run"] for r in runs]
        # MLflow's Assistant stays closed on a first visit through the printed link; opened without our page
        # (the control) it covers a quarter of the window
        assistant = "Ask questions about your experiments"
        assert assistant not in dom, "the Assistant panel opened"
        assert assistant in _dom(table_url.replace(CLASSIC_PAGE, "")), "control: MLflow opens its Assistant"
        assert ">train.seed<" not in dom, "a grouped table has no seed column"
        assert ">axis.variant<" in dom, "no axis column"
        assert ">val/heldout/ppl<" in dom, "no column of the ranking metric"
        for cost in ("cost/params_non_embedding", "cost/fwd_flops_per_token", "train/flops"):
            assert f">{cost}<" in dom, f"no cost column {cost}"
        assert ">report/train_tokens_per_sec<" in dom, "no column of the report's tokens/s"
        # grouped by grid point: one folded row per grid point, best first, with its mean over the seeds
        groups = _groups(dom)
        rows = list(dict.fromkeys(r["row"] for r in runs))  # the report's order: best row first
        assert list(groups) == rows and rows[0] == best_row, groups
        assert not any(f">{n}<" in dom for n in names), "the seeds are folded under their grid point"
        for row in rows:
            mean = sum(r["value"] for r in runs if r["row"] == row) / 2
            assert any(abs(v - mean) <= 0.01 for v in groups[row]), (row, mean, groups[row])
        # its chart view (MLflow's compare mode) opens on the ranking: the grid points' means, the ranking
        # metric against training FLOPs (MLflow's metric x-axis); a dump can end before the plots are drawn:
        # render again, a bounded number of times
        for _ in range(3):
            charts = _dom(f"{table_url}&compareRunsMode=CHART", profile=browser)
            if 'data-unformatted="train/flops"' in charts:
                break
        first = charts.find("Ranking: val/heldout/ppl")
        assert first != -1, "no ranking section in the chart view"
        assert all(first < charts.find(s) for s in (">train<", ">val/heldout<", "final/val/heldout")), (
            "not first"
        )
        assert re.search(r'class="g-xtitle"[^>]*>.{0,300}data-unformatted="train/flops"', charts[first:]), (
            "no curve against train/flops"
        )
        # the ranking against training FLOPs, one point per grid point (a scatter, axes spanning the values)
        assert "train/flops vs. val/heldout/ppl" in _text(charts[first:]), "no scatter against train/flops"
        # a run opened from MLflow's own table (its link carries no workflowType) opens classic because the
        # printed link stored the choice; the same link in a fresh browser opens GenAI (the control)
        info = json.loads((run_dir / "sweep.json").read_text())
        c = client(f"sqlite:///{run_dir / 'mlflow.db'}")
        parent_run = c.get_run(info["parent_run_id"])
        clicked = f"{base}/#/experiments/{parent_run.info.experiment_id}/runs/{parent_run.data.tags['best_trial_run_id']}"
        assert "Evaluation runs" in _dom(clicked, width=1600), "control: a first visit opens GenAI"
        page = _dom(clicked, width=1600, profile=browser)
        assert "Evaluation runs" not in page and "Model registry" in page and names[0] in page

        page = _dom(parent_url, width=1600)
        assert "Evaluation runs" not in page and "Model registry" in page  # the classic view's side bar
        assert "Open the report (report.html)" in page and "Best: " in page
        # the parent's description weighs the winner: its sentence as the parent's tag states it
        said = parent_run.data.tags["best.vs_runner_up"]
        assert "distinguishable from the runner-up" in said and said.replace("`", "") in _text(page), said
        assert re.search(
            r'href="/?#/experiments/\d+/runs/\w+/artifacts/report/report\.html\?workflowType=machine_learning"',
            page,
        )
        # a trial's run page, as linked from the parent's description: classic view too
        child = re.search(
            r'href="/?(#/experiments/\d+/runs/\w+\?workflowType=machine_learning)"[^>]*>'
            + re.escape(names[0]),
            page,
        )
        assert child, "the description links the best trial's run"
        # the same store behind a tracking server: `ui --tracking-uri http://...` prints the same links there
        served = subprocess.run(
            [sys.executable, "-m", "recursive_lightning", "ui", "--tracking-uri", base],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert served.returncode == 0, served.stderr
        assert table_url in served.stdout and parent_url in served.stdout, served.stdout
        trial_page = _dom(f"{base}/{child.group(1)}", width=1600)  # a fresh browser, the link's workflowType
        assert "Evaluation runs" not in trial_page and names[0] in trial_page and "axis.variant" in trial_page
        assert f"Best row {best_row}: {said.replace('`', '')}." in _text(trial_page)  # the best trial's page
    finally:
        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(timeout=60)


def test_a_train_run_experiment_gets_a_ranked_view(tmp_path, tiny_run):
    """A single `train` run's experiment: ranked by val/heldout/ppl with tokens/s, and `ui` prints its run page
    in the classic view."""
    from recursive_lightning.config import RunConfig
    from recursive_lightning.tracking.view import experiment_links
    from recursive_lightning.training.run import train

    raw = tiny_run()
    raw["train"]["max_steps"] = 4
    raw["train"]["val_every"] = 4
    r = train(RunConfig.from_dict(raw), tmp_path / "run")
    lines = experiment_links(r.tracking_uri, "http://host:1")
    exp = client(r.tracking_uri).get_experiment_by_name("tiny")
    view = json.loads(exp.tags[SHARED_VIEW_TAG + VIEW_KEY])
    assert view["orderByKey"] == "metrics.`val/heldout/ppl`" and view["orderByAsc"] is True
    assert "metrics.`train/tokens_per_sec`" in view["selectedColumns"]
    charts = {c["type"]: c for c in view["compareRunCharts"]}  # the chart view's first section: the ranking
    # the ranking metric against training FLOPs, a scatter whose axes span the values (bars start at 0)
    assert charts["SCATTER"]["yaxis"] == {"key": "val/heldout/ppl", "type": "METRIC"}
    assert charts["SCATTER"]["xaxis"] == {"key": "train/flops", "type": "METRIC"} and "BAR" not in charts
    assert view["isAccordionReordered"] is True
    assert charts["PARALLEL"]["selectedMetrics"] == ["val/heldout/ppl"]
    assert (
        lines[0]
        == f"  tiny: http://host:1/#/experiments/{exp.experiment_id}/runs?viewStateShareKey={VIEW_KEY}&workflowType=machine_learning"
    )
    assert lines[1].endswith(f"/runs/{r.mlflow_run_id}?workflowType=machine_learning")
    # its page opens on what it reached (MLflow lists system/* metrics first in its metrics table)
    note = client(r.tracking_uri).get_run(r.mlflow_run_id).data.tags[NOTE_TAG]
    ppl = r.metrics["val/heldout/ppl"]
    assert note.startswith("**Trained to step 4** (") and f"`val/heldout/ppl` **{ppl:.4g}**" in note, note


def test_train_note_ranks_first_and_keeps_a_description_it_did_not_write():
    metrics = {"val/heldout/loss": 5.0, "val/idle/ppl": 300.0, "val/heldout/ppl": 148.41}
    note = train_note(metrics, 300, 614400, 92.4)
    assert note == (
        "**Trained to step 300** (614,400 tokens in 92 s). Validation: `val/heldout/ppl` **148.4**, "
        "`val/heldout/loss` 5, `val/idle/ppl` 300."
    )
    assert train_note({}, 0, 0, 0.2).endswith("; no validation yet.")
    assert ours_to_replace(None) and ours_to_replace("") and ours_to_replace(note)
    assert not ours_to_replace("Grid point **`base`**, seed 0: rank **1**") and not ours_to_replace(
        "my notes"
    )


def test_the_best_trial_belongs_to_the_best_row():
    """Row a has the single lowest trial (1.0) but the higher mean (3.0); row b (2.0, 2.5) is best: its trial
    2.0 is the best trial, ranked first, and a's 1.0 third (the old `best_trial` named a's 1.0)."""
    from recursive_lightning.sweep.ranking import best, rank
    from recursive_lightning.sweep.rows import Row

    def trial(key, seed, v):
        return {"key": key, "params": {"variant": key[0], "train.seed": seed}, "metrics": {"m": v}}

    rows = [
        Row("a", {}, [trial("a0", 0, 1.0), trial("a1", 1, 5.0)]),
        Row("b", {}, [trial("b1", 1, 2.5), trial("b0", 0, 2.0)]),
        Row("c", {}, [{"key": "c0", "params": {}, "metrics": {}}]),
    ]
    ranking = rank(rows, "m")
    row, t = best(ranking)
    assert row.name == "b" and row.mean == pytest.approx(2.25) and t["key"] == "b0"
    assert [t["key"] for r in ranking for t in r.trials] == ["b0", "b1", "a0", "a1", "c0"]


def test_a_large_sweep_s_description_fits_mlflow_s_limit():
    """60 trials and a 60-row table: the parent's description stays within MLflow's 8,000 characters (a longer
    tag fails the whole batch, and the parent would lose its best_* tags), cut at a whole line and saying so."""
    from recursive_lightning.tracking.view import NOTE_LIMIT, parent_note

    table = ["| row | seeds | ppl |", "|---|---|---|"] + [
        f"| variant-{i:03d} | 2 | {i}.0 ± 0.1 |" * 4 for i in range(60)
    ]
    runs = [(f"variant-{i:03d}-0-abcdef", "f" * 32) for i in range(60)]
    note = parent_note("1", "e" * 32, "val/heldout/ppl", "variant-000", "the best", table, runs)
    assert len(note) <= NOTE_LIMIT
    assert note.endswith("the report has every row)") and "Open the report (report.html)" in note
    assert "| variant-000 |" in note and "48 more in the runs table" not in note  # the trials' line was cut
    small = parent_note("1", "e" * 32, "val/heldout/ppl", "variant-000", "the best", table[:5], runs)
    assert "48 more in the runs table" in small and len(small) < NOTE_LIMIT


def test_a_grid_is_grouped_by_its_axes_and_a_search_or_a_train_run_is_not():
    """MLflow's group ids ("param.<key>.<value>" joined by ",") folded, the seed never a grouping key."""
    from types import SimpleNamespace

    from recursive_lightning.tracking.view import grid_groups

    def run(params, tags=None):
        return SimpleNamespace(data=SimpleNamespace(params=params, tags=tags or {}, metrics={}))

    def parent(axes):
        return run({"sweep.axes": json.dumps(axes)}, {"kind": "sweep"})

    trials = [
        run({"axis.variant": v, "model.buffer": b, "train.seed": s, "train.lr": lr})
        for v, b, s, lr in (
            ("mesh", "3", "0", "1e-3"),
            ("mesh", "3", "1", "2e-3"),
            ("base", "4", "0", "3e-3"),
        )
    ]
    grid = grid_groups(
        [parent({"variant": ["mesh", "base"], "model.buffer": [3, 4], "train.seed": [0, 1]}), *trials]
    )
    assert grid["groupBy"]["groupByKeys"] == [
        {"mode": "param", "groupByData": "axis.variant"},
        {"mode": "param", "groupByData": "model.buffer"},
    ]
    assert grid["groupsExpanded"] == {
        "param.axis.variant.mesh,param.model.buffer.3": False,
        "param.axis.variant.base,param.model.buffer.4": False,
    }
    assert grid_groups([parent({}), *trials]) == {}  # a search: train.lr differs, yet no grid point
    assert grid_groups([parent({"train.seed": [0, 1]}), *trials]) == {}  # seeds only
    assert grid_groups(trials) == {}  # `train` runs
    # the grouped table's columns: no seed column (a group would show the mean of its seeds; a trial's name
    # carries its seed); ungrouped, the seed is a column after the axes
    from recursive_lightning.tracking.view import param_column, runs_view

    seed = param_column("train.seed")
    grouped = runs_view([parent({"variant": ["mesh", "base"], "train.seed": [0, 1]}), *trials])
    assert "groupBy" in grouped and seed not in grouped["selectedColumns"] + grouped["columnOrder"]
    assert param_column("axis.variant") in grouped["selectedColumns"]
    flat = runs_view([parent({}), *trials])
    assert "groupBy" not in flat and seed in flat["selectedColumns"]
    # the chart view: parallel coordinates only where MLflow can draw them (ungrouped runs have the params)
    for t in trials:
        t.data.metrics.update({"val/heldout/ppl": 100.0, "train/flops": 1e9})
    charts = {
        name: [c["type"] for c in view["compareRunCharts"]]
        for name, view in (
            ("grouped", runs_view([parent({"variant": ["mesh", "base"], "train.seed": [0, 1]}), *trials])),
            ("flat", runs_view([parent({}), *trials])),
        )
    }
    assert charts == {"grouped": ["SCATTER", "LINE"], "flat": ["SCATTER", "PARALLEL", "LINE"]}
