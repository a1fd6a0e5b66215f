"""Database and tracking URLs as the package shows and compares them.

:func:`mask_url` is the one place a URL's password is hidden: every line the package prints or logs that
names a database (the sweep's study, MLflow's backend store, an sbatch line, MLflow params and tags) passes
its URL through it. :func:`same_server` says whether two tracking URIs name one server (``localhost`` and
``127.0.0.1`` are the same host).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
# scheme://user:password@host...: the password is whatever lies between the first ':' after '//' and the last
# '@' of the authority (a password may itself hold '@' or ':' when the user did not percent-encode it)
_AUTH = re.compile(
    r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*:)(?P<pw>[^\s/]*)@(?=[^@\s/]*(?:[/?#\s]|$))"
)
_LOOPBACK = {"localhost", "127.0.0.1", "::1", "[::1]"}


def mask_url(text: str) -> str:
    """``text`` (a URL, or a line holding URLs) with the password of every ``scheme://user:password@host``
    replaced by ``***``."""
    return _AUTH.sub(lambda m: f"{m['head']}{MASK}@", str(text))


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
    every loopback name as one, filling in the default port and dropping a trailing slash."""
    return _normal(a) == _normal(b)
