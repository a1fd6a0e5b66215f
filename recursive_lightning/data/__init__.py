"""Data pipeline: text sources -> tokenizer -> cached litdata token shards -> ``TextDataModule``."""

from recursive_lightning.data.corpus import embedded_corpus_documents, write_embedded_corpus
from recursive_lightning.data.datamodule import TextDataModule
from recursive_lightning.data.shards import ensure_token_shards, streaming_dataset
from recursive_lightning.data.sources import DataError, DataSource, load_documents, resolve_source
from recursive_lightning.data.tokenizer import EOS_TOKEN, load_tokenizer, tokenizer_fingerprint

__all__ = [
    "EOS_TOKEN",
    "DataError",
    "DataSource",
    "TextDataModule",
    "embedded_corpus_documents",
    "ensure_token_shards",
    "load_documents",
    "load_tokenizer",
    "resolve_source",
    "streaming_dataset",
    "tokenizer_fingerprint",
    "write_embedded_corpus",
]
