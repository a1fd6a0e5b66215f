"""How a command says it was stopped, and what it keeps quiet: Ctrl-C of `train` prints the exact command that
resumes it; SIGTERM inside a training step prints that sentence without Lightning's "[rank: 0] Received
SIGTERM" line; a sweep stopped while it starts says so in one line (exit 143, nothing written); Ctrl-C of a
sweep with two workers says "interrupted" once; a run directory copied to a new path resumes without
Lightning's "dirpath has changed" warning and moves its MLflow run's `run_dir` tag, or is refused while the
directory the tag names still logs to that same run. Each stop comes at a named fault point (``pause``)."""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import ENV, command_output, run_of, sweep_runs, write_sweep

from recursive_lightning import faults, interrupts
from recursive_lightning.sweep.launch import Stop, on_sigterm

QUIET = {**ENV, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}


def _stopped(argv: list, tmp_path: Path, point: str, signum: int, group: bool = False) -> tuple[int, str]:
    """``python -m recursive_lightning *argv`` held at the fault point ``point`` (``NAME:N``) until ``signum``
    arrives (to its whole process group with ``group``: a terminal's Ctrl-C): (exit status, output)."""
    mark = tmp_path / "at-point"
    env = {
        **QUIET,
        "RECURSIVE_LIGHTNING_FAULT": f"{point}:pause",
        "RECURSIVE_LIGHTNING_FAULT_MARK": str(mark),
    }
    p = subprocess.Popen(
        [sys.executable, "-m", "recursive_lightning", *map(str, argv)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=group,
        # as from a terminal: Python's Ctrl-C handler installed (a shell's background job ignores SIGINT)
        preexec_fn=None if group else (lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)),
    )
    try:
        while not mark.exists():
            assert p.poll() is None, p.communicate()[0]
            try:
                p.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
        if group:
            os.killpg(p.pid, signum)
        else:
            p.send_signal(signum)
        out, _ = p.communicate(timeout=600)
    finally:
        p.kill()
    return p.returncode, out


def _config(tmp_path: Path, tiny_run) -> Path:
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump(tiny_run()))
    return cfg_file


