"""Sweeps beyond one machine: an Optuna study on a real PostgreSQL server, a real `mlflow server` on a PostgreSQL
backend store with served artifacts, and `sweep --attach` workers as a scheduler would start them.

The module starts its own throwaway PostgreSQL cluster (initdb in a temporary folder, as the `postgres` system
user when run as root, on a free loopback port) and its own `mlflow server` on 127.0.0.1; it is skipped only
where PostgreSQL's server binaries are not installed. Heartbeats are shortened (1 s, stale after 8 s) so that
a dead worker's trial is taken over within the test; the kill itself is a named fault point, not a timing.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from conftest import ENV, run_sweep, sweep_runs, write_sweep
from test_sweep import _CLAIMER  # the same claiming process, against PostgreSQL

from recursive_lightning.sweep import servers

PG_ENV = {**ENV, "RECURSIVE_LIGHTNING_HEARTBEAT": "1,8"}  # heartbeats every second, stale after 8 s
COMPLETE, FAIL = optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL

pytestmark = pytest.mark.skipif(
    servers.postgres_bindir() is None,
    reason="PostgreSQL's server binaries (initdb, pg_ctl) are not installed",
)


@pytest.fixture(scope="module")
def tracking(mlflow_server):
    """An `mlflow server` whose backend store is a PostgreSQL database, artifacts served from a folder."""
    return mlflow_server


def pg_sweep(tmp: Path, cache: str, name: str, variants=("anchor", "mesh", "base"), seeds=(0, 1)) -> Path:
    axes = {"variant": {v: {"model.topology": v} for v in variants}}
    return write_sweep(tmp / f"{name}.yaml", cache, name, axes, seeds, max_retries=1)


def prepare(spec: Path, run_dir: Path, storage: str, tracking: str) -> None:
    """`sweep FILE --prepare` (in this process: it saves a process start on a 2-core CI machine)."""
    from recursive_lightning.commands import sweep as sweep_command

    args = [spec, "--run-dir", run_dir, "--storage", storage, "--tracking-uri", tracking, "--prepare"]
    assert sweep_command.main([str(a) for a in args]) == 0
    assert not (run_dir / "trials").exists()  # prepared: nothing trained yet


def finish(p: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


@pytest.fixture(scope="module")
def grid(pg, tracking, tmp_path_factory, data_cache):
    """A six-point sweep prepared once, then run by three `sweep --attach` workers started together, each
    told only the study's URL (the run directory and tracking server come from the study)."""
    tmp = tmp_path_factory.mktemp("grid")
    spec = pg_sweep(tmp, data_cache, "pg-grid")
    storage, run_dir = pg.create_database("grid"), tmp / "run"
    prepare(spec, run_dir, storage, tracking)
    workers = [run_sweep([spec, "--attach", "--storage", storage], env=PG_ENV) for _ in range(3)]
    outs = [finish(w) for w in workers]
    assert [c for c, _ in outs] == [0, 0, 0], "\n".join(o for _, o in outs)
    study = optuna.load_study(study_name="pg-grid", storage=storage)
    return {
        "storage": storage,
        "run_dir": run_dir,
        "study": study,
        "outs": [o for _, o in outs],
        "spec": spec,
    }


def test_three_attached_workers_finish_the_grid_each_point_once(grid, tracking):
    trials = grid["study"].get_trials()
    keys = [t.user_attrs["point_key"] for t in trials]
    assert len(trials) == 6 and len(set(keys)) == 6  # six grid points, one trial each: no duplicate claim
    assert all(t.state == COMPLETE for t in trials)
    assert sorted(
        (t.user_attrs["point"]["variant"], t.user_attrs["point"]["train.seed"]) for t in trials
    ) == sorted((v, s) for v in ("anchor", "mesh", "base") for s in (0, 1))
    started = sum(o.count("] trial ") for o in grid["outs"])
    assert started == 6  # every point trained by exactly one worker, none started twice
    assert not any("View run" in o for o in grid["outs"])  # MLflow's own links: the commands print theirs
    # the workers found the run directory of the study (none was given one)
    assert sorted(p.name for p in (grid["run_dir"] / "trials").iterdir()) == sorted(keys)

    c, parents, children = sweep_runs(tracking, "pg-grid")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert sorted(r.data.tags["point_key"] for r in children) == sorted(keys)  # one child run per point
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    assert {r.info.status for r in children} == {"FINISHED"}
    for r in children:  # trained once: one loss per step in the child run
        steps = [m.step for m in c.get_metric_history(r.info.run_id, "train/loss")]
        assert sorted(steps) == list(range(6))
    # the report went to the parent run's artifacts through the server
    assert "report.md" in {Path(a.path).name for a in c.list_artifacts(parents[0].info.run_id, "report")}
    assert json.loads((grid["run_dir"] / "sweep.json").read_text())["storage"] == grid["storage"]


