"""Tokenizers (Hugging Face ``tokenizers`` only): a local ``tokenizer.json``, a Hub name, or ``bpe:<vocab_size>``.

``bpe:<vocab_size>`` trains a byte-level BPE on the corpus and caches it under ``cache_dir``, keyed by
(corpus fingerprint, vocab size); a second call with the same corpus loads the cached file. Every tokenizer
returned by :func:`load_tokenizer` has the end-of-text token :data:`EOS_TOKEN`, which the shard writer
appends after each document.
"""

from __future__ import annotations

import hashlib
import os
import socket
import urllib.parse
from collections.abc import Callable, Iterable
from pathlib import Path

from huggingface_hub import constants, hf_hub_download, is_offline_mode
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from recursive_lightning.data.sources import DataError, short_reason
from recursive_lightning.files import atomic_path

__all__ = [
    "EOS_TOKEN",
    "corpus_content_fingerprint",
    "eos_token_id",
    "load_tokenizer",
    "tokenizer_fingerprint",
    "train_bpe",
]

EOS_TOKEN = "<|endoftext|>"
INIT_TOKENIZER = "init"  # data.tokenizer value: the tokenizer of train.init_from (training/uptrain.py)
BPE_FORMAT_VERSION = 1
_MIN_BPE_VOCAB = 257  # 256 byte symbols + EOS
HUB_CONNECT_TIMEOUT_S = 5  # seconds to reach the Hugging Face Hub before saying it cannot be


def tokenizer_fingerprint(tok: Tokenizer) -> str:
    """Hash of the tokenizer's JSON serialisation (vocabulary, merges, normalisers, special tokens)."""
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()[:16]


def eos_token_id(tok: Tokenizer) -> int:
    """Id of :data:`EOS_TOKEN` in ``tok`` (it is always present in tokenizers from :func:`load_tokenizer`)."""
    token_id = tok.token_to_id(EOS_TOKEN)
    if token_id is None:
        raise DataError(f"The tokenizer has no {EOS_TOKEN} token; load it with load_tokenizer() to add one.")
    return token_id


def corpus_content_fingerprint(documents: Iterable[str]) -> str:
    """Hash of the documents' text (used when the caller has no cheaper corpus fingerprint)."""
    h = hashlib.sha256()
    for document in documents:
        h.update(hashlib.sha256(document.encode("utf-8")).digest())
    return h.hexdigest()[:16]


def train_bpe(documents: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a GPT-2 style byte-level BPE with ``vocab_size`` entries (including :data:`EOS_TOKEN`)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return tok


def _save_atomically(tok: Tokenizer, target: Path) -> None:
    with atomic_path(target) as tmp:
        tok.save(tmp)


def ensure_eos(tok: Tokenizer) -> Tokenizer:
    if tok.token_to_id(EOS_TOKEN) is None:
        tok.add_special_tokens([EOS_TOKEN])
    tok.no_padding()
    tok.no_truncation()
    return tok


def _load_file(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:
        raise DataError(
            f"The tokenizer file {path} could not be loaded ({short_reason(err)}); pass a valid tokenizer.json."
        ) from None


def _load_bpe(
    vocab_text: str,
    spec: str,
    documents_fn: Callable[[], Iterable[str]],
    cache_dir: Path,
    corpus_fingerprint: str | None,
) -> Tokenizer:
    try:
        vocab_size = int(vocab_text)
    except ValueError:
        raise DataError(
            f"The tokenizer spec {spec!r} has no integer vocab size; use bpe:<vocab_size>, e.g. bpe:4096."
        ) from None
    if vocab_size < _MIN_BPE_VOCAB:
        raise DataError(
            f"The tokenizer spec {spec!r} asks for fewer than {_MIN_BPE_VOCAB} tokens; use bpe:4096 or more."
        )
    fingerprint = corpus_fingerprint or corpus_content_fingerprint(documents_fn())
    key = hashlib.sha256(f"{BPE_FORMAT_VERSION}|{fingerprint}|{vocab_size}".encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"bpe{vocab_size}-{key}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tok = train_bpe(documents_fn(), vocab_size)
    _save_atomically(tok, path)
    return tok


def _hub_unreachable(endpoint: str) -> str | None:
    """Why the Hugging Face Hub at ``endpoint`` cannot be reached (a name that does not resolve, a refused
    connection), found in seconds: its client retries a download for half a minute first. None if it answers."""
    parts = urllib.parse.urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname or "", port), timeout=HUB_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def _load_hub(name: str) -> Tokenizer:
    try:  # fetched before: no network needed
        return Tokenizer.from_file(hf_hub_download(name, "tokenizer.json", local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache (or a damaged copy): the Hub is asked below
        pass
    fetch = f"`hf download {name} tokenizer.json` where the Hub can be reached"
    if is_offline_mode():
        raise DataError(
            f"The tokenizer {name!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1 keeps the Hub "
            f"off; fetch it with {fetch} (or unset HF_HUB_OFFLINE), or use a local tokenizer.json or "
            "bpe:<vocab_size>."
        )
    reason = _hub_unreachable(constants.ENDPOINT)
    if reason is not None:
        raise DataError(
            f"The tokenizer {name!r} is not in the local Hugging Face cache and the Hub ({constants.ENDPOINT}) "
            f"cannot be reached ({reason}); fetch it with {fetch}, or use a local tokenizer.json or "
            "bpe:<vocab_size>."
        )
    try:
        return Tokenizer.from_pretrained(name)
    except Exception as err:
        raise DataError(
            f"Could not download the tokenizer {name!r} from the Hugging Face Hub ({short_reason(err)}); "
            "check the name and your network, or use a local tokenizer.json or bpe:<vocab_size>."
        ) from None


def load_tokenizer(
    spec: str,
    documents_fn: Callable[[], Iterable[str]],
    cache_dir: str | os.PathLike[str],
    *,
    corpus_fingerprint: str | None = None,
) -> Tokenizer:
    """Load or train the tokenizer named by ``spec``; the result always contains :data:`EOS_TOKEN`.

    ``spec`` is a path to a ``tokenizer.json`` (or a folder holding one), a Hub repository such as
    ``EleutherAI/pythia-160m``, or ``bpe:<vocab_size>``. ``documents_fn`` returns the training documents and
    is only called when a BPE must be trained (or fingerprinted, if ``corpus_fingerprint`` is not given).
    """
    spec = spec.strip()
    if spec.startswith("bpe:"):
        tok = _load_bpe(spec[4:], spec, documents_fn, Path(cache_dir), corpus_fingerprint)
        return ensure_eos(tok)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if path.is_file():
        return ensure_eos(_load_file(path))
    if spec.endswith(".json") or spec.startswith(("/", ".", "~")) or path.is_dir():
        raise DataError(
            f"The tokenizer file {path} does not exist; pass an existing tokenizer.json, a Hub name or bpe:<n>."
        )
    return ensure_eos(_load_hub(spec))
