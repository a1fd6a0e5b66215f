"""Downstream tasks built from the embedded corpus's held-out documents, for a machine without the network.

Two tasks, each a few hundred items drawn deterministically (seeded) from the documents that a ``train`` run on
the embedded corpus holds out, ``split_documents(embedded_corpus_documents(), 0.05)[1]`` (``data.val_fraction``'s
default; its validation batches come from the same documents):

* ``embedded_lastword`` (LAMBADA-style): the text of a paragraph up to the last word of one of its sentences;
  the model must give that word. Scored by lm-eval's ``loglikelihood``: ``acc`` = the word is the greedy
  continuation, ``perplexity`` of the word.
* ``embedded_nextsent`` (multiple choice): up to three sentences of a paragraph; the choices are the sentence
  that follows them and three sentences of similar length from *other* held-out documents. ``acc`` /
  ``acc_norm`` (log-likelihood normalised by the choice's byte length).

Only prose is used (no indented code, doctest lines or section underlines), whitespace is collapsed, and an item
whose answer sentence or whole text (context and answer) occurs anywhere in a training document (whitespace
collapsed the same way) is dropped, so nothing a model trained on the training split has seen gives the answer
away. A run with ``data.val_fraction``
>= :data:`HELDOUT_FRACTION` on the embedded corpus never trained on these documents (the held-out documents of a
smaller fraction are a subset of those of a larger one).

The items are cached as one JSON file per (corpus fingerprint, held-out fraction, seed, sizes, format version)
under ``<cache>/tasks/``, written atomically; the lm-eval task configs in ``evaluation/tasks/`` read them through
:func:`dataset_dict`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from recursive_lightning.data.corpus import embedded_corpus_documents, embedded_corpus_fingerprint
from recursive_lightning.errors import UserError
from recursive_lightning.files import atomic_write_text, default_cache_dir

__all__ = [
    "EMBEDDED_TASKS",
    "HELDOUT_FRACTION",
    "LASTWORD",
    "NEXTSENT",
    "build_items",
    "dataset_dict",
    "default_cache_dir",
    "embedded_task_items",
    "normalise",
    "prose_paragraphs",
    "sentences",
]

TASK_FORMAT_VERSION = 2
LASTWORD = "embedded_lastword"
NEXTSENT = "embedded_nextsent"
EMBEDDED_TASKS = (LASTWORD, NEXTSENT)
HELDOUT_FRACTION = 0.05  # = DataConfig.val_fraction: the documents a default `train` run holds out
SEED = 17
TEST_ITEMS = 300  # per task (fewer if the held-out documents do not have that many)
FEWSHOT_ITEMS = 16  # per task, the ``train`` split lm-eval draws few-shot examples from
CONTEXT_WORDS = 48  # at most this many words of context
CHOICES = 4

_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\]”\"'][.!?])\s+(?=[A-Z“\"(])")
_LAST_WORD = re.compile(r"^(.*\S)\s([A-Za-z]{3,})[.!?]$")
_UNDERLINE = re.compile(r"^[\s*=\-~^#+]+$")


def normalise(text: str) -> str:
    """Whitespace collapsed to single spaces (how item text is compared with training documents)."""
    return re.sub(r"\s+", " ", text).strip()


def prose_paragraphs(document: str) -> list[str]:
    """The paragraphs of ``document`` that are prose: no indented, doctest or underline lines, mostly letters."""
    out = []
    for para in document.split("\n\n"):
        lines = [line for line in para.split("\n") if line.strip()]
        if not lines or any(
            line[0].isspace() or line.startswith((">>>", "...")) or _UNDERLINE.match(line) for line in lines
        ):
            continue
        text = normalise(" ".join(lines))
        if len(text.split()) < 8:
            continue
        if sum(c.isalpha() or c.isspace() for c in text) < 0.85 * len(text):
            continue
        out.append(text)
    return out


def sentences(paragraph: str) -> list[str]:
    """``paragraph`` cut after ``.``, ``!`` or ``?`` that are followed by a capitalised word."""
    return [s for s in _SENTENCE_END.split(paragraph) if s]


def _tail_words(text: str, n: int) -> str:
    words = text.split(" ")
    return " ".join(words[-n:])


def _in_training(text: str, training: str) -> bool:
    return text in training


def build_items(
    heldout: Sequence[str],
    training: Iterable[str],
    *,
    seed: int = SEED,
    test_items: int = TEST_ITEMS,
    fewshot_items: int = FEWSHOT_ITEMS,
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """``{task: {"test": [...], "train": [...]}}`` from the held-out documents; deterministic for the same
    arguments. ``training`` are the documents the items must not come from (checked after collapsing
    whitespace)."""
    train_text = "\f".join(normalise(d) for d in training)
    rng = random.Random(seed)
    lastword: list[dict[str, Any]] = []
    pairs: list[tuple[int, str, str]] = []  # (document, context, next sentence)
    pool: list[tuple[int, str]] = []  # (document, sentence): distractors
    seen: set[str] = set()
    for doc_index, document in enumerate(heldout):
        for para in prose_paragraphs(document):
            sents = sentences(para)
            for i, sent in enumerate(sents):
                words = sent.split(" ")
                if 5 <= len(words) <= 60:
                    pool.append((doc_index, sent))
                m = _LAST_WORD.match(sent)
                if m and len(words) >= 6 and sent not in seen and not _in_training(sent, train_text):
                    seen.add(sent)
                    context = _tail_words(" ".join([*sents[:i], m.group(1)]), CONTEXT_WORDS)
                    if not _in_training(f"{context} {m.group(2)}", train_text):
                        lastword.append({"context": context, "target": m.group(2), "doc": doc_index})
                if i + 1 < len(sents):
                    nxt = sents[i + 1]
                    if (
                        4 <= len(nxt.split(" ")) <= 60
                        and len(words) >= 4
                        and not _in_training(nxt, train_text)
                    ):
                        context = _tail_words(" ".join(sents[max(0, i - 2) : i + 1]), CONTEXT_WORDS)
                        pairs.append((doc_index, context, nxt))
    nextsent: list[dict[str, Any]] = []
    seen_pairs: set[tuple[str, str]] = set()
    for doc_index, context, answer in pairs:
        if (context, answer) in seen_pairs or _in_training(f"{context} {answer}", train_text):
            continue
        seen_pairs.add((context, answer))
        n = len(answer.split(" "))
        others = sorted(
            {s for d, s in pool if d != doc_index and s != answer and 0.6 * n <= len(s.split(" ")) <= 1.6 * n}
        )
        if len(others) < CHOICES - 1:
            continue
        choices = rng.sample(others, CHOICES - 1)
        label = rng.randrange(CHOICES)
        choices.insert(label, answer)
        nextsent.append({"context": context, "choices": choices, "label": label, "doc": doc_index})
    out = {}
    for task, items in ((LASTWORD, lastword), (NEXTSENT, nextsent)):
        rng.shuffle(items)
        fewshot = items[:fewshot_items]
        test = items[fewshot_items : fewshot_items + test_items]
        out[task] = {
            "test": [{"id": i, **x} for i, x in enumerate(test)],
            "train": [{"id": i, **x} for i, x in enumerate(fewshot)],
        }
    return out


def _cache_key(fingerprint: str, fraction: float, seed: int, test_items: int, fewshot_items: int) -> str:
    text = f"{TASK_FORMAT_VERSION}|{fingerprint}|{fraction!r}|{seed}|{test_items}|{fewshot_items}|{CONTEXT_WORDS}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def embedded_task_items(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    seed: int = SEED,
    test_items: int = TEST_ITEMS,
    fewshot_items: int = FEWSHOT_ITEMS,
) -> dict[str, Any]:
    """The items of both tasks (``{"meta": ..., task: {"test": [...], "train": [...]}}``), read from the cache or
    built from the embedded corpus and cached (atomically) under ``<cache_dir>/tasks/``."""
    fingerprint = embedded_corpus_fingerprint()
    key = _cache_key(fingerprint, HELDOUT_FRACTION, seed, test_items, fewshot_items)
    path = Path(cache_dir or default_cache_dir()) / "tasks" / f"embedded-{key}.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if all(t in data for t in EMBEDDED_TASKS):
                return data
        except (OSError, ValueError):
            pass  # damaged: built again below
    from recursive_lightning.data.shards import split_documents  # heavy

    training, heldout = split_documents(embedded_corpus_documents(), HELDOUT_FRACTION)
    data = {
        "meta": {
            "format_version": TASK_FORMAT_VERSION,
            "corpus_fingerprint": fingerprint,
            "heldout_fraction": HELDOUT_FRACTION,
            "heldout_documents": len(heldout),
            "seed": seed,
        },
        **build_items(heldout, training, seed=seed, test_items=test_items, fewshot_items=fewshot_items),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(data, ensure_ascii=False, indent=1))
    except OSError as e:
        raise UserError(
            f"the embedded tasks' cache folder '{path.parent}' is not writable ({e.strerror}); "
            "set RECURSIVE_LIGHTNING_CACHE to a writable folder."
        ) from None
    return data


def dataset_dict(task: str, cache_dir: str | os.PathLike[str] | None = None, **_: Any) -> Any:
    """A ``datasets.DatasetDict`` (``test``, ``train``) of ``task``, for lm-eval's ``custom_dataset``."""
    import datasets  # heavy

    items = embedded_task_items(cache_dir)[task]
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows) for split, rows in items.items()})