def test_report_and_ui_read_the_server_backed_sweep(grid, tracking, capsys):
    """`report --run-dir` of a sweep whose study and runs live on servers reads them there; `ui` of it names
    the tracking server, which serves the runs itself."""
    from recursive_lightning.commands import report, ui

    (grid["run_dir"] / "report.md").unlink()
    assert report.main(["--run-dir", str(grid["run_dir"])]) == 0
    text = (grid["run_dir"] / "report.md").read_text()
    assert all(v in text for v in ("anchor", "mesh", "base")) and "not finished" not in text
    capsys.readouterr()
    assert ui.main([str(grid["run_dir"])]) == 0
    out = capsys.readouterr().out
    # a plain `mlflow server` (not our MLflow app): MLflow's own page, the links carrying workflowType
    assert f"{tracking}/#/experiments/" in out and "workflowType=machine_learning" in out, out


def test_a_sigkilled_workers_trial_is_resumed_by_another_worker(grid, pg, tracking, tmp_path, data_cache):
    """Worker A is SIGKILLed in its trial after the trial's first checkpoint (a named fault point). Worker B,
    started after, runs the other point, sees A's trial miss its heartbeats, takes it over once Optuna
    declares it stale, and resumes it from A's checkpoint in the shared run directory into the same MLflow
    child run: the metric equals the uninterrupted sweep's for that point, bit for bit."""
    spec = pg_sweep(tmp_path, data_cache, "pg-kill", variants=("anchor", "mesh"), seeds=(0,))
    storage, run_dir = pg.create_database("kill"), tmp_path / "run"
    prepare(spec, run_dir, storage, tracking)
    code, out_a = finish(
        run_sweep(
            [spec, "--attach", "--storage", storage],
            env={**PG_ENV, "RECURSIVE_LIGHTNING_FAULT": "mid_training"},
        )
    )
    assert code == -9, out_a
    (killed,) = [d for d in (run_dir / "trials").iterdir()]
    assert any((killed / "checkpoints").glob("*.ckpt")) and not (killed / "result.json").exists()
    run_id = (killed / "mlflow_run_id").read_text()

    code, out_b = finish(run_sweep([spec, "--attach", "--storage", storage], env=PG_ENV))
    assert code == 0, out_b
    assert "(resuming)" in out_b

    study = optuna.load_study(study_name="pg-kill", storage=storage)
    by_key: dict[str, list] = {}
    for t in study.get_trials():
        by_key.setdefault(t.user_attrs["point_key"], []).append(t.state)
    assert by_key[killed.name] == [FAIL, COMPLETE]  # the dead worker's trial, failed as stale, then its retry
    assert [s for k, s in by_key.items() if k != killed.name] == [[COMPLETE]]
    baseline = {t.user_attrs["point_key"]: t.value for t in grid["study"].get_trials()}
    got = {t.user_attrs["point_key"]: t.value for t in study.get_trials() if t.state == COMPLETE}
    assert got == {k: baseline[k] for k in got}  # the uninterrupted sweep's metrics

    assert (killed / "mlflow_run_id").read_text() == run_id
    _, parents, children = sweep_runs(tracking, "pg-kill")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert sorted(r.info.run_id for r in children if r.data.tags["point_key"] == killed.name) == [run_id]
    assert len(children) == 2 and {r.info.status for r in children} == {"FINISHED"}


