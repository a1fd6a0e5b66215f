"""One writer per run directory: a second `train` into a directory another live process writes is refused in one
sentence naming the holder (exit 2) and changes nothing; a dead holder's lock is taken over; a sweep worker
whose trial directory is held waits for it instead of training into it. Two real processes each time, held at
a named fault point or by a helper process that holds the lock until its stdin closes: no timing is guessed."""

import contextlib
import hashlib
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import ENV, run_of, run_sweep, write_sweep
from mlflow.tracking import MlflowClient

# the holder is paused mid-step with nothing else running: MLflow's system-metrics thread would write meanwhile
QUIET = {**ENV, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}

# a process that holds a directory's writer lock until its stdin closes
_HOLDER = """
import sys
from recursive_lightning.training.run_lock import run_dir_lock
with run_dir_lock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


@contextlib.contextmanager
def holding(folder: Path) -> Iterator[int]:
    """A helper process holding ``folder``'s writer lock (its pid) until the block ends and closes its stdin."""
    helper = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(folder)],
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert helper.stdout.readline() == "held\n"
        yield helper.pid
    finally:
        helper.stdin.close()
        helper.wait(timeout=60)


def _train(*args) -> list[str]:
    return [sys.executable, "-m", "recursive_lightning", "train", *map(str, args)]


def snapshot(folder: Path) -> dict[str, tuple]:
    """Every file and folder under ``folder``: size, modification time and content hash."""
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.stat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        out[str(p.relative_to(folder))] = (st.st_size, st.st_mtime_ns, digest)
    return out


def paused_train(cfg_file: Path, run_dir: Path, mark: Path, step: int) -> subprocess.Popen:
    """`train --config cfg_file --run-dir run_dir` started to pause inside training step ``step`` (the fault
    point writes ``mark`` when it gets there; ``wait_for(mark, proc)``), holding the directory."""
    env = {
        **QUIET,
        "RECURSIVE_LIGHTNING_FAULT": f"training_step:{step}:pause",
        "RECURSIVE_LIGHTNING_FAULT_MARK": str(mark),
    }
    return subprocess.Popen(
        _train("--config", cfg_file, "--run-dir", run_dir),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(path: Path, proc: subprocess.Popen) -> None:
    """Until ``proc`` has created ``path`` (a fault point's mark); fails if it ends first."""
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0]
        try:
            proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass


