"""The tokenizer and token shards of a data spec, built once into the cache (or found there), without Lightning.

``TextDataModule`` (``data/datamodule.py``) loads its batches from these; a sweep's coordinating process builds
them before its workers start (``sweep/prepare.py``: tokenising once rather than racing in every worker), and it
does not import Lightning for it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

from recursive_lightning.data.shards import (
    DEFAULT_VAL_FRACTION,
    TOKENIZER_FILE,
    ShardInfo,
    ensure_token_shards,
    is_complete,
    split_documents,
)
from recursive_lightning.data.sources import (
    DataError,
    DataSource,
    iter_documents,
    load_documents,
    resolve_source,
)
from recursive_lightning.data.tokenizer import load_tokenizer

HF_MAX_DOCUMENTS = 100_000  # documents streamed from a ``hf:`` spec
CHECK_DOCUMENTS = 10_000  # a corpus with more documents than this always splits (``check_data``)


def prebuilt_dir(data: str | None) -> Path | None:
    """The finished shard folder ``data`` names (from ``data/*.py``), else None."""
    if data is None or data.startswith("hf:"):
        return None
    path = Path(data).expanduser()
    return path if path.is_dir() and is_complete(path) else None


def memoised_documents(source: DataSource, hf_max_documents: int | None) -> Callable[[], list[str]]:
    """The source's documents, read on the first call only (a ``hf:`` source capped at ``hf_max_documents``)."""
    cache: list[list[str]] = []
    limit = hf_max_documents if source.kind == "hf" else None

    def documents() -> list[str]:
        if not cache:
            cache.append(load_documents(source, limit=limit))
        return cache[0]

    return documents


def build_corpus(
    data: str | None,
    tokenizer_spec: str,
    cache_dir: str | os.PathLike[str],
    val_fraction: float = DEFAULT_VAL_FRACTION,
    hf_max_documents: int | None = HF_MAX_DOCUMENTS,
) -> tuple[Tokenizer, ShardInfo]:
    """The tokenizer and the token shards of ``data`` (None: the embedded corpus) under ``cache_dir``, built
    there on first use; a finished shard folder is used as it is, with its own tokenizer."""
    prebuilt = prebuilt_dir(data)
    if prebuilt is not None:
        return Tokenizer.from_file(str(prebuilt / TOKENIZER_FILE)), ShardInfo(path=prebuilt, built=False)
    cache_dir = Path(cache_dir)
    source = resolve_source(data, embedded_dir=cache_dir / "corpus")
    documents_fn = memoised_documents(source, hf_max_documents)
    fingerprint = source.fingerprint()
    if source.kind == "hf":  # the streamed sample depends on the cap
        fingerprint = f"{fingerprint}-{hf_max_documents}"
    tokenizer = load_tokenizer(
        tokenizer_spec, documents_fn, cache_dir / "tokenizers", corpus_fingerprint=fingerprint
    )
    try:
        shards = ensure_token_shards(
            documents_fn,
            tokenizer,
            cache_dir / "shards",
            corpus_fingerprint=fingerprint,
            val_fraction=val_fraction,
        )
    except ValueError as err:
        if isinstance(err, DataError):
            raise
        raise DataError(
            f"The data {source.spec} cannot be split into train and validation ({err}); add more documents."
        ) from None
    return tokenizer, shards


def check_data(data: str | None, val_fraction: float = DEFAULT_VAL_FRACTION) -> None:
    """Refuse, writing nothing, a local ``data`` spec that training would refuse when it prepares the data: a
    path that names no text, no text at all, or text that cannot be split into train and validation documents
    (read up to ``CHECK_DOCUMENTS`` documents; the embedded corpus, a finished shard folder and a ``hf:``
    dataset, read from the network, are taken as they are)."""
    if data is None or str(data).startswith("hf:") or prebuilt_dir(data) is not None:
        return
    source = resolve_source(data)
    documents = []
    for document in iter_documents(source):
        documents.append(document)
        if len(documents) > CHECK_DOCUMENTS:
            return
    if not documents:
        load_documents(source)  # its one sentence: no text at all
    try:
        split_documents(documents, val_fraction)
    except ValueError as err:
        raise DataError(
            f"The data {source.spec} cannot be split into train and validation ({err}); add more documents."
        ) from None