def test_a_worker_with_nothing_left_takes_over_a_dead_workers_trial(pg, tmp_path, data_cache, monkeypatch):
    """The take-over on its own, in this process and without training: of two running trials, one's worker is
    dead (its last heartbeat three seconds old, written so), the other's alive (beating). A worker that finds
    nothing waiting waits for the dead one to go stale, runs its retry, and leaves the live one alone."""
    from sqlalchemy import create_engine, text

    from recursive_lightning.sweep import study as sweep_study
    from recursive_lightning.sweep import trial
    from recursive_lightning.sweep.spec import load_sweep, point_key

    monkeypatch.setattr(sweep_study, "HEARTBEAT_S", 1)
    monkeypatch.setattr(sweep_study, "GRACE_S", 4)
    spec = load_sweep(pg_sweep(tmp_path, data_cache, "pg-takeover", variants=("mesh", "base"), seeds=(0,)))
    url = pg.create_database("takeover")
    storage = sweep_study.open_storage(url, spec.max_retries)
    study = optuna.create_study(study_name=spec.name, storage=storage)
    study.set_user_attr("mlflow_parent_run_id", "-")
    for point in spec.grid():
        study.enqueue_trial(point, user_attrs={"point_key": point_key(point), "attempt": 0})
    dead, alive = trial.claim(study, storage, url), trial.claim(study, storage, url)
    storage.record_heartbeat(dead)
    engine = create_engine(url)
    with engine.begin() as con:  # the dead worker's last heartbeat: late (> 2 intervals), not yet stale (4 s)
        con.execute(
            text(
                "UPDATE trial_heartbeats SET heartbeat = heartbeat - interval '3 seconds' WHERE trial_id = :t"
            ),
            {"t": dead},
        )
    engine.dispose()
    ran = []

    def run_trial(spec, study, trial_id, *_):
        ran.append(trial_id)
        study.tell(storage.get_trial(trial_id).number, 1.0)

    monkeypatch.setattr(trial, "run_trial", run_trial)
    with trial.Heartbeat(storage, alive):  # the live worker
        assert trial.worker(spec, tmp_path, url, "-", take_over=True) == 1
    trials = {t._trial_id: t for t in study.get_trials()}
    (retry,) = ran
    assert trials[dead].state == FAIL and trials[retry].state == COMPLETE
    assert (
        trials[retry].user_attrs["point_key"] == trials[dead].user_attrs["point_key"]
    )  # the same grid point
    assert trials[alive].state == optuna.trial.TrialState.RUNNING  # a live worker's trial is not taken


def test_a_claim_skips_a_trial_finished_since_the_list_was_read(pg):
    """Workers on a server database list the waiting trials, then claim one by one: a trial another worker
    claimed and finished in between is skipped (with eight workers it crashed a worker before)."""
    from recursive_lightning.sweep.claims import claim
    from recursive_lightning.sweep.study import open_storage

    url = pg.create_database("stale_list")
    storage = open_storage(url, 0)
    study = optuna.create_study(study_name="stale", storage=storage)
    for i in range(2):
        study.enqueue_trial({"x": i})
    stale = study.get_trials(states=(optuna.trial.TrialState.WAITING,))  # what a worker read
    first = claim(study, storage, url)  # another worker: claimed and finished it since
    study.tell(storage.get_trial(first).number, 1.0)

    class Stale:  # the study as the slow worker saw it
        def get_trials(self, deepcopy=True, states=None):
            return stale

    got = claim(Stale(), storage, url)
    assert got == stale[1]._trial_id and storage.get_trial(got).state == optuna.trial.TrialState.RUNNING


def test_a_stopped_worker_puts_its_trial_back_for_the_next(pg, tmp_path, data_cache, monkeypatch):
    """A worker stopped in a trial (SIGTERM from the scheduler raises there, as Ctrl-C does) puts the trial
    back to WAITING at once: the next worker resumes it without waiting out the heartbeats."""
    from recursive_lightning.errors import Terminated
    from recursive_lightning.sweep import trial
    from recursive_lightning.sweep.spec import load_sweep, point_key

    spec = load_sweep(pg_sweep(tmp_path, data_cache, "pg-stop", variants=("mesh",), seeds=(0,)))
    url = pg.create_database("stop")
    study = optuna.create_study(study_name=spec.name, storage=url)
    study.set_user_attr("mlflow_parent_run_id", "-")
    (point,) = spec.grid()
    study.enqueue_trial(point, user_attrs={"point_key": point_key(point), "attempt": 0})

    def run_trial(*_):
        raise Terminated("train: stopped by SIGTERM at step 3")

    monkeypatch.setattr(trial, "run_trial", run_trial)
    with pytest.raises(Terminated):
        trial.worker(spec, tmp_path, url, "-", take_over=True)
    (stopped,) = study.get_trials()
    assert stopped.state == optuna.trial.TrialState.WAITING  # the same trial: same directory, same child run


