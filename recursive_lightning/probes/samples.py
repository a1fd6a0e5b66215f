"""The text ``probe`` runs on: ``--data`` or the run's own ``data.path``, cut into token windows.

Documents the training split holds out (the same content hash as the shard writer) come first, then the
others, each followed by the end-of-text token, and the token stream is cut into ``samples`` consecutive
windows of ``seq_len`` tokens - deterministic for a given tokenizer and text.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recursive_lightning.data import corpus
from recursive_lightning.data.sources import DataError, iter_documents, resolve_source
from recursive_lightning.data.tokenizer import EOS_TOKEN
from recursive_lightning.errors import UserError


@dataclass
class Samples:
    tokens: torch.Tensor  # [N, L] int64
    info: dict[str, Any]


def _documents(data: str | None) -> tuple[Iterator[str], str, bool]:
    """(documents, spec, prefer held-out documents)."""
    if data is None:
        return iter(corpus.embedded_corpus_documents()), "<embedded>", True
    try:
        source = resolve_source(data)
    except DataError as e:
        raise UserError(str(e)) from None
    return iter_documents(source), source.spec, source.kind != "hf"


def probe_data(data: str | None, run: Any) -> str | None:
    """The text to probe on: ``--data`` if given (``embedded`` for the embedded corpus), else the run's own
    ``data.path`` (None: the embedded corpus), refused in one sentence when that text is no longer there."""
    if data is not None:
        return None if data == "embedded" else data
    path = getattr(getattr(run, "data", None), "path", None)
    if (
        path
        and not str(path).startswith("hf:")
        and not any(c in str(path) for c in "*?[")
        and not Path(path).exists()
    ):
        raise UserError(
            f"the checkpoint's run trained on data.path '{path}', which is not here; pass its text with --data PATH "
            "(or --data embedded for the embedded corpus)."
        )
    return path or None


def load_samples(
    tokenizer: Any, data: str | None, samples: int, seq_len: int, vocab_size: int | None = None
) -> Samples:
    """``samples`` consecutive windows of ``seq_len`` tokens (held-out documents first, EOS after each)."""
    if tokenizer is None:
        raise UserError("the checkpoint carries no tokenizer, so probe cannot turn --data text into tokens.")
    need = samples * seq_len
    eos = tokenizer.token_to_id(EOS_TOKEN)
    tail = [eos] if eos is not None else []

    def encode(docs: list[str]) -> list[int]:
        out: list[int] = []
        for enc in tokenizer.encode_batch(docs, add_special_tokens=False):
            out.extend(enc.ids)
            out.extend(tail)
        return out

    docs, spec, prefer_heldout = _documents(data)
    held, rest_docs, scanned = _scan(docs, prefer_heldout, need, encode)
    heldout_tokens = len(held) if prefer_heldout else 0
    ids = held
    i = 0
    while len(ids) < need and i < len(rest_docs):
        ids.extend(encode(rest_docs[i : i + 32]))
        i += 32
    tokens = _windows(ids, samples, seq_len, spec, vocab_size)
    n = tokens.shape[0]
    info = {
        "source": spec,
        "samples": n,
        "requested_samples": samples,
        "seq_len": seq_len,
        "heldout_samples": min(n, heldout_tokens // seq_len),
        "documents_scanned": scanned,
        "tokens_sha256": hashlib.sha256(tokens.numpy().tobytes()).hexdigest()[:16],
    }
    if n < samples:
        print(
            f"warning: the text gives only {n} windows of {seq_len} tokens (asked for {samples}).",
            file=sys.stderr,
        )
    return Samples(tokens, info)


def _scan(
    docs: Iterable[str], prefer_heldout: bool, need: int, encode: Callable[[list[str]], list[int]]
) -> tuple[list[int], list[str], int]:
    """Read documents until ``need`` tokens are had: (the tokens of the held-out documents, or of every
    document without ``prefer_heldout``; the other documents kept to fill up with, about 16 characters per
    token needed; the documents scanned). Held-out documents are ~2% of a corpus: about 50x the text needed is
    scanned (at least 20M characters)."""
    from recursive_lightning.data.shards import is_validation_document  # heavy

    held: list[int] = []
    rest_docs: list[str] = []
    rest_chars = 0
    pending: list[str] = []
    scanned = scanned_chars = 0
    max_scan_chars = max(400 * need, 20_000_000)
    try:
        for doc in docs:
            scanned += 1
            scanned_chars += len(doc)
            if scanned_chars > max_scan_chars and rest_chars >= 16 * need:
                break
            if not prefer_heldout or is_validation_document(doc):
                pending.append(doc)
                if len(pending) >= 32:
                    held.extend(encode(pending))
                    pending = []
                    if len(held) >= need:
                        break
            elif rest_chars < 16 * need:  # generous: a token is rarely longer than 16 characters
                rest_docs.append(doc)
                rest_chars += len(doc)
    except DataError as e:
        raise UserError(str(e)) from None
    if pending:
        held.extend(encode(pending))
    return held, rest_docs, scanned


def _windows(ids: list[int], samples: int, seq_len: int, spec: str, vocab_size: int | None) -> torch.Tensor:
    """At most ``samples`` consecutive windows of ``seq_len`` of ``ids`` as ``[n, seq_len]`` (one sentence when
    there is not one window, or a token id past the model's vocabulary)."""
    n = min(samples, len(ids) // seq_len)
    if n == 0:
        raise UserError(
            f"the text in {spec} has only {len(ids)} tokens, fewer than one --seq-len window of {seq_len}; "
            "pass more text with --data or a smaller --seq-len."
        )
    tokens = torch.tensor(ids[: n * seq_len], dtype=torch.int64).view(n, seq_len)
    if vocab_size is not None and int(tokens.max()) >= vocab_size:
        raise UserError(
            f"the checkpoint's tokenizer produces token id {int(tokens.max())} but the model has only "
            f"{vocab_size} embeddings; the checkpoint is inconsistent."
        )
    return tokens
