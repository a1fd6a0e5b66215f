"""scripts/slurm/ against a real single-node SLURM (slurm-wlm + munge started by the ``slurm`` fixture, as root),
with the cluster path's stores: a throwaway PostgreSQL study and an ``mlflow server``.

One sweep of two points runs as scripts/slurm/submit-sweep.sh submits it on a cluster: a job array of two
``sweep --attach`` workers and the report job after it (``--dependency=afterany``). Both tasks are pre-empted
the way SLURM pre-empts a requeueable job (``scontrol requeue``: SIGTERM to every process of the job, then the
job is queued again) at a named point: each trial waits just after its first checkpoint (the ``mid_training``
fault point in ``pause`` mode, set by the tasks' RL_SETUP file on their first run only) until the signal
arrives, so nothing depends on timing. The requeued tasks resume the trials from their checkpoints and finish
the sweep; the report job then writes the report.
"""

import subprocess
import sys
import time

import optuna
import pytest
import yaml
from conftest import ENV, ROOT, sweep_runs
from test_sweep_postgres import pg_sweep, prepare

from recursive_lightning.sweep import servers

SCRIPTS = ROOT / "scripts" / "slurm"

pytestmark = pytest.mark.skipif(
    servers.postgres_bindir() is None,
    reason="PostgreSQL's server binaries (initdb, pg_ctl) are not installed",
)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A PostgreSQL database for the study and an `mlflow server` on another, as on a cluster."""
    with servers.LocalPostgres(fast=True) as pg:
        backend = pg.create_database("mlflow")
        with servers.LocalMlflowServer(backend, tmp_path_factory.mktemp("mlflow") / "artifacts") as server:
            yield pg.create_database("optuna"), server.uri


def _wait(what: str, done, timeout: float = 600.0):
    """Poll ``done()`` until it returns something true; a bound, not a guess at a timing."""
    deadline = time.monotonic() + timeout
    while not (value := done()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f}s")
        time.sleep(0.3)
    return value


@pytest.fixture(scope="module")
def cluster_sweep(slurm, stores, tmp_path_factory, data_cache):
    storage, tracking = stores
    tmp = tmp_path_factory.mktemp("slurm-sweep")
    spec = pg_sweep(tmp, data_cache, "slurm-grid", variants=("anchor", "mesh"), seeds=(0,))
    raw = yaml.safe_load(
        spec.read_text()
    )  # checkpoints at 2, 4, 6, 8; the pause at step 3, between validations
    raw["overrides"].update({"train.max_steps": 8, "train.val_every": 4})
    spec.write_text(yaml.safe_dump(raw))
    run_dir = tmp / "run"
    prepare(spec, run_dir, storage, tracking)
    marks = tmp / "marks"
    marks.mkdir()
    setup = tmp / "site.sh"  # RL_SETUP, as a site's `module load` file: here, the pre-emption point
    setup.write_text(
        'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then\n'
        "  export RECURSIVE_LIGHTNING_FAULT=mid_training:1:pause\n"
        f"  export RECURSIVE_LIGHTNING_FAULT_MARK={marks}/task-${{SLURM_ARRAY_TASK_ID:-report}}\n"
        "fi\n"
    )
    env = {
        **ENV,
        **slurm.env,
        "RL_SWEEP": str(spec),
        "RL_STORAGE": storage,
        "RL_RUN_DIR": str(run_dir),
        "RL_SETUP": str(setup),
        "RL_PYTHON": sys.executable,
        "RL_REPO": str(ROOT),
    }
    # the script's own resources, but one CPU per task (the test node has four)
    p = subprocess.run(
        [str(SCRIPTS / "submit-sweep.sh"), "--array=0-1", "--cpus-per-task=1"],
        env=env, cwd=tmp, capture_output=True, text=True, check=True,
    )  # fmt: skip
    words = p.stdout.split()
    array, report = words[words.index("array") + 1].rstrip(";"), words[words.index("job", 4) + 1]
    tasks = [f"{array}_{i}" for i in (0, 1)]

    def paused() -> bool:
        for t in tasks:
            if slurm.job(t).get("JobState") not in ("PENDING", "RUNNING"):
                raise AssertionError(f"task {t} ended before its pre-emption: {slurm.job(t)}")
        return all((marks / f"task-{i}").exists() for i in (0, 1))

    _wait("both trials reaching their first checkpoint", paused)
    checkpoints = sorted(p.name for p in (run_dir / "trials").glob("*/checkpoints/*.ckpt"))
    for t in tasks:  # what slurmctld does to a requeueable job it pre-empts (PreemptMode=REQUEUE)
        slurm.run("scontrol", "requeue", t)
    for t in tasks:  # SLURM holds a requeued job for two minutes (BeginTime); an admin may release it at once
        _wait(f"{t} requeued", lambda t=t: slurm.job(t).get("JobState") == "PENDING")
        slurm.run("scontrol", "update", f"JobId={t}", "StartTime=now")
    ended = {t: slurm.wait_ended(t) for t in tasks}
    ended[report] = slurm.wait_ended(report)
    return {
        "storage": storage,
        "tracking": tracking,
        "run_dir": run_dir,
        "jobs": ended,
        "tasks": tasks,
        "report": report,
        "array": array,
        "checkpoints": checkpoints,
        "out": {i: (tmp / f"sweep-{array}_{i}.out").read_text() for i in (0, 1)},
        "report_out": (tmp / f"sweep-report-{report}.out").read_text(),
    }


def test_an_array_of_two_workers_finishes_the_sweep(cluster_sweep):
    s = cluster_sweep
    logs = "\n".join(s["out"].values())
    for t in s["tasks"]:
        assert s["jobs"][t]["JobState"] == "COMPLETED" and s["jobs"][t]["ExitCode"] == "0:0", logs
    trials = optuna.load_study(study_name="slurm-grid", storage=s["storage"]).get_trials()
    states = [(t.number, t.state.name, t.user_attrs) for t in trials]
    assert len(trials) == 2 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials), (
        states,
        logs,
    )
    assert {t.user_attrs["steps"] for t in trials} == {8}  # trained to the end after the resume
    _, parents, children = sweep_runs(s["tracking"], "slurm-grid")
    assert [p.info.status for p in parents] == ["FINISHED"]
    # one child run per point: the resumed trials logged into the runs they started
    assert len(children) == 2 and {c.info.status for c in children} == {"FINISHED"}


def test_a_preempted_task_is_requeued_and_its_trial_resumes_from_its_checkpoint(cluster_sweep):
    s = cluster_sweep
    assert s["checkpoints"], "no checkpoint was written before the pre-emption"
    for i, t in enumerate(s["tasks"]):
        assert s["jobs"][t]["Restarts"] == "1"  # requeued once, not failed
        out = s["out"][i]
        # --open-mode=append: the first run's output is kept above the second's
        first, _, second = out.partition(f"array task {i} (restart 1)")
        assert f"array task {i} (restart 0)" in first and second, out
        assert "stopped" in first, out  # the worker stopped the trial on the SIGTERM, at a step boundary
    # the two trials stopped after their first checkpoint resume from it (whichever task claims them)
    assert sum(o.count("(resuming)") for o in s["out"].values()) == 2, "\n".join(s["out"].values())


def test_the_follow_up_job_writes_the_report_after_the_array(cluster_sweep):
    s = cluster_sweep
    job = s["jobs"][s["report"]]
    assert job["JobState"] == "COMPLETED", s["report_out"]
    last_task_end = max(s["jobs"][t]["EndTime"] for t in s["tasks"])
    assert job["StartTime"] >= last_task_end  # afterany: once every task (requeued ones too) has ended
    report = s["run_dir"] / "report.md"
    assert f"report: {report}" in s["report_out"]
    text = report.read_text()
    assert "2 finished trials" in text and "not finished" not in text


_STEP = """
import subprocess, sys
from recursive_lightning.config import RunConfig
from recursive_lightning.sweep.launch import slurm_launcher
import yaml

