"""Fault injection: a sweep killed at every step of a trial's life loses no finished result.

The sweep process SIGKILLs itself at a named point (``recursive_lightning.faults``, set through the environment
by these tests only), then the same command is run again. After the re-run every grid point has finished
exactly once, with the metric of an uninterrupted run, the MLflow parent run is FINISHED and the report is
complete. Nothing here depends on timing: the kill happens at the named instant of the named trial.
"""

import json
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from conftest import ENV, command_output, write_sweep
from mlflow.tracking import MlflowClient

NAME = "fault-sweep"


def fault_sweep(tmp: Path, cache: str, steps: int = 6, rows=None, **top) -> Path:
    axes = {"variant": rows or {"anchor": {"model.topology": "anchor"}, "mesh": {"model.topology": "mesh"}}}
    # max_retries 0: a lost result shows up as a failed trial, not as a silent retry
    return write_sweep(
        tmp / "sweep.yaml",
        cache,
        NAME,
        axes,
        overrides={"train.max_steps": steps},
        **{"max_retries": 0, **top},
    )


def sweep(spec: Path, run_dir: Path, fault: str | None = None, *extra, timeout=600):
    env = dict(ENV)
    if fault:
        env["RECURSIVE_LIGHTNING_FAULT"] = fault
    p = subprocess.run(
        [sys.executable, "-m", "recursive_lightning", "sweep", str(spec), "--run-dir", str(run_dir), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return p.returncode, p.stdout


def trials(run_dir: Path):
    storage = f"sqlite:///{run_dir / 'optuna.db'}"
    return optuna.load_study(study_name=NAME, storage=storage).get_trials()


def values(run_dir: Path) -> dict[str, float]:
    done = [t for t in trials(run_dir) if t.state == optuna.trial.TrialState.COMPLETE]
    return {t.user_attrs["point_key"]: t.value for t in done}


def mlflow_runs(run_dir: Path):
    c = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = c.search_runs([c.get_experiment_by_name(NAME).experiment_id])
    parents = [r for r in runs if r.data.tags.get("kind") == "sweep"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return parents, children


def fresh_run_dir(tmp: Path) -> Path:
    """A new run directory: the sweep makes its stores (the MLflow one a copy of a migrated empty store,
    ``tracking/sqlite_store.py``)."""
    run_dir = tmp / "run"
    run_dir.mkdir()
    return run_dir


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, data_cache):
    """The uninterrupted sweep every faulted one must reproduce."""
    tmp = tmp_path_factory.mktemp("baseline")
    spec = fault_sweep(tmp, data_cache)
    code, out = sweep(spec, fresh_run_dir(tmp))
    assert code == 0, out
    got = values(tmp / "run")
    assert len(got) == 2
    return got


def assert_complete(run_dir: Path, baseline: dict[str, float]) -> None:
    ts = trials(run_dir)
    states = [t.state for t in ts]
    assert states == [optuna.trial.TrialState.COMPLETE] * 2, [(t.number, t.state, t.user_attrs) for t in ts]
    got = values(run_dir)
    assert got == baseline  # the same metric as the uninterrupted sweep, bit for bit
    (parent,), children = mlflow_runs(run_dir)
    assert parent.info.status == "FINISHED"
    assert sorted(r.data.tags["point_key"] for r in children) == sorted(baseline)  # one child per point
    assert {r.info.status for r in children} == {"FINISHED"}
    report = (run_dir / "report.md").read_text()
    assert "2 finished trials" in report and "not finished" not in report and "Failed" not in report
    for key in baseline:
        record = json.loads((run_dir / "trials" / key / "sweep_result.json").read_text())
        assert record["metrics"]["val/heldout/loss"] == baseline[key]


# where the kill happens, and the occurrence: ":2" is the second trial (the first one has finished by then)
FAULTS = [
    "before_training:2",
    "mid_training:2",  # after the trial's first checkpoint
    "final_validation:2",  # last.ckpt at max_steps written, its validation not yet logged
    "after_last_checkpoint:2",  # fit ended, result.json not written
    "after_result_write:2",  # result.json written, the sweep has not recorded it
    "before_tell:2",  # the sweep's record written, the study not told
    "during_report:1",  # every trial told, the MLflow parent run still RUNNING (as at before_close_parent)
]


@pytest.mark.parametrize("fault", FAULTS)
def test_sweep_killed_at_a_named_point_resumes_to_the_same_results(fault, baseline, tmp_path, data_cache):
    spec = fault_sweep(tmp_path, data_cache)
    run_dir = fresh_run_dir(tmp_path)
    code, out = sweep(spec, run_dir, fault)
    assert code == -9, out  # it was killed there (SIGKILL: no cleanup ran)
    (parent,), _ = mlflow_runs(run_dir)
    assert parent.info.status == "RUNNING"
    first = min((run_dir / "trials").glob("*/sweep_result.json"), default=None)
    before = first.stat().st_mtime_ns if first is not None else None

    code, out = sweep(spec, run_dir)
    assert code == 0, out
    assert_complete(run_dir, baseline)
    if first is not None:  # a trial recorded before the kill is never trained or recorded again
        assert first.stat().st_mtime_ns == before
    name = fault.split(":")[0]
    if name in ("after_result_write", "before_tell"):
        assert "finished before; its result is kept" in out and "(resuming)" not in out
    if name in ("mid_training", "final_validation", "after_last_checkpoint"):
        assert "(resuming)" in out


def test_a_finished_trials_last_checkpoint_validates_to_its_result(tmp_path, tiny_run):
    """The sweep's own recovery when training reached max_steps but left no validation metrics (whatever
    `train --resume` does): validating the last checkpoint gives the final validation's metrics exactly, and
    records them in result.json and the trial's MLflow run."""
    import dataclasses

    from recursive_lightning.config import RunConfig
    from recursive_lightning.sweep.trial import validate_last_checkpoint
    from recursive_lightning.training.run import train

    cfg = RunConfig.from_dict(tiny_run())
    result = train(cfg, tmp_path / "run")
    assert result.steps == cfg.train.max_steps and "val/heldout/loss" in result.metrics
    (tmp_path / "run" / "result.json").unlink()
    again = validate_last_checkpoint(cfg, dataclasses.replace(result, metrics={}))
    assert again.metrics == result.metrics
    assert json.loads((tmp_path / "run" / "result.json").read_text())["metrics"] == result.metrics
    run = MlflowClient(result.tracking_uri).get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["final/val/heldout/loss"] == result.metrics["val/heldout/loss"]


@pytest.mark.parametrize("fault", ["after_result_write:2", "before_tell:2"])
def test_a_sweep_killed_then_moved_resumes_where_it_lies_now(fault, baseline, tmp_path, data_cache):
    """Killed after a trial's result was written, the sweep directory moved (to shared storage, a laptop),
    the same command re-run on the new path: the finished trial's checkpoint is found where it lies now (its
    `evaluate:` reads it; result.json and sweep_result.json recorded the old path), and the study and the
    child run name the new one."""
    spec = fault_sweep(tmp_path, data_cache, evaluate={"ppl": {"heldout": "embedded:heldout"}})
    run_dir = fresh_run_dir(tmp_path)
    code, out = sweep(spec, run_dir, fault)
    assert code == -9, out
    moved = tmp_path / "elsewhere" / "run"
    moved.parent.mkdir()
    run_dir.rename(moved)

    code, out = sweep(spec, moved)
    assert code == 0, out
    assert_complete(moved, baseline)
    assert "finished before; its result is kept" in out and "(resuming)" not in out
    resumed = trials(moved)[
        1
    ]  # the trial killed before the move (the first one finished and was told before)
    ckpt = Path(resumed.user_attrs["checkpoint"])
    assert ckpt.is_relative_to(moved) and ckpt.is_file()
    assert (
        resumed.user_attrs["metrics"]["eval/ppl/heldout"] > 1
    )  # evaluate: read the checkpoint where it is now
    _, children = mlflow_runs(moved)
    (child,) = [r for r in children if r.data.tags["point_key"] == resumed.user_attrs["point_key"]]
    assert Path(child.data.tags["checkpoint"]) == ckpt
    assert not run_dir.exists()  # nothing was written at the old path


@pytest.mark.parametrize("fault", ["mid_training:1", "after_result_write:1"])
def test_spawned_workers_killed_at_a_named_point_resume_to_the_same_results(
    fault, baseline, tmp_path, data_cache
):
    """`--workers 2`: each worker process SIGKILLs itself at the named point of its first trial; the sweep
    command says a worker died and exits non-zero, and the same command run again finishes every grid point
    once with the uninterrupted metrics."""
    spec = fault_sweep(tmp_path, data_cache)
    run_dir = fresh_run_dir(tmp_path)
    code, out = sweep(spec, run_dir, fault, "--workers", "2")
    assert code not in (0, -9), out  # the command itself was not killed: it reports its dead workers
    assert "exited with code" in out
    code, out = sweep(spec, run_dir, None, "--workers", "2")
    assert code == 0, out
    assert_complete(run_dir, baseline)
    if fault.startswith("after_result_write"):  # both results were on disk: kept, nothing trained again
        assert out.count("finished before; its result is kept") == 2 and "(resuming)" not in out, out
    else:
        assert out.count("(resuming)") == 2, out


def test_sigterm_while_a_finished_sweep_writes_its_report_closes_its_parent(tmp_path, data_cache):
    """SIGTERM (a pre-emption, a time limit) at the instant a finished sweep writes its report: the command
    exits 143 and the MLflow parent run is FINISHED, not RUNNING (every grid point finished). A SIGKILL there
    leaves it RUNNING; `report` then writes the report and closes it as its grid stands."""
    import signal
    import time

    from conftest import run_sweep

    spec = fault_sweep(tmp_path, data_cache, rows={"mesh": {"model.topology": "mesh"}})
    run_dir, mark = fresh_run_dir(tmp_path), tmp_path / "in-report"
    env = {
        **ENV,
        "RECURSIVE_LIGHTNING_FAULT": "during_report:1:pause",
        "RECURSIVE_LIGHTNING_FAULT_MARK": str(mark),
    }
    p = run_sweep([spec, "--run-dir", run_dir], env=env)
    try:
        while not mark.exists():
            assert p.poll() is None, p.communicate()[0]
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=300)
    finally:
        p.kill()
    assert p.returncode == 143, out
    (parent,), (child,) = mlflow_runs(run_dir)
    assert parent.info.status == "FINISHED" and child.info.status == "FINISHED", out

    spec = fault_sweep(tmp_path, data_cache, rows={"mesh": {"model.topology": "mesh"}})
    killed = tmp_path / "killed"
    killed.mkdir()
    code, out = sweep(spec, killed, "during_report:1")
    assert code == -9, out
    (parent,), _ = mlflow_runs(killed)
    assert parent.info.status == "RUNNING"
    code, out = command_output("report", "--run-dir", killed, timeout=300)
    assert code == 0, out
    (parent,), _ = mlflow_runs(killed)
    assert parent.info.status == "FINISHED" and (killed / "report.md").is_file()