def test_ctrl_c_of_train_prints_the_command_that_resumes_it(tmp_path, tiny_run):
    run_dir = tmp_path / "run"
    argv = ["train", "--config", _config(tmp_path, tiny_run), "--run-dir", run_dir]
    code, out = _stopped(argv, tmp_path, "training_step:6", signal.SIGINT)  # after the checkpoint at step 4
    assert code == 130 and "Traceback" not in out, out
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"train: interrupted at step \d+; the run is resumable from its last checkpoint: python -m "
        rf"recursive_lightning train --resume --run-dir {re.escape(str(run_dir))}",
        last,
    ), out
    assert run_of(run_dir).info.status == "KILLED"
    # the printed command does what it says
    command = last.split(": ")[-1].split()
    assert command[0] == "python"
    resumed = subprocess.run([sys.executable, *command[1:]], env=QUIET, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert run_of(run_dir).info.status == "FINISHED"


def test_sigterm_inside_a_training_step_is_one_sentence_without_lightnings_line(tmp_path, tiny_run):
    run_dir = tmp_path / "run"
    argv = ["train", "--config", _config(tmp_path, tiny_run), "--run-dir", run_dir]
    code, out = _stopped(argv, tmp_path, "training_step:6", signal.SIGTERM)
    assert code == 143, out
    assert "Received SIGTERM" not in out, out
    assert (
        out.strip()
        .splitlines()[-1]
        .endswith(
            f"the run is resumable from its last checkpoint: python -m recursive_lightning train --resume --run-dir "
            f"{run_dir}"
        )
    ), out


def test_sigterm_while_a_sweep_starts_is_one_line_and_writes_nothing(tmp_path, data_cache):
    spec = write_sweep(tmp_path / "s.yaml", data_cache, "s", {"variant": {"a": {"model.topology": "base"}}})
    run_dir = tmp_path / "out"
    code, out = _stopped(["sweep", spec, "--run-dir", run_dir], tmp_path, "sweep_checked:1", signal.SIGTERM)
    assert code == 143, out
    assert out.strip().splitlines() == [
        "sweep: stopped by SIGTERM while starting, before any trial; run the same command again."
    ], out
    assert not run_dir.exists()


@pytest.mark.parametrize("point", ["parent_created:1", "parent_opened:1"])
def test_sigterm_once_the_parent_run_exists_closes_it_killed(tmp_path, data_cache, point):
    """Stopped while it starts, after its MLflow parent run was made (before or after the study records it):
    the same one line and exit 143, and the parent run is KILLED, not left RUNNING; the same command then runs
    the sweep to the end in the one parent run the study records."""
    spec = write_sweep(tmp_path / "s.yaml", data_cache, "s", {"variant": {"a": {"model.topology": "base"}}})
    run_dir = tmp_path / "out"
    code, out = _stopped(["sweep", spec, "--run-dir", run_dir], tmp_path, point, signal.SIGTERM)
    assert code == 143, out
    assert out.strip().splitlines()[-1] == (
        "sweep: stopped by SIGTERM while starting, before any trial; run the same command again."
    ), out
    tracking = f"sqlite:///{run_dir / 'mlflow.db'}"
    _, parents, _ = sweep_runs(tracking, "s")
    assert [p.info.status for p in parents] == ["KILLED"]
    code, out = command_output("sweep", spec, "--run-dir", run_dir, env=QUIET)
    assert code == 0, out
    _, parents, children = sweep_runs(tracking, "s")
    assert sorted(p.info.status for p in parents) == (
        ["FINISHED"] if point == "parent_opened:1" else ["FINISHED", "KILLED"]
    )
    assert len(children) == 1 and children[0].info.status == "FINISHED"


def test_ctrl_c_of_a_sweep_with_two_workers_says_interrupted_once(tmp_path, data_cache):
    """Ctrl-C reaches the sweep command and both its workers (one process group, as from a terminal) while one
    worker is inside a training step: one line says the sweep was interrupted, exit 130."""
    axes = {"variant": {"a": {"model.topology": "base"}, "b": {"model.topology": "mesh"}}}
    spec = write_sweep(tmp_path / "s.yaml", data_cache, "s", axes, workers=2)
    argv = ["sweep", spec, "--run-dir", tmp_path / "out"]
    code, out = _stopped(argv, tmp_path, "training_step:2", signal.SIGINT, group=True)
    assert code == 130, out
    assert out.count("interrupted") == 1, out
    assert "[sweep s] interrupted; re-run the same command to resume it" in out, out
    assert "Traceback" not in out, out


def test_a_copied_run_directory_resumes_quietly_and_takes_its_mlflow_run_with_it(trained_run, tmp_path):
    run = shutil.copytree(trained_run, tmp_path / "copy")
    assert run_of(run).data.tags["run_dir"] == str(trained_run)
    code, out = command_output("train", "--resume", "--run-dir", run, "--max-steps", 16, timeout=600)
    assert code == 0, out
    assert "dirpath has changed" not in out and "is not empty" not in out, out
    assert run_of(run).data.tags["run_dir"] == str(run)
    assert run_of(trained_run).data.tags["run_dir"] == str(trained_run)  # its own store: untouched


def test_a_copy_that_shares_its_mlflow_run_with_a_live_directory_is_refused(tmp_path, tiny_run):
    """Two directories logging to one MLflow run in one store (a store outside the run directory): the copy's
    resume is refused in one sentence, nothing changes; once the first is gone, the copy takes the run over."""
    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    first = tmp_path / "first"
    code, out = command_output(
        "train", "--config", _config(tmp_path, tiny_run), "--run-dir", first, "--tracking-uri", shared
    )
    assert code == 0, out
    copy = shutil.copytree(first, tmp_path / "copy")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in copy.rglob("*"))
    code, out = command_output("train", "--resume", "--run-dir", copy, "--max-steps", 16)
    assert code == 2, out
    run = run_of(first)
    assert out.strip().splitlines()[-1] == (
        f"error: --resume: the MLflow run {run.info.run_id} in {shared} is the run of '{first}', which still "
        f"exists and logs to it; resume '{first}' instead, or move (not copy) it to '{copy}'."
    ), out
    assert sorted((p.name, p.stat().st_mtime_ns) for p in copy.rglob("*")) == before
    assert run_of(first).info.status == "FINISHED" and run_of(first).data.tags["run_dir"] == str(first)
    shutil.rmtree(first)
    code, out = command_output("train", "--resume", "--run-dir", copy, "--max-steps", 16)
    assert code == 0, out
    assert run_of(copy).data.tags["run_dir"] == str(copy)


