"""Token shards: tokenise once with ``litdata.optimize``, read back with ``litdata.StreamingDataset``.

Layout of a finished shard folder (the same for the cache built here and for the ``data/`` recipes)::

    <dir>/train/index.json, chunk-*.bin   litdata chunks; each item is the 1-D token tensor of one document
    <dir>/val/index.json, chunk-*.bin     (ids followed by EOS), dtype uint16 when the vocab fits, else int32
    <dir>/tokenizer.json                  the tokenizer that produced the ids
    <dir>/meta.json                       fingerprints, dtype, token counts
    <dir>/COMPLETE                        written last

A folder is built under a temporary name and renamed into place after ``COMPLETE`` is written, so an
interrupted run never leaves a folder that looks finished. Training reads fixed blocks of
``seq_len + 1`` tokens with :class:`litdata.streaming.item_loader.TokensLoader` (blocks may span documents).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")  # no network round-trip on every optimize()

from litdata import StreamingDataset, optimize  # noqa: E402
from litdata.constants import _TORCH_DTYPES_MAPPING  # noqa: E402
from litdata.processing.data_processor import DataProcessor  # noqa: E402
from litdata.streaming.item_loader import TokensLoader  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from recursive_lightning import faults  # noqa: E402
from recursive_lightning.data.tokenizer import EOS_TOKEN, tokenizer_fingerprint  # noqa: E402

__all__ = [
    "COMPLETE_MARKER",
    "DEFAULT_CHUNK_BYTES",
    "SPLITS",
    "DocumentTokenizer",
    "ShardInfo",
    "build_token_shards",
    "count_tokens",
    "default_start_method",
    "ensure_token_shards",
    "is_complete",
    "is_validation_document",
    "iter_chunk_tokens",
    "optimize_run_count",
    "publish_shards",
    "read_meta",
    "shards_key",
    "split_documents",
    "streaming_dataset",
    "token_dtype",
    "write_split",
]

SHARD_FORMAT_VERSION = 2
COMPLETE_MARKER = "COMPLETE"
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
DEFAULT_CHUNK_BYTES = "64MB"
DEFAULT_VAL_FRACTION = 0.02
_OPTIMIZE_RUNS = 0


def optimize_run_count() -> int:
    """How many times this process has called ``litdata.optimize`` (lets tests check that caches are reused)."""
    return _OPTIMIZE_RUNS


def token_dtype(vocab_size: int) -> torch.dtype:
    """Smallest safe storage dtype for token ids: ``uint16`` up to 65,536 ids, else ``int32``."""
    return torch.uint16 if vocab_size <= 2**16 else torch.int32


def _document_hash_fraction(text: str) -> float:
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def is_validation_document(text: str, val_fraction: float = DEFAULT_VAL_FRACTION) -> bool:
    """Streaming split rule (used by the Hub recipes): held out iff the content hash falls below ``val_fraction``."""
    return _document_hash_fraction(text) < val_fraction


def split_documents(
    documents: Sequence[str], val_fraction: float = DEFAULT_VAL_FRACTION
) -> tuple[list[str], list[str]]:
    """Split documents into (train, val), both in their original order.

    Documents are visited in order of their content hash and moved to val until val holds ``val_fraction``
    of all characters (at least one document). The result is deterministic, independent of the input
    order, sized by text rather than by document count, and identical documents share a split.
    """
    if len(documents) < 2:
        raise ValueError("at least two documents are needed for a train/validation split")
    target = val_fraction * sum(len(d) for d in documents)
    by_hash = sorted(range(len(documents)), key=lambda i: (_document_hash_fraction(documents[i]), i))
    val_texts: set[str] = set()
    held_out, size = set(), 0
    for i in by_hash:
        if held_out and size >= target and documents[i] not in val_texts:
            break
        held_out.add(i)
        val_texts.add(documents[i])
        size += len(documents[i])
    if len(held_out) == len(documents):
        raise ValueError("all documents are identical, so no train/validation split by document exists")
    train = [d for i, d in enumerate(documents) if i not in held_out]
    val = [d for i, d in enumerate(documents) if i in held_out]
    return train, val


class DocumentTokenizer:
    """Picklable ``documents -> token tensors`` encoder for ``litdata.optimize`` workers.

    It holds the tokenizer as a JSON string and builds the :class:`tokenizers.Tokenizer` lazily in the
    worker. :meth:`encode` returns one 1-D tensor per document: its ids followed by the EOS id.
    """

    def __init__(self, tokenizer_json: str, dtype: torch.dtype) -> None:
        self.tokenizer_json = tokenizer_json
        self.dtype = dtype
        self._tokenizer: Tokenizer | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokenizer": None}

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_str(self.tokenizer_json)
        return self._tokenizer

    def encode(self, documents: Sequence[str]) -> list[torch.Tensor]:
        eos = self.tokenizer.token_to_id(EOS_TOKEN)
        encodings = self.tokenizer.encode_batch(list(documents), add_special_tokens=False)
        return [torch.tensor([*enc.ids, eos], dtype=torch.int64).to(self.dtype) for enc in encodings]


class _EncodeBatches(DocumentTokenizer):
    """``optimize`` function over batch indices; the document batches travel with the function."""

    def __init__(self, tokenizer_json: str, dtype: torch.dtype, batches: list[list[str]]) -> None:
        super().__init__(tokenizer_json, dtype)
        self.batches = batches

    def __call__(self, batch_index: int) -> Iterator[torch.Tensor]:
        faults.point("tokenising")  # tests: Ctrl-C while a worker tokenises
        yield from self.encode(self.batches[batch_index])


@contextlib.contextmanager
def _isolated_optimizer_env(scratch: Path) -> Iterator[None]:
    """Point litdata's scratch folders (which ``optimize`` wipes) into ``scratch`` and restore global state after."""
    keys = (
        "DATA_OPTIMIZER_CACHE_FOLDER",
        "DATA_OPTIMIZER_DATA_CACHE_FOLDER",
        "LITDATA_DISABLE_VERSION_CHECK",
    )
    saved = {k: os.environ.get(k) for k in keys}
    start_method = multiprocessing.get_start_method(allow_none=True)
    os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = str(scratch / "chunks")
    os.environ["DATA_OPTIMIZER_DATA_CACHE_FOLDER"] = str(scratch / "data")
    os.environ["LITDATA_DISABLE_VERSION_CHECK"] = "1"
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        multiprocessing.set_start_method(start_method, force=True)  # optimize() forces its own


