"""The ablation runner end to end: kill and resume, two workers, a real MLflow server reading the results."""

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest
import yaml
from conftest import ENV, ROOT, run_sweep, sweep_file, sweep_runs

from recursive_lightning.errors import ConfigError, UserError


def study_trials(run_dir: Path):
    return optuna.load_study(
        study_name="tiny-sweep", storage=f"sqlite:///{run_dir / 'optuna.db'}"
    ).get_trials()


def child_runs(run_dir: Path):
    return sweep_runs(f"sqlite:///{run_dir / 'mlflow.db'}", "tiny-sweep")


def test_sweep_killed_mid_trial_resumes(tmp_path, data_cache):
    """SIGKILL in the middle of the second trial (after its first checkpoint; a named fault point, so the
    test does not race the trainer), then the same command: the finished trial is kept, the other resumes."""
    rows = {"anchor": {"model.topology": "anchor"}, "mesh": {"model.topology": "mesh"}}
    spec = sweep_file(tmp_path, data_cache, rows)
    run_dir = tmp_path / "sweep"
    p = run_sweep([spec, "--run-dir", run_dir], env={**ENV, "RECURSIVE_LIGHTNING_FAULT": "mid_training:2"})
    out, _ = p.communicate(timeout=600)
    assert p.returncode == -signal.SIGKILL, out
    done = list(run_dir.glob("trials/*/result.json"))
    assert len(done) == 1
    (second,) = [d for d in run_dir.glob("trials/*") if not (d / "result.json").exists()]
    assert (second / "checkpoints" / "step=000004.ckpt").exists()
    first = done[0].parent
    first_mtime = (first / "result.json").stat().st_mtime
    second_run_id = (second / "mlflow_run_id").read_text()

    p = run_sweep([spec, "--run-dir", run_dir])
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    assert "(resuming)" in out and out.count("trial ") >= 1
    assert (first / "result.json").stat().st_mtime == first_mtime  # the finished trial was not re-trained
    assert (second / "mlflow_run_id").read_text() == second_run_id  # resumed into the same child run

    trials = study_trials(run_dir)
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert sorted(t.user_attrs["point"]["variant"] for t in complete) == ["anchor", "mesh"]
    assert len(trials) == 2  # each grid point is one trial: the interrupted one was resumed, not copied
    c, parent, children = child_runs(run_dir)
    assert len(parent) == 1 and len(children) == 2
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent[0].info.run_id}
    assert parent[0].info.status == "FINISHED" and {r.info.status for r in children} == {"FINISHED"}
    for r in children:
        steps = [m.step for m in c.get_metric_history(r.info.run_id, "train/loss")]
        assert sorted(set(steps)) == list(range(12))
        assert r.data.tags["checkpoint"].endswith("last.ckpt") and "optuna.trial_number" in r.data.tags
    report = (run_dir / "report.md").read_text()
    assert "★" in report and (run_dir / "report_variant.png").stat().st_size > 1000


@pytest.fixture(scope="module")
def two_worker_sweep(tmp_path_factory, data_cache):
    tmp = tmp_path_factory.mktemp("two")
    rows = {"base": {"model.topology": "base"}, "mesh": {"model.topology": "mesh"}}
    spec = sweep_file(tmp, data_cache, rows, seeds=(0, 1), steps=6)
    run_dir = tmp / "sweep"
    p = run_sweep([spec, "--run-dir", run_dir, "--workers", 2])
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out
    return run_dir