def test_bad_storage_or_tracking_urls_get_one_sentence_before_any_work(pg, tracking, tmp_path, data_cache):
    from recursive_lightning.commands import sweep as sweep_command
    from recursive_lightning.errors import ConfigError

    spec = pg_sweep(tmp_path, data_cache, "pg-bad", variants=("mesh",), seeds=(0,))
    closed = servers.free_port()
    good = pg.create_database("bad")
    cases = [
        (["--storage", f"postgresql+psycopg://postgres@127.0.0.1:{closed}/x"], f"127.0.0.1:{closed}/x"),
        (["--storage", f"postgresql://postgres@127.0.0.1:{pg.port}/bad"], "postgresql+psycopg://"),
        (["--storage", pg.url("nosuch")], "createdb nosuch"),
        (["--storage", "postgres:/nonsense"], "--storage 'postgres:/nonsense' is not a database URL"),
        (["--storage", good, "--tracking-uri", f"http://127.0.0.1:{closed}"], f"http://127.0.0.1:{closed}"),
        (["--storage", good, "--tracking-uri", f"http://127.0.0.1:{pg.port}"], "MLflow tracking server"),
        (["--storage", good, "--tracking-uri", tracking + "/nothing"], "HTTP 404"),
    ]
    for args, named in cases:
        t0 = time.time()
        with pytest.raises(ConfigError) as e:
            sweep_command.main([str(spec), "--run-dir", str(tmp_path / "run"), *args])
        msg = str(e.value)
        assert named in msg and msg.endswith(".") and "\n" not in msg, msg  # one sentence naming it
        assert time.time() - t0 < 30  # not MLflow's minutes of retries
    assert not (tmp_path / "run").exists()  # nothing made, nothing trained
    assert optuna.get_all_study_names(storage=good) == []  # refused before the study was made

    # an attached worker told another tracking server than the study's: its child runs would lose their parent
    prepare(spec, tmp_path / "run", good, tracking)
    with pytest.raises(ConfigError, match="is not the tracking store the study 'pg-bad' logs to"):
        sweep_command.main(
            [str(spec), "--attach", "--storage", good, "--tracking-uri", f"http://localhost:{closed}"]
        )
    assert not (tmp_path / "run" / "trials").exists()


_PREPARER = """
import sys, time
from pathlib import Path
from recursive_lightning.sweep.prepare import prepare_study
from recursive_lightning.sweep.spec import load_sweep
spec, run_dir, storage, tracking, start = load_sweep(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:5], float(sys.argv[5])
while time.time() < start:
    time.sleep(0.001)
study, parent = prepare_study(spec, run_dir, storage, tracking)
print(parent)
"""


