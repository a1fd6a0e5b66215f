"""The sweep report as the papers' tables: one tiny finished sweep (two rows x two seeds, a named perplexity set
and a local multiple-choice task), its report checked against values computed here from the trials' files,
`describe` and the MLflow child runs."""

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import ENV, ROOT, command_output, run_sweep, sweep_file, sweep_output, tiny_config
from mlflow.tracking import MlflowClient
from scipy import stats


@pytest.fixture(scope="module")
def tiny_report_sweep(tmp_path_factory, data_cache):
    tmp = tmp_path_factory.mktemp("report")
    data = ROOT / "tests" / "fixtures"
    (tmp / "tasks").mkdir()
    task = yaml.safe_load((data / "tiny_mc.yaml").read_text())
    task["dataset_kwargs"]["data_files"] = {
        k: str(data / v) for k, v in task["dataset_kwargs"]["data_files"].items()
    }
    task["dataset_kwargs"]["cache_dir"] = str(tmp / "hf")
    (tmp / "tasks" / "tiny_mc.yaml").write_text(yaml.safe_dump(task))
    (tmp / "wiki.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    rows = {"base": {"model.topology": "base"}, "mesh": {"model.topology": "mesh"}}
    spec = sweep_file(tmp, data_cache, rows, seeds=(0, 1), steps=5)
    raw = yaml.safe_load(spec.read_text())
    # validations after steps 2 and 4 inside fit, and train's final one after fit at step 5
    raw["overrides"]["train.val_every"] = 2
    raw["evaluate"] = {
        "ppl": {"wiki": str(tmp / "wiki.txt")},
        "tasks": ["tiny_mc"],
        "include_path": str(tmp / "tasks"),
        "limit": 4,
        "shots": [0],
    }
    raw["report"] = {"plot": "bar", "baseline": "base"}
    spec.write_text(yaml.safe_dump(raw))
    run_dir = tmp / "sweep"
    p = run_sweep([spec, "--run-dir", run_dir])
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out
    (tmp / "console.txt").write_text(out)  # what the sweep printed: its `best:` line
    return run_dir


def _trials(run_dir):
    """{(row, seed): (sweep_result.json, result.json, trial dir)} as the trial directories hold them."""
    out = {}
    for d in sorted((run_dir / "trials").iterdir()):
        rec = json.loads((d / "sweep_result.json").read_text())
        res = json.loads((d / "result.json").read_text())
        topology = rec["config"]["model.topology"]
        out[(topology, rec["config"]["train.seed"])] = (rec, res, d)
    return out


def _row_line(markdown: str, header: str, row: str) -> list[str]:
    """The cells of ``row`` in the table under the heading ``header``."""
    section = markdown.split(header, 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].removesuffix(" ★") == row:
            return cells
    raise AssertionError(f"no row {row} under {header}")


def _columns(markdown: str, header: str) -> list[str]:
    section = markdown.split(header, 1)[1]
    line = next(ln for ln in section.splitlines() if ln.startswith("|"))
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _pm(two: list[float], form: str) -> str:
    """mean ± std of two values as the report prints them: the mean alone where the std shows as zero."""
    m, sd = sum(two) / 2, abs(two[0] - two[1]) / math.sqrt(2)
    return form.format(m) if form.format(sd) == form.format(0.0) else f"{form.format(m)} ± {form.format(sd)}"


def test_results_table_holds_the_trials_values(tiny_report_sweep):
    from recursive_lightning.config import load_run_config
    from recursive_lightning.model.describe import describe
    from recursive_lightning.sweep.report import write_report

    run_dir = tiny_report_sweep
    out = write_report(run_dir)
    md = out["markdown"]
    assert (run_dir / "report.md").read_text() == md
    trials = _trials(run_dir)
    cols = _columns(md, "## Results")
    table = {r["row"]: r for r in out["table"]}
    assert set(table) == {"base", "mesh"} and all(r["seeds"] == 2 for r in table.values())
    for row in ("base", "mesh"):
        cells = dict(zip(cols, _row_line(md, "## Results", row)))
        rec, res, d = trials[(row, 0)]
        cfg = load_run_config(d / "config.yaml")
        counted = describe(cfg.model, seq_len=cfg.data.seq_len)
        # parameters and FLOPs: `describe`'s count of the trial's config
        assert cells["params (non-emb.)"] == f"{counted['params_non_embedding']:,}"
        assert table[row]["values"]["params_non_embedding"] == [counted["params_non_embedding"]] * 2
        assert table[row]["values"]["flops_per_token"][0] == pytest.approx(
            counted["flops_forward"] / cfg.data.seq_len
        )
        # wall-clock: result.json's seconds less its data preparation, which has its own column; mean ± std
        # over the two seeds, one format per quantity ("5", never "5 ± 0")
        res = [trials[(row, s)][1] for s in (0, 1)]
        assert all(0 < r["data_seconds"] < r["seconds"] for r in res)
        assert cells["wall-clock (s)"] == _pm([r["seconds"] - r["data_seconds"] for r in res], "{:,.0f}")
        assert cells["data prep (s)"] == _pm([r["data_seconds"] for r in res], "{:,.0f}")
        # perplexities and accuracy: sweep_result.json's metrics
        for key, scale in (("val/heldout/ppl", 1), ("eval/ppl/wiki", 1), ("eval/avg/0shot", 100)):
            vals = [scale * trials[(row, s)][0]["metrics"][key] for s in (0, 1)]
            title = key if scale == 1 else "avg acc 0-shot (%)"
            assert cells[title] == _pm(vals, "{:.2f}"), key
        # tokens/s: the child run's per-step history, harmonic mean
        c = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
        rates = []
        for s in (0, 1):
            hist = c.get_metric_history(trials[(row, s)][0]["mlflow_run_id"], "train/tokens_per_sec")
            v = [h.value for h in hist]
            assert v
            rates.append(len(v) / sum(1 / x for x in v))
        assert table[row]["values"]["tokens_per_sec"] == pytest.approx(rates)
    # downstream accuracy (MeSH Table 2): the headline metric of evaluation.downstream.headline (acc for a task
    # the papers do not name)
    down = dict(zip(_columns(md, "## Downstream accuracy"), _row_line(md, "## Downstream accuracy", "mesh")))
    accs = [100 * trials[("mesh", s)][0]["metrics"]["eval/tiny_mc/0shot/acc"] for s in (0, 1)]
    assert down["tiny_mc (acc)"] == _pm(accs, "{:.2f}") and down["shots"] == "0-shot"


def test_paired_difference_to_the_baseline_is_a_t_interval_over_seed_pairs(tiny_report_sweep):
    from recursive_lightning.sweep.report import write_report

    out = write_report(tiny_report_sweep, log=False)
    trials = _trials(tiny_report_sweep)
    metric = "val/heldout/ppl"
    d = [
        trials[("mesh", s)][0]["metrics"][metric] - trials[("base", s)][0]["metrics"][metric] for s in (0, 1)
    ]
    mean = sum(d) / 2
    half = stats.t.ppf(0.975, 1) * (abs(d[0] - d[1]) / math.sqrt(2)) / math.sqrt(2)
    got = out["paired"]["mesh"][metric]
    assert got["n"] == 2 and got["mean"] == pytest.approx(mean)
    assert (got["lo"], got["hi"]) == pytest.approx((mean - half, mean + half))
    assert "base" not in out["paired"]  # the baseline is not compared with itself
    cells = dict(
        zip(
            _columns(out["markdown"], "## Paired difference to `base`"),
            _row_line(out["markdown"], "## Paired difference to `base`", "mesh"),
        )
    )

    def signed(v):
        return ("+" if v >= 0 else "−") + f"{abs(v):.2f}"

    text = f"{signed(mean)} [{signed(mean - half)}, {signed(mean + half)}]"
    excludes_zero = mean - half > 0 or mean + half < 0
    assert cells[metric] == (f"**{text}** excludes 0" if excludes_zero else f"{text} includes 0")
    assert cells["pairs"] == "2"


def test_a_value_missing_on_disk_is_shown_missing(tiny_report_sweep, tmp_path):
    """A metric removed from the trials' sweep_result.json (the study still holds it) is missing in the report:
    the report reads the trials' files and never fills a value in."""
    from recursive_lightning.sweep.report import write_report

    copy = tmp_path / "sweep"
    shutil.copytree(tiny_report_sweep, copy)
    trials = _trials(copy)
    for key, seeds in ((("base",), (0, 1)), (("mesh",), (1,))):
        for s in seeds:
            rec, _, d = trials[(key[0], s)]
            del rec["metrics"]["eval/ppl/wiki"]
            (d / "sweep_result.json").write_text(json.dumps(rec))
    md = write_report(copy, log=False)["markdown"]
    cols = _columns(md, "## Results")
    base = dict(zip(cols, _row_line(md, "## Results", "base")))
    mesh = dict(zip(cols, _row_line(md, "## Results", "mesh")))
    assert base["eval/ppl/wiki"] == "—"
    wiki0 = trials[("mesh", 0)][0]["metrics"]["eval/ppl/wiki"]
    assert mesh["eval/ppl/wiki"] == f"{wiki0:.2f} (1/2 seeds)"
    pairs = dict(zip(_columns(md, "## Paired difference"), _row_line(md, "## Paired difference", "mesh")))
    assert pairs["eval/ppl/wiki"] == "—"


def test_a_bad_baseline_is_refused_in_one_sentence(tmp_path, data_cache):
    from recursive_lightning.errors import ConfigError
    from recursive_lightning.sweep.spec import load_sweep

    rows = {"base": {"model.topology": "base"}, "mesh": {"model.topology": "mesh"}}
    spec = sweep_file(tmp_path, data_cache, rows, seeds=(0, 1))
    raw = yaml.safe_load(spec.read_text())
    raw["report"] = {"baseline": "anchor"}
    spec.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as e:
        load_sweep(spec)
    msg = str(e.value)
    assert "report.baseline 'anchor' is not a row of this sweep; the rows are: base, mesh." in msg
    assert "\n" not in msg and msg.count(". ") == 0
    raw["report"] = {"baseline": "mesh"}
    spec.write_text(yaml.safe_dump(raw))
    assert load_sweep(spec).report["baseline"] == "mesh"


def test_learning_curves_and_html_report_are_logged_to_the_parent_run(tiny_report_sweep):
    run_dir = tiny_report_sweep
    png = run_dir / "report_learning_curves.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
    md = (run_dir / "report.md").read_text()
    assert "![learning curves](report_learning_curves.png)" in md
    html = (run_dir / "report.html").read_text()
    # the figures are inlined: MLflow's viewer shows HTML in a frame where a relative <img src> cannot load
    assert html.count('src="data:image/png;base64,') == md.count("![") >= 2
    assert "<table>" in html and "report_learning_curves.png" in html
    c = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    parent = json.loads((run_dir / "sweep.json").read_text())["parent_run_id"]
    logged = {a.path: a.file_size for a in c.list_artifacts(parent, "report")}
    for name in ("report.md", "report.html", "report_learning_curves.png", "report_variant.png"):
        assert f"report/{name}" in logged, logged
    assert logged["report/report_learning_curves.png"] == png.stat().st_size
    # the curves' x axis: the last validation of a trial is its final one, after all its training tokens
    from recursive_lightning.sweep.cost import training_flops, training_flops_per_token
    from recursive_lightning.sweep.curves import against_flops, against_tokens, metric_history
    from recursive_lightning.sweep.results import load_trial

    for rec, res, trial_dir in _trials(run_dir).values():
        hist = metric_history(f"sqlite:///{run_dir / 'mlflow.db'}", rec["mlflow_run_id"])
        entry = {"history": hist, "tokens_per_step": res["tokens"] / res["steps"], "steps": res["steps"]}
        val = against_tokens(entry, "val/heldout/ppl")
        tokens = res["tokens"] / res["steps"]
        assert sorted(val) == [2 * tokens, 4 * tokens, 5 * tokens] and res["steps"] == 5
        assert val[res["tokens"]] == pytest.approx(rec["metrics"]["val/heldout/ppl"])
        assert max(against_tokens(entry, "train/loss")) == res["tokens"]
        # the third panel: validation perplexity against training FLOPs, tokens × the cost section's FLOPs/token
        trial = load_trial(run_dir, {"key": trial_dir.name}, None, {})
        entry["flops_per_token"] = training_flops_per_token(trial)
        assert entry["flops_per_token"] == pytest.approx(training_flops(trial) / res["tokens"])
        by_flops = against_flops(entry, "val/heldout/ppl")
        assert by_flops[training_flops(trial)] == pytest.approx(rec["metrics"]["val/heldout/ppl"])
        assert sorted(by_flops) == pytest.approx([n * entry["flops_per_token"] for n in sorted(val)])
    assert "against training FLOPs" in md
    from PIL import Image

    with Image.open(png) as im:  # three panels of 6 inches at 130 dpi
        assert im.size[0] == round(18 * 130)


def test_training_flops_of_a_sampled_loop_row_are_its_expected_flops(data_cache):
    """The cost section's training FLOPs: 3 × forward FLOPs/token × tokens at a fixed depth; with
    ``train.loops`` the expected training FLOPs per token over the distribution × tokens, as the run's describe."""
    from recursive_lightning.config import RunConfig
    from recursive_lightning.sweep.cost import training_flops
    from recursive_lightning.sweep.results import _describe
    from recursive_lightning.training.loop_flops import expected_training_flops

    fixed = RunConfig.from_dict(tiny_config(data_cache, layout="1+1R2+1", topology="anchor"))
    raw = fixed.to_dict()
    raw["train"]["loops"] = {"distribution": "uniform", "low": 1, "high": 5, "backprop": 2}
    sampled = RunConfig.from_dict(raw)
    cache: dict = {}
    d_fixed, d_sampled = _describe(fixed, cache), _describe(sampled, cache)
    seq = fixed.data.seq_len
    assert training_flops({"describe": d_fixed, "tokens": 1000}) == 3 * d_fixed["flops_forward"] / seq * 1000
    want = expected_training_flops(sampled.model, seq, sampled.train.loops)["flops_train_per_token_expected"]
    assert training_flops({"describe": d_sampled, "tokens": 1000}) == pytest.approx(want * 1000, rel=1e-12)
    assert want * seq != 3 * d_fixed["flops_forward"]


def test_a_report_run_again_adds_no_metric_points(tiny_report_sweep, tmp_path, capsys):
    """`report` run twice more on a finished sweep: every trial's `report/rank` and `row/<metric>`, and the
    parent's `best/<metric>` and `trials/*`, keep the one point the sweep's own report logged (each re-run
    appended another step-0 point of the same value)."""
    from recursive_lightning.cli import main

    copy = tmp_path / "sweep"
    shutil.copytree(tiny_report_sweep, copy)
    for _ in range(2):
        assert main(["report", "--run-dir", str(copy)]) == 0, capsys.readouterr().err
    c = MlflowClient(f"sqlite:///{copy / 'mlflow.db'}")
    parent = json.loads((copy / "sweep.json").read_text())["parent_run_id"]
    counted = {}
    for rec, _, _ in _trials(copy).values():
        for key in ("report/rank", "row/val/heldout/ppl"):
            counted[(rec["mlflow_run_id"], key)] = len(c.get_metric_history(rec["mlflow_run_id"], key))
    for key in ("best/val/heldout/ppl", "trials/finished", "trials/failed"):
        counted[(parent, key)] = len(c.get_metric_history(parent, key))
    assert set(counted.values()) == {1}, counted


def test_the_best_line_says_whether_the_best_row_is_distinguishable_from_the_runner_up():
    """One definition of the paired interval (statistics.paired_difference) behind the sweep's `best:` line and the
    parent's description: excluded zero -> distinguishable, otherwise not, one seed -> no interval."""
    from recursive_lightning.sweep.ranking import rank, summary
    from recursive_lightning.sweep.rows import Row

    def row(name, values):
        trials = [
            {"key": f"{name}-{s}", "params": {"train.seed": s}, "metrics": {"ppl": v}} for s, v in values
        ]
        return Row(name, {}, trials)

    apart = rank(
        [row("mesh", [(0, 10.0), (1, 11.0), (2, 12.0)]), row("base", [(0, 20.0), (1, 21.5), (2, 22.0)])],
        "ppl",
    )
    assert "; distinguishable from the runner-up `base` (paired -10.17 [" in summary(apart, "ppl")
    close = rank([row("mesh", [(0, 10.0), (1, 30.0)]), row("base", [(0, 20.0), (1, 21.0)])], "ppl")
    line = summary(close, "ppl")
    assert "; not distinguishable from the runner-up `base`" in line and "over 2 seeds" in line
    d = [10.0 - 20.0, 30.0 - 21.0]  # mesh - base per seed: mean -0.5
    half = stats.t.ppf(0.975, 1) * math.sqrt(sum((x + 0.5) ** 2 for x in d)) / math.sqrt(2)
    assert f"(paired -0.5 [{-0.5 - half:+.4g}, {-0.5 + half:+.4g}]" in line
    one = rank([row("mesh", [(0, 10.0)]), row("base", [(0, 20.0)])], "ppl")
    assert summary(one, "ppl").endswith(
        "one seed in common with the runner-up `base` (-10): no interval exists"
    )
    assert "runner-up" not in summary(rank([row("mesh", [(0, 10.0)])], "ppl"), "ppl")


def _rows(*spec):
    from recursive_lightning.sweep.rows import Row

    return [
        Row(
            name,
            {},
            [{"key": f"{name}-{s}", "params": {"train.seed": s}, "metrics": {"ppl": v}} for s, v in vals],
        )
        for name, vals in spec
    ]


def test_the_winner_is_weighed_against_the_baseline_with_the_report_s_own_paired_difference():
    """The baseline sentence reads the report's paired difference (the dict it computed), not a second
    computation: a planted paired value shows up verbatim. A runner-up that is the baseline is named once;
    a best row that is the baseline says so; one seed: no interval exists."""
    from recursive_lightning.sweep.ranking import rank, significance, summary
    from recursive_lightning.sweep.statistics import paired_difference

    rows = _rows(
        ("mesh", [(0, 10.0), (1, 11.0), (2, 12.0)]),
        ("wide", [(0, 10.5), (1, 12.0), (2, 12.2)]),
        ("base", [(0, 20.0), (1, 21.5), (2, 22.0)]),
    )
    ranking = rank(rows, "ppl")
    paired = {"mesh": {"ppl": paired_difference(rows[0], rows[2], "ppl")}}
    said = significance(ranking, "ppl", "base", paired)
    d = paired["mesh"]["ppl"]
    assert said["baseline"] == (
        f"distinguishable from the baseline `base` (paired {d['mean']:+.4g} [{d['lo']:+.4g}, {d['hi']:+.4g}], "
        "95% t-interval over 3 seeds)"
    )
    assert said["runner_up"].startswith("not distinguishable from the runner-up `wide` (paired ")
    line = summary(ranking, "ppl", "base", paired)
    assert line.endswith(f"; {said['runner_up']}; {said['baseline']}")
    planted = {"mesh": {"ppl": {**d, "mean": 99.0, "lo": 98.0, "hi": 100.0}}}
    assert "(paired +99 [+98, +100]" in significance(ranking, "ppl", "base", planted)["baseline"]
    # the runner-up is the baseline: one sentence, from the report's paired difference
    two = rank(_rows(("mesh", [(0, 10.0), (1, 30.0)]), ("base", [(0, 20.0), (1, 21.0)])), "ppl")
    planted = {"mesh": {"ppl": {"n": 2, "mean": -7.0, "lo": -9.0, "hi": -5.0}}}
    said = significance(two, "ppl", "base", planted)
    assert said == {
        "runner_up": "distinguishable from the runner-up `base` (the baseline) (paired -7 [-9, -5], "
        "95% t-interval over 2 seeds)"
    }
    # the best row is the baseline
    said = significance(rank(_rows(("base", [(0, 1.0)]), ("mesh", [(0, 2.0)])), "ppl"), "ppl", "base", {})
    assert said["baseline"] == "it is the baseline row"
    assert said["runner_up"] == "one seed in common with the runner-up `mesh` (-1): no interval exists"
    one = rank(_rows(("mesh", [(0, 1.0)]), ("wide", [(0, 1.5)]), ("base", [(0, 2.0)])), "ppl")
    one_paired = {
        "mesh": {
            "ppl": paired_difference(_rows(("mesh", [(0, 1.0)]))[0], _rows(("base", [(0, 2.0)]))[0], "ppl")
        }
    }
    assert significance(one, "ppl", "base", one_paired)["baseline"] == (
        "one seed in common with the baseline `base` (-1): no interval exists"
    )


def test_console_parent_trial_page_and_report_weigh_the_winner_alike(tiny_report_sweep, tmp_path):
    """The sweep's printed `best:` line, the parent's description and `best.vs_*` tags, the best trial's
    description and the sentence under the report's results table carry the same significance sentences,
    whose numbers are the report's paired difference to the baseline (here the runner-up)."""
    from recursive_lightning.sweep.ranking import significance, summary_line
    from recursive_lightning.sweep.report import write_report

    run_dir = tiny_report_sweep
    out = write_report(run_dir, log=False, out=tmp_path)
    said = significance(out["ranking"], out["ranked"], out["baseline"], out["paired"])
    best = out["best_row"]
    assert out["baseline"] == "base" and said
    if best == "mesh":  # the runner-up is the baseline: named once, with the report's own interval
        d = out["paired"]["mesh"][out["ranked"]]
        assert set(said) == {"runner_up"} and "(the baseline)" in said["runner_up"]
        assert (
            f"(paired {d['mean']:+.4g} [{d['lo']:+.4g}, {d['hi']:+.4g}], 95% t-interval over 2 seeds)"
            in (said["runner_up"])
        )
    else:
        assert said["baseline"] == "it is the baseline row"
    console = (run_dir.parent / "console.txt").read_text()
    best_line = next(ln for ln in console.splitlines() if ln.startswith("best: "))
    assert best_line == f"best: {summary_line(out)}" and best_line.endswith("; ".join(said.values()))
    c = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    parent = c.get_run(json.loads((run_dir / "sweep.json").read_text())["parent_run_id"])
    assert {k: v for k, v in parent.data.tags.items() if k.startswith("best.vs_")} == {
        f"best.vs_{k}": v for k, v in said.items()
    }
    assert summary_line(out).split(" — ", 1)[1] in parent.data.tags["mlflow.note.content"]
    sentence = f"★ `{best}`: " + "; ".join(said.values()) + "."
    assert sentence in out["markdown"].split("## Results", 1)[1].split("\n## ", 1)[0]
    trial = c.get_run(parent.data.tags["best_trial_run_id"])
    assert trial.data.tags["mlflow.note.content"].endswith(
        f" Best row `{best}`: " + "; ".join(said.values()) + "."
    )
    others = [t for r in out["ranking"] for t in r.trials][1:]
    assert all(
        "Best row" not in c.get_run(t["mlflow_run_id"]).data.tags["mlflow.note.content"] for t in others
    )


def test_cost_and_compute_are_metrics_of_every_trial_and_columns_of_the_grouped_view(
    tiny_report_sweep, tmp_path
):
    """Every trial's run: `cost/*` (describe of its config), cumulative `train/tokens` and `train/flops` (3 x
    forward FLOPs/token x tokens) at every logged step, the last `train/flops` the report's training FLOPs and
    `report/train_tokens_per_sec` the report's tokens/s; the shared view groups the table by grid point, shows
    the cost beside the ranking metric and plots the ranking metric against `train/flops`."""
    from recursive_lightning.config import load_run_config
    from recursive_lightning.model.describe import describe
    from recursive_lightning.sweep.cost import training_flops
    from recursive_lightning.sweep.report import write_report
    from recursive_lightning.tracking.view import SHARED_VIEW_TAG, VIEW_KEY

    run_dir = tiny_report_sweep
    out = write_report(run_dir, log=False, out=tmp_path)
    c = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    for t in out["rows"]:
        run = c.get_run(t["mlflow_run_id"])
        cfg = load_run_config(t["trial_dir"] / "config.yaml")
        counted = describe(cfg.model, seq_len=cfg.data.seq_len)
        fwd = counted["flops_forward"] / cfg.data.seq_len
        assert run.data.metrics["cost/params_non_embedding"] == counted["params_non_embedding"]
        assert run.data.metrics["cost/fwd_flops_per_token"] == pytest.approx(fwd)
        tokens = {m.step: m.value for m in c.get_metric_history(run.info.run_id, "train/tokens")}
        flops = {m.step: m.value for m in c.get_metric_history(run.info.run_id, "train/flops")}
        assert sorted(flops) == sorted(tokens) and set(range(int(t["steps"]))) <= set(flops)
        assert all(flops[s] == pytest.approx(3 * fwd * tokens[s]) for s in flops)
        assert flops[max(flops)] == pytest.approx(training_flops(t)) and tokens[max(tokens)] == t["tokens"]
        # every point of the ranking metric's curve has its x (train's final validation included)
        val = {m.step for m in c.get_metric_history(run.info.run_id, "val/heldout/ppl")}
        assert val and val <= set(flops)
        assert run.data.metrics["report/train_tokens_per_sec"] == pytest.approx(t["tokens_per_sec"])
    view = json.loads(c.get_experiment_by_name("tiny-sweep").tags[SHARED_VIEW_TAG + VIEW_KEY])
    assert view["groupBy"] == {
        "aggregateFunction": "average",
        "groupByKeys": [{"mode": "param", "groupByData": "axis.variant"}],
    }
    # the seeds folded under their grid point (MLflow's group ids), the grouped values in the charts
    assert view["groupsExpanded"] == {"param.axis.variant.base": False, "param.axis.variant.mesh": False}
    assert view["useGroupedValuesInCharts"] is True
    cols = view["selectedColumns"]
    ranked = cols.index("metrics.`val/heldout/ppl`")
    assert cols[ranked + 1 : ranked + 4] == [
        "metrics.`cost/params_non_embedding`",
        "metrics.`cost/fwd_flops_per_token`",
        "metrics.`train/flops`",
    ]
    assert "metrics.`report/train_tokens_per_sec`" in cols and "metrics.`train/tokens_per_sec`" not in cols
    curve = next(ch for ch in view["compareRunCharts"] if ch["uuid"] == "rl-curve-val/heldout/ppl")
    assert (curve["xAxisKey"], curve["selectedXAxisMetricKey"], curve["useGlobalXaxisKey"]) == (
        "metric",
        "train/flops",
        False,
    )


def test_a_sub_percent_flop_range_is_not_stretched_across_the_figure():
    """Grid points whose training FLOPs differ by 0.3 %: the figure's FLOPs axis starts at zero with ticks in
    the quantity's format (no "1e10" offset label), and the table adds each row's excess over the least; a
    tenfold range keeps its own axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from recursive_lightning.sweep.cost import _readable_axis, section

    fig, ax = plt.subplots()
    ax.plot([9.31e9, 9.34e9], [1, 2])
    _readable_axis(ax, [9.31e9, 9.34e9], "flops")
    fig.canvas.draw()
    assert ax.get_xlim()[0] == 0 and ax.get_xlim()[1] >= 9.34e9
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text() not in ("", "0")]
    assert (
        labels and all(t.endswith("GFLOPs") for t in labels) and ax.xaxis.get_offset_text().get_text() == ""
    )
    wide, ax2 = plt.subplots()
    ax2.plot([1e9, 1e10], [1, 2])
    _readable_axis(ax2, [1e9, 1e10], "flops")
    assert ax2.get_xlim()[0] > 0
    plt.close("all")
    pts = [
        {"row": "base", "n": 2, "flops": (9.31e9, 0.0), "seconds": (1.3, 0.1), "metric": (3349.9, 35.5)},
        {"row": "mesh", "n": 2, "flops": (9.34e9, 0.0), "seconds": (1.4, 0.1), "metric": (3425.0, 133.0)},
    ]
    md = "\n".join(section(Path("cost.png"), pts, "val/heldout/ppl"))
    assert "| row | seeds | training FLOPs | vs the least | wall-clock (s) | val/heldout/ppl |" in md
    assert "| mesh | 2 | 9.34 GFLOPs | +0.32 % | 1 | 3425.00 ± 133.00 |" in md
    assert "training FLOPs differ by under 1%: the figure draws that axis from zero" in md


def test_a_damaged_record_or_a_metric_that_is_not_a_number_is_said_so(tiny_report_sweep, tmp_path):
    """`report` as a user types it over trials whose files were damaged: a metric stored as a string is shown
    missing (no traceback), and a `sweep_result.json` cut short is named damaged, its metrics the study's copy
    (not "trained on another machine?")."""

    copy = tmp_path / "sweep"
    shutil.copytree(tiny_report_sweep, copy)
    trials = _trials(copy)
    rec, _, d = trials[("base", 0)]
    rec["metrics"]["val/heldout/ppl"] = "3504.7"
    (d / "sweep_result.json").write_text(json.dumps(rec))
    _, _, cut = trials[("mesh", 1)]
    (cut / "sweep_result.json").write_text('{"metrics": {"val/heldout/ppl": 3')
    code, out = command_output("report", "--run-dir", copy, "--no-mlflow", timeout=600)
    assert code == 0 and "Traceback" not in out, out
    md = (copy / "report.md").read_text()
    assert (
        "`sweep_result.json` is damaged (not a JSON object): their metrics are the Optuna study's copy" in md
    )
    assert "another machine" not in md
    assert _row_line(md, "## By variant", "base")[2] == "1"  # the string left out: one seed's value
    assert _row_line(md, "## By variant", "mesh")[2] == "2"  # the damaged record: the study's copy


def test_a_sweep_with_a_resumed_trial_states_one_set_of_numbers(tmp_path, data_cache):
    """2 rows x 2 seeds with a baseline, the second trial killed after its first checkpoint and resumed by the
    sweep run again: the printed `best:` line, the runs table's values (each trial's `report/rank`,
    `row/<metric>`, `report/train_tokens_per_sec`, `train/flops`), the parent's description, tags and metric,
    the trial pages and the report state the same numbers; the resumed trial logs each step's `train/flops`
    once and its wall-clock less its data preparation is summed over its two segments."""
    from recursive_lightning.sweep.cost import training_flops
    from recursive_lightning.sweep.ranking import significance, summary_line
    from recursive_lightning.sweep.report import write_report
    from recursive_lightning.sweep.rows import trial_value

    rows = {"base": {"model.topology": "base"}, "mesh": {"model.topology": "mesh"}}
    spec = sweep_file(tmp_path, data_cache, rows, seeds=(0, 1), steps=6)
    raw = yaml.safe_load(spec.read_text())
    raw["report"] = {"baseline": "base"}
    spec.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "sweep"
    code, said_first = sweep_output(
        spec, "--run-dir", run_dir, env={**ENV, "RECURSIVE_LIGHTNING_FAULT": "mid_training:2"}
    )
    assert code == -9, said_first
    code, console = sweep_output(spec, "--run-dir", run_dir)
    assert code == 0 and "(resuming)" in console, console
    out = write_report(run_dir, log=False, out=tmp_path / "again")
    metric = out["ranked"]
    resumed = [
        t for t in out["rows"] if json.loads((t["trial_dir"] / "result.json").read_text())["segments"] == 2
    ]
    assert len(resumed) == 1
    said = significance(out["ranking"], metric, out["baseline"], out["paired"])
    # the console and the parent run
    best_line = next(ln for ln in console.splitlines() if ln.startswith("best: "))
    assert best_line == f"best: {summary_line(out)}"
    c = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    parent = c.get_run(json.loads((run_dir / "sweep.json").read_text())["parent_run_id"])
    assert summary_line(out).split(" — ", 1)[1] in parent.data.tags["mlflow.note.content"]
    assert {k: v for k, v in parent.data.tags.items() if k.startswith("best.vs_")} == {
        f"best.vs_{k}": v for k, v in said.items()
    }
    assert parent.data.metrics[f"best/{metric}"] == pytest.approx(out["ranking"][0].mean)
    # the runs table's values and the trial pages, trial by trial in the report's order
    place = 0
    for r in out["ranking"]:
        for t in r.trials:
            place += 1
            run = c.get_run(t["mlflow_run_id"])
            m = run.data.metrics
            assert (m["report/rank"], m[f"row/{metric}"]) == (place, pytest.approx(r.mean))
            assert m["report/train_tokens_per_sec"] == pytest.approx(t["tokens_per_sec"])
            assert m["train/flops"] == pytest.approx(training_flops(t))
            steps = [p.step for p in c.get_metric_history(t["mlflow_run_id"], "train/flops")]
            assert sorted(steps) == list(range(int(t["steps"]))), steps  # each step once, the resumed one too
            note = run.data.tags["mlflow.note.content"]
            assert f"rank **{place}**" in note and f"`{metric}` {trial_value(t, metric):.4g} " in note
            assert f"over its seeds {r.mean:.4g})" in note
            assert ("Best row" in note) == (place == 1)
    # the report: the resumed trial's wall-clock is its two segments' seconds less their data preparation
    (t,) = resumed
    result = json.loads((t["trial_dir"] / "result.json").read_text())
    assert 0 < result["data_seconds"] < result["seconds"]
    assert trial_value(t, "seconds") == pytest.approx(result["seconds"] - result["data_seconds"])
    row = next(r for r in out["ranking"] if t in r.trials)
    cells = dict(
        zip(_columns(out["markdown"], "## Results"), _row_line(out["markdown"], "## Results", row.name))
    )
    assert cells["wall-clock (s)"] == _pm([trial_value(x, "seconds") for x in row.trials], "{:,.0f}")
    assert cells[metric] == _pm([trial_value(x, metric) for x in row.trials], "{:.2f}")
    assert f"★ `{out['best_row']}`: " + "; ".join(said.values()) + "." in out["markdown"]