def test_two_workers_split_the_grid(two_worker_sweep):
    trials = study_trials(two_worker_sweep)
    keys = [t.user_attrs["point_key"] for t in trials]
    assert len(trials) == 4 and len(set(keys)) == 4
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert len({t.system_attrs["pid"] for t in trials}) == 2  # both workers trained
    from recursive_lightning.tracking.runs import default_tracking_uri

    for key in keys:  # eval / train --resume of a trial directory find its run in the sweep's store
        assert default_tracking_uri(two_worker_sweep / "trials" / key) == (
            f"sqlite:///{two_worker_sweep.resolve() / 'mlflow.db'}"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, data: dict | None = None):
    req = urllib.request.Request(
        url,
        data=None if data is None else json.dumps(data).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        body = r.read()
    return json.loads(body) if r.headers.get_content_type() == "application/json" else body


def test_ui_serves_a_copied_sweep_directory(two_worker_sweep, tmp_path):
    """`ui` on a copy of the sweep directory, the original moved away: the UI lists the parent and its children
    from the copy and reads a child run's artifacts from the copy (MLflow stores absolute artifact paths)."""
    copy = tmp_path / "laptop" / "sweep"
    shutil.copytree(two_worker_sweep, copy)
    away = two_worker_sweep.with_name("moved-away")
    two_worker_sweep.rename(away)
    proc = subprocess.Popen(
        [sys.executable, "-m", "recursive_lightning", "ui", str(copy), "--port", str(_free_port())],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("MLflow UI at http://127.0.0.1:"), line
        url = line.split()[3]
        base = f"{url}/api/2.0/mlflow"
        exp = _get(f"{base}/experiments/get-by-name?experiment_name=tiny-sweep")["experiment"]
        exp_tags = {t["key"]: t["value"] for t in exp.get("tags", [])}
        assert exp_tags["mlflow.experimentKind"] == "custom_model_development"  # opens on the runs, not GenAI
        runs = _get(f"{base}/runs/search", {"experiment_ids": [exp["experiment_id"]]})["runs"]
        tags = [{t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs]
        parents = [r for r, t in zip(runs, tags) if t.get("kind") == "sweep"]
        children = [(r, t) for r, t in zip(runs, tags) if "mlflow.parentRunId" in t]
        assert len(parents) == 1 and len(children) == 4
        assert parents[0]["info"]["status"] == "FINISHED"  # the sweep ended, and says so in the UI
        assert all(t["mlflow.parentRunId"] == parents[0]["info"]["run_id"] for _, t in children)
        points = set()
        for r, _ in children:
            metrics = {m["key"]: m["value"] for m in r["data"]["metrics"]}
            assert metrics["val/heldout/ppl"] > 1 and "train/loss" in metrics
            params = {p["key"]: p["value"] for p in r["data"]["params"]}
            assert params["model.preset"] == "cpu-tiny" and "describe.params_total" in params
            points.add((params["axis.variant"], params["train.seed"]))  # every axis of the sweep is a param
            assert params["axis.variant"] == params["model.topology"]
            assert "axis.train.seed" not in params  # a config field's axis is that field's param, once
        assert points == {("base", "0"), ("base", "1"), ("mesh", "0"), ("mesh", "1")}
        # the parent names its best trial by the metric the report ranks by (perplexity)
        ppl = {
            t["point_key"]: {m["key"]: m["value"] for m in r["data"]["metrics"]}["val/heldout/ppl"]
            for r, t in children
        }
        parent_tags = {t["key"]: t["value"] for t in parents[0]["data"]["tags"]}
        parent_metrics = {m["key"]: m["value"] for m in parents[0]["data"]["metrics"]}
        # one definition of best: the row with the lowest mean over its seeds, its lowest seed
        means = {
            v: (ppl[a] + ppl[b]) / 2
            for v in ("base", "mesh")
            for a, b in [sorted(k for k in ppl if k.startswith(v))]
        }
        best_row = min(means, key=means.get)
        assert parent_tags["best_row"] == best_row
        assert parent_tags["best_trial"] == min((k for k in ppl if k.startswith(best_row)), key=ppl.get)
        assert parent_metrics["best/val/heldout/ppl"] == pytest.approx(means[best_row])
        child = children[0][0]["info"]
        assert str(copy) in child["artifact_uri"]
        listed = _get(f"{base}/artifacts/list?run_id={child['run_id']}")
        assert "config.yaml" in {f["path"] for f in listed["files"]}
        text = _get(f"{url}/get-artifact?path=config.yaml&run_uuid={child['run_id']}").decode()
        assert "cpu-tiny" in text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        away.rename(two_worker_sweep)


def test_sweep_evaluates_finished_trials(tmp_path, data_cache):
    """evaluate: perplexity on a named text set and a local lm-eval task for every finished trial, again at
    each of evaluate.loops in the looped trial's MLflow run (the trained K = 2 as the ordinary numbers) and with
    adaptive exit at each of evaluate.exit_kl (at most max(loops) steps); a vanilla trial, which has no loop to
    run, is evaluated as trained, without exit. The looped row trains with a sampled loop count per step
    (train.loops), logged as train/loops."""
    data = ROOT / "tests" / "fixtures"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    cfg = yaml.safe_load((data / "tiny_mc.yaml").read_text())
    cfg["dataset_kwargs"]["data_files"] = {
        k: str(data / v) for k, v in cfg["dataset_kwargs"]["data_files"].items()
    }
    cfg["dataset_kwargs"]["cache_dir"] = str(tmp_path / "hf")
    (tasks / "tiny_mc.yaml").write_text(yaml.safe_dump(cfg))
    text = tmp_path / "wiki.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    sampled = {"distribution": "uniform", "low": 1, "high": 3, "backprop": 2}
    rows = {
        "mesh": {"model.topology": "mesh", "train.loops": sampled},
        "vanilla": {"model.layout": "3", "model.topology": "base"},
    }
    spec = sweep_file(tmp_path, data_cache, rows, steps=4)
    raw = yaml.safe_load(spec.read_text())
    raw["evaluate"] = {
        "ppl": {"wiki": str(text)},
        "tasks": ["tiny_mc"],
        "include_path": str(tasks),
        "limit": 4,
        "shots": [0],
        "loops": [1, 2],
        "h_cycles": [1],  # no Mela trial here: unused
        "exit_kl": [0, 5.0e-4],
        "exit_max_tokens": 40,
    }
    spec.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "sweep"
    p = run_sweep([spec, "--run-dir", run_dir])
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    trials = study_trials(run_dir)
    assert len(trials) == 2
    (m,) = [t.user_attrs["metrics"] for t in trials if "eval/loops_1/ppl/wiki" in t.user_attrs["metrics"]]
    assert m["eval/ppl/wiki"] > 1 and 0 <= m["eval/tiny_mc/0shot/acc"] <= 1
    _, _, children = child_runs(run_dir)
    runs = {r.data.params["axis.variant"]: r for r in children}
    logged = runs["mesh"].data.metrics
    assert logged["eval/loops_2/ppl/wiki"] == logged["eval/ppl/wiki"] != logged["eval/loops_1/ppl/wiki"]
    assert logged["eval/loops_2/tiny_mc/0shot/acc"] == logged["eval/tiny_mc/0shot/acc"]
    assert logged["eval/exit_kl_0/mean_loops"] == 2 == logged["eval/exit_reference/loops"]
    assert logged["eval/exit_kl_0/ppl/wiki"] == pytest.approx(
        logged["eval/exit_reference/ppl/wiki"], rel=1e-5
    )
    assert "eval/exit_kl_5e-04/ppl/wiki" in logged and "eval/exit_kl_5e-04/mean_loops" in logged
    assert not any(k.startswith(("eval/loops_", "eval/exit_")) for k in runs["vanilla"].data.metrics)
    from mlflow.tracking import MlflowClient  # heavy

    tracking = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    history = tracking.get_metric_history(runs["mesh"].info.run_id, "train/loops")
    assert len(history) == 4 and {m.value for m in history} <= {1, 2, 3}
    assert "train/loops" not in runs["vanilla"].data.metrics
    assert "eval/ppl/wiki" in runs["vanilla"].data.metrics
    report = (run_dir / "report.md").read_text()
    assert "eval/ppl/wiki" in report and "eval/tiny_mc/0shot/acc" in report


def test_tpe_search_with_pruning_reports(tmp_path, data_cache):
    """A search space instead of a grid: Optuna's TPE proposes the trials; intermediate losses are reported."""
    spec = sweep_file(tmp_path, data_cache, {"mesh": {"model.topology": "mesh"}}, steps=6)
    raw = yaml.safe_load(spec.read_text())
    del raw["axes"], raw["seeds"]
    raw["search"] = {
        "n_trials": 2,
        "space": {
            "train.lr": {"low": 1e-4, "high": 1e-2, "log": True},
            "model.topology": {"choices": ["anchor", "mesh"]},
        },
    }
    raw["pruning"] = {"enabled": True, "warmup_steps": 0}
    spec.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "sweep"
    p = run_sweep([spec, "--run-dir", run_dir])
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    trials = study_trials(run_dir)
    assert len(trials) == 2 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert all(1e-4 <= t.params["train.lr"] <= 1e-2 for t in trials)
    assert all(t.intermediate_values for t in trials)  # validation losses reported by global step


def test_a_search_value_valid_beside_another_parameters_choice_is_kept(tmp_path, data_cache):
    """A search value is refused only when no trial drawing it can train: the vanilla layout ``4`` fails beside the
    base's MeSH topology but trains beside the space's ``base`` topology, so the sweep is kept; without that choice
    it is refused in one sentence naming the value."""
    from recursive_lightning.errors import ConfigError
    from recursive_lightning.sweep.spec import load_sweep

    spec = sweep_file(tmp_path, data_cache, {"mesh": {"model.topology": "mesh"}})
    raw = yaml.safe_load(spec.read_text())
    del raw["axes"], raw["seeds"]
    raw["overrides"]["model.topology"] = "mesh"
    layouts = {"choices": ["1+2R2+1", "4"]}
    raw["search"] = {
        "n_trials": 2,
        "space": {"model.layout": layouts, "model.topology": {"choices": ["mesh", "base"]}},
    }
    spec.write_text(yaml.safe_dump(raw))
    assert load_sweep(spec).search_values()[1] == {"model.layout": "4"}
    raw["search"]["space"] = {"model.layout": layouts}
    spec.write_text(yaml.safe_dump(raw))
    with pytest.raises(
        ConfigError, match="at model.layout=4: model.topology 'mesh' needs a recurrent layout"
    ):
        load_sweep(spec)


@pytest.mark.slow
def test_a_trial_can_be_a_two_process_fsdp_job(tmp_path, data_cache):
    """A grid point with train.strategy fsdp on 2 devices runs as its own `train` command (Lightning launches
    the ranks), lands in the study with its metric and in MLflow as a child of the sweep's parent run."""
    rows = {"fsdp": {"train.strategy": "fsdp", "train.devices": 2, "train.accelerator": "cpu"}}
    spec = sweep_file(tmp_path, data_cache, rows, steps=6)
    run_dir = tmp_path / "run"
    p = run_sweep([spec, "--run-dir", run_dir])
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out
    (trial,) = study_trials(run_dir)
    assert trial.state == optuna.trial.TrialState.COMPLETE and trial.value > 1
    assert trial.user_attrs["steps"] == 6
    assert (Path(trial.user_attrs["checkpoint"])).is_dir()  # a sharded (distributed) checkpoint
    _, (parent,), (child,) = child_runs(run_dir)
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.info.status == "FINISHED"
    assert child.data.metrics["final/val/heldout/loss"] == pytest.approx(trial.value)  # the study's metric
    assert trial.user_attrs["metrics"]["val/heldout/ppl"] == pytest.approx(math.exp(trial.value), rel=1e-4)


def test_a_failing_grid_point_is_retried_then_reported(tmp_path, data_cache):
    """A point that fails at training time is tried 1 + max_retries times, the others finish, the report lists
    the failure with its error, the sweep's MLflow parent run ends FAILED and the command exits 1."""
    rows = {"ok": {"model.topology": "base"}, "bad": {"model.vocab_size": 100}}  # smaller than the tokenizer
    spec = sweep_file(tmp_path, data_cache, rows, steps=4)
    raw = yaml.safe_load(spec.read_text())
    raw["max_retries"] = 1
    spec.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "run"
    p = run_sweep([spec, "--run-dir", run_dir])
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 1, out  # the parent run ended FAILED: not the exit status of a finished sweep
    assert "FAILED" in out and "sweep finished" not in out
    trials = study_trials(run_dir)
    bad = [t for t in trials if t.user_attrs["point"]["variant"] == "bad"]
    assert [t.state for t in bad] == [optuna.trial.TrialState.FAIL] * 2
    assert all("model.vocab_size" in t.user_attrs["error"] for t in bad)
    assert [t.state for t in trials if t.user_attrs["point"]["variant"] == "ok"] == [
        optuna.trial.TrialState.COMPLETE
    ]
    report = (run_dir / "report.md").read_text()
    assert "## Failed trials" in report and "model.vocab_size" in report
    _, (parent,), _ = child_runs(run_dir)
    assert parent.info.status == "FAILED"


_CLAIMER = """
import sys, time
from recursive_lightning.sweep.study import open_storage
from recursive_lightning.sweep.claims import claim
import optuna
url, start = sys.argv[1], float(sys.argv[2])
storage = open_storage(url, 0)
study = optuna.load_study(study_name="claims", storage=storage)
while time.time() < start:
    time.sleep(0.001)
got = []
while (trial_id := claim(study, storage, url)) is not None:
    got.append(trial_id)
print(" ".join(map(str, got)))
"""


def test_concurrent_workers_never_claim_the_same_trial(tmp_path):
    """SQLite ignores Optuna's SELECT ... FOR UPDATE, so its WAITING -> RUNNING check-and-set alone lets two
    local workers claim one grid point and train it twice into one directory (seen in CI: a checkpoint's
    temporary file renamed away by the other process). Four processes racing for 40 trials: each trial is
    claimed exactly once."""
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="claims", storage=url)
    for i in range(40):
        study.enqueue_trial({"x": i})
    start = time.time() + 8  # every process imports first, then all claim at once
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CLAIMER, url, str(start)], env=ENV, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    claimed = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0
        claimed += [int(x) for x in out.split()]
    assert len(claimed) == 40 and len(set(claimed)) == 40, sorted(claimed)


def test_an_edited_sweep_file_is_refused_in_the_same_run_dir(tmp_path, data_cache):
    """Re-running an edited sweep file into the same --run-dir would report the old trials as the new file's
    results: it is refused in one sentence naming the changed field, and the directory's sweep.yaml is kept.
    Adding grid points (another seed) to the same file is fine."""
    from recursive_lightning.sweep import prepare
    from recursive_lightning.sweep.spec import load_sweep, point_key
    from recursive_lightning.sweep.study import default_storage

    spec = sweep_file(tmp_path, data_cache, {"mesh": {"model.topology": "mesh"}}, steps=4)
    run_dir = tmp_path / "run"
    p = run_sweep([spec, "--run-dir", run_dir])
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    kept = (run_dir / "sweep.yaml").read_text()
    report = (run_dir / "report.md").read_text()

    raw = yaml.safe_load(spec.read_text())
    raw["overrides"]["train.lr"] = 1e-4
    spec.write_text(yaml.safe_dump(raw))
    p = run_sweep([spec, "--run-dir", run_dir])
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 2, out
    (line,) = [x for x in out.splitlines() if x.startswith("error:")]
    assert "train.lr changed" in line and "new --run-dir" in line and "Traceback" not in out
    assert (run_dir / "sweep.yaml").read_text() == kept and (run_dir / "report.md").read_text() == report

    del raw["overrides"]["train.lr"]
    raw["pruning"] = {"enabled": True, "warmup_steps": 2}  # pruning decides which trials end early
    spec.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="pruning changed"):
        prepare.prepare_study(
            load_sweep(spec), run_dir, default_storage(run_dir), f"sqlite:///{run_dir / 'mlflow.db'}"
        )
    del raw["pruning"]  # back to the file that was run, plus one more seed
    raw["seeds"] = [0, 1]
    spec.write_text(yaml.safe_dump(raw))
    storage, tracking = default_storage(run_dir), f"sqlite:///{run_dir / 'mlflow.db'}"
    study, _ = prepare.prepare_study(load_sweep(spec), run_dir, storage, tracking)
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [t.user_attrs["point_key"] for t in waiting] == [point_key({"variant": "mesh", "train.seed": 1})]