cfg = RunConfig.from_dict(yaml.safe_load(open(sys.argv[1])))
rank = "import os; print('rank', os.environ['SLURM_PROCID'], 'of', os.environ['SLURM_NTASKS'], 'gpus', " \\
    "os.environ.get('SLURM_GPUS_ON_NODE'), flush=True)"
print("step exit", subprocess.run([*slurm_launcher(cfg), sys.executable, "-c", rank]).returncode, flush=True)
"""


@pytest.mark.parametrize(
    "resources, ranks",
    [
        (["--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1"], 2),
        (["--ntasks=1", "--cpus-per-task=2"], 0),
    ],
    ids=["one-task-per-device", "one-task"],
)
def test_a_two_device_point_starts_its_srun_step_in_the_array_task(
    slurm, tmp_path, tiny_run, resources, ranks
):
    """The worker's `srun` step for a point with train.devices=2, inside the allocation of sweep-array.sbatch
    sized as its comment says (one task per device): both ranks start on the node's two GPUs (stand-ins here;
    Lightning picks its own by local rank). The old sizing (one task, several CPUs) cannot hold the step."""

    raw = tiny_run()
    raw["train"].update({"devices": 2, "strategy": "ddp"})
    (tmp_path / "point.yaml").write_text(yaml.safe_dump(raw))
    (tmp_path / "step.py").write_text(_STEP)
    python = tmp_path / "python"  # RL_PYTHON: the worker replaced by the step it would start
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'step.py'} {tmp_path / 'point.yaml'}\n")
    python.chmod(0o755)
    env = {**ENV, **slurm.env, "RL_SWEEP": "s.yaml", "RL_STORAGE": "sqlite:///x", "RL_PYTHON": str(python)}
    job = slurm.run(
        "sbatch",
        "--parsable",
        "--array=0",
        *resources,
        str(SCRIPTS / "sweep-array.sbatch"),
        env=env,
        cwd=tmp_path,
    ).stdout.strip()
    slurm.wait_ended(f"{job}_0", timeout=120)
    out = (tmp_path / f"sweep-{job}_0.out").read_text()
    started = sorted(line for line in out.splitlines() if line.startswith("rank "))
    if ranks:
        assert started == ["rank 0 of 2 gpus 2", "rank 1 of 2 gpus 2"], out
        assert "step exit 0" in out, out
    else:
        assert not started and "More processors requested than permitted" in out, out
