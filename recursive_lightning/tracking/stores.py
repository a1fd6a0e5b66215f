"""Database stores (an Optuna study, an MLflow backend store) checked before any work: one sentence for a URL
that cannot be parsed, a driver that is not installed, or a server that does not answer or refuses us."""

from __future__ import annotations

import base64
import json
import os
import sqlite3
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from recursive_lightning.errors import ConfigError
from recursive_lightning.uris import STORAGE_ENV, TRACKING_ENV, mask_url

CONNECT_TIMEOUT_S = 10
SQLITE_HEADER = b"SQLite format 3\x00"


def sqlite_file_problem(
    path: str | os.PathLike, table: str | None = None, owner: str = "", empty_ok: bool = False
) -> str | None:
    """Why the SQLite file ``path`` cannot serve as a store, as a clause naming it: empty (unless ``empty_ok``:
    the client makes its tables there), not a SQLite database, damaged (truncated, overwritten), or without
    ``table`` (``owner``'s, e.g. MLflow's ``runs``). None when it is fine, or does not exist yet."""
    p = Path(path)
    try:
        if not p.exists():
            return None
        if not p.is_file():
            return f"'{p}' is not a file"
        with open(p, "rb") as f:
            head = f.read(len(SQLITE_HEADER))
    except OSError as e:
        return f"'{p}' cannot be read ({e.strerror})"
    if not head:
        return None if empty_ok else f"'{p}' is empty (0 bytes)"
    if head != SQLITE_HEADER:
        return f"'{p}' is not a SQLite database"
    try:
        # read-write, never created (mode=rw): a writer killed inside a transaction leaves a hot journal, which
        # the next connection rolls back, as SQLite's recovery; a read-only one cannot, and fails with
        # "attempt to write a readonly database" on a sound store
        con = sqlite3.connect(f"{p.resolve().as_uri()}?mode=rw", uri=True, timeout=30)
        try:
            check = con.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                return f"'{p}' is a damaged SQLite database ({check})"
            if (
                table
                and not con.execute(
                    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
                ).fetchone()
            ):
                return f"'{p}' is a SQLite database without {owner} tables"
        finally:
            con.close()
    except sqlite3.OperationalError as e:
        if "locked" in str(e):  # another process writes it: a live store
            return None
        readonly = getattr(e, "sqlite_errorname", "").startswith("SQLITE_READONLY")
        if readonly:  # a write-protected file or folder
            return f"'{p}' cannot be written ({e})"
        return f"'{p}' is a damaged SQLite database ({e})"
    except sqlite3.DatabaseError as e:
        return f"'{p}' is a damaged SQLite database ({e})"
    return None


def _first_line(e: BaseException) -> str:
    text = mask_url(str(getattr(e, "orig", None) or e)).strip()
    return text.splitlines()[0].strip().rstrip(".") if text else type(e).__name__


def is_database_url(url: str) -> bool:
    """Whether ``url`` names a database (SQLAlchemy), not a tracking server or a folder."""
    return "://" in url and url.split("://", 1)[0].lower() not in ("http", "https", "file", "databricks")