@pytest.mark.parametrize("command", ["probe", "eval", "generate", "describe", "report"])
def test_sigterm_while_a_command_starts_is_one_line(command, tmp_path):
    """The commands without a handler of their own (they write only finished results) say in one line that
    SIGTERM stopped them, exit 143, where the default action killed them silently."""
    code, out = _stopped([command, tmp_path / "run"], tmp_path, "command_started:1", signal.SIGTERM)
    assert code == 143, out
    assert out.strip().splitlines() == [
        f"{command}: stopped by SIGTERM before it finished; run the same command again."
    ], out
    assert list(tmp_path.iterdir()) == [tmp_path / "at-point"]


@pytest.mark.parametrize("raised,signum", [(KeyboardInterrupt, signal.SIGINT), (Stop, signal.SIGTERM)])
def test_an_interrupt_that_lands_in_a_finalizer_reaches_the_command_without_a_traceback(
    capsys, monkeypatch, raised, signum
):
    """Ctrl-C (or a sweep's SIGTERM stop) raised inside a finalizer, as in SQLAlchemy's weakref callbacks during
    garbage collection, is raised again as its signal by the commands' unraisable hook: the command stops (the
    exception arrives at the next check) and no "Exception ignored ... Traceback" is printed."""
    monkeypatch.setattr(
        sys, "unraisablehook", functools.partial(interrupts.unraisable_hook, sys.__unraisablehook__)
    )
    before = signal.getsignal(signum)
    if signum == signal.SIGTERM:
        signal.signal(signal.SIGTERM, on_sigterm)

    class Finalised:
        def __del__(self):
            raise raised()

    try:
        with pytest.raises(raised):
            Finalised()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # until the signal is handled (at once, here)
                pass
    finally:
        signal.signal(signum, before)
    assert "Exception ignored" not in capsys.readouterr().err


@pytest.mark.parametrize("in_finalizer", [KeyboardInterrupt, ValueError])
def test_a_sigterm_stop_that_lands_inside_the_unraisable_hook_still_stops_once(
    capsys, monkeypatch, tmp_path, in_finalizer
):
    """A sweep's SIGTERM stop that arrives while the unraisable hook handles a finalizer's exception (Ctrl-C to a
    process group lands in a finalizer, then the sweep command's SIGTERM reaches its worker) is delivered again
    once the hook has returned: the command stops, once, and nothing is printed as "Exception ignored in
    sys.unraisablehook" (the hook's own exception, after which Python drops both stops). The SIGTERM comes at
    the hook's fault point."""
    mark = tmp_path / "in-hook"
    monkeypatch.setenv(faults.ENV, "unraisable_hook:1:pause")
    monkeypatch.setenv(faults.MARK_ENV, str(mark))
    monkeypatch.setattr(faults, "_seen", {})
    monkeypatch.setattr(
        sys, "unraisablehook", functools.partial(interrupts.unraisable_hook, sys.__unraisablehook__)
    )

    def send_once_held() -> None:
        while not mark.exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    class Finalised:
        def __del__(self):
            raise in_finalizer()

    before = signal.signal(signal.SIGTERM, on_sigterm)
    threading.Thread(target=send_once_held, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt) as stopped:
            Finalised()  # its exception goes to the hook, held at the fault point until SIGTERM arrives
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # until the stop is delivered again (10 ms after the hook)
                pass
    finally:
        signal.signal(signal.SIGTERM, before)
    assert stopped.type is Stop  # the first stop to be delivered again; the Ctrl-C it met is not raised twice
    assert "in sys.unraisablehook" not in capsys.readouterr().err
