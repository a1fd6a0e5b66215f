"""Commands that start servers stop every process they started on SIGTERM or Ctrl-C, checked by pid: the
throwaway stores of ``python -m recursive_lightning.sweep.servers`` (PostgreSQL, ``mlflow server`` with its
uvicorn and huey workers) and ``ui`` signalled while its server is still starting (a named pause point, not a
timing)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from recursive_lightning.sweep import servers

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
ENV.pop("RECURSIVE_LIGHTNING_FAULT", None)


def _poll(what: str, done, timeout: float = 180.0):
    """Poll ``done()`` until it returns something true (a bound, not a guess at a timing)."""
    deadline = time.monotonic() + timeout
    while not (value := done()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f}s")
        time.sleep(0.2)
    return value


def _tree(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        return psutil.Process(pid).children(recursive=True)
    return []


def _running(procs: list[psutil.Process]) -> list[str]:
    """The processes of ``procs`` still running (a zombie awaiting its reaper has stopped)."""
    alive = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
    return alive


def _cmdline(p: psutil.Process) -> str:
    """``p``'s command line; empty once it has exited or is a zombie (it can turn into one between any two
    calls: ``is_running()`` is still true for a zombie, and ``cmdline()`` then raises ``ZombieProcess``)."""
    with contextlib.suppress(psutil.NoSuchProcess):  # ZombieProcess is a NoSuchProcess
        return " ".join(p.cmdline())
    return ""


def _huey(procs: list[psutil.Process]) -> bool:
    return any("huey" in _cmdline(p) for p in procs)


def _kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


@pytest.mark.skipif(
    servers.postgres_bindir() is None, reason="PostgreSQL's server binaries are not installed"
)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_throwaway_servers_stop_every_process_on_a_signal(sig):
    cmd = subprocess.Popen(
        [sys.executable, "-m", "recursive_lightning.sweep.servers"],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    procs: list[psutil.Process] = []
    try:
        line = cmd.stdout.readline()
        assert line.startswith("--storage postgresql"), line + cmd.stdout.read()
        port = line.split("@127.0.0.1:", 1)[1].split("/", 1)[0]
        postmaster = next(
            p for p in psutil.process_iter(["cmdline"]) if f"-p {port}" in " ".join(p.info["cmdline"] or [])
        )
        # the mlflow server's group is complete (its job runner starts the huey consumers after it answers)
        _poll("huey consumers", lambda: _huey(_tree(cmd.pid)))
        procs = [*_tree(cmd.pid), postmaster, *_tree(postmaster.pid)]
        assert any("uvicorn" in _cmdline(p) for p in procs)
        cmd.send_signal(sig)
        assert cmd.wait(timeout=120) == 0
        assert not _running(procs)  # at once: nothing left to stop on its own later
    finally:
        cmd.kill()
        _kill(procs)


@pytest.mark.parametrize("point", ["ui_server_starting", "ui_links"])
def test_ui_signalled_while_its_server_starts_stops_the_server_group(point, tmp_path):
    """SIGTERM while the server starts, or once it answers but before the links are printed: every process of
    the server's group (uvicorn, huey) is stopped before `ui` exits."""
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(store).create_experiment("e")
    mark = tmp_path / "paused"
    env = {
        **ENV,
        "RECURSIVE_LIGHTNING_FAULT": f"{point}:1:pause",
        "RECURSIVE_LIGHTNING_FAULT_MARK": str(mark),
    }
    ui = subprocess.Popen(
        [sys.executable, "-m", "recursive_lightning", "ui", "--tracking-uri", store, "--port", "5350"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    procs: list[psutil.Process] = []
    try:
        _poll("ui waiting for its server", mark.exists)
        _poll(
            "the server's huey consumers", lambda: _huey(_tree(ui.pid))
        )  # ui still waits at its pause point
        procs = _tree(ui.pid)
        assert any("uvicorn" in _cmdline(p) for p in procs)
        ui.send_signal(signal.SIGTERM)
        ui.wait(timeout=120)
        out = ui.stdout.read()
        if point == "ui_server_starting":
            assert "MLflow UI at" not in out  # it was stopped while starting
        assert "Traceback" not in out and not _running(procs), out
    finally:
        ui.kill()
        _kill(procs)