_PREPARER = """
import sys, time
from pathlib import Path
from recursive_lightning.sweep.prepare import prepare_study
from recursive_lightning.sweep.study import default_storage
from recursive_lightning.sweep.spec import load_sweep
spec, run_dir, start = load_sweep(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
run_dir.mkdir(parents=True, exist_ok=True)  # as the command does
while time.time() < start:
    time.sleep(0.001)
study, parent = prepare_study(spec, run_dir, default_storage(run_dir), f"sqlite:///{run_dir / 'mlflow.db'}")
print(parent)
"""


def test_a_partial_sweep_says_so_and_an_attached_worker_finishes_it_where_it_lies_now(tmp_path, data_cache):
    """`--max-trials 1` of a two-point grid: exit 3 and a report that says it is partial. The directory is then
    moved with its study; a worker attached through the moved study's SQLite file trains the last point in the
    directory where it lies now (the study recorded the old path) and the report is complete."""
    rows = {"base": {"model.topology": "base"}, "mesh": {"model.topology": "mesh"}}
    spec = sweep_file(tmp_path, data_cache, rows, steps=4)
    run_dir = tmp_path / "a" / "run"
    p = run_sweep([spec, "--run-dir", run_dir, "--max-trials", 1])
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 3, out
    # one sentence naming the unfinished point and the command that finishes it
    from recursive_lightning.sweep.spec import point_key

    left = point_key({"variant": "mesh", "train.seed": 0})
    assert f"unfinished grid point(s) {left}: run `sweep {spec} --run-dir {run_dir.resolve()}`" in out, out
    assert "The sweep is not finished" in (run_dir / "report.md").read_text()
    moved = tmp_path / "b" / "run"
    moved.parent.mkdir()
    run_dir.rename(moved)

    p = run_sweep([spec, "--attach", "--storage", f"sqlite:///{moved / 'optuna.db'}"])
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    assert not run_dir.exists()  # nothing recreated at the old path
    assert sorted(t.state.name for t in study_trials(moved)) == ["COMPLETE", "COMPLETE"]
    assert len(list((moved / "trials").glob("*/sweep_result.json"))) == 2
    report = (moved / "report.md").read_text()
    assert "2 finished trials" in report and "not finished" not in report
    _, (parent,), children = child_runs(moved)
    assert parent.info.status == "FINISHED" and len(children) == 2


