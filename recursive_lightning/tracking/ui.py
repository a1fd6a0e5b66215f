"""Serving the MLflow UI of a run or sweep directory, wherever it lies now (the ``ui`` command: ``commands/ui.py``).

MLflow keeps absolute artifact locations in its store, so a directory copied to a laptop or moved to shared
storage would show "No Artifacts Recorded" under a plain ``mlflow ui``. The command finds the directory's
store (``sweep.json`` of a sweep, ``mlflow_tracking_uri`` of a run), points its artifact locations at the
directory's current place (``tracking.runs.relocate_artifacts``; on a read-only copy, in a private copy of the
database), and serves it with ``mlflow server`` on 127.0.0.1. A server-backed store (``--tracking-uri
http://...``) is served by its own server: the command prints its address.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib.metadata import entry_points
from pathlib import Path

from recursive_lightning import faults
from recursive_lightning.errors import UserError
from recursive_lightning.processes import dies_with_parent, stop_group
from recursive_lightning.run_dir import SweepDir
from recursive_lightning.tracking.mlflow_app import APP_NAME
from recursive_lightning.tracking.runs import (
    absolute_uri,
    default_tracking_uri,
    relocate_artifacts,
    sqlite_parts,
)
from recursive_lightning.uris import mask_url, reveal


def store_of(run_dir: str | os.PathLike) -> str:
    """The tracking URI a run or sweep directory logs to (relative SQLite paths resolved where it lies now)."""
    d = Path(run_dir).resolve()
    if not d.is_dir():
        raise UserError(
            f"ui: '{run_dir}' is not a folder; pass a run or sweep directory (what --run-dir named)."
        )
    info = SweepDir(d).info
    if info.is_file():
        try:
            uri = json.loads(info.read_text()).get("tracking_uri")
        except ValueError:
            uri = None
        if uri:  # recorded with its password masked: filled in from the environment
            return reveal(absolute_uri(uri, base=d))
    uri = default_tracking_uri(d)
    parts = sqlite_parts(uri)
    if parts is not None and not Path(parts[0]).is_file():
        raise UserError(
            f"ui: '{run_dir}' holds no MLflow store (no mlflow.db, sweep.json or mlflow_tracking_uri); pass the "
            "directory a `train` or `sweep` wrote (its --run-dir)."
        )
    return uri


def servable(uri: str, workdir: Path) -> str:
    """``uri`` with its artifact locations pointing where the store lies now: rewritten in place, or, when
    the store cannot be written (a read-only copy), in a private copy under ``workdir``."""
    parts = sqlite_parts(uri)
    if parts is None:
        return uri
    db = Path(parts[0])
    if os.access(db, os.W_OK) and os.access(db.parent, os.W_OK):
        relocate_artifacts(uri)
        return uri
    copy = workdir / db.name
    shutil.copyfile(db, copy)
    private = f"sqlite:///{copy}{parts[1]}"
    relocate_artifacts(private, root=db.parent)
    return private


def check_address(host: str, port: int) -> None:
    """One sentence for a port outside 1-65535 or a host name that does not resolve."""
    if not 1 <= port <= 65535:
        raise UserError(f"ui: --port must be between 1 and 65535, not {port}; e.g. --port 5000.")
    try:
        socket.getaddrinfo(host, port)
    except OSError:
        raise UserError(
            f"ui: --host '{host}' is not an address of this machine; e.g. --host 127.0.0.1."
        ) from None


def free_port(host: str, preferred: int) -> int:
    for port in (preferred, *range(preferred + 1, min(preferred + 50, 65536))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def app_args() -> list[str]:
    """``--app-name recursive-lightning`` (``mlflow_app.py``: the page that opens the classic view) where the
    package is installed with its entry point; MLflow's plain server otherwise (links then carry only
    ``workflowType``)."""
    if any(e.name == APP_NAME for e in entry_points(group="mlflow.app")):
        return ["--app-name", APP_NAME]
    return []


def start_server(uri: str, host: str, port: int, workdir: Path) -> subprocess.Popen:
    """``mlflow server`` on ``uri`` at host:port, returned once it answers (or raising if it exits)."""
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
        *app_args(),
        # artifacts logged through this server (none by this package) go beside the store
        "--artifacts-destination",
        str(workdir / "served-artifacts"),
    ]
    # the store through the environment (mlflow's own --backend-store-uri variable): a password stays off the
    # server's command line
    env = {**os.environ, "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false", "MLFLOW_BACKEND_STORE_URI": uri}
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 (open for the server's lifetime)
    # its own session: Ctrl-C reaches this command, which stops it; SIGTERM if this command dies otherwise
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=dies_with_parent(signal.SIGTERM),
    )
    url = f"http://{host}:{port}/health"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            faults.point("ui_server_starting")
            if proc.poll() is not None:
                reason = last_error((workdir / "server.log").read_text(errors="replace"))
                raise UserError(
                    f"ui: mlflow server could not serve the store {mask_url(uri)} (exit code {proc.returncode}): "
                    f"{reason}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return proc
            except OSError:
                time.sleep(0.3)
    except BaseException:  # SIGTERM / Ctrl-C while it starts: its uvicorn and huey workers are stopped too
        stop_server(proc)
        raise
    stop_server(proc)
    raise UserError(
        f"ui: mlflow server on {host}:{port} did not answer within 120 s; see {workdir}/server.log."
    )


def last_error(log: str) -> str:
    """The error a server's log ends with, without the stack lines before it or the exception's module path
    (``mlflow.exceptions.MlflowException: ...`` -> ``MlflowException: ...``)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    if not lines:
        return "it wrote nothing"
    kind, sep, message = lines[-1].partition(": ")
    if sep and " " not in kind:  # a qualified exception name before the message
        return f"{kind.rsplit('.', 1)[-1]}: {message}"
    return lines[-1]


def stop_server(proc: subprocess.Popen) -> None:
    """Stop the server with every process of its group (uvicorn, huey workers), not only the leader."""
    stop_group(proc, timeout=30)