def _interrupt(processor: DataProcessor, signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _kill_workers(workers: set[multiprocessing.Process]) -> None:
    """SIGKILL ``workers`` and the processes they started (what they were writing is thrown away)."""
    pids = [w.pid for w in workers if w.pid is not None]
    try:
        import psutil  # optional

        for pid in list(pids):
            with contextlib.suppress(psutil.Error):
                pids += [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except ImportError:  # their own children then end with them, or with their pipes
        pass
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for w in workers:
        w.join()


@contextlib.contextmanager
def _ctrl_c_interrupts() -> Iterator[None]:
    """Ctrl-C while ``litdata.optimize`` runs raises KeyboardInterrupt, as anywhere else (exit 130; the shard
    folder being built is removed by ``publish_shards``), and the workers it started are stopped. litdata's
    own handler would stop its workers and end the process with status 0 at once (``os._exit``: no cleanup),
    and stays installed after it returns: the process's handler is put back."""
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGINT) if main else None
    before = set(multiprocessing.active_children())
    litdata_handler = DataProcessor._signal_handler
    DataProcessor._signal_handler = _interrupt  # bound when optimize installs it
    try:
        yield
    except BaseException:  # Ctrl-C, SIGTERM, an error: no worker left tokenising into a removed folder
        _kill_workers(set(multiprocessing.active_children()) - before)
        raise
    finally:
        DataProcessor._signal_handler = litdata_handler
        if handler is not None:
            signal.signal(signal.SIGINT, handler)


def default_start_method() -> str:
    """``"fork"`` where available and CUDA is not initialised (seconds faster: no re-import of torch), else ``"spawn"``."""
    if "fork" in multiprocessing.get_all_start_methods() and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


def write_split(
    fn: Callable[[Any], Iterator[torch.Tensor]],
    inputs: Sequence[Any],
    output_dir: str | os.PathLike[str],
    *,
    chunk_bytes: int | str = DEFAULT_CHUNK_BYTES,
    num_workers: int = 1,
    start_method: str | None = None,
    verbose: bool = False,
) -> None:
    """Run ``litdata.optimize`` so that ``output_dir`` holds TokensLoader chunks of the tensors ``fn`` yields.

    litdata runs ``fn`` in ``num_workers`` worker processes, started with :func:`default_start_method`
    unless ``start_method`` is given; with ``"spawn"``, ``fn`` must be picklable (a module-level function
    or an instance of a module-level class) and the calling script needs an ``if __name__ == "__main__"`` guard.
    """
    global _OPTIMIZE_RUNS
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".litdata-scratch-", dir=output_dir.parent) as scratch:
        quiet = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
        with _isolated_optimizer_env(Path(scratch)), _ctrl_c_interrupts(), quiet:
            optimize(
                fn=fn,
                inputs=list(inputs),
                output_dir=str(output_dir),
                chunk_bytes=chunk_bytes,
                item_loader=TokensLoader(),
                num_workers=num_workers,
                reorder_files=False,
                keep_data_ordered=True,
                start_method=start_method or default_start_method(),
                verbose=verbose,
            )
    _OPTIMIZE_RUNS += 1
    if not (output_dir / "index.json").is_file():
        raise RuntimeError(f"litdata.optimize finished without writing {output_dir / 'index.json'}.")


