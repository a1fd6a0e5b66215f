"""Resolve a ``--data`` spec to a stream of text documents.

Accepted specs:

* ``None`` -- the embedded corpus (:mod:`recursive_lightning.data.corpus`), written once as a text file;
* a ``.txt``/``.md`` (or any UTF-8 text) file, a ``.jsonl`` file with a ``"text"`` field per line;
* a folder, searched recursively for ``*.txt``, ``*.md`` and ``*.jsonl``;
* a glob such as ``"corpus/**/*.txt"``;
* ``hf:<dataset_name>[:<config>][@split]`` -- a Hugging Face dataset, streamed (needs network).

Text files are split into documents at form-feed lines (``"\\f"`` alone on a line); any document longer
than :data:`MAX_DOCUMENT_CHARS` is cut at paragraph boundaries, so a single large file still yields many
documents for the train/validation split. Problems raise :class:`DataError` with a one-sentence message.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from recursive_lightning.data.corpus import embedded_corpus_fingerprint, write_embedded_corpus
from recursive_lightning.errors import UserError
from recursive_lightning.files import absent

__all__ = [
    "MAX_DOCUMENT_CHARS",
    "TEXT_SUFFIXES",
    "DataError",
    "DataSource",
    "iter_documents",
    "load_documents",
    "resolve_source",
    "short_reason",
    "split_long_document",
]

TEXT_SUFFIXES = (".txt", ".md", ".jsonl")
MAX_DOCUMENT_CHARS = 16_384
_FORM_FEED_LINE = re.compile(r"\n?^\f$\n?", re.MULTILINE)
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


class DataError(UserError):
    """A ``--data`` / ``--tokenizer`` spec could not be turned into usable data; the message says how to fix it."""


@dataclass(frozen=True)
class DataSource:
    """A resolved data spec: local files, or a Hugging Face dataset to stream."""

    spec: str
    kind: str  # "files", "embedded" or "hf"
    files: tuple[Path, ...] = ()
    hf_name: str | None = None
    hf_config: str | None = None
    hf_split: str = "train"

    def fingerprint(self) -> str:
        """Cheap identity of the corpus: file paths + sizes + mtimes, the embedded-corpus version, or the HF spec."""
        h = hashlib.sha256(self.kind.encode())
        if self.kind == "embedded":
            h.update(embedded_corpus_fingerprint().encode())
        elif self.kind == "hf":
            h.update(f"{self.hf_name}|{self.hf_config}|{self.hf_split}".encode())
        for path in self.files if self.kind == "files" else ():
            stat = path.stat()
            h.update(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
        return h.hexdigest()[:16]


def _parse_hf_spec(spec: str) -> DataSource:
    body = spec[len("hf:") :]
    body, _, split = body.partition("@")
    name, _, config = body.partition(":")
    if not name:
        raise DataError(f"The data spec {spec!r} names no dataset; use hf:<dataset_name>[:<config>][@split].")
    return DataSource(spec=spec, kind="hf", hf_name=name, hf_config=config or None, hf_split=split or "train")


def _folder_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)


def resolve_source(
    spec: str | os.PathLike[str] | None, *, embedded_dir: str | os.PathLike[str] | None = None
) -> DataSource:
    """Turn a ``--data`` spec into a :class:`DataSource`, checking that the paths exist.

    ``embedded_dir`` is where the embedded corpus file is written when ``spec`` is ``None``
    (default: ``.cache/recursive_lightning/corpus`` under the current directory).
    """
    if spec is None or str(spec).strip() == "":
        target = Path(embedded_dir) if embedded_dir is not None else Path(".cache/recursive_lightning/corpus")
        return DataSource(spec="<embedded>", kind="embedded", files=(write_embedded_corpus(target),))
    text = os.fspath(spec)
    if text.startswith("hf:"):
        return _parse_hf_spec(text)
    path = Path(text).expanduser()
    if path.is_file():
        return DataSource(spec=text, kind="files", files=(path,))
    if path.is_dir():
        files = _folder_files(path)
        if not files:
            raise DataError(
                f"The folder {path} contains no {'/'.join(TEXT_SUFFIXES)} files; add some or point --data elsewhere."
            )
        return DataSource(spec=text, kind="files", files=tuple(files))
    if glob.has_magic(text):
        matches = sorted(Path(m) for m in glob.glob(os.path.expanduser(text), recursive=True))
        files = sorted({f for m in matches for f in ([m] if m.is_file() else _folder_files(m))})
        if not files:
            raise DataError(f"The glob {text!r} matches no files; check the pattern (quote it in the shell).")
        return DataSource(spec=text, kind="files", files=tuple(files))
    raise DataError(
        f"The data path {path} {absent(path)}; pass an existing file, folder, glob or hf:<dataset>."
    )


def split_long_document(text: str, max_chars: int = MAX_DOCUMENT_CHARS) -> list[str]:
    """Cut ``text`` at paragraph breaks into pieces of at most about ``max_chars`` characters."""
    if len(text) <= max_chars:
        return [text]
    pieces, current, size = [], [], 0
    for paragraph in _PARAGRAPH_BREAK.split(text):
        if current and size + len(paragraph) > max_chars:
            pieces.append("\n\n".join(current))
            current, size = [], 0
        current.append(paragraph)
        size += len(paragraph) + 2
    pieces.append("\n\n".join(current))
    return pieces


def read_utf8(path: Path, what: str = "The file {path}", fix: str = "remove it from --data") -> str:
    """The text of ``path``; one sentence (``what`` naming it, then ``fix``) when it is not UTF-8 text (a binary
    file) or cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(
            f"{what.format(path=path)} is not valid UTF-8 text (byte {err.start}); convert it to UTF-8 or {fix}."
        ) from None
    except OSError as err:
        raise DataError(
            f"The file {path} cannot be read ({err.strerror}); fix its permissions or remove it."
        ) from None


