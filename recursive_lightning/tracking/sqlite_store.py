"""A fresh SQLite tracking store in milliseconds: a copy of an empty store MLflow migrated once.

MLflow creates a SQLite store by running every Alembic migration of its schema in order (about 100 Python
files loaded and run: 1.5-3 s on a 2-core machine), and every ``train`` in a new run directory and every sweep
pays it. Here the first store of an MLflow version is created by MLflow itself, its one data row the default
experiment taken out, and kept in the cache folder (``$RECURSIVE_LIGHTNING_CACHE``, else
``~/.cache/recursive_lightning``: ``mlflow-store/<mlflow version>.db``). A new store is a copy of
it; when MLflow opens the copy it finds every table at the head revision and adds the default experiment as it
does to any store without one (artifact location from the current directory, creation time now). So the copy
holds what MLflow's own creation leaves, row for row (``tests/tracking/test_sqlite_store.py``).

Copies are made beside the store and linked into place (``os.link`` never replaces a file): two processes
creating one store at once leave one store, and a kill at any instant leaves no half-written one. Where the cache
cannot be written, MLflow creates the store as it would without this module."""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
from pathlib import Path

from recursive_lightning.files import atomic_path, default_cache_dir

TEMPLATE_DIR = "mlflow-store"


def template_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the empty store of the installed MLflow version is kept."""
    import mlflow  # heavy

    return Path(cache_dir or default_cache_dir()) / TEMPLATE_DIR / f"{mlflow.__version__}.db"


def _make_template(path: Path) -> None:
    """An empty store migrated by MLflow, without the default experiment (MLflow adds it on opening)."""
    from mlflow.tracking import MlflowClient  # heavy

    with atomic_path(path) as tmp:
        Path(tmp).unlink()  # MLflow creates the database file itself
        MlflowClient(f"sqlite:///{tmp}").search_experiments()  # runs the migrations
        con = sqlite3.connect(tmp)
        try:
            with con:
                con.execute("DELETE FROM experiments")
        finally:
            con.close()


def create_store(db: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> bool:
    """Create the SQLite tracking store ``db`` (which does not exist yet) as a copy of the migrated template,
    making the template first if needed. False (nothing written) where the cache or ``db``'s folder cannot be
    written: MLflow then creates the store itself."""
    db = Path(db)
    if db.exists():
        return False
    try:
        template = template_path(cache_dir)
        if not template.is_file():
            _make_template(template)
        db.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=db.parent, prefix=f".{db.name}.", suffix=".tmp")
        os.close(fd)
        try:
            shutil.copyfile(template, tmp)
            os.chmod(tmp, 0o644)
            try:
                os.link(tmp, db)  # never over a store another process has just made
            except FileExistsError:
                return False
        finally:
            Path(tmp).unlink(missing_ok=True)
    except (OSError, sqlite3.Error):
        return False
    return True
