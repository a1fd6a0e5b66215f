"""Stream a Hugging Face text dataset into token shards (the ``data/*.py`` recipes; needs network and disk).

The output has the layout of :mod:`recursive_lightning.data.shards` and can be passed straight to
``TextDataModule(data=<output>)``. Documents are assigned to train/val by
:func:`~recursive_lightning.data.shards.is_validation_document`, so the splits are disjoint.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from recursive_lightning.data.shards import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_VAL_FRACTION,
    DocumentTokenizer,
    is_validation_document,
    publish_shards,
    token_dtype,
    write_split,
)
from recursive_lightning.data.sources import DataError, short_reason
from recursive_lightning.data.tokenizer import tokenizer_fingerprint

__all__ = ["HubStreamEncoder", "build_hub_shards", "hub_num_shards", "iter_hub_texts"]


def _stream(dataset: str, config: str | None, split: str) -> Any:
    try:
        import datasets  # optional
    except ImportError:
        raise DataError(
            "Streaming from the Hub needs the `datasets` package; run `pip install datasets`."
        ) from None
    try:
        return datasets.load_dataset(dataset, config, split=split, streaming=True)
    except Exception as err:
        raise DataError(
            f"Could not open {dataset} ({config or 'default'}, {split}) on the Hub ({short_reason(err)}); "
            "check the name and your network."
        ) from err


def hub_num_shards(dataset: str, config: str | None = None, split: str = "train") -> int:
    """Number of file shards of a streamed Hub dataset (the unit of parallelism of :func:`build_hub_shards`)."""
    stream = _stream(dataset, config, split)
    return int(getattr(stream, "num_shards", None) or stream.n_shards)


def iter_hub_texts(
    dataset: str,
    config: str | None = None,
    split: str = "train",
    *,
    text_field: str = "text",
    num_shards: int = 1,
    index: int = 0,
) -> Iterator[str]:
    """Yield the non-empty ``text_field`` of every record in file-shard ``index`` of ``num_shards``."""
    stream = _stream(dataset, config, split)
    if num_shards > 1:
        stream = stream.shard(num_shards=num_shards, index=index)
    for record in stream:
        text = record.get(text_field)
        if isinstance(text, str) and text.strip():
            yield text


class HubStreamEncoder(DocumentTokenizer):
    """``litdata.optimize`` function: input ``i`` streams file-shard ``i`` of ``num_inputs`` and yields the token
    tensors of the documents of one split until ``tokens_per_input`` tokens have been written."""

    def __init__(
        self,
        tokenizer_json: str,
        dtype: torch.dtype,
        *,
        dataset: str,
        config: str | None,
        split: str,
        num_inputs: int,
        tokens_per_input: float,
        validation: bool,
        val_fraction: float,
        text_field: str = "text",
        batch_documents: int = 256,
    ) -> None:
        super().__init__(tokenizer_json, dtype)
        self.source = {"dataset": dataset, "config": config, "split": split, "text_field": text_field}
        self.num_inputs = num_inputs
        self.tokens_per_input = tokens_per_input
        self.validation = validation
        self.val_fraction = val_fraction
        self.batch_documents = batch_documents

    def _batches(self, index: int) -> Iterator[list[str]]:
        batch: list[str] = []
        for text in iter_hub_texts(**self.source, num_shards=self.num_inputs, index=index):
            if is_validation_document(text, self.val_fraction) == self.validation:
                batch.append(text)
                if len(batch) == self.batch_documents:
                    yield batch
                    batch = []
        if batch:
            yield batch

    def __call__(self, index: int) -> Iterator[torch.Tensor]:
        written = 0
        for batch in self._batches(index):
            for tokens in self.encode(batch):
                yield tokens
                written += tokens.numel()
                if written >= self.tokens_per_input:
                    return


def build_hub_shards(
    output: str | os.PathLike[str],
    tokenizer: Tokenizer,
    *,
    dataset: str,
    config: str | None = None,
    split: str = "train",
    max_tokens: float | None = None,
    val_tokens: float = 5e6,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    num_workers: int | None = None,
    num_inputs: int | None = None,
    text_field: str = "text",
    chunk_bytes: int | str = DEFAULT_CHUNK_BYTES,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Tokenise a streamed Hub dataset into a finished shard folder at ``output`` (skipped if already complete).

    ``max_tokens`` caps the train split (``None``: the whole dataset); the val split gets ``val_tokens`` tokens
    from held-out documents. Work is split into ``num_inputs`` file shards (default: all of them, or fewer
    when ``max_tokens`` is small) processed by ``num_workers`` spawned processes.
    """
    workers = num_workers or os.cpu_count() or 1
    total_shards = hub_num_shards(dataset, config, split)
    if num_inputs is None:
        num_inputs = total_shards if max_tokens is None else min(total_shards, 4 * workers)
    num_inputs = max(1, min(num_inputs, total_shards))
    val_inputs = max(1, min(num_inputs, workers))
    dtype = token_dtype(tokenizer.get_vocab_size())
    common = {
        "dataset": dataset,
        "config": config,
        "split": split,
        "val_fraction": val_fraction,
        "text_field": text_field,
    }

    def build(tmp: Path) -> None:
        train_fn = HubStreamEncoder(
            tokenizer.to_str(),
            dtype,
            num_inputs=num_inputs,
            validation=False,
            tokens_per_input=math.inf if max_tokens is None else math.ceil(max_tokens / num_inputs),
            **common,
        )
        val_fn = HubStreamEncoder(
            tokenizer.to_str(),
            dtype,
            num_inputs=val_inputs,
            validation=True,
            tokens_per_input=math.ceil(val_tokens / val_inputs),
            **common,
        )
        for name, fn, inputs in (("val", val_fn, val_inputs), ("train", train_fn, num_inputs)):
            print(
                f"[{name}] tokenising {dataset} into {tmp / name} with {min(workers, inputs)} workers ...",
                flush=True,
            )
            write_split(
                fn,
                range(inputs),
                tmp / name,
                chunk_bytes=chunk_bytes,
                num_workers=min(workers, inputs),
                start_method="spawn",
                verbose=True,
            )

    info = {
        "source": f"hf:{dataset}" + (f":{config}" if config else "") + f"@{split}",
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "vocab_size": tokenizer.get_vocab_size(),
        "dtype": str(dtype).removeprefix("torch."),
        "val_fraction": val_fraction,
        "max_tokens": max_tokens,
        **(meta or {}),
    }
    return publish_shards(output, build, tokenizer, info)
