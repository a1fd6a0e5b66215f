"""A sweep that grows: one more seed, one more value of an axis, one more row of a named
axis, re-run into the same run directory, train exactly the new grid points. The finished ones are kept (not
retrained, the same metrics), the report and the MLflow parent run cover every point and the parent ends
FINISHED. What would change earlier points (a new axis, a changed override) is refused in one sentence and
leaves the parent as it was. On SQLite here and on PostgreSQL in test_sweep_postgres.py."""

from pathlib import Path

import optuna
import yaml
from conftest import sweep_output, sweep_runs, write_sweep
from test_sweep_postgres import PG_ENV

NAME = "grow-sweep"
COMPLETE = optuna.trial.TrialState.COMPLETE


def grow_spec(
    tmp: Path, cache: str, name: str = NAME, rows=("anchor",), lrs=(3e-3,), seeds=(0,), **extra
) -> Path:
    """A tiny sweep: a named axis of topologies, a value axis (train.lr) and seeds."""
    axes = {"variant": {r: {"model.topology": r} for r in rows}, "train.lr": list(lrs)}
    overrides = {"train.max_steps": 4, "train.val_every": 2, **extra}
    return write_sweep(tmp / f"{name}.yaml", cache, name, axes, seeds, overrides, max_retries=0)


def finished(storage: str, name: str = NAME) -> dict[str, float]:
    study = optuna.load_study(study_name=name, storage=storage)
    return {t.user_attrs["point_key"]: t.value for t in study.get_trials() if t.state == COMPLETE}


def parent_and_children(tracking: str, name: str = NAME):
    _, (parent,), children = sweep_runs(tracking, name)
    return parent, children


def mtimes(run_dir: Path) -> dict[str, int]:
    return {p.parent.name: p.stat().st_mtime_ns for p in (run_dir / "trials").glob("*/sweep_result.json")}


def trained(out: str) -> int:
    """Trials the command trained (printed as `trial N: ...` without `finished before`)."""
    return sum(
        1
        for x in out.splitlines()
        if "] trial " in x
        and ": " in x
        and "finished before" not in x
        and "failed" not in x
        and "taken over" not in x
    )


def grow(spec: Path, run_dir: Path, storage: str, tracking: str, extra: tuple, new: int, total: int) -> None:
    """Re-run the grown sweep: exactly ``new`` points train, the old ones keep their results and files."""
    before, files = finished(storage), mtimes(run_dir)
    code, out = sweep_output(spec, "--run-dir", run_dir, *extra)
    assert code == 0, out
    assert "does not support dynamic value space" not in out
    assert trained(out) == new, out
    after = finished(storage)
    assert len(after) == total and {k: after[k] for k in before} == before  # kept, same metrics
    assert {k: v for k, v in mtimes(run_dir).items() if k in files} == files  # never rewritten
    parent, children = parent_and_children(tracking)
    assert parent.info.status == "FINISHED"
    assert sorted(r.data.tags["point_key"] for r in children) == sorted(after)  # one child per point
    report = (run_dir / "report.md").read_text()
    assert f"{total} finished trials" in report and "not finished" not in report


def test_adding_a_seed_a_value_and_a_row_trains_only_the_new_points(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    storage, tracking = f"sqlite:///{run_dir / 'optuna.db'}", f"sqlite:///{run_dir / 'mlflow.db'}"
    code, out = sweep_output(grow_spec(tmp_path, data_cache), "--run-dir", run_dir)
    assert code == 0, out
    grow(grow_spec(tmp_path, data_cache, seeds=(0, 1)), run_dir, storage, tracking, (), new=1, total=2)
    grow(
        grow_spec(tmp_path, data_cache, seeds=(0, 1), lrs=(3e-3, 1e-3)), run_dir, storage, tracking, (), 2, 4
    )
    spec = grow_spec(tmp_path, data_cache, seeds=(0, 1), lrs=(3e-3, 1e-3), rows=("anchor", "mesh"))
    grow(spec, run_dir, storage, tracking, (), new=4, total=8)

    # what would change the earlier points is refused in one sentence; the parent stays FINISHED
    kept = (run_dir / "sweep.yaml").read_text()
    for edit, words in (
        ({"train.warmup_steps": 1}, "train.warmup_steps changed"),
        ({}, "new axis train.weight_decay"),
    ):
        bad = grow_spec(tmp_path, data_cache, seeds=(0, 1), lrs=(3e-3, 1e-3), rows=("anchor", "mesh"), **edit)
        if not edit:
            raw = yaml.safe_load(bad.read_text())
            raw["axes"]["train.weight_decay"] = [0.1]
            bad.write_text(yaml.safe_dump(raw))
        code, out = sweep_output(bad, "--run-dir", run_dir)
        assert code == 2, out
        (line,) = [x for x in out.splitlines() if x.startswith("error:")]
        assert words in line and "new --run-dir" in line and "Traceback" not in out, line
        assert (run_dir / "sweep.yaml").read_text() == kept
        parent, _ = parent_and_children(tracking)
        assert parent.info.status == "FINISHED"

    # a later command stopped (Ctrl-C, SIGTERM) once every grid point has finished leaves the parent FINISHED
    from recursive_lightning.sweep.parent import close_parent
    from recursive_lightning.sweep.spec import load_sweep

    assert close_parent(load_sweep(run_dir / "sweep.yaml"), storage, tracking, interrupted=True) == "FINISHED"
    assert parent_and_children(tracking)[0].info.status == "FINISHED"


def test_a_grown_sweep_on_postgresql_and_the_edited_sweep_advice_there(
    pg, mlflow_server, tmp_path, data_cache
):
    """The same on a PostgreSQL study with an `mlflow server`: one more seed trains one point. An edited file
    is refused naming the real conflict (the study in the shared database, which a new --run-dir alone meets
    again) and a fix that works: the edited file under a new `name:` runs in the same database."""
    storage, run_dir, tracking = pg.create_database("grow"), tmp_path / "run", mlflow_server
    name = "pg-grow"
    stores = ("--storage", storage, "--tracking-uri", tracking)
    code, out = sweep_output(
        grow_spec(tmp_path, data_cache, name=name), "--run-dir", run_dir, *stores, env=PG_ENV
    )
    assert code == 0, out
    before = finished(storage, name)
    spec = grow_spec(tmp_path, data_cache, name=name, seeds=(0, 1))
    code, out = sweep_output(spec, "--run-dir", run_dir, *stores, env=PG_ENV)
    assert code == 0 and trained(out) == 1, out
    after = finished(storage, name)
    assert len(after) == 2 and {k: after[k] for k in before} == before
    parent, children = parent_and_children(tracking, name)
    assert parent.info.status == "FINISHED" and len(children) == 2

    edited = grow_spec(tmp_path, data_cache, name=name, seeds=(0, 1), **{"train.warmup_steps": 1})
    code, out = sweep_output(edited, "--run-dir", tmp_path / "elsewhere", *stores, env=PG_ENV)
    assert code == 2, out
    (line,) = [x for x in out.splitlines() if x.startswith("error:")]
    assert f"the study '{name}' in the shared database" in line and "new `name:`" in line, line
    assert parent_and_children(tracking, name)[0].info.status == "FINISHED"
    renamed = grow_spec(tmp_path, data_cache, name=f"{name}-2", seeds=(0,), **{"train.warmup_steps": 1})
    code, out = sweep_output(renamed, "--run-dir", tmp_path / "elsewhere", *stores, env=PG_ENV)
    assert code == 0, out