def _file_documents(path: Path) -> Iterator[str]:
    text = read_utf8(path)
    if path.suffix.lower() != ".jsonl":
        yield from _FORM_FEED_LINE.split(text)
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise DataError(f"Line {lineno} of {path} is not valid JSON; fix or remove that line.") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(
                f'Line {lineno} of {path} has no string "text" field; every JSONL record needs one.'
            )
        yield record["text"]


def short_reason(err: BaseException) -> str:
    """First clause of an exception message, for embedding in a one-sentence :class:`DataError`."""
    text = (str(err).strip().splitlines() or [""])[0].split(". ")[0][:160].rstrip(". ")
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _hf_documents(source: DataSource) -> Iterator[str]:
    try:
        import datasets  # optional
    except ImportError:
        raise DataError(
            f"Reading {source.spec} needs the `datasets` package; run `pip install datasets`."
        ) from None
    try:
        stream = datasets.load_dataset(
            source.hf_name, source.hf_config, split=source.hf_split, streaming=True
        )
        for record in stream:
            text = record.get("text") if isinstance(record, dict) else None
            if isinstance(text, str):
                yield text
    except DataError:
        raise
    except Exception as err:  # offline, unknown dataset, missing config...
        raise DataError(
            f"Could not stream {source.spec} from the Hugging Face Hub ({short_reason(err)}); "
            "check the name and your network, or pass a local file, folder or glob instead."
        ) from err


def iter_documents(source: DataSource, *, limit: int | None = None) -> Iterator[str]:
    """Yield the non-blank documents of ``source`` (long ones cut by :func:`split_long_document`)."""
    raw = (
        _hf_documents(source)
        if source.kind == "hf"
        else (d for f in source.files for d in _file_documents(f))
    )
    count = 0
    for document in raw:
        document = document.strip()
        if not document:
            continue
        for piece in split_long_document(document):
            yield piece
            count += 1
            if limit is not None and count >= limit:
                return


def load_documents(source: DataSource, *, limit: int | None = None) -> list[str]:
    """All documents of ``source`` as a list; raises :class:`DataError` if there is no text at all."""
    documents = list(iter_documents(source, limit=limit))
    if not documents:
        where = ", ".join(str(f) for f in source.files[:3]) + (" ..." if len(source.files) > 3 else "")
        raise DataError(
            f"No non-whitespace text was found in {where or source.spec}; point --data at UTF-8 text with content."
        )
    return documents
