"""The sweep report as the papers' tables: one tiny finished sweep (two rows x two seeds, a named perplexity set
and a local multiple-choice task), its report checked against values computed here from the trials' files,
`describe` and the MLflow child runs."""

import json
import math
import shutil

import pytest
import yaml
from conftest import ROOT, run_sweep, sweep_file, tiny_config
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
        # wall-clock: result.json's seconds, mean ± std over the two seeds
        secs = [trials[(row, s)][1]["seconds"] for s in (0, 1)]
        m, sd = sum(secs) / 2, abs(secs[0] - secs[1]) / math.sqrt(2)
        assert cells["wall-clock (s)"] == f"{m:,.0f} ± {sd:,.0f}"
        # perplexities and accuracy: sweep_result.json's metrics
        for key, scale in (("val/heldout/ppl", 1), ("eval/ppl/wiki", 1), ("eval/avg/0shot", 100)):
            vals = [scale * trials[(row, s)][0]["metrics"][key] for s in (0, 1)]
            m, sd = sum(vals) / 2, abs(vals[0] - vals[1]) / math.sqrt(2)
            title = key if scale == 1 else "avg acc 0-shot (%)"
            assert cells[title] == f"{m:.2f} ± {sd:.2f}", key
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
    m, sd = sum(accs) / 2, abs(accs[0] - accs[1]) / math.sqrt(2)
    assert down["tiny_mc (acc)"] == f"{m:.2f} ± {sd:.2f}" and down["shots"] == "0-shot"


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
    assert cells[metric] == (f"**{text}**" if excludes_zero else text)
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
    from recursive_lightning.sweep.curves import against_tokens, metric_history

    for rec, res, _ in _trials(run_dir).values():
        hist = metric_history(f"sqlite:///{run_dir / 'mlflow.db'}", rec["mlflow_run_id"])
        entry = {"history": hist, "tokens_per_step": res["tokens"] / res["steps"], "steps": res["steps"]}
        val = against_tokens(entry, "val/heldout/ppl")
        tokens = res["tokens"] / res["steps"]
        assert sorted(val) == [2 * tokens, 4 * tokens, 5 * tokens] and res["steps"] == 5
        assert val[res["tokens"]] == pytest.approx(rec["metrics"]["val/heldout/ppl"])
        assert max(against_tokens(entry, "train/loss")) == res["tokens"]


def test_training_flops_of_a_sampled_loop_row_are_its_expected_flops(data_cache):
    """The cost section's training FLOPs: 3 × forward FLOPs/token × tokens at a fixed depth; with
    ``train.loops`` the expected training FLOPs per token over the distribution × tokens, as the run's describe."""
    from recursive_lightning.config import RunConfig
    from recursive_lightning.sweep.cost import training_flops
    from recursive_lightning.sweep.tables import _describe
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
    """One definition of the paired interval (tables.paired_difference) behind the sweep's `best:` line and the
    parent's description: excluded zero -> distinguishable, otherwise not, one seed -> no interval."""
    from recursive_lightning.sweep.ranking import rank, summary
    from recursive_lightning.sweep.tables import Row

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
