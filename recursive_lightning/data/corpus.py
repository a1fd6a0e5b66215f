"""An embedded default corpus: English prose that ships with every Python installation.

Sources, in a fixed order:

1. ``pydoc_data.topics.topics`` -- the language reference sections that ``help()`` shows;
2. docstrings of the pure-Python standard library, read with :mod:`ast` from the source files
   (nothing is imported, so there are no import side effects), one document per source file;
3. docstrings of a fixed list of built-in (C) modules, one document per module.

Docstrings shorter than :data:`MIN_DOCSTRING_CHARS` are dropped and every docstring is kept once
(the first occurrence wins), so the result is deterministic for a given Python installation.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

__all__ = [
    "MIN_DOCSTRING_CHARS",
    "embedded_corpus_documents",
    "embedded_corpus_fingerprint",
    "write_embedded_corpus",
]

MIN_DOCSTRING_CHARS = 80
CORPUS_FORMAT_VERSION = 1
DOCUMENT_SEPARATOR = "\n\n\f\n\n"  # form feed on its own line separates documents in the written file

# Sub-trees of the standard library that are test suites, vendored packages or generated tables.
_SKIPPED_PARTS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "pydoc_data", "encodings"}
)

# C modules that are compiled into (or always shipped with) CPython; missing ones are skipped.
_BUILTIN_MODULES = (
    "builtins",
    "sys",
    "math",
    "cmath",
    "itertools",
    "functools",
    "operator",
    "time",
    "posix",
    "nt",
    "_io",
    "_collections",
    "_abc",
    "_codecs",
    "_weakref",
    "_thread",
    "_signal",
    "gc",
    "errno",
    "marshal",
    "atexit",
    "faulthandler",
    "array",
    "binascii",
    "zlib",
    "select",
    "_datetime",
    "_pickle",
    "_struct",
    "_random",
    "unicodedata",
    "_csv",
    "_heapq",
    "_bisect",
    "_json",
    "_sre",
    "_socket",
    "_statistics",
    "_string",
    "_functools",
    "_operator",
    "_contextvars",
    "_queue",
    "_stat",
    "_locale",
)


def _clean(doc: object) -> str | None:
    if not isinstance(doc, str):
        return None
    text = inspect.cleandoc(doc).strip()
    return text if len(text) >= MIN_DOCSTRING_CHARS else None


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_source_files() -> list[Path]:
    root = _stdlib_dir()
    files = [p for p in root.rglob("*.py") if not _SKIPPED_PARTS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _ast_docstrings(node: ast.AST) -> list[str]:
    """Docstrings of a module/class/function node and of the definitions nested in it, in source order."""
    found = []
    doc = ast.get_docstring(node, clean=False) if isinstance(node, _DEF_NODES) else None
    if doc:
        found.append(doc)
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            found.extend(_ast_docstrings(child))
        elif isinstance(child, (ast.If, ast.Try, ast.With)):  # definitions guarded by `if`/`try`
            found.extend(_ast_docstrings(child))
    return found


_DEF_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _builtin_module_docstrings(name: str) -> list[str]:
    try:
        module = importlib.import_module(name)
    except ImportError:
        return []
    docs = [module.__doc__]
    for _, obj in sorted(vars(module).items()):
        docs.append(getattr(obj, "__doc__", None))
        if isinstance(obj, type):
            docs.extend(getattr(member, "__doc__", None) for _, member in sorted(vars(obj).items()))
    return [d for d in docs if isinstance(d, str)]


def _join_unique(docstrings: list[object], seen: set[str]) -> str:
    kept = []
    for doc in docstrings:
        text = _clean(doc)
        if text is not None and text not in seen:
            seen.add(text)
            kept.append(text)
    return "\n\n".join(kept)


@functools.lru_cache(maxsize=1)
def _documents() -> tuple[str, ...]:
    from pydoc_data.topics import topics

    seen: set[str] = set()
    documents = [_join_unique([topics[key]], seen) for key in sorted(topics)]
    for path in _stdlib_source_files():
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, OSError):  # e.g. lib2to3 grammar fixtures
            continue
        documents.append(_join_unique(list(_ast_docstrings(tree)), seen))
    for name in _BUILTIN_MODULES:
        documents.append(_join_unique(list(_builtin_module_docstrings(name)), seen))
    return tuple(doc for doc in documents if doc)


def embedded_corpus_documents() -> list[str]:
    """Return the embedded corpus as a list of documents (deterministic order, deduplicated)."""
    return list(_documents())


def embedded_corpus_fingerprint() -> str:
    """A cheap identifier of the embedded corpus: Python version, stdlib location and corpus format."""
    key = f"{CORPUS_FORMAT_VERSION}|{sys.version}|{_stdlib_dir()}|{MIN_DOCSTRING_CHARS}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def write_embedded_corpus(directory: str | os.PathLike[str]) -> Path:
    """Write the embedded corpus to ``directory`` as one UTF-8 text file and return its path.

    Documents are separated by a form-feed line (:data:`DOCUMENT_SEPARATOR`). The file name contains
    :func:`embedded_corpus_fingerprint`, so an existing file is reused without rebuilding the corpus;
    it is written atomically (temporary file + ``os.replace``).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"embedded_corpus_{embedded_corpus_fingerprint()}.txt"
    if target.is_file():
        return target
    text = DOCUMENT_SEPARATOR.join(_documents()) + "\n"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".embedded_corpus.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
