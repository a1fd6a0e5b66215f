"""One writer per run directory: an exclusive ``flock`` on ``<run-dir>/.writer.lock`` held for the writer's life.

Two commands training into one directory at once would mix their files (the second's ``config.yaml``, the
first's MLflow params, checkpoints of two models). The writer holds the lock from before it writes anything
until it ends; the kernel releases it when the process dies however it dies (a SIGKILL, a lost node), so a
dead writer's lock is simply taken over. The file records the holder's pid and host for the refusal sentence
and is removed when the holder ends normally.

A process the holder starts to do its work (a sweep worker's ``train`` process, Lightning's or ``srun``'s
further ranks) finds the lock held by its ancestor through ``RECURSIVE_LIGHTNING_RUN_DIR_HELD`` and goes on;
ranks other than the first never take it (``first_rank``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from recursive_lightning import faults
from recursive_lightning.errors import UserError
from recursive_lightning.files import writable_dir_problem
from recursive_lightning.run_dir import RunDir
from recursive_lightning.tracking.runs import client, default_tracking_uri, set_terminated

LOCK_FILE = RunDir.WRITER_LOCK
HELD_ENV = (
    "RECURSIVE_LIGHTNING_RUN_DIR_HELD"  # {run dir: [pid, host]} of the locks this process's ancestors hold
)
POLL_S = 0.5  # how often a waiting sweep worker tries again
_held: set[str] = set()  # run directories this process holds (a nested lock of the same directory is a no-op)


class RunDirBusy(UserError):
    """Another live process writes the run directory."""


def holder(run_dir: str | os.PathLike) -> dict[str, object]:
    """The pid and host the lock file of ``run_dir`` records (empty when there is none or it is unreadable)."""
    try:
        data = json.loads(RunDir(run_dir).writer_lock.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def describe_holder(info: dict[str, object]) -> str:
    if not info.get("pid"):
        return "another process"
    return f"pid {info['pid']} on {info.get('host') or 'an unknown host'}"


def first_rank(environ: dict[str, str] | None = None) -> bool:
    """Whether this process is the first rank of its job (or not one of several): the ranks Lightning, ``srun``
    or ``torchrun`` start beside it write through it and never take the lock."""
    env = os.environ if environ is None else environ
    for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"):
        value = env.get(key, "").strip()
        if value.isdigit() and int(value) != 0:
            return False
    return True


def _held_for_us(path: str, info: dict[str, object]) -> bool:
    """Whether the process that holds ``path`` is the one that started this process to do its work there."""
    try:
        given = json.loads(os.environ.get(HELD_ENV) or "{}").get(path)
    except (ValueError, AttributeError):
        return False
    return bool(given) and [info.get("pid"), info.get("host")] == list(given)


def _try_lock(lock: Path) -> int | None:
    """An open descriptor of ``lock`` holding its exclusive lock, or None while another process holds it. A
    file removed or replaced between our open and our lock (its holder ended) is opened again."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError:
            os.close(fd)
            raise
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


