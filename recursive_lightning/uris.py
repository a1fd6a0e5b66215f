"""Database and tracking URLs as the package shows, stores and compares them.

:func:`mask_url` is the one place a URL's password is hidden: every line the package prints or logs that
names a database (the sweep's study, MLflow's backend store, an sbatch line, MLflow params and tags), and every
file or command line that records one (``sweep.json``, ``result.json``, ``mlflow_tracking_uri``, a worker's
arguments), passes its URL through it. Both forms are masked: ``scheme://user:password@host`` and a
``password=`` query parameter (``...?password=...``, or a libpq ``key=value`` string).

A masked URL read back (from those files, or given as printed) gets its password from where this process was
told it (:func:`remember`: a command's own options) or from the environment (``RECURSIVE_LIGHTNING_STORAGE``,
``RECURSIVE_LIGHTNING_TRACKING_URI``: how a sweep hands its URLs to its workers, off their command lines): see
:func:`reveal`; else the password is left out, so the driver's own sources apply (``PGPASSWORD``,
``~/.pgpass``). :func:`same_server` says whether two tracking URIs name one server (``localhost`` and
``127.0.0.1`` are the same host).
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
STORAGE_ENV = "RECURSIVE_LIGHTNING_STORAGE"  # a sweep's --storage, for processes it starts (and its default)
TRACKING_ENV = "RECURSIVE_LIGHTNING_TRACKING_URI"  # a --tracking-uri, likewise
# scheme://user:password@host...: the password is whatever lies between the first ':' after '//' and the last
# '@' of the authority (a password may itself hold '@' or ':' when the user did not percent-encode it)
_AUTH = re.compile(
    r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*:)(?P<pw>[^\s/]*)@(?=[^@\s/]*(?:[/?#\s]|$))"
)
_SECRET_KEYS = ("password", "passwd")
# ?password=... / &password=... (a query parameter SQLAlchemy passes to the driver), or password=... of a
# libpq "host=... password=..." string; a quoted libpq value may hold spaces. Punctuation that ends a sentence
# or clause after the URL (".", ";", ")") is left outside the value.
_QUERY = re.compile(
    r"(?i)(?P<head>(?:^|[?&;\s])(?:password|passwd)=)"
    r"(?P<pw>'(?:[^'\\]|\\.)*'|[^&#\s'\"]*?)(?=[.,;:)]*(?:[&#\s'\"]|$))"
)
_LOOPBACK = {"localhost", "127.0.0.1", "::1", "[::1]"}
_given: set[str] = set()


def mask_url(text: str) -> str:
    """``text`` (a URL, or a line holding URLs) with every password replaced by ``***``: the one of each
    ``scheme://user:password@host`` and each ``password=`` parameter."""
    text = _AUTH.sub(lambda m: f"{m['head']}{MASK}@", str(text))
    return _QUERY.sub(lambda m: f"{m['head']}{MASK}" if m["pw"] else m[0], text)


def is_masked(url: str) -> bool:
    """Whether ``url`` carries ``***`` where its password goes (a URL as the package prints and stores it)."""
    return any(m["pw"] == MASK for m in _AUTH.finditer(url)) or any(
        m["pw"] == MASK for m in _QUERY.finditer(url)
    )


def remember(url: str | None) -> str | None:
    """Keep ``url``, given to this command with its password, for :func:`reveal`; returns it."""
    if url and mask_url(url) != url:
        _given.add(url)
    return url


def without_password(url: str) -> str:
    """``url`` with its password left out (``user:pw@`` becomes ``user@``, a ``password=`` parameter is
    dropped): the driver then takes it from its own sources (``PGPASSWORD``, ``~/.pgpass``)."""
    url = _AUTH.sub(lambda m: f"{m['head'][:-1]}@", url)
    base, sep, rest = url.partition("?")
    if not sep:
        return url
    query, hash_sep, fragment = rest.partition("#")
    kept = [p for p in query.split("&") if p.split("=", 1)[0].lower() not in _SECRET_KEYS]
    return base + ("?" + "&".join(kept) if kept else "") + hash_sep + fragment


def reveal(url: str | None) -> str | None:
    """``url`` ready to connect: a masked one (read from a file, or given as printed) becomes the URL this
    process was given (:func:`remember`) or finds in ``RECURSIVE_LIGHTNING_STORAGE`` /
    ``RECURSIVE_LIGHTNING_TRACKING_URI`` that masks to it, else the URL without its password. Others as they
    are."""
    if not url or not is_masked(url):
        return url
    for known in (*sorted(_given), os.environ.get(STORAGE_ENV), os.environ.get(TRACKING_ENV)):
        if known and not is_masked(known) and mask_url(known) == url:
            return known
    return without_password(url)


def _normal(uri: str) -> str:
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return uri.rstrip("/")
    host = "localhost" if parts.hostname in _LOOPBACK else parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    user = f"{parts.username}@" if parts.username else ""
    return urlunsplit((parts.scheme, f"{user}{host}:{port}", parts.path.rstrip("/"), parts.query, ""))


def same_server(a: str, b: str) -> bool:
    """Whether two tracking URIs name the same server: equal after lower-casing the scheme and host, treating
    every loopback name as one, filling in the default port and dropping a trailing slash; a password (shown
    or masked) does not count."""
    return _normal(mask_url(a)) == _normal(mask_url(b))