def check_database(url: str, option: str, what: str) -> None:
    """Refuse in one sentence a database URL (``option``, naming ``what`` it holds) that SQLAlchemy cannot
    parse, whose driver is not installed, or whose server cannot be reached or refuses us (a password left out:
    where to give it), within ``CONNECT_TIMEOUT_S`` rather than after a client's minutes of retries. A SQLite
    file is created on first use; one that is there but no sound database (``sqlite_file_problem``) is refused."""
    from sqlalchemy import create_engine, text  # heavy
    from sqlalchemy.engine import make_url  # heavy
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError  # heavy

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ConfigError(
            f"{option} '{mask_url(url)}' is not a database URL; write postgresql+psycopg://USER@HOST:PORT/DATABASE "
            "(or sqlite:///PATH for one machine)."
        ) from None
    if parsed.get_backend_name() == "sqlite":  # a file that is there must be a sound database
        problem = sqlite_file_problem(parsed.database, empty_ok=True) if parsed.database else None
        if problem is not None:
            raise ConfigError(
                f"cannot open the {what} {option} '{mask_url(url)}': {problem}; move it aside (or put back a "
                "good copy), then run the command again."
            )
        return
    if (
        parsed.drivername == "postgresql"
    ):  # SQLAlchemy's default driver for it is psycopg2, not installed here
        try:
            import psycopg2  # noqa: F401  # optional
        except ImportError:
            raise ConfigError(
                f"{option} '{mask_url(url)}' asks SQLAlchemy for the psycopg2 driver, which is not installed; "
                f"write {parsed.set(drivername='postgresql+psycopg').render_as_string(hide_password=True)} to "
                "use psycopg 3 (requirements.lock)."
            ) from None
    try:
        connect_args = (
            {"connect_timeout": CONNECT_TIMEOUT_S} if parsed.get_backend_name() == "postgresql" else {}
        )
        engine = create_engine(parsed, connect_args=connect_args)
    except (NoSuchModuleError, ImportError, ModuleNotFoundError) as e:
        raise ConfigError(
            f"{option} '{mask_url(url)}' needs the database driver '{parsed.drivername}', which is not installed "
            f"({_first_line(e)}); use postgresql+psycopg://... (psycopg 3 is in requirements.lock)."
        ) from None
    try:
        with engine.connect() as con:
            con.execute(text("SELECT 1"))
    except Exception as e:
        reason = _first_line(e)
        if "does not exist" in reason and parsed.database and "database" in reason:
            fix = f"create it first (createdb {parsed.database})"
        elif "password" in reason.lower():
            # a URL read back from a file, or given as printed, has its password masked and left out
            fix = (
                "give its password in the URL, in PGPASSWORD or ~/.pgpass, or the whole URL in "
                f"{STORAGE_ENV} / {TRACKING_ENV}"
            )
        else:
            fix = "start the database server or fix the URL"
        raise ConfigError(
            f"cannot open the {what} {option} '{mask_url(url)}' ({reason}); {fix}, then run the command again."
        ) from None
    finally:
        engine.dispose()


def _auth_headers(userinfo: str = "") -> dict[str, str]:
    """The credentials MLflow's own client would send: a URL's ``user:password@``, else its environment
    variables."""
    if userinfo:
        user, _, password = userinfo.partition(":")
        pair = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
        return {"Authorization": "Basic " + base64.b64encode(pair.encode()).decode()}
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    if token:
        return {"Authorization": f"Bearer {token}"}
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
    return {}


def check_tracking_server(uri: str, option: str = "--tracking-uri") -> None:
    """Refuse in one sentence an ``http(s)://`` tracking URI that does not answer as an MLflow tracking
    server within a few seconds (MLflow's client would retry for minutes, and only after training)."""
    parts = urllib.parse.urlsplit(uri)
    userinfo, _, host = parts.netloc.rpartition("@")  # urllib resolves no `user:password@`: sent as a header
    url = (
        urllib.parse.urlunsplit(parts._replace(netloc=host)).rstrip("/")
        + "/api/2.0/mlflow/experiments/search"
    )
    req = urllib.request.Request(
        url,
        data=json.dumps({"max_results": 1}).encode(),
        headers={"Content-Type": "application/json", **_auth_headers(userinfo)},
    )
    try:
        with urllib.request.urlopen(req, timeout=CONNECT_TIMEOUT_S) as r:
            json.load(r)
    except urllib.error.HTTPError as e:
        body = e.read(300).decode("utf-8", "replace") if e.fp is not None else ""
        if e.code == 403 and "Invalid Host header" in body:  # MLflow's allowed-hosts check, not a credential
            hint = (
                f"the server does not allow the host name '{host}' (its --allowed-hosts); start it with "
                f"`mlflow server --allowed-hosts {host}` or use an address it allows"
            )
        elif e.code in (401, 403):
            hint = "set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)"
        else:
            hint = "is it an `mlflow server`? fix the URL"
        raise ConfigError(
            f"the MLflow tracking server {option} '{mask_url(uri)}' answered HTTP {e.code} to {mask_url(url)}; "
            f"{hint}."
        ) from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ConfigError(
            f"cannot reach the MLflow tracking server {option} '{mask_url(uri)}' ({reason}); start `mlflow server` there "
            "(see docs/sweeps.md) or fix the URL, then run the command again."
        ) from None


def check_tracking_store(uri: str, option: str = "--tracking-uri") -> None:
    """One sentence, before any work, for an MLflow tracking URI that MLflow would wait on for minutes or fail
    on with a traceback: a tracking server that does not answer (:func:`check_tracking_server`), a database that
    cannot be opened or a damaged SQLite file (:func:`check_database`). A folder (``file://``) is not checked."""
    if uri.split("://", 1)[0].lower() in ("http", "https"):
        check_tracking_server(uri, option)
    elif is_database_url(uri):
        check_database(uri, option, "MLflow tracking store")
