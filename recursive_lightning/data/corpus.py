"""An embedded default corpus: English prose that ships with every Python installation.

Sources, in a fixed order:

1. ``pydoc_data.topics.topics`` -- the language reference sections that ``help()`` shows;
2. docstrings of the pure-Python standard library, one document per source file: the module's code object
   is loaded from its ``__pycache__`` file (or compiled; never imported, so nothing runs) and the docstrings
   are read off the code objects -- about ten times faster than parsing every file with :mod:`ast`;
3. docstrings of a fixed list of built-in (C) modules, one document per module.

Docstrings shorter than :data:`MIN_DOCSTRING_CHARS` are dropped and every docstring is kept once
(the first occurrence wins), so the result is deterministic for a given Python installation.
"""

from __future__ import annotations

import dis
import functools
import hashlib
import importlib
import importlib.util
import inspect
import marshal
import os
import sys
import sysconfig
import types
from pathlib import Path
from pydoc_data.topics import topics

from recursive_lightning.files import atomic_write_text

__all__ = [
    "MIN_DOCSTRING_CHARS",
    "embedded_corpus_documents",
    "embedded_corpus_fingerprint",
    "write_embedded_corpus",
]

MIN_DOCSTRING_CHARS = 80
CORPUS_FORMAT_VERSION = 2
DOCUMENT_SEPARATOR = "\n\n\f\n\n"  # form feed on its own line separates documents in the written file

# Sub-trees of the standard library that are test suites, vendored packages or generated tables.
_SKIPPED_PARTS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "pydoc_data", "encodings"}
)

# C modules that are compiled into (or always shipped with) CPython; missing ones are skipped.
_BUILTIN_MODULES = tuple(
    """
    builtins sys math cmath itertools functools operator time posix nt _io _collections _abc _codecs _weakref
    _thread _signal gc errno marshal atexit faulthandler array binascii zlib select _datetime _pickle _struct
    _random unicodedata _csv _heapq _bisect _json _sre _socket _statistics _string _functools _operator
    _contextvars _queue _stat _locale
    """.split()
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
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _SKIPPED_PARTS]
        files.extend(Path(folder, name) for name in names if name.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


_NOT_DOCUMENTED = frozenset({"<lambda>", "<listcomp>", "<setcomp>", "<dictcomp>", "<genexpr>"})
_CO_HAS_DOCSTRING = getattr(inspect, "CO_HAS_DOCSTRING", 0)  # Python >= 3.14 flags functions with a docstring
_LOAD_CONST, _STORE_NAME, _EXTENDED_ARG = (
    dis.opmap[name] for name in ("LOAD_CONST", "STORE_NAME", "EXTENDED_ARG")
)


def _body_docstring(code: types.CodeType) -> str | None:
    """Docstring of a module or class body: the constant stored to ``__doc__`` by its first instructions."""
    raw, pending, extended = code.co_code, None, 0
    for i in range(0, min(len(raw), 64), 2):  # (opcode, arg) byte pairs; the docstring comes first
        op, arg = raw[i], raw[i + 1] | extended
        extended = arg << 8 if op == _EXTENDED_ARG else 0
        if op == _LOAD_CONST:
            pending = code.co_consts[arg]
        elif op == _STORE_NAME and code.co_names[arg] == "__doc__":
            return pending if isinstance(pending, str) else None
    return None


def _code_docstrings(code: types.CodeType) -> list[str]:
    """Docstrings of a compiled module/class/function and of all code objects nested in it.

    A function's docstring is its first constant (CPython stores ``None`` there when it has none); a module
    or class body starts with ``LOAD_CONST <doc>; STORE_NAME __doc__``.
    """
    found = []
    if code.co_flags & inspect.CO_OPTIMIZED:  # function body
        has_doc = code.co_flags & _CO_HAS_DOCSTRING if _CO_HAS_DOCSTRING else True
        first = code.co_consts[0] if code.co_consts else None
        if has_doc and code.co_name not in _NOT_DOCUMENTED and isinstance(first, str):
            found.append(first)
    elif (doc := _body_docstring(code)) is not None:
        found.append(doc)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found.extend(_code_docstrings(const))
    return found


def _compiled(path: Path) -> types.CodeType | None:
    """The module code of ``path``: from its up-to-date ``__pycache__`` file if there is one, else compiled."""
    try:
        source = path.read_bytes()
    except OSError:
        return None
    try:
        cached = Path(importlib.util.cache_from_source(str(path), optimization="")).read_bytes()
        flags = int.from_bytes(cached[4:8], "little")
        stat = path.stat()
        header_ok = cached[:4] == importlib.util.MAGIC_NUMBER and flags == 0  # timestamp-validated pyc
        if header_ok and cached[8:16] == _pyc_stamp(int(stat.st_mtime), stat.st_size):
            return marshal.loads(cached[16:])
    except (OSError, ValueError, EOFError, TypeError):
        pass
    try:
        return compile(source, str(path), "exec", dont_inherit=True, optimize=0)  # keep docstrings under -OO
    except (SyntaxError, ValueError):  # e.g. lib2to3 grammar fixtures
        return None


def _pyc_stamp(mtime: int, size: int) -> bytes:
    return (mtime & 0xFFFFFFFF).to_bytes(4, "little") + (size & 0xFFFFFFFF).to_bytes(4, "little")


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
    seen: set[str] = set()
    documents = [_join_unique([topics[key]], seen) for key in sorted(topics)]
    for path in _stdlib_source_files():
        code = _compiled(path)
        if code is not None:
            documents.append(_join_unique(list(_code_docstrings(code)), seen))
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
    atomic_write_text(target, text)
    return target
