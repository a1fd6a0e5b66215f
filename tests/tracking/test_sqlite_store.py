"""A new SQLite tracking store is a copy of a migrated empty one (``tracking/sqlite_store.py``): it holds what
MLflow's own creation leaves, row for row, and falls back to MLflow where the cache cannot be written."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from recursive_lightning.tracking.runs import client, tracking_store_problem
from recursive_lightning.tracking.sqlite_store import create_store, template_path

TIMES = ("creation_time", "last_update_time")


def _clauses(sql: str | None) -> tuple[str, ...]:
    """A CREATE statement's lines as a set: MLflow's migrations write a table's CHECK constraints in an order that
    changes from one process to the next (two stores MLflow makes differ in it)."""
    return tuple(sorted(line.strip().rstrip(",").strip() for line in (sql or "").splitlines()))


def dump(db: Path) -> dict:
    """Schema and every row of every table (the default experiment's times taken out: they are "now")."""
    con = sqlite3.connect(db)
    try:
        schema = sorted(
            (kind, name, table, _clauses(sql))
            for kind, name, table, sql in con.execute("SELECT type, name, tbl_name, sql FROM sqlite_master")
        )
        rows = {}
        for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
            cur = con.execute(f"SELECT * FROM {table}")
            names = [c[0] for c in cur.description]
            rows[table] = sorted(
                (tuple(v for n, v in zip(names, row, strict=True) if n not in TIMES) for row in cur), key=str
            )
    finally:
        con.close()
    return {"schema": schema, "rows": rows}


def test_a_new_store_holds_what_mlflows_own_creation_holds(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    elsewhere = tmp_path / "where-the-template-was-made"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the default experiment's artifact location follows the current directory
    assert create_store(tmp_path / "first.db", cache) and template_path(cache).is_file()

    here = tmp_path / "run"
    here.mkdir()
    monkeypatch.chdir(here)
    ours, theirs = here / "ours.db", here / "theirs.db"
    assert create_store(ours, cache)
    client(f"sqlite:///{ours}").search_experiments()  # MLflow opens the copy
    MlflowClient(f"sqlite:///{theirs}").search_experiments()  # MLflow's migrations
    assert dump(ours) == dump(theirs)
    (default,) = dump(ours)["rows"]["experiments"]
    assert str(here / "mlruns" / "0") in default
    assert sorted(p.name for p in here.iterdir()) == ["ours.db", "theirs.db"]  # no temporary left


def test_an_existing_store_is_never_replaced(tmp_path):
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"not replaced")
    assert not create_store(db, tmp_path / "cache")
    assert db.read_bytes() == b"not replaced"


def test_an_unwritable_cache_leaves_the_store_to_mlflow(tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("the cache folder cannot be made under a file")
    monkeypatch.setenv("RECURSIVE_LIGHTNING_CACHE", str(blocked))
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "run" / "mlflow.db"
    db.parent.mkdir()
    assert not create_store(db)
    assert list(db.parent.iterdir()) == []
    assert [e.name for e in client(f"sqlite:///{db}").search_experiments()] == ["Default"]  # MLflow made it


# a writer that stops inside a transaction whose changes have reached the database file (a one-page cache spills
# them), so that its SIGKILL leaves a hot journal: what a command killed while MLflow or Optuna writes leaves
KILLED_WRITER = """
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("PRAGMA cache_size=1")
con.execute("BEGIN")
con.execute("UPDATE experiments SET name = name || '-unfinished'")
con.execute(
    "INSERT INTO experiments (name, lifecycle_stage) WITH RECURSIVE n(i) AS "
    "(SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 3000) SELECT 'bulk' || i, 'active' FROM n"
)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_store_whose_writer_was_killed_in_a_transaction_is_rolled_back_and_opens(tmp_path):
    db = tmp_path / "mlflow.db"
    client(f"sqlite:///{db}").create_experiment("finished")  # a committed result
    writer = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(db)], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout.readline().strip() == "ready"
    writer.kill()
    writer.wait()
    assert (tmp_path / "mlflow.db-journal").exists()  # the hot journal the check must roll back

    assert tracking_store_problem(f"sqlite:///{db}") is None
    assert not (tmp_path / "mlflow.db-journal").exists()
    names = sorted(e.name for e in client(f"sqlite:///{db}").search_experiments())
    assert names == ["Default", "finished"]  # the unfinished transaction undone, the finished one kept
