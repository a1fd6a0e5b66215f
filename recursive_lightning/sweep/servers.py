"""Sweeps on servers: an Optuna study on PostgreSQL, an ``mlflow server``, workers on several machines.

- :func:`check_stores` refuses a ``--storage`` or ``--tracking-uri`` that is malformed, names a driver that is
  not installed, or cannot be reached, in one sentence naming it, before the sweep does any work (an
  unreachable MLflow server would otherwise be retried by MLflow's client for minutes, after training).
- :func:`database_lock` makes the preparation of a study (create it, enqueue the grid, make the MLflow parent
  run) one step across machines: a PostgreSQL advisory lock, where a file lock in the run directory only
  serialises the processes of one machine (and not every shared file system honours it).
- :class:`LocalPostgres` and :class:`LocalMlflowServer` start a throwaway PostgreSQL cluster and an
  ``mlflow server`` on it, on loopback ports: for the tests, the benchmark, and trying the cluster path on
  one machine (``python -m recursive_lightning.sweep.servers``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from recursive_lightning import interrupts
from recursive_lightning.errors import ConfigError
from recursive_lightning.processes import dies_with_parent, stop_group
from recursive_lightning.run_dir import SweepDir
from recursive_lightning.tracking.runs import absolute_uri, sqlite_parts
from recursive_lightning.tracking.stores import (
    check_database,
    check_tracking_server,
    check_tracking_store,
)
from recursive_lightning.uris import mask_url, reveal, same_server


def check_stores(storage_url: str, tracking_uri: str) -> None:
    """One sentence, before any work, for a ``--storage`` or ``--tracking-uri`` the sweep cannot use."""
    check_database(storage_url, "--storage", "Optuna storage")
    check_tracking_store(tracking_uri)


def recorded_study(storage_url: str, name: str, tracking_uri: str | None = None) -> dict[str, str]:
    """The run directory and tracking URI the study ``name`` in ``storage_url`` was prepared with (what a
    ``sweep --attach`` worker uses when not told); empty when there is no such study yet. A ``tracking_uri``
    that differs from the study's is refused in one sentence: its child runs would lose their parent."""
    import optuna  # heavy

    check_database(storage_url, "--storage", "Optuna storage")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        attrs = optuna.load_study(study_name=name, storage=storage_url).user_attrs
    except KeyError:
        return {}
    out = {k: str(attrs[k]) for k in ("run_dir", "tracking_uri") if attrs.get(k)}
    out.update(_moved_with_its_study(storage_url, out.get("run_dir")))
    if tracking_uri and out.get("tracking_uri") and not same_server(tracking_uri, out["tracking_uri"]):
        raise ConfigError(
            f"--tracking-uri '{mask_url(tracking_uri)}' is not the tracking store the study '{name}' logs to "
            f"('{mask_url(out['tracking_uri'])}'); leave --tracking-uri out to use the study's."
        )
    if (
        "tracking_uri" in out
    ):  # recorded with its password masked: filled in from this command or the environment
        out["tracking_uri"] = reveal(out["tracking_uri"])
    return out


def _moved_with_its_study(storage_url: str, recorded_dir: str | None) -> dict[str, str]:
    """A SQLite study inside a sweep directory that was moved or copied since it recorded ``recorded_dir``: the
    directory and tracking store are where the study lies now (its ``sweep.json``), not at the old path."""
    parts = sqlite_parts(absolute_uri(storage_url))
    if parts is None or recorded_dir is None:
        return {}
    here = Path(parts[0]).parent
    info = SweepDir(here).info
    if here == Path(recorded_dir) or not info.is_file():
        return {}
    try:
        tracking = json.loads(info.read_text()).get("tracking_uri")
    except ValueError:
        return {}
    return {"run_dir": str(here), **({"tracking_uri": absolute_uri(tracking, base=here)} if tracking else {})}


@contextlib.contextmanager
def database_lock(storage_url: str, name: str) -> Iterator[None]:
    """Hold a PostgreSQL advisory lock named after ``name`` in the study's database (other databases: no-op)
    for the duration: sweep commands on several machines prepare one study in turn."""
    if not storage_url.lower().startswith("postgresql"):
        yield
        return
    from sqlalchemy import create_engine, text  # heavy
    from sqlalchemy.pool import NullPool  # heavy

    key = int.from_bytes(
        hashlib.sha256(f"recursive_lightning:{name}".encode()).digest()[:8], "big", signed=True
    )
    engine = create_engine(storage_url, poolclass=NullPool)
    try:
        with engine.connect() as con:
            con.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
            try:
                yield
            finally:
                con.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
    finally:
        engine.dispose()


