"""``TextDataModule``: data spec + tokenizer spec -> cached litdata token shards -> ``[B, seq_len + 1]`` batches.

Resuming mid-epoch: the train loader is a :class:`litdata.StreamingDataLoader`, which Lightning 2.x treats as
a stateful loader -- the fit loop stores ``loader.state_dict()`` in every checkpoint (``loops.fit_loop`` ->
``state_dict["combined_loader"]``) and loads it into the freshly built train loader on resume, before the first
batch is drawn. :meth:`TextDataModule.state_dict` stores the same loader state (plus the shard key) under the
datamodule's checkpoint entry, and :meth:`TextDataModule.load_state_dict` applies it when
:meth:`train_dataloader` builds the loader, so a resume also works outside the fit loop; applying the same state
twice is harmless. Either way training continues with exactly the next batch.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from litdata import StreamingDataLoader
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, Dataset

from recursive_lightning.data.prepare import HF_MAX_DOCUMENTS, build_corpus, prebuilt_dir
from recursive_lightning.data.shards import (
    DEFAULT_VAL_FRACTION,
    ShardInfo,
    iter_chunk_tokens,
    streaming_dataset,
)
from recursive_lightning.data.sources import DataError, resolve_source

__all__ = ["TextDataModule", "collate_long"]


def collate_long(blocks: list[torch.Tensor]) -> torch.Tensor:
    """Stack token blocks (stored as uint16/int32) into one ``int64`` tensor ``[B, seq_len + 1]``."""
    return torch.stack([block.to(torch.int64) for block in blocks])


class _MovableLoader(StreamingDataLoader):
    """A StreamingDataLoader whose saved position also applies where the shard cache now lives.

    litdata stores the absolute ``input_dir_path`` in the loader state and refuses a state whose path differs;
    the shards are keyed by content (``shards/<key>/train``), so a run resumed on another machine or under
    another ``cache_dir`` reads the same blocks from a new place: the saved path is replaced by the current one.
    """

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        dataset = dict(obj.get("dataset") or {})
        if "input_dir_path" in dataset:
            dataset["input_dir_path"] = self.dataset.input_dir.path
            obj = {**obj, "dataset": dataset}
        super().load_state_dict(obj)


class _Blocks(Dataset):
    """The first ``length`` blocks of a StreamingDataset, as a map-style dataset (fixed validation set)."""

    def __init__(self, dataset: Any, length: int) -> None:
        self.dataset = dataset
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.length:
            raise IndexError(index)
        return self.dataset[index]


class TextDataModule(L.LightningDataModule):
    """Language-model batches from text.

    Args:
        data: ``--data`` spec (file, folder, glob, ``hf:name[:config][@split]``, a finished shard folder
            from ``data/*.py``), or ``None`` for the embedded corpus.
        tokenizer: ``bpe:<vocab_size>``, a ``tokenizer.json`` path or a Hub name (ignored for a shard folder,
            which carries its own tokenizer).
        seq_len: tokens per training example; batches hold ``seq_len + 1`` tokens (inputs + shifted targets).
        batch_size: examples per batch (train and validation).
        cache_dir: where the embedded corpus, trained tokenizers and token shards are cached.
        seed: shuffling seed of the train stream (each epoch is reshuffled deterministically).
        val_batches: number of validation batches (``None``: the whole validation split).
        num_workers: DataLoader worker processes.
        val_fraction: share of documents held out for validation (by content hash).
        hf_max_documents: cap on documents streamed from a ``hf:`` spec.
    """

    def __init__(
        self,
        data: str | None = None,
        tokenizer: str = "bpe:4096",
        seq_len: int = 256,
        batch_size: int = 16,
        cache_dir: str | os.PathLike[str] = ".cache/recursive_lightning",
        seed: int = 0,
        val_batches: int | None = 16,
        num_workers: int = 0,
        val_fraction: float = DEFAULT_VAL_FRACTION,
        hf_max_documents: int | None = HF_MAX_DOCUMENTS,
    ) -> None:
        super().__init__()
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}.")
        self.data = None if data is None else os.fspath(data)
        self.tokenizer_spec = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.cache_dir = Path(cache_dir)
        self.seed = seed
        self.val_batches = val_batches
        self.num_workers = num_workers
        self.val_fraction = val_fraction
        self.hf_max_documents = hf_max_documents
        self.tokenizer: Tokenizer | None = None
        self.shards: ShardInfo | None = None
        self._train_loader: StreamingDataLoader | None = None
        self._pending_train_state: dict[str, Any] | None = None
        self._unigram_cache: dict[str, float] = {}

    # ----------------------------------------------------------------------------------------- building
    def _build(self) -> tuple[Tokenizer, ShardInfo]:
        return build_corpus(
            self.data, self.tokenizer_spec, self.cache_dir, self.val_fraction, self.hf_max_documents
        )

    def corpus_summary(self) -> dict[str, Any]:
        """What the run trains on, for the tracking store (available after :meth:`setup`): name, source kind
        and location, corpus and tokenizer fingerprints, and the documents and tokens of each split."""
        meta_file = self.shards.path / "meta.json" if self.shards is not None else None
        meta = json.loads(meta_file.read_text()) if meta_file is not None and meta_file.is_file() else {}
        if prebuilt_dir(self.data) is not None:
            kind, name, location = "shards", Path(self.data).name, str(Path(self.data).resolve())
        else:
            source = resolve_source(self.data, embedded_dir=self.cache_dir / "corpus")
            kind = source.kind
            if kind == "hf":
                name = source.hf_name + (f":{source.hf_config}" if source.hf_config else "")
                location = name
            elif kind == "embedded":
                name, location = "embedded-corpus", str(source.files[0])
            else:
                name = Path(source.spec).name
                location = str(Path(source.spec).resolve())
        return {
            "name": name,
            "kind": kind,
            "location": location,
            "corpus_fingerprint": meta.get("corpus_fingerprint"),
            "tokenizer": self.tokenizer_spec,
            "tokenizer_fingerprint": meta.get("tokenizer_fingerprint"),
            "vocab_size": meta.get("vocab_size"),
            "splits": {
                "train": {"documents": meta.get("train_documents"), "tokens": meta.get("train_tokens")},
                "heldout": {"documents": meta.get("val_documents"), "tokens": meta.get("val_tokens")},
            },
        }

    def prepare_data(self) -> None:
        """Build (or find in the cache) the tokenizer and the token shards; runs once per node."""
        self._build()

    def setup(self, stage: str | None = None) -> None:
        """Load the tokenizer and locate the shards (building them if :meth:`prepare_data` was skipped)."""
        if self.tokenizer is None or self.shards is None:
            self.tokenizer, self.shards = self._build()

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer (available after :meth:`setup`)."""
        return self._require_tokenizer().get_vocab_size()

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise RuntimeError("Call TextDataModule.setup() before using the tokenizer or the loaders.")
        return self.tokenizer

    def _split_dir(self, split: str) -> Path:
        self._require_tokenizer()
        assert self.shards is not None
        return self.shards.split_dir(split)

    # ----------------------------------------------------------------------------------------- loaders
    def _too_small(self, split: str, blocks: int, needed: int) -> DataError:
        return DataError(
            f"The {split} split in {self._split_dir(split)} has {blocks} blocks of {self.seq_len + 1} tokens but "
            f"needs at least {needed}; use more text or a smaller seq_len/batch_size."
        )

    def train_dataloader(self) -> StreamingDataLoader:
        """Shuffled, endless-by-epochs stream of ``int64`` batches ``[batch_size, seq_len + 1]`` (drop_last)."""
        dataset = streaming_dataset(self._split_dir("train"), self.seq_len, shuffle=True, seed=self.seed)
        if len(dataset) < self.batch_size:
            raise self._too_small("train", len(dataset), self.batch_size)
        loader = _MovableLoader(
            dataset,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            drop_last=True,
            collate_fn=collate_long,
            persistent_workers=False,
        )
        if self._pending_train_state is not None:  # resuming: continue with the next batch
            loader.load_state_dict(self._pending_train_state)
            self._pending_train_state = None
        elif self._train_loader is not None:  # rebuilt (e.g. reload_dataloaders_every_n_epochs): next epoch
            loader.current_epoch = self._train_loader.current_epoch
        self._train_loader = loader
        return loader

    def _val_dataset(self) -> _Blocks:
        dataset = streaming_dataset(self._split_dir("val"), self.seq_len, shuffle=False)
        available = len(dataset)
        if available == 0:
            raise self._too_small("val", 0, 1)
        length = available if self.val_batches is None else min(available, self.val_batches * self.batch_size)
        if length >= self.batch_size:
            length -= length % self.batch_size  # equal batch shapes (no recompiles under torch.compile)
        return _Blocks(dataset, length)

    def val_dataloader(self) -> DataLoader:
        """The first ``val_batches`` batches of the held-out split, always the same, in order."""
        return DataLoader(
            self._val_dataset(),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            collate_fn=collate_long,
        )

    # ----------------------------------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        """Position of the train stream (``StreamingDataLoader.state_dict()``) and the shard key it refers to."""
        state: dict[str, Any] = {"shards": self.shards.path.name if self.shards else None}
        if self._pending_train_state is not None:  # restored but not applied yet: keep it for the next save
            state["train_loader"] = self._pending_train_state
        elif self._train_loader is not None:
            state["train_loader"] = self._train_loader.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the train-stream position; it is applied to the loader built by the next :meth:`train_dataloader`
        (Lightning builds the train loader after restoring the datamodule)."""
        expected = state_dict.get("shards")
        if expected and self.shards is not None and expected != self.shards.path.name:
            raise DataError(
                f"The checkpoint was trained on shards {expected} but the data now resolves to {self.shards.path}; "
                "resume with the same --data and --tokenizer."
            )
        self._pending_train_state = state_dict.get("train_loader")

    # ----------------------------------------------------------------------------------------- baselines
    def unigram_perplexity(self, split: str = "val") -> float:
        """exp(cross-entropy) of the train-split unigram distribution (add-one smoothed) on ``split`` targets.

        For ``"val"`` the targets are exactly those the validation loader scores (tokens ``1..seq_len`` of each
        block); for ``"train"`` all train tokens. A language model should reach a lower perplexity.
        """
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}.")
        if split in self._unigram_cache:
            return self._unigram_cache[split]
        vocab = self.vocab_size
        counts = np.zeros(vocab, dtype=np.int64)
        for tokens in iter_chunk_tokens(self._split_dir("train")):
            counts += np.bincount(tokens, minlength=vocab)[:vocab]
        log_probs = np.log(counts + 1.0) - np.log(counts.sum() + vocab)
        if split == "train":
            nll = -(counts * log_probs).sum() / counts.sum()
        else:
            total, count = 0.0, 0
            for batch in self.val_dataloader():
                targets = batch[:, 1:].reshape(-1).numpy()
                total -= float(log_probs[targets].sum())
                count += targets.size
            nll = total / count
        self._unigram_cache[split] = float(math.exp(nll))
        return self._unigram_cache[split]
