"""Tests of the data pipeline with real litdata, real tokenizers and the embedded corpus (no mocks)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")

import collections  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

import lightning as L  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from recursive_lightning.data import shards as shards_mod  # noqa: E402
from recursive_lightning.data.corpus import embedded_corpus_documents, write_embedded_corpus  # noqa: E402
from recursive_lightning.data.datamodule import TextDataModule  # noqa: E402
from recursive_lightning.data.sources import (  # noqa: E402
    DataError,
    load_documents,
    resolve_source,
    split_long_document,
)
from recursive_lightning.data.tokenizer import (  # noqa: E402
    EOS_TOKEN,
    eos_token_id,
    load_tokenizer,
    tokenizer_fingerprint,
)

SEQ_LEN, BATCH = 128, 8


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rl-data-cache")


@pytest.fixture(scope="session")
def dm(cache_dir: Path) -> TextDataModule:
    """The default pipeline: embedded corpus, bpe:4096, built once for the whole session."""
    module = TextDataModule(
        None, "bpe:4096", seq_len=SEQ_LEN, batch_size=BATCH, cache_dir=cache_dir, val_batches=4
    )
    module.prepare_data()
    module.setup("fit")
    return module


def _long_dm(cache_dir: Path, **kwargs) -> TextDataModule:
    """Same corpus and shards with long blocks, so one epoch is only ~75 batches."""
    module = TextDataModule(None, "bpe:4096", seq_len=512, batch_size=16, cache_dir=cache_dir, **kwargs)
    module.setup("fit")
    return module


# ------------------------------------------------------------------------------------------- corpus
def test_embedded_corpus_is_real_english_prose(tmp_path: Path) -> None:
    docs = embedded_corpus_documents()
    text = "\n".join(docs)
    assert len(text) > 2_000_000
    assert len(docs) > 300 and len(set(docs)) == len(docs)
    assert embedded_corpus_documents() == docs  # deterministic

    words = re.findall(r"[a-z]+", text.lower())
    freq = collections.Counter(words)
    top = [w for w, _ in freq.most_common(10)]
    assert top[0] == "the" and 0.03 < freq["the"] / len(words) < 0.12  # English: ~5-7 %
    assert {"a", "is", "to", "of", "and", "in"} <= set(top)
    assert len(freq) > 8_000  # a real (technical) vocabulary, not a repeated template
    rank_100 = freq.most_common(100)[-1][1]
    assert 10 < freq["the"] / rank_100 < 200  # Zipf-like decay of word frequencies
    assert sum(c.isalpha() or c.isspace() for c in text) / len(text) > 0.8

    path = write_embedded_corpus(tmp_path)
    mtime = path.stat().st_mtime_ns
    assert (
        write_embedded_corpus(tmp_path) == path and path.stat().st_mtime_ns == mtime
    )  # reused, not rewritten
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp files left behind
    source = resolve_source(None, embedded_dir=tmp_path)
    assert source.kind == "embedded" and source.files == (path,)
    assert "".join(load_documents(source)).replace("\n", "") == "".join(docs).replace("\n", "")


# ------------------------------------------------------------------------------------------- sources
def _assert_one_sentence_naming(err: pytest.ExceptionInfo[DataError], path: Path | str) -> None:
    message = str(err.value)
    assert str(path) in message, message
    assert "\n" not in message and message.endswith(".")
    assert message.replace(str(path), "<path>")[:-1].count(". ") == 0, message


def test_missing_path_raises(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError) as err:
        resolve_source(missing)
    _assert_one_sentence_naming(err, missing)


def test_glob_without_match_raises(tmp_path: Path) -> None:
    pattern = str(tmp_path / "*.txt")
    with pytest.raises(DataError) as err:
        resolve_source(pattern)
    _assert_one_sentence_naming(err, pattern)


@pytest.mark.parametrize("content", ["", "  \n\n\t\n", "\n\f\n"])
def test_empty_file_raises(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.txt"
    path.write_text(content)
    with pytest.raises(DataError) as err:
        load_documents(resolve_source(path))
    _assert_one_sentence_naming(err, path)


def test_undecodable_file_raises(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(DataError) as err:
        load_documents(resolve_source(path))
    _assert_one_sentence_naming(err, path)


def test_folder_without_text_files_and_bad_jsonl_raise(tmp_path: Path) -> None:
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(DataError) as err:
        resolve_source(tmp_path)
    _assert_one_sentence_naming(err, tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"title": "no text"}\n')
    with pytest.raises(DataError) as err:
        load_documents(resolve_source(bad))
    _assert_one_sentence_naming(err, bad)


def test_folder_glob_and_jsonl_documents(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("first document\n\f\nsecond document\n")
    (tmp_path / "sub" / "b.md").write_text("# third\n")
    (tmp_path / "c.jsonl").write_text(
        json.dumps({"text": "fourth"}) + "\n\n" + json.dumps({"text": " "}) + "\n"
    )
    (tmp_path / "ignored.csv").write_text("x,y\n")
    expected = ["first document", "second document", "fourth", "# third"]
    assert load_documents(resolve_source(tmp_path)) == expected
    assert load_documents(resolve_source(str(tmp_path / "**" / "*.md"))) == ["# third"]
    long = "\n\n".join(f"paragraph {i} " + "word " * 50 for i in range(200))
    pieces = split_long_document(long, max_chars=2000)
    assert len(pieces) > 10 and all(len(p) <= 2000 for p in pieces) and "\n\n".join(pieces) == long


def test_hf_spec_offline_gives_clear_error() -> None:
    source = resolve_source("hf:HuggingFaceFW/fineweb-edu:sample-10BT@train")
    assert (source.hf_name, source.hf_config, source.hf_split) == (
        "HuggingFaceFW/fineweb-edu",
        "sample-10BT",
        "train",
    )
    missing = resolve_source("hf:recursive-lightning-tests/no-such-dataset")  # fails offline and online
    with pytest.raises(DataError, match="hf:recursive-lightning-tests/no-such-dataset"):
        load_documents(missing, limit=1)


# ------------------------------------------------------------------------------------------- tokenizer
def test_bpe_tokenizer_is_trained_once_and_cached(tmp_path: Path) -> None:
    docs = embedded_corpus_documents()[:60]
    calls = []

    def documents():
        calls.append(1)
        return docs

    tok = load_tokenizer("bpe:512", documents, tmp_path, corpus_fingerprint="corpus-a")
    assert len(calls) == 1 and tok.get_vocab_size() == 512
    assert tok.token_to_id(EOS_TOKEN) == eos_token_id(tok)
    sample = "Return the number of items in a container, e.g. len([1, 2]) == 2.\n"
    assert tok.decode(tok.encode(sample).ids) == sample
    again = load_tokenizer("bpe:512", documents, tmp_path, corpus_fingerprint="corpus-a")
    assert len(calls) == 1 and tokenizer_fingerprint(again) == tokenizer_fingerprint(
        tok
    )  # loaded, not retrained
    load_tokenizer("bpe:512", documents, tmp_path, corpus_fingerprint="corpus-b")
    assert len(calls) == 2 and len(list(tmp_path.glob("bpe512-*.json"))) == 2  # other corpus -> other entry

    saved = tmp_path / "tokenizer.json"
    tok.save(str(saved))
    assert tokenizer_fingerprint(load_tokenizer(str(saved), documents, tmp_path)) == tokenizer_fingerprint(
        tok
    )
    with pytest.raises(DataError) as err:
        load_tokenizer(str(tmp_path / "missing.json"), documents, tmp_path)
    _assert_one_sentence_naming(err, tmp_path / "missing.json")
    with pytest.raises(DataError, match="bpe:<vocab_size>"):
        load_tokenizer("bpe:lots", documents, tmp_path)
    with pytest.raises(DataError, match="recursive-lightning-tests/no-such-tokenizer"):  # offline or not
        load_tokenizer("recursive-lightning-tests/no-such-tokenizer", documents, tmp_path)


# ------------------------------------------------------------------------------------------- shards
def test_shards_are_reused(dm: TextDataModule, cache_dir: Path) -> None:
    assert dm.shards is not None and shards_mod.is_complete(dm.shards.path)
    marker = dm.shards.path / shards_mod.COMPLETE_MARKER
    mtime, runs = marker.stat().st_mtime_ns, shards_mod.optimize_run_count()
    again = TextDataModule(None, "bpe:4096", seq_len=64, batch_size=4, cache_dir=cache_dir)
    again.prepare_data()
    again.setup()
    assert again.shards == shards_mod.ShardInfo(path=dm.shards.path, built=False)
    assert shards_mod.optimize_run_count() == runs and marker.stat().st_mtime_ns == mtime
    assert not [p for p in dm.shards.path.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left
    meta = shards_mod.read_meta(dm.shards.path)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == dm.vocab_size == 4096
    assert meta["train_tokens"] > 400_000 and meta["val_tokens"] > 2_000


def test_finished_shard_folder_is_a_data_spec(dm: TextDataModule, tmp_path: Path) -> None:
    module = TextDataModule(str(dm.shards.path), seq_len=SEQ_LEN, batch_size=BATCH, cache_dir=tmp_path)
    module.setup()  # e.g. the output of data/pile_dedup.py: its own tokenizer, nothing rebuilt
    assert module.shards.path == dm.shards.path and not list(tmp_path.iterdir())
    assert tokenizer_fingerprint(module.tokenizer) == tokenizer_fingerprint(dm.tokenizer)
    assert next(iter(module.train_dataloader())).shape == (BATCH, SEQ_LEN + 1)


def test_train_val_documents_are_disjoint(dm: TextDataModule) -> None:
    docs = embedded_corpus_documents()
    train, val = shards_mod.split_documents(docs)
    assert train and val and not set(train) & set(val) and len(train) + len(val) == len(docs)
    assert shards_mod.split_documents(list(reversed(docs)))[1] == list(reversed(val))  # order-independent
    meta = shards_mod.read_meta(dm.shards.path)
    assert meta["val_documents"] >= 3 and meta["train_documents"] > 10 * meta["val_documents"]
    assert 0.01 < meta["val_tokens"] / (meta["train_tokens"] + meta["val_tokens"]) < 0.05  # ~2 % of the text
    eos = eos_token_id(dm.tokenizer)
    val_tokens = torch.cat(
        [torch.from_numpy(t.astype("int64")) for t in shards_mod.iter_chunk_tokens(dm.shards.path / "val")]
    )
    assert int((val_tokens == eos).sum()) == meta["val_documents"]  # one EOS after every document


def test_train_loader_batches(dm: TextDataModule) -> None:
    loader = dm.train_dataloader()
    batch = next(iter(loader))
    assert batch.shape == (BATCH, SEQ_LEN + 1) and batch.dtype == torch.int64
    assert 0 <= int(batch.min()) and int(batch.max()) < dm.vocab_size
    text = dm.tokenizer.decode(batch[0].tolist())
    assert len(re.findall(r"[A-Za-z]+", text)) > 30


def test_epochs_cycle_without_repeats(cache_dir: Path, dm: TextDataModule) -> None:
    module = _long_dm(cache_dir)
    loader = module.train_dataloader()
    epochs = [torch.cat(list(loader)) for _ in range(2)]
    blocks = len(loader.dataset)
    for epoch in epochs:
        assert epoch.shape[0] == blocks // 16 * 16
        assert (
            len({tuple(row.tolist()) for row in epoch}) == epoch.shape[0]
        )  # nothing repeats within an epoch
    assert not torch.equal(epochs[0], epochs[1])  # reshuffled each epoch
    rebuilt = torch.cat(list(module.train_dataloader()))  # a rebuilt loader continues with the next epoch
    assert not torch.equal(rebuilt, epochs[0]) and not torch.equal(rebuilt, epochs[1])


def test_val_loader_is_fixed(dm: TextDataModule) -> None:
    first, second = list(dm.val_dataloader()), list(dm.val_dataloader())
    assert len(first) == 4 and all(b.shape == (BATCH, SEQ_LEN + 1) and b.dtype == torch.int64 for b in first)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_loader_state_dict_resumes_with_next_batches(dm: TextDataModule, cache_dir: Path) -> None:
    loader = dm.train_dataloader()
    iterator = iter(loader)
    for _ in range(5):
        next(iterator)
    state = loader.state_dict()
    expected = [next(iterator) for _ in range(4)]

    fresh = dm.train_dataloader()  # a brand-new loader, as after a restart
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(expected, [b for _, b in zip(range(4), fresh)]))

    # the same through the DataModule's own state_dict / load_state_dict (a new process would do this)
    module_state = {"shards": dm.shards.path.name, "train_loader": state}
    restored = TextDataModule(None, "bpe:4096", seq_len=SEQ_LEN, batch_size=BATCH, cache_dir=cache_dir)
    restored.setup()
    restored.load_state_dict(module_state)
    resumed = restored.train_dataloader()
    assert all(torch.equal(a, b) for a, b in zip(expected, [b for _, b in zip(range(4), resumed)]))


def test_unigram_perplexity_baseline(dm: TextDataModule) -> None:
    val_ppl, train_ppl = dm.unigram_perplexity("val"), dm.unigram_perplexity("train")
    assert 50 < train_ppl < val_ppl < dm.vocab_size


def test_too_little_data_is_a_data_error(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    for i in range(4):
        (tmp_path / "docs" / f"{i}.txt").write_text(f"Document number {i} is short.\n")
    module = TextDataModule(
        str(tmp_path / "docs"), "bpe:300", seq_len=64, batch_size=2, cache_dir=tmp_path / "c"
    )
    module.setup()
    with pytest.raises(DataError, match="train split"):
        module.train_dataloader()


# ------------------------------------------------------------------------------------------- Lightning resume
class _Recorder(L.LightningModule):
    def __init__(self, save_at: dict[int, Path] | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.seen: list[torch.Tensor] = []
        self.save_at = save_at or {}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch.clone())
        return self.weight * batch.float().mean() / 1000

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if self.trainer.global_step in self.save_at:
            self.trainer.save_checkpoint(self.save_at[self.trainer.global_step])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(
    module: _Recorder, datamodule: TextDataModule, max_steps: int, ckpt_path: Path | None = None
) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)


def test_lightning_resume_continues_with_next_batch(
    cache_dir: Path, tmp_path: Path, dm: TextDataModule
) -> None:
    per_epoch = len(_long_dm(cache_dir).train_dataloader())
    mid, next_epoch = 7, per_epoch + 3  # a step inside epoch 0 and one inside epoch 1
    total = next_epoch + 4
    saves = {mid: tmp_path / "mid.ckpt", next_epoch: tmp_path / "next_epoch.ckpt"}
    reference = _Recorder(saves)
    _fit(reference, _long_dm(cache_dir), total)
    assert len(reference.seen) == total
    assert all(p.is_file() for p in saves.values())
    checkpoint = torch.load(saves[mid], weights_only=False)
    assert checkpoint["TextDataModule"]["train_loader"]["num_samples_yielded"] == mid * 16

    for step, stop in ((mid, mid + 5), (next_epoch, total)):
        resumed = _Recorder()
        _fit(resumed, _long_dm(cache_dir), stop, ckpt_path=saves[step])
        assert len(resumed.seen) == stop - step
        assert all(torch.equal(a, b) for a, b in zip(resumed.seen, reference.seen[step:stop]))


@pytest.mark.parametrize(
    "env, says",
    [
        (
            {"HF_HUB_OFFLINE": "1"},
            "error: The tokenizer 'nobody/no-such-tokenizer' is not in the local Hugging Face cache and "
            "HF_HUB_OFFLINE=1 keeps the Hub off; fetch it with `hf download nobody/no-such-tokenizer tokenizer.json` "
            "where the Hub can be reached (or unset HF_HUB_OFFLINE)",
        ),
        (
            {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:1"},
            "error: The tokenizer 'nobody/no-such-tokenizer' is not in the local Hugging Face cache and the Hub "
            "(http://127.0.0.1:1) cannot be reached (Connection refused); fetch it with `hf download",
        ),
    ],
    ids=["offline", "hub-unreachable"],
)
def test_a_hub_tokenizer_that_cannot_be_had_is_one_sentence_at_once(env, says, tmp_path, data_cache):
    """`train --data.tokenizer <a Hub name not in the cache>`: offline, or with a Hub that does not answer, one
    sentence saying how to fetch it, without the Hub client's half minute of retries; no run directory left."""
    import yaml
    from conftest import ENV, command_output, tiny_config

    cfg = tiny_config(data_cache)
    cfg["data"]["tokenizer"] = "nobody/no-such-tokenizer"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    code, out = command_output(
        "train", "--config", tmp_path / "c.yaml", "--run-dir", run_dir, env={**ENV, **env}
    )
    assert code == 2, out
    assert len(out.strip().splitlines()) == 1 and out.startswith(says) and "Retrying" not in out, out
    assert not run_dir.exists()