def is_complete(shard_dir: str | os.PathLike[str]) -> bool:
    """Whether ``shard_dir`` is a finished shard folder (marker, metadata and both split indexes present)."""
    shard_dir = Path(shard_dir)
    return (shard_dir / COMPLETE_MARKER).is_file() and all(
        (shard_dir / split / "index.json").is_file() for split in SPLITS
    )


def read_meta(shard_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``meta.json`` of a finished shard folder."""
    return json.loads((Path(shard_dir) / META_FILE).read_text())


def count_tokens(split_dir: str | os.PathLike[str]) -> int:
    """Number of tokens stored in one split (from its ``index.json``)."""
    index = json.loads((Path(split_dir) / "index.json").read_text())
    return int(sum(chunk["dim"] or 0 for chunk in index["chunks"]))


def iter_chunk_tokens(split_dir: str | os.PathLike[str]) -> Iterator[np.ndarray]:
    """Yield the token ids of each chunk of a split as a NumPy array (memory-mapped, no copy)."""
    split_dir = Path(split_dir)
    index = json.loads((split_dir / "index.json").read_text())
    data_format = index["config"]["data_format"][0]
    serializer, dtype_index = data_format.split(":")
    if serializer != "no_header_tensor":
        raise ValueError(f"{split_dir} holds {serializer!r} items, not token tensors.")
    dtype = torch.empty(0, dtype=_TORCH_DTYPES_MAPPING[int(dtype_index)]).numpy().dtype
    for chunk in index["chunks"]:
        offset = (
            1 + chunk["chunk_size"] + 1
        ) * 4  # header: item count + offsets (uint32), see litdata writer
        yield np.memmap(
            split_dir / chunk["filename"], dtype=dtype, mode="r", offset=offset, shape=(chunk["dim"],)
        )


def publish_shards(
    final_dir: str | os.PathLike[str],
    build: Callable[[Path], None],
    tokenizer: Tokenizer,
    meta: dict[str, Any],
) -> Path:
    """Build a shard folder atomically: ``build(tmp)`` writes ``tmp/train`` and ``tmp/val``, then the tokenizer,
    ``meta.json`` and ``COMPLETE`` are added and ``tmp`` is renamed to ``final_dir``.

    If ``final_dir`` is already complete it is returned untouched; an incomplete leftover is replaced.
    """
    final_dir = Path(final_dir)
    if is_complete(final_dir):
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.tmp-", dir=final_dir.parent))
    try:
        build(tmp)
        tokenizer.save(str(tmp / TOKENIZER_FILE))
        counts = {f"{split}_tokens": count_tokens(tmp / split) for split in SPLITS}
        full_meta = {"format_version": SHARD_FORMAT_VERSION, "created": time.time(), **meta, **counts}
        (tmp / META_FILE).write_text(json.dumps(full_meta, indent=2, sort_keys=True))
        (tmp / COMPLETE_MARKER).write_text("ok\n")
        os.chmod(tmp, 0o755)  # mkdtemp creates it private
        if final_dir.exists() and not is_complete(final_dir):
            shutil.rmtree(final_dir)  # leftover of an older, interrupted layout
        try:
            os.rename(tmp, final_dir)
        except OSError:
            if not is_complete(final_dir):  # another process won the race with a finished folder: keep it
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final_dir


def shards_key(corpus_fingerprint: str, tokenizer_fp: str, val_fraction: float = DEFAULT_VAL_FRACTION) -> str:
    """Cache key of a shard folder: corpus, tokenizer, split rule and format version."""
    text = f"{SHARD_FORMAT_VERSION}|{corpus_fingerprint}|{tokenizer_fp}|{val_fraction!r}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _batches(documents: Sequence[str], max_chars: int = 1_000_000) -> list[list[str]]:
    batches, current, size = [], [], 0
    for document in documents:
        if current and size + len(document) > max_chars:
            batches.append(current)
            current, size = [], 0
        current.append(document)
        size += len(document)
    if current:
        batches.append(current)
    return batches


def build_token_shards(
    documents: Sequence[str],
    tokenizer: Tokenizer,
    output_dir: str | os.PathLike[str],
    *,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    chunk_bytes: int | str = DEFAULT_CHUNK_BYTES,
    num_workers: int = 1,
    start_method: str | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Split ``documents`` by document, tokenise them and publish a complete shard folder at ``output_dir``."""
    train, val = split_documents(documents, val_fraction)
    dtype = token_dtype(tokenizer.get_vocab_size())
    tokenizer_json = tokenizer.to_str()

    def build(tmp: Path) -> None:
        for split, docs in (("train", train), ("val", val)):
            batches = _batches(docs)
            fn = _EncodeBatches(tokenizer_json, dtype, batches)
            write_split(
                fn,
                range(len(batches)),
                tmp / split,
                chunk_bytes=chunk_bytes,
                num_workers=min(num_workers, len(batches)),
            )

    info = {
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "vocab_size": tokenizer.get_vocab_size(),
        "dtype": str(dtype).removeprefix("torch."),
        "val_fraction": val_fraction,
        "train_documents": len(train),
        "val_documents": len(val),
        **(meta or {}),
    }
    return publish_shards(output_dir, build, tokenizer, info)


@dataclass(frozen=True)
class ShardInfo:
    """Where the shards of one (corpus, tokenizer) pair live, and whether this call built them."""

    path: Path
    built: bool

    def split_dir(self, split: str) -> Path:
        if split not in SPLITS:
            raise ValueError(f"Unknown split {split!r}; expected one of {SPLITS}.")
        return self.path / split


def ensure_token_shards(
    documents_fn: Callable[[], Sequence[str]],
    tokenizer: Tokenizer,
    cache_dir: str | os.PathLike[str],
    *,
    corpus_fingerprint: str,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    chunk_bytes: int | str = DEFAULT_CHUNK_BYTES,
    num_workers: int = 1,
    start_method: str | None = None,
) -> ShardInfo:
    """Return the cached shards for (corpus, tokenizer), building them first if no complete copy exists.

    ``documents_fn`` is only called when the shards have to be built.
    """
    key = shards_key(corpus_fingerprint, tokenizer_fingerprint(tokenizer), val_fraction)
    path = Path(cache_dir) / key
    if is_complete(path):
        return ShardInfo(path=path, built=False)
    build_token_shards(
        documents_fn(),
        tokenizer,
        path,
        val_fraction=val_fraction,
        chunk_bytes=chunk_bytes,
        num_workers=num_workers,
        meta={"corpus_fingerprint": corpus_fingerprint},
    )
    return ShardInfo(path=path, built=True)


def streaming_dataset(
    split_dir: str | os.PathLike[str],
    seq_len: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    drop_last: bool = True,
) -> StreamingDataset:
    """A dataset of non-overlapping blocks of ``seq_len + 1`` token ids read from one split."""
    return StreamingDataset(
        str(Path(split_dir).resolve()),
        item_loader=TokensLoader(block_size=seq_len + 1),
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