def test_sweep_and_report_refuse_directories_they_cannot_write(
    two_worker_sweep, tmp_path, monkeypatch, capsys
):
    """A --run-dir that is a file or read-only (shared storage, a copy), and `report` on a read-only sweep
    directory: one sentence before any work; `report --out DIR --no-mlflow` writes elsewhere."""
    from conftest import read_only

    from recursive_lightning.cli import main
    from recursive_lightning.commands import report

    spec = two_worker_sweep.parent / "sweep.yaml"
    (tmp_path / "file").write_text("x")
    assert main(["sweep", str(spec), "--run-dir", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert "is a file" in err and "--run-dir" in err and "Traceback" not in err
    copy = tmp_path / "copy"
    shutil.copytree(two_worker_sweep, copy)
    before = sorted(p.name for p in copy.iterdir())
    read_only(monkeypatch, copy)
    assert main(["sweep", str(spec), "--run-dir", str(copy)]) == 2
    assert "read-only" in capsys.readouterr().err
    with pytest.raises(UserError, match="read-only.*--out"):
        report.main(["--run-dir", str(copy)])
    with pytest.raises(UserError, match="MLflow store.*--no-mlflow"):
        report.main(["--run-dir", str(copy), "--out", str(tmp_path / "out")])
    assert report.main(["--run-dir", str(copy), "--out", str(tmp_path / "out"), "--no-mlflow"]) == 0
    assert "4 finished trials" in (tmp_path / "out" / "report.md").read_text()
    assert (tmp_path / "out" / "report_variant.png").is_file()
    assert sorted(p.name for p in copy.iterdir()) == before


def test_sweeps_started_together_on_one_fresh_directory_share_it(tmp_path, data_cache):
    """Two `sweep` commands started together on a fresh directory used to race creating the Optuna and MLflow
    stores (a raw SQLAlchemy traceback); now they take turns and join one sweep with one parent run."""
    spec = sweep_file(tmp_path, data_cache, {"mesh": {"model.topology": "mesh"}}, steps=4)
    run_dir = tmp_path / "run"
    start = time.time() + 8  # every process imports first, then all start at once
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PREPARER, str(spec), str(run_dir), str(start)],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len({o.strip().splitlines()[-1] for o in outs}) == 1  # one MLflow parent run
    assert len(study_trials(run_dir)) == 1  # the grid point enqueued once


def _trial_pids(run_dir: Path, n: int, ckpt: str) -> list[int] | None:
    """The worker pids of ``n`` running trials once each has written ``ckpt``, else None."""
    if not (run_dir / "sweep.json").exists():  # opening the study before the sweep made it would race it
        return None
    running = [t for t in study_trials(run_dir) if t.state == optuna.trial.TrialState.RUNNING]
    dirs = [run_dir / "trials" / t.user_attrs.get("point_key", "?") for t in running]
    if len(running) < n or not all((d / "checkpoints" / ckpt).exists() for d in dirs):
        return None
    return [int(t.system_attrs["pid"]) for t in running]


def _wait_for(fn, timeout=300, proc=None):
    """Poll ``fn`` until it returns something true; fail at once if ``proc`` ended meanwhile."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = fn()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the sweep ended ({proc.returncode}): {proc.stdout.read()}")
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_workers_die_with_the_sweep_command(tmp_path, data_cache):
    """SIGKILL of a sweep command with two workers: the workers (held at a named point in the middle of their
    trials) die with it instead of training unattended, and the re-run finishes every grid point once."""
    from recursive_lightning.sweep.claims import pid_alive

    rows = {"base": {"model.topology": "base"}, "mesh": {"model.topology": "mesh"}}
    spec = sweep_file(tmp_path, data_cache, rows, steps=6)
    run_dir = tmp_path / "run"
    env = {**ENV, "RECURSIVE_LIGHTNING_FAULT": "mid_training:1:hang"}
    p = run_sweep([spec, "--run-dir", run_dir, "--workers", 2], env=env, start_new_session=True)
    try:
        pids = _wait_for(lambda: _trial_pids(run_dir, 2, "step=000004.ckpt"), proc=p)
        assert p.pid not in pids
        p.kill()
        p.wait()
        _wait_for(lambda: not any(pid_alive(pid) for pid in pids), timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    p = run_sweep([spec, "--run-dir", run_dir])
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    trials = study_trials(run_dir)
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    _, (parent,), children = child_runs(run_dir)
    assert parent.info.status == "FINISHED" and len(children) == 2


def test_a_rerun_waits_for_trials_still_running_here(tmp_path, data_cache):
    """A re-run while an earlier sweep command still trains (here held at a named point) does not report the
    sweep finished with a partial table: it waits for that process, and when it dies resumes its trial."""
    spec = sweep_file(tmp_path, data_cache, {"mesh": {"model.topology": "mesh"}}, steps=6)
    run_dir = tmp_path / "run"
    env = {**ENV, "RECURSIVE_LIGHTNING_FAULT": "mid_training:1:hang"}
    first = run_sweep([spec, "--run-dir", run_dir], env=env, start_new_session=True)
    second = None
    try:
        (pid,) = _wait_for(lambda: _trial_pids(run_dir, 1, "step=000004.ckpt"), proc=first)
        assert pid == first.pid
        second = run_sweep([spec, "--run-dir", run_dir])
        seen = []
        for line in second.stdout:
            seen.append(line)
            if "waiting for 1 trial" in line:
                break
        assert "waiting for 1 trial" in seen[-1], "".join(seen)
        _, (parent,), _ = child_runs(run_dir)
        assert parent.info.status == "RUNNING"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    out = "".join(seen) + second.communicate(timeout=600)[0]
    assert second.returncode == 0, out
    assert "(resuming)" in out
    (trial,) = study_trials(run_dir)
    assert trial.state == optuna.trial.TrialState.COMPLETE
    _, (parent,), _ = child_runs(run_dir)
    assert parent.info.status == "FINISHED"
    assert "1 finished trials" in (run_dir / "report.md").read_text()


def test_a_trial_claimed_by_a_process_killed_before_it_named_itself_is_resumed(tmp_path, data_cache):
    """A worker killed between claiming a trial (WAITING -> RUNNING) and recording its pid left the trial
    RUNNING forever: no heartbeat, no pid to check, so no re-run ever finished the sweep."""
    from recursive_lightning.sweep import prepare
    from recursive_lightning.sweep.spec import load_sweep
    from recursive_lightning.sweep.study import default_storage

    spec = load_sweep(sweep_file(tmp_path, data_cache, {"mesh": {"model.topology": "mesh"}}, steps=4))
    run_dir = tmp_path / "run"
    storage, tracking = default_storage(run_dir), f"sqlite:///{run_dir / 'mlflow.db'}"
    study, _ = prepare.prepare_study(spec, run_dir, storage, tracking)
    (trial,) = study.get_trials()
    study._storage.set_trial_state_values(trial._trial_id, state=optuna.trial.TrialState.RUNNING)
    study, _ = prepare.prepare_study(spec, run_dir, storage, tracking)  # what a re-run does first
    assert [t.state for t in study.get_trials()] == [optuna.trial.TrialState.WAITING]


def test_sigterm_closes_the_parent_run_and_exits_143(tmp_path, data_cache):
    """SIGTERM to a sweep command (a scheduler's pre-emption; here while it is held at a named point between
    claiming a trial and training it) ends the MLflow parent run KILLED instead of leaving it RUNNING, exits
    143."""
    spec = sweep_file(tmp_path, data_cache, {"mesh": {"model.topology": "mesh"}}, steps=4)
    run_dir = tmp_path / "run"
    env = {**ENV, "RECURSIVE_LIGHTNING_FAULT": "before_training:1:hang"}
    p = run_sweep([spec, "--run-dir", run_dir], env=env, start_new_session=True)
    try:

        def claimed():
            if not (run_dir / "sweep.json").exists():  # opening the study before the sweep made it races it
                return False
            return any(t.state == optuna.trial.TrialState.RUNNING for t in study_trials(run_dir))

        _wait_for(claimed, proc=p)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 143, out
    _, (parent,), _ = child_runs(run_dir)
    assert parent.info.status == "KILLED"  # a re-run resumes it (RUNNING again), as after any kill


_HOLDER = """
import os, subprocess, sys, time
from recursive_lightning.sweep.launch import DIE_WITH_PARENT_EXEC
child = [sys.executable, "-c", "import time; time.sleep(600)", "recursive_lightning"]
p = subprocess.Popen([sys.executable, "-c", DIE_WITH_PARENT_EXEC, str(os.getpid()), *child])
print(p.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_multi_device_trials_train_command_dies_with_its_worker(tmp_path):
    """A multi-device trial runs as a `train` subprocess of the worker; killing the worker kills it too."""
    from recursive_lightning.sweep.claims import pid_alive

    holder = subprocess.Popen([sys.executable, "-c", _HOLDER], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        child = int(holder.stdout.readline())
        _wait_for(lambda: pid_alive(child), timeout=60)  # exec'd into the long-running command
        holder.kill()
        holder.wait()
        _wait_for(lambda: not pid_alive(child), timeout=60)
    finally:
        holder.kill()
        with contextlib.suppress(Exception):
            os.kill(child, signal.SIGKILL)