# --- throwaway local servers (tests, benchmark, trying the cluster path on one machine) ---------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def postgres_bindir() -> Path | None:
    """The folder holding PostgreSQL's server binaries (initdb, pg_ctl, postgres), or None."""
    candidates = []
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(Path(os.path.realpath(initdb)).parent)
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    for d in candidates:
        if all((d / b).is_file() for b in ("initdb", "pg_ctl", "postgres")):
            return d
    return None


class LocalPostgres:
    """A PostgreSQL cluster in a temporary folder on a free loopback port, trusting local connections, run as
    the database's own system user ``postgres`` when we are root (PostgreSQL refuses to run as root).
    ``fast`` turns off fsync and synchronous commits (tests); leave it off to measure."""

    def __init__(self, fast: bool = False) -> None:
        bindir = postgres_bindir()
        if bindir is None:
            raise RuntimeError("PostgreSQL's server binaries (initdb, pg_ctl, postgres) are not installed")
        self.bindir, self.fast, self.port = bindir, fast, free_port()
        self.root = Path(tempfile.mkdtemp(prefix="rl-postgres-"))
        self.data, self.log = self.root / "data", self.root / "server.log"
        self._as: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]

    def _run(self, *cmd: str) -> None:
        p = subprocess.run([*self._as, *cmd], capture_output=True, text=True, cwd=self.root)
        if p.returncode:
            raise RuntimeError(f"{' '.join(cmd[:2])} failed: {p.stderr.strip() or p.stdout.strip()}")

    def start(self) -> LocalPostgres:
        try:
            self._start()
        except BaseException:  # SIGTERM / Ctrl-C while it starts: no server left behind
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                  "--no-sync", "--no-instructions")  # fmt: skip
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c max_connections=300"
        if self.fast:
            opts += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run(
            str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "start"
        )

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """CREATE DATABASE ``name``; returns its URL."""
        import psycopg  # optional

        with psycopg.connect(
            f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True
        ) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalPostgres:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalMlflowServer:
    """``mlflow server`` on a free loopback port, its backend store ``backend_uri`` (a PostgreSQL database),
    artifacts served from ``artifacts`` (``--serve-artifacts``: workers reach them through the server)."""

    def __init__(self, backend_uri: str, artifacts: str | os.PathLike, workers: int = 1) -> None:
        self.backend_uri, self.artifacts, self.workers = backend_uri, Path(artifacts), workers
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> LocalMlflowServer:
        try:
            return self._start(timeout)
        except BaseException:  # SIGTERM / Ctrl-C while it starts: stop what it started already
            self.stop()
            raise

    def _start(self, timeout: float) -> LocalMlflowServer:
        self.artifacts.mkdir(parents=True, exist_ok=True)
        self._log = open(self.artifacts.parent / f"mlflow-server-{self.port}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.backend_uri,
             "--serve-artifacts", "--artifacts-destination", str(self.artifacts),
             "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(self.workers)],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=dies_with_parent(signal.SIGTERM),  # no server left behind by a killed test or benchmark
        )  # fmt: skip
        deadline = time.time() + timeout
        while True:
            try:
                check_tracking_server(self.uri)
                return self
            except ConfigError:
                if self.proc.poll() is not None or time.time() > deadline:
                    log = Path(self._log.name).read_text()[-2000:]
                    raise RuntimeError(f"mlflow server did not start:\n{log}") from None
                time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None:  # the server's whole process group: uvicorn and huey workers too
            stop_group(self.proc, timeout=10)
        if getattr(self, "_log", None) is not None:
            self._log.close()

    def __enter__(self) -> LocalMlflowServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _interrupt(signum, frame) -> None:
    if interrupts.defer_in_hook(signum, frame):
        return
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second one must not cut the stopping short
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def main() -> int:
    """Start a throwaway PostgreSQL and an ``mlflow server`` on it, print the two URLs; Ctrl-C, SIGTERM or a
    closed terminal stops both servers and every process they started."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    with contextlib.suppress(KeyboardInterrupt), LocalPostgres() as pg:
        storage = pg.create_database("optuna")
        backend = pg.create_database("mlflow")
        with LocalMlflowServer(backend, pg.root / "artifacts") as server:
            print(mask_url(f"--storage {storage} --tracking-uri {server.uri}"), flush=True)
            while True:
                time.sleep(3600)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