def test_a_second_train_into_a_run_dir_in_use_is_refused_and_a_dead_holders_lock_is_taken_over(
    tmp_path, tiny_run
):
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump(tiny_run()))
    run_dir, mark = tmp_path / "run", tmp_path / "paused"
    # the first holds the directory, paused inside its second step (before its first checkpoint)
    first = paused_train(cfg_file, run_dir, mark, step=2)
    try:
        wait_for(mark, first)
        before = snapshot(run_dir)
        assert "config.yaml" in before and "mlflow_run_id" in before
        # a second command with another config into the same directory
        second = subprocess.run(
            _train("--config", cfg_file, "--run-dir", run_dir, "--max-steps", 8, "--seed", 1),
            env=QUIET,
            capture_output=True,
            text=True,
            timeout=600,
        )
        err = second.stderr.strip()
        assert second.returncode == 2, second.stdout + second.stderr
        assert err == (
            f"error: --run-dir '{run_dir}' is being written by another process (pid {first.pid} on "
            f"{socket.gethostname()}); wait for it to end, or choose another --run-dir."
        ), err
        assert snapshot(run_dir) == before  # it wrote nothing: no config, no MLflow run, no checkpoint
        c = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
        runs = c.search_runs([e.experiment_id for e in c.search_experiments()])
        assert len(runs) == 1 and runs[0].data.params["train.max_steps"] == "12"
    finally:
        first.kill()  # SIGKILL: no cleanup, its lock file stays behind
        first.wait()
    assert (run_dir / ".writer.lock").exists()
    # the dead holder's lock is taken over: the run resumes and finishes, its lock file removed at its end
    resumed = subprocess.run(
        _train("--config", cfg_file, "--run-dir", run_dir, "--resume"),
        env=QUIET,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert (run_dir / "result.json").exists() and not (run_dir / ".writer.lock").exists()


def test_the_holders_own_processes_go_on_and_a_refused_lock_leaves_nothing(tmp_path, monkeypatch):
    """In this process: a lock held by a helper process is refused with RunDirBusy, unless the environment
    says the helper started this process for that directory; a second lock of a directory this process holds
    is a no-op; ranks other than the first do not take it; an unused lock leaves no directory behind."""
    import pytest

    from recursive_lightning.training import run_lock

    d = tmp_path / "held"
    with holding(d) as pid:
        with pytest.raises(run_lock.RunDirBusy, match=f"pid {pid} on {socket.gethostname()}"):
            with run_lock.run_dir_lock(d):
                pass
        monkeypatch.setenv(run_lock.HELD_ENV, json.dumps({str(d.resolve()): [pid, socket.gethostname()]}))
        with run_lock.run_dir_lock(d):  # started by the holder to do its work: goes on
            pass
        monkeypatch.delenv(run_lock.HELD_ENV)
    assert not (d / run_lock.LOCK_FILE).exists()  # removed by its holder at its end
    with run_lock.run_dir_lock(d), run_lock.run_dir_lock(d):  # nested in one process
        assert (d / run_lock.LOCK_FILE).exists()
    fresh = tmp_path / "fresh"
    with run_lock.run_dir_lock(fresh):
        assert fresh.is_dir()
    assert not fresh.exists()  # created for the lock, nothing written: removed
    assert not run_lock.first_rank({"LOCAL_RANK": "1"}) and not run_lock.first_rank({"SLURM_PROCID": "3"})
    assert run_lock.first_rank({"SLURM_PROCID": "0", "LOCAL_RANK": "0"}) and run_lock.first_rank({})


def test_a_sweep_worker_waits_for_a_trial_directory_another_process_writes(tmp_path, data_cache):
    from recursive_lightning.sweep.spec import load_sweep, point_key

    spec = write_sweep(
        tmp_path / "lock.yaml", data_cache, "lock-sweep", {"variant": {"mesh": {"model.topology": "mesh"}}}
    )
    run_dir = tmp_path / "run"
    (point,) = load_sweep(spec).grid()
    trial_dir = run_dir / "trials" / point_key(point)
    with holding(trial_dir) as pid:  # at its end the holder ends: the worker takes the directory and trains
        sweep = run_sweep([spec, "--run-dir", run_dir, "--no-report"])
        seen = []
        for line in sweep.stdout:  # until the worker says it waits (or the sweep ends without waiting)
            seen.append(line)
            if "waiting for its directory" in line:
                break
        text = "".join(seen)
        assert f"held by pid {pid} on {socket.gethostname()}" in seen[-1], text
        assert sorted(p.name for p in trial_dir.iterdir()) == [".writer.lock"]  # nothing written meanwhile
    out, _ = sweep.communicate(timeout=600)
    assert sweep.returncode == 0, text + out
    assert (trial_dir / "sweep_result.json").exists() and not (trial_dir / ".writer.lock").exists()


@pytest.mark.parametrize("then", ["eval", "refused-resume"])
def test_a_killed_writers_run_is_closed_killed_by_the_next_command(then, tmp_path, tiny_run):
    """`train` killed by SIGKILL after its first checkpoint leaves its MLflow run RUNNING and its lock file
    behind; the next command into the directory (`eval` of it, or a `train --resume` that is then refused) finds
    the lock abandoned, marks the run KILLED and says so in one line."""
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump(tiny_run()))
    run_dir, mark = tmp_path / "run", tmp_path / "paused"
    first = paused_train(cfg_file, run_dir, mark, step=6)
    try:
        wait_for(mark, first)
    finally:
        first.kill()  # SIGKILL: nothing closes its run
        first.communicate()
    assert run_of(run_dir).info.status == "RUNNING" and (run_dir / ".writer.lock").exists()
    if then == "eval":
        (tmp_path / "t.txt").write_text("the shared core loops over the middle layers. " * 20)
        argv = [
            sys.executable,
            "-m",
            "recursive_lightning",
            "eval",
            str(run_dir),
            "--ppl",
            str(tmp_path / "t.txt"),
        ]
        p = subprocess.run([*argv, "--tasks", "none"], env=QUIET, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout + p.stderr
    else:
        p = subprocess.run(
            _train("--run-dir", run_dir, "--resume", "--max-steps", 2),
            env=QUIET,
            capture_output=True,
            text=True,
        )
        assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("error: "), p.stderr
    run = run_of(run_dir)
    assert run.info.status == "KILLED", p.stdout + p.stderr
    said = [line for line in p.stderr.splitlines() if line.startswith("note: the MLflow run")]
    assert said == [
        f"note: the MLflow run {run.info.run_id} of '{run_dir}' was left RUNNING by its writer (pid {first.pid} on "
        f"{socket.gethostname()}), which is gone; marked it KILLED."
    ], p.stderr