def test_claims_and_preparation_race_across_machines_without_duplicates(pg, tracking, tmp_path, data_cache):
    """Four processes claim 40 waiting trials of one PostgreSQL study at once: each trial once. Three sweep
    commands prepare one study at once from separate run directories (as on three machines, where the run
    directory's file lock does not serialise them): one MLflow parent run, every grid point enqueued once."""
    url = pg.create_database("claims")
    study = optuna.create_study(study_name="claims", storage=url)
    for i in range(40):
        study.enqueue_trial({"x": i})
    spec = pg_sweep(tmp_path, data_cache, "pg-prep")
    prep_url = pg.create_database("prep")
    start = time.time() + 6  # every process imports first, then all start at once
    claimers = [
        subprocess.Popen(
            [sys.executable, "-c", _CLAIMER, url, str(start)], env=PG_ENV, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    preparers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _PREPARER,
                str(spec),
                str(tmp_path / f"machine{i}"),
                prep_url,
                tracking,
                str(start),
            ],
            env=PG_ENV,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    claimed = []
    for p in claimers:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0
        claimed += [int(x) for x in out.split()]
    assert len(claimed) == 40 and len(set(claimed)) == 40, sorted(claimed)
    parents = [p.communicate(timeout=300)[0].strip().splitlines()[-1] for p in preparers]
    assert len(set(parents)) == 1, parents
    trials = optuna.load_study(study_name="pg-prep", storage=prep_url).get_trials()
    assert len(trials) == 6 and len({t.user_attrs["point_key"] for t in trials}) == 6


def test_a_multi_device_trial_is_started_by_srun_inside_slurm(tmp_path, tiny_run):
    from recursive_lightning.config import RunConfig
    from recursive_lightning.sweep.launch import slurm_launcher

    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text(f'#!/bin/sh\necho "$@" > {srun.parent / "called"}\n')
    srun.chmod(0o755)
    raw = tiny_run()
    raw["train"].update({"strategy": "fsdp", "devices": 4, "num_nodes": 2})
    cfg = RunConfig.from_dict(raw)
    slurm = {"SLURM_JOB_ID": "7", "PATH": str(srun.parent)}
    assert slurm_launcher(cfg, slurm)[:4] == [str(srun), "--nodes=2", "--ntasks=8", "--ntasks-per-node=4"]
    # the worker starts it through its die-with-the-worker wrapper, which execs a path
    from recursive_lightning.sweep.launch import DIE_WITH_PARENT_EXEC

    cmd = [
        sys.executable,
        "-c",
        DIE_WITH_PARENT_EXEC,
        str(os.getpid()),
        *slurm_launcher(cfg, slurm),
        "train",
    ]
    assert subprocess.run(cmd, env={**PG_ENV, **slurm}).returncode == 0
    assert (srun.parent / "called").read_text().split()[-2:] == ["--export=ALL", "train"]
    assert slurm_launcher(cfg, {"PATH": str(srun.parent)}) == []  # not in an allocation
    assert slurm_launcher(cfg, {"SLURM_JOB_ID": "7", "PATH": str(tmp_path)}) == []  # no srun


def test_sigterm_while_a_finished_postgresql_sweep_writes_its_report_closes_its_parent(
    pg, tracking, tmp_path, data_cache
):
    """A sweep on PostgreSQL (its study there, its runs on an `mlflow server` with a PostgreSQL store), stopped
    by SIGTERM at the instant it writes its report (every point finished): exit 143, the MLflow parent run
    FINISHED, not RUNNING. A SIGKILL there leaves the parent RUNNING; a later `report` closes it."""
    import signal

    from conftest import command_output

    def sweep(how: str, fault: str) -> tuple[subprocess.Popen, Path, str]:
        name = f"pg-report-{how}"
        spec = pg_sweep(tmp_path, data_cache, name, variants=("mesh",), seeds=(0,))
        run_dir = tmp_path / how
        args = [spec, "--run-dir", run_dir, "--storage", pg.create_database(f"report_{how}")]
        env = {
            **PG_ENV,
            "RECURSIVE_LIGHTNING_FAULT": fault,
            "RECURSIVE_LIGHTNING_FAULT_MARK": str(tmp_path / f"{how}.mark"),
        }
        return run_sweep([*args, "--tracking-uri", tracking], env=env), run_dir, name

    p, _, name = sweep("term", "during_report:1:pause")
    try:
        while not (tmp_path / "term.mark").is_file():  # the sweep waits inside its report
            assert p.poll() is None, p.communicate()[0]
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        code, out = finish(p)
    finally:
        p.kill()
    assert code == 143, out
    _, (parent,), (child,) = sweep_runs(tracking, name)
    assert parent.info.status == "FINISHED" and child.info.status == "FINISHED", out

    p, run_dir, name = sweep("kill", "during_report:1")
    code, out = finish(p)
    assert code == -9, out
    _, (parent,), _ = sweep_runs(tracking, name)
    assert parent.info.status == "RUNNING"
    code, out = command_output("report", "--run-dir", run_dir, env=PG_ENV, timeout=300)
    assert code == 0, out
    _, (parent,), _ = sweep_runs(tracking, name)
    assert parent.info.status == "FINISHED" and (run_dir / "report.md").is_file()


def test_a_new_run_dir_for_a_postgresql_study_is_refused_naming_its_directory(
    pg, tracking, tmp_path, data_cache
):
    """A study prepared on PostgreSQL into one run directory: `sweep` with another --run-dir is refused in one
    sentence naming the study's directory, and writes nothing there."""
    from conftest import sweep_output

    from recursive_lightning.uris import mask_url

    spec = pg_sweep(tmp_path, data_cache, "pg-one-dir", variants=("mesh",), seeds=(0,))
    storage, run_dir = pg.create_database("one_dir"), tmp_path / "run"
    prepare(spec, run_dir, storage, tracking)
    elsewhere = tmp_path / "elsewhere"
    code, out = sweep_output(spec, "--run-dir", elsewhere, "--storage", storage, env=PG_ENV, timeout=300)
    assert code == 2, out
    assert out.strip() == (
        f"error: --run-dir '{elsewhere}': the study 'pg-one-dir' in {mask_url(storage)} runs in '{run_dir}'; pass "
        f"--run-dir {run_dir} to continue it there, or give the sweep file a new `name:` to start another study."
    ), out
    assert not elsewhere.exists()
