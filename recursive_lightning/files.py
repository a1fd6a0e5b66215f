"""Files written atomically (a reader, or a kill at any instant, sees the old file or the new one) and the
checks around them: JSON records read back, and whether a folder can take results at all."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from recursive_lightning import faults
from recursive_lightning.errors import DiskFull


def absent(path: str | os.PathLike) -> str:
    """What a path that is neither a regular file nor a folder is, as the end of a sentence naming it: "does not
    exist", or what it is instead (a named pipe, a socket, a device, a link that leads nowhere)."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        return "is a symbolic link that leads nowhere" if p.is_symlink() else "does not exist"
    except OSError as e:  # ELOOP: a symbolic link loop; EACCES: a folder on the way we may not enter
        return f"cannot be read ({e.strerror})"
    if stat.S_ISFIFO(mode):
        return "is a named pipe (FIFO), not a file"
    if stat.S_ISSOCK(mode):
        return "is a socket, not a file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "is a device, not a file"
    return "does not exist"


def _home_cache() -> Path:
    """``$XDG_CACHE_HOME``, else ``~/.cache``; with no home (``HOME`` unset or the filesystem root, as in some
    containers) a folder of this user's under the temporary directory, never one at the root."""
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"])
    home = os.environ.get("HOME")
    if home and Path(home) != Path("/"):
        return Path(home) / ".cache"
    return Path(tempfile.gettempdir()) / f"cache-{os.getuid()}"


def default_cache_dir() -> Path:
    """The cache folder: ``$RECURSIVE_LIGHTNING_CACHE``, else ``$XDG_CACHE_HOME/recursive_lightning`` (default
    ``~/.cache/recursive_lightning``; without a home, under the temporary directory); a run's
    ``data.cache_dir`` takes its place for its data."""
    return Path(os.environ.get("RECURSIVE_LIGHTNING_CACHE") or _home_cache() / "recursive_lightning")


def read_json(path: str | os.PathLike) -> dict[str, Any] | None:
    """A JSON object from ``path``; None when it is missing, unreadable, damaged or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """A private temporary file beside ``path`` to write into; renamed over ``path`` when the block ends, removed
    if it raises. Readers (and a kill at any instant) see the old file or the new one, never half of one, and
    two processes writing the same file at once never share the temporary."""
    path = Path(path)
    with no_space_is_one_sentence(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            yield tmp
            faults.point(f"write_{path.name}")  # tests: the disk fills while this file is written
            os.chmod(tmp, 0o644)  # mkstemp creates it private
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


@contextlib.contextmanager
def no_space_is_one_sentence(path: str | os.PathLike) -> Iterator[None]:
    """A full disk (``OSError`` ENOSPC) while the block writes ``path``: one sentence naming it
    (:class:`DiskFull`), not a traceback."""
    try:
        yield
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise DiskFull(path) from None


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_figure(fig: Any, path: str | os.PathLike, **savefig: Any) -> Path:
    """Save a matplotlib figure as PNG atomically (``atomic_path``)."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", **savefig)
    return Path(path)


def _can_write(directory: Path) -> bool:
    """Whether a file can be created in ``directory`` (tried, not guessed from permission bits)."""
    try:
        with tempfile.TemporaryFile(dir=directory, prefix=".write-check-"):
            return True
    except OSError:
        return False


def _nearest_existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def writable_dir_problem(path: str | os.PathLike) -> str | None:
    """Why results cannot be written into the folder ``path`` (created if missing), or None if they can."""
    path = Path(path)
    longest = max((len(part.encode()) for part in Path(os.path.abspath(path)).parts), default=0)
    if longest > 255:  # NAME_MAX of every common file system: the folder (or a file in it) cannot be made
        return f"'{path}' has a name of {longest} bytes, above the 255 a file system allows"
    for p in (Path(os.path.abspath(path)), *Path(os.path.abspath(path)).parents):
        if p.is_symlink() and not p.exists():  # a loop, or a target that is gone: nothing can be made there
            return f"'{p}' is a symbolic link that leads nowhere (a loop, or its target is gone)"
    base = _nearest_existing(path)
    if not base.is_dir():
        return f"'{base}' is a file, not a folder"
    if not _can_write(base):
        return (
            f"'{base}' is read-only"
            if base == Path(os.path.abspath(path))
            else (f"'{path}' cannot be created ('{base}' is read-only)")
        )
    return None