@contextlib.contextmanager
def run_dir_lock(
    run_dir: str | os.PathLike,
    *,
    on_wait: Callable[[dict[str, object]], None] | None = None,
    what: str = "--run-dir",
) -> Iterator[None]:
    """Hold ``run_dir``'s writer lock for the block (the directory is created if missing). Held by another live
    process, it is refused in one sentence naming the holder (:class:`RunDirBusy`), or, with ``on_wait``, waited
    for (``on_wait(holder)`` is called once; a signal handler that raises ends the wait). On exit the lock file
    is removed, and the directory and its parents too where this lock created them and nothing else was written
    there. A directory that cannot be written is left to the command's own check (nothing can be written to
    it)."""
    path = os.path.abspath(os.path.realpath(run_dir))
    if path in _held or writable_dir_problem(path) is not None:
        yield
        return
    folder = Path(path)
    created = _make_dirs(folder)
    lock = RunDir(folder).writer_lock
    announced = False
    while True:
        try:
            fd = _try_lock(lock)
        except FileNotFoundError:  # the directory was removed by a refused command that had created it
            created = sorted({*created, *_make_dirs(folder)}, key=lambda p: len(p.parts), reverse=True)
            continue
        except (
            OSError
        ) as e:  # a file system without flock (ENOLCK, EOPNOTSUPP): one writer cannot be enforced
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            yield
            return
        if fd is not None:
            break
        info = holder(folder)
        for _ in range(50):  # its holder has locked it and is about to record itself
            if info:
                break
            time.sleep(0.02)
            info = holder(folder)
        if _held_for_us(path, info):
            yield
            return
        if on_wait is None:
            raise RunDirBusy(
                f"{what} '{run_dir}' is being written by another process ({describe_holder(info)}); wait for it "
                f"to end, or choose another {what}."
            )
        if not announced:
            on_wait(info)
            announced = True
        time.sleep(POLL_S)
    dead = holder(folder)  # a record nobody holds: its writer died without ending (a SIGKILL, a lost node)
    before = _record_holder(fd, path)
    try:
        if dead.get("pid"):
            close_dead_writers_run(folder, dead)
        faults.point("run_dir_locked")  # tests: a signal the instant the directory is taken
        yield
    finally:
        _release(fd, path, before, created)


def _make_dirs(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; returns the folders this call created, deepest first (the ones
    ``_release`` removes again while they are empty)."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _record_holder(fd: int, path: str) -> str | None:
    """Write this process (pid, host) into the held lock file ``fd`` of the directory ``path`` and into the
    environment its child processes inherit (``HELD_ENV``: they hold it for us); returns that variable's value
    before, for ``_release``."""
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    before = os.environ.get(HELD_ENV)
    try:
        inherited = json.loads(before or "{}")
    except ValueError:
        inherited = {}
    os.environ[HELD_ENV] = json.dumps({**inherited, path: [me["pid"], me["host"]]})
    _held.add(path)
    return before


def _release(fd: int, path: str, before: str | None, created: list[Path]) -> None:
    """Undo ``_record_holder``: the environment as it was, the lock file removed, the folders the lock created
    (the directory and its parents, deepest first) too while nothing was written there; the lock released."""
    _held.discard(path)
    if before is None:
        os.environ.pop(HELD_ENV, None)
    else:
        os.environ[HELD_ENV] = before
    folder = Path(path)
    with contextlib.suppress(OSError):  # removed while held: a process opening it now opens it again
        RunDir(folder).writer_lock.unlink()
    for made in created:  # only while empty: the command wrote nothing there
        try:
            made.rmdir()
        except FileNotFoundError:  # removed already (a refused command's own clean-up)
            continue
        except OSError:
            break
    os.close(fd)


def close_dead_writers_run(run_dir: Path, dead: dict[str, object]) -> None:
    """The MLflow run of ``run_dir`` that its dead writer (``dead``: its pid and host) left RUNNING, marked
    KILLED and said in one line on stderr: a process killed by SIGKILL (or on a lost node) could not close it,
    and the run would show as running for ever. A store that cannot be read is left to the command's checks."""
    id_file = RunDir(run_dir).run_id_file
    if not id_file.is_file():
        return
    run_id, uri = id_file.read_text().strip(), default_tracking_uri(run_dir)
    try:
        if client(uri).get_run(run_id).info.status != "RUNNING":
            return
        set_terminated(uri, run_id, "KILLED")
    except Exception:  # noqa: BLE001 - a damaged or unreachable store: refused in one sentence later
        return
    print(
        f"note: the MLflow run {run_id} of '{run_dir}' was left RUNNING by its writer ({describe_holder(dead)}), "
        "which is gone; marked it KILLED.",
        file=sys.stderr,
        flush=True,
    )


def close_if_abandoned(run_dir: str | os.PathLike) -> None:
    """For a command that reads ``run_dir`` without writing it (``eval``): a writer lock that nobody holds but
    that records a writer (it died) has its MLflow run closed (:func:`close_dead_writers_run`); a live
    writer's run is left as it is."""
    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its writer is alive
            return
        dead = holder(run_dir)
        if dead.get("pid"):
            close_dead_writers_run(Path(run_dir), dead)
    finally:
        os.close(fd)
