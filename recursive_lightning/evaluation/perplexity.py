"""Token-level perplexity: strided sliding windows, and perplexity by context length (Mela Sec. 5).

Conventions shared with the lm-eval adapter (``lm_eval_adapter.py``), so both give the same numbers:

* A document is scored as ``[EOS] + tokens``: its first token is predicted from the end-of-text token
  alone (lm-eval's ``prefix_token_id`` convention), so every token of the document is scored once.
* Windows (:func:`plan_windows`): the first window predicts up to ``max_length`` tokens; each further window
  advances by ``stride`` tokens and predicts only those, seeing the ``max_length`` tokens before each of
  its predictions' last one (the standard Hugging Face strided evaluation, and exactly lm-eval's
  ``get_rolling_token_windows(..., context_len=max_length - stride + 1)``). ``stride = max_length``
  (the default, and lm-eval's own convention) gives disjoint windows; a smaller stride gives every scored
  token more left context at more compute.
* Scores are natural-log probabilities from ``log_softmax`` in float32 over the model's logits.

Batches are right-padded: the models are causal (the multi-resolution steps too, SpiralFormer Prop. 1),
so padding after a sequence never changes the logits of its real positions (the multi-resolution steps
keep every complete chunk, so a position's logits do not depend on how many tokens follow it either).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from recursive_lightning.data.corpus import embedded_corpus_documents
from recursive_lightning.data.sources import read_utf8
from recursive_lightning.errors import UserError
from recursive_lightning.files import absent
from recursive_lightning.progress import Progress

EOS_TOKEN = "<|endoftext|>"
LOGIT_ROWS = 4096  # head + log_softmax over at most this many positions at a time (bounds memory)


# ---------------------------------------------------------------------------------------------- windows
@dataclass(frozen=True)
class Window:
    """One forward pass over ``seq[begin : end - 1]`` that scores the predictions of ``seq[target:end]``."""

    begin: int
    target: int
    end: int


def plan_windows(n: int, start: int, max_length: int, stride: int | None = None) -> list[Window]:
    """Windows that score tokens ``start .. n-1`` of a sequence of ``n`` tokens, each exactly once.

    Token ``j`` is predicted from ``seq[begin:j]`` with ``j - begin <= max_length``. The first window scores
    ``min(n - start, max_length)`` tokens with all the context that fits (left truncation of a long
    context); later windows score ``stride`` new tokens each with a full ``max_length`` window.
    """
    if start < 1:
        raise ValueError("the first scored token needs at least one token of context (start >= 1)")
    stride = max_length if stride is None else int(stride)
    if not 1 <= stride <= max_length:
        raise UserError(f"stride {stride} must lie between 1 and the window length {max_length}.")
    out: list[Window] = []
    a, b = start, min(n, start + max_length)
    while a < n:
        out.append(Window(max(0, b - 1 - max_length), a, b))
        a, b = b, min(n, b + stride)
    return out


# ---------------------------------------------------------------------------------------------- scoring
@dataclass
class Scored:
    logprob: float  # sum of the scored tokens' log-probabilities (nats)
    greedy: bool  # every scored token is the argmax of its distribution
    tokens: int
    token_logprobs: torch.Tensor | None = None  # float64, only when asked for


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def score_rows(
    model: torch.nn.Module,
    h: torch.Tensor,
    rows_b: Sequence[int],
    rows_p: Sequence[int],
    targets: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability (float64) of ``targets[i]`` at hidden state ``h[rows_b[i], rows_p[i]]``, and whether
    it is the argmax; only these rows go through the output head, :data:`LOGIT_ROWS` at a time."""
    device = h.device
    sel = h[torch.as_tensor(rows_b, device=device), torch.as_tensor(rows_p, device=device)]
    tgt = torch.as_tensor(targets, dtype=torch.long, device=device)
    lps, hits = [], []
    for c in range(0, sel.shape[0], LOGIT_ROWS):
        logits = model.head(sel[c : c + LOGIT_ROWS]).float()
        t = tgt[c : c + LOGIT_ROWS]
        lps.append(F.log_softmax(logits, dim=-1).gather(-1, t[:, None]).squeeze(-1).double())
        hits.append(logits.argmax(-1) == t)
    lp = torch.cat(lps).cpu() if lps else torch.zeros(0, dtype=torch.float64)
    hit = torch.cat(hits).cpu() if hits else torch.zeros(0, dtype=torch.bool)
    return lp, hit


STREAM_CHUNKS = 8  # decoder chunks per piece when a chunk-local model streams a long input


def stream_piece(cfg: Any) -> int:
    """Tokens per piece when a chunk-local model streams a long input: :data:`STREAM_CHUNKS` decoder chunks,
    never more than the chunks that fit the training length (``max_seq_len``; at least one chunk). Mela-400M
    (2,048-token chunks, trained at 4K) streams 4K pieces, so its eval memory is that of 4K at any length."""
    per_chunk = getattr(cfg, "tokens_per_chunk", 0)
    if not per_chunk:
        return 0
    fit = max(1, getattr(cfg, "max_seq_len", 0) // per_chunk)
    return per_chunk * min(STREAM_CHUNKS, fit)


def hidden_states(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``model.hidden(x)``; a model without a context window whose decoder is chunk-local (Mela) runs a long
    input through its decoding cache a few chunks at a time (:func:`stream_piece`), so activation memory stays
    that of one piece (the same states, ``tests/model/test_mela.py``); every other model needs the full window
    at once."""
    piece = stream_piece(model.cfg)
    if getattr(model, "window", 0) is not None or x.shape[1] <= piece:
        return model.hidden(x)
    cache = model.new_cache()
    return torch.cat([model.hidden(x[:, i : i + piece], cache=cache) for i in range(0, x.shape[1], piece)], 1)


@torch.inference_mode()
def score_sequences(
    model: torch.nn.Module,
    requests: Sequence[tuple[Sequence[int], int]],
    batch_size: int = 16,
    per_token: bool = False,
    pad_id: int = 0,
    progress: Callable[[int], Any] | None = None,
    progress_tokens: Callable[[int], Any] | None = None,
) -> list[Scored]:
    """Score ``(tokens, k)`` requests: run the model on ``tokens[:-1]`` and score the last ``k`` tokens.
    ``progress`` is told the requests of each finished batch, ``progress_tokens`` their scored tokens.

    Requests are sorted by length (longest first) and batched ``batch_size`` at a time with right padding;
    the results come back in the order of ``requests``. Only the scored positions go through the output
    head, in slices of :data:`LOGIT_ROWS` rows.
    """
    device = model_device(model)
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0]))
    out: list[Scored | None] = [None] * len(requests)
    for s in range(0, len(order), max(1, int(batch_size))):
        idx = order[s : s + max(1, int(batch_size))]
        lengths = [len(requests[i][0]) - 1 for i in idx]
        width = max(lengths)
        if width < 1:
            for i in idx:
                out[i] = Scored(0.0, True, 0, torch.zeros(0, dtype=torch.float64) if per_token else None)
            if progress is not None:
                progress(len(idx))
            continue
        x = torch.full((len(idx), width), pad_id, dtype=torch.long)
        rows_b, rows_p, targets, owner = [], [], [], []
        for r, i in enumerate(idx):
            toks, k = requests[i]
            m = len(toks) - 1
            if not 0 <= k <= m:
                raise ValueError(f"cannot score {k} tokens of a sequence of {len(toks)}")
            x[r, :m] = torch.as_tensor(toks[:m], dtype=torch.long)
            rows_b += [r] * k
            rows_p += range(m - k, m)
            targets += toks[m - k + 1 : m + 1]
            owner += [r] * k
        h = hidden_states(model, x.to(device))
        lp, hit = score_rows(model, h, rows_b, rows_p, targets)
        own = torch.as_tensor(owner, dtype=torch.long)
        sums = torch.zeros(len(idx), dtype=torch.float64).index_add_(0, own, lp)
        misses = torch.zeros(len(idx), dtype=torch.long).index_add_(0, own, (~hit).long())
        offset = 0
        for r, i in enumerate(idx):
            k = requests[i][1]
            out[i] = Scored(
                float(sums[r]),
                bool(misses[r] == 0),
                k,
                lp[offset : offset + k].clone() if per_token else None,
            )
            offset += k
        if progress is not None:
            progress(len(idx))
        if progress_tokens is not None:
            progress_tokens(offset)
    return out  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------- documents
def document_logprobs(
    model: torch.nn.Module,
    documents: Sequence[Sequence[int]],
    prefix_id: int,
    max_length: int | None = None,
    stride: int | None = None,
    batch_size: int = 16,
    label: str | None = None,
) -> list[tuple[float, int]]:
    """(sum of log-probabilities, tokens) of each tokenized document scored as ``[prefix_id] + doc``;
    with a ``label``, progress in tokens (:mod:`recursive_lightning.progress`)."""
    max_length = int(max_length or model.cfg.max_seq_len)
    requests: list[tuple[list[int], int]] = []
    owner: list[int] = []
    for d, toks in enumerate(documents):
        seq = [int(prefix_id), *map(int, toks)]
        for w in plan_windows(len(seq), 1, max_length, stride):
            requests.append((seq[w.begin : w.end], w.end - w.target))
            owner.append(d)
    with _progress(label, sum(k for _, k in requests)) as p:
        scored = score_sequences(model, requests, batch_size=batch_size, progress_tokens=p and p.update)
    totals = [[0.0, 0] for _ in documents]
    for d, s in zip(owner, scored):
        totals[d][0] += s.logprob
        totals[d][1] += s.tokens
    return [(lp, n) for lp, n in totals]


def eos_id_of(tokenizer: Any) -> int:
    """The id of ``<|endoftext|>`` in a ``tokenizers.Tokenizer``."""
    token_id = tokenizer.token_to_id(EOS_TOKEN)
    if token_id is None:
        raise UserError(
            f"the checkpoint's tokenizer has no {EOS_TOKEN} token, which scoring uses as the document prefix."
        )
    return int(token_id)


def encode(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]


def exp_per(nll: float, count: int) -> float:
    """``exp(nll / count)``, a perplexity: infinite where it exceeds a float (a text of few whitespace-separated
    words, Chinese or one long line, makes nll per word thousands of nats), NaN for nothing counted."""
    if not count:
        return float("nan")
    try:
        return math.exp(nll / count)
    except OverflowError:
        return float("inf")


def _summary(nll: float, tokens: int, texts: Sequence[str]) -> dict[str, Any]:
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    words = sum(len(re.split(r"\s+", t)) for t in texts)
    return {
        "nll": nll,
        "tokens": tokens,
        "ppl": exp_per(nll, tokens),
        "documents": len(texts),
        "bytes": n_bytes,
        "bits_per_byte": nll / (math.log(2) * n_bytes) if n_bytes else float("nan"),
        "words": words,
        "word_perplexity": exp_per(nll, words),
    }


@contextmanager
def _progress(label: str | None, total: int) -> Iterator[Progress | None]:
    if label is None:
        yield None
        return
    with Progress(label, total) as p:
        yield p


def perplexity(
    model: torch.nn.Module,
    tokenizer: Any,
    texts: str | Iterable[str],
    max_length: int | None = None,
    stride: int | None = None,
    batch_size: int = 16,
    label: str | None = None,
) -> dict[str, Any]:
    """Token-level perplexity of documents (each scored separately, first token conditioned on EOS);
    with a ``label``, progress in tokens (a bar on a terminal, a line every 30 s in a log).

    Returns ``nll`` (sum over tokens, nats), ``tokens``, ``ppl = exp(nll / tokens)``, plus ``bits_per_byte``
    and lm-eval's ``word_perplexity`` (``exp(nll / whitespace-separated words)``, infinite where a text of few
    words makes it exceed a float), the window and stride.
    ``max_length`` defaults to the model's ``max_seq_len``; ``stride`` to ``max_length`` (disjoint windows).
    """
    texts = [texts] if isinstance(texts, str) else [t for t in texts if t]
    max_length = int(max_length or model.cfg.max_seq_len)
    docs = encode(tokenizer, texts)
    scores = document_logprobs(model, docs, eos_id_of(tokenizer), max_length, stride, batch_size, label)
    nll = -sum(lp for lp, _ in scores)
    tokens = sum(n for _, n in scores)
    return {**_summary(nll, tokens, texts), "window": max_length, "stride": stride or max_length}


# ---------------------------------------------------------------------------------------------- context length
def perplexity_by_context_length(
    model: torch.nn.Module,
    tokenizer: Any,
    texts: str | Iterable[str],
    lengths: Sequence[int],
    block: int = 128,
    max_tokens: int | None = None,
    mode: str = "stream",
    batch_size: int = 16,
    extrapolate: bool = True,
    label: str | None = None,
) -> dict[int, dict[str, Any]]:
    """Perplexity at each context length ``L`` in ``lengths`` (Mela Sec. 5 / Table 5 axis).

    Definition. ``mode="stream"``: the documents are tokenized and joined into one stream, each preceded
    by EOS (``[EOS] d1 [EOS] d2 ...``); the stream is cut into consecutive, non-overlapping segments of
    ``L + 1`` tokens ``s_k = stream[kL : kL + L + 1]``. ``mode="documents"``: each document with at least
    ``L`` tokens contributes one segment, ``[EOS] + its first L tokens``; shorter documents are left out.
    Each segment is one forward pass over its first ``L`` tokens (no sliding window, nothing carried
    between segments) that predicts its last ``L`` tokens. With ``max_tokens`` at most
    ``max(1, max_tokens // L)`` segments are used (the first ones), so every length sees about the same
    number of scored tokens.

    Reported per length: ``ppl = exp(mean NLL over all L predictions of every segment)`` (positions with
    0..L-1 tokens of context), and ``ppl_last = exp(mean NLL over the last min(block, L) predictions of
    every segment)``, i.e. tokens that see at least ``L - block`` tokens of context; with a fixed ``block``
    the ``ppl_last`` column isolates how well the model uses longer contexts.

    Lengths above the model's ``max_seq_len``: every model family here (vanilla, looped, unshared,
    multi-resolution) has no absolute position table, only rotary positions computed for any length, so a
    longer context is run as length extrapolation and marked ``extrapolated: true`` (Mela's "beyond the
    pre-trained context" axis). With ``extrapolate=False`` such lengths are reported as
    ``{"skipped": reason}`` instead. A length longer than the available text is always skipped with its
    reason; nothing here raises for a length.
    """
    if mode not in ("stream", "documents"):
        raise UserError(f"context-length mode '{mode}' is unknown; use stream or documents.")
    texts = [texts] if isinstance(texts, str) else [t for t in texts if t]
    eos = eos_id_of(tokenizer)
    docs = encode(tokenizer, texts)
    stream: list[int] = []
    if mode == "stream":
        for d in docs:
            stream += [eos, *d]
    trained = int(model.cfg.max_seq_len)
    results: dict[int, dict[str, Any]] = {}
    for L in sorted({int(x) for x in lengths}):
        base = {"context_length": L, "mode": mode, "max_seq_len": trained}
        skipped = _length_skipped(L, trained, extrapolate)
        segments: list[list[int]] = []
        if skipped is None:
            segments, skipped = _segments(L, mode, stream, docs, eos, max_tokens)
        if skipped is not None:
            results[L] = {**base, "skipped": skipped}
            continue
        bs = max(1, min(int(batch_size), int(batch_size) * trained // L))
        with _progress(label and f"{label} L={L}", L * len(segments)) as p:
            scored = score_sequences(
                model,
                [(s, L) for s in segments],
                batch_size=bs,
                per_token=True,
                progress_tokens=p and p.update,
            )
        results[L] = {**base, **_length_perplexity(scored, L, int(block)), "extrapolated": L > trained}
    return results


def _length_skipped(L: int, trained: int, extrapolate: bool) -> str | None:
    """Why a context length is not evaluated at all (not positive; past ``max_seq_len`` without
    extrapolation), else None."""
    if L < 1:
        return "context length must be a positive number of tokens"
    if L > trained and not extrapolate:
        return f"longer than the model's max_seq_len {trained} (extrapolation disabled)"
    return None


def _segments(
    L: int, mode: str, stream: list[int], docs: list[list[int]], eos: int, max_tokens: int | None
) -> tuple[list[list[int]], str | None]:
    """The segments of ``L + 1`` tokens scored at length ``L`` (``perplexity_by_context_length``'s definition),
    at most ``max_tokens // L`` of them; or why the text has none."""
    if mode == "stream":
        n_seg = (len(stream) - 1) // L
        if max_tokens:
            n_seg = min(n_seg, max(1, int(max_tokens) // L))
        segments = [stream[k * L : k * L + L + 1] for k in range(n_seg)]
        if not segments:
            return [], f"the text has {len(stream)} tokens with EOS separators, fewer than {L + 1}"
        return segments, None
    segments = [[eos, *d[:L]] for d in docs if len(d) >= L]
    if max_tokens:
        segments = segments[: max(1, int(max_tokens) // L)]
    if not segments:
        return [], f"no document has {L} tokens (longest: {max(map(len, docs), default=0)})"
    return segments, None


def _length_perplexity(scored: list, L: int, block: int) -> dict[str, Any]:
    """The perplexity over all ``L`` predictions of every segment, and over the last ``min(block, L)``."""
    blk = min(block, L)
    nll = -sum(s.logprob for s in scored)
    nll_last = -sum(float(s.token_logprobs[-blk:].sum()) for s in scored)
    n, n_last = L * len(scored), blk * len(scored)
    return {
        "segments": len(scored),
        "nll": nll,
        "tokens": n,
        "ppl": exp_per(nll, n),
        "last_block": blk,
        "nll_last": nll_last,
        "tokens_last": n_last,
        "ppl_last": exp_per(nll_last, n_last),
    }


# ---------------------------------------------------------------------------------------------- text sets
EMBEDDED_HELDOUT = "embedded:heldout"


def read_texts(path: str | os.PathLike) -> list[str]:
    """Documents of a perplexity set: a ``.txt`` file (one document), a ``.jsonl`` file (one JSON object with
    a ``text`` field, or a JSON string, per line), a ``.json`` list of those, or a folder of such files;
    ``embedded:heldout`` is the embedded corpus's held-out documents (the split ``train`` validates on)."""
    if str(path) == EMBEDDED_HELDOUT:
        from recursive_lightning.data.shards import split_documents  # heavy

        return split_documents(embedded_corpus_documents())[1]
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".txt", ".jsonl", ".json"))
        if not files:
            raise UserError(f"perplexity set folder '{p}' holds no .txt, .jsonl or .json files.")
        return [t for f in files for t in read_texts(f)]
    if not p.is_file():
        raise UserError(
            f"perplexity set '{p}' {absent(p)}; pass a .txt, .jsonl or .json file or a folder of them."
        )

    def read() -> str:  # a binary file is refused, not scored as replacement characters
        return read_utf8(p, "perplexity set '{path}'", "pass a .txt, .jsonl or .json file of text")

    def text_of(item: Any, where: str) -> str:
        if isinstance(item, str):
            return item
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            return item["text"]
        raise UserError(f"{where} is neither a string nor an object with a 'text' string.")

    if p.suffix == ".jsonl":
        out = []
        for i, line in enumerate(read().splitlines(), 1):
            if line.strip():
                try:
                    out.append(text_of(json.loads(line), f"line {i} of '{p}'"))
                except json.JSONDecodeError:
                    raise UserError(f"line {i} of '{p}' is not valid JSON.") from None
        return [t for t in out if t]
    if p.suffix == ".json":
        try:
            data = json.loads(read())
        except json.JSONDecodeError:
            raise UserError(f"'{p}' is not valid JSON.") from None
        items = data if isinstance(data, list) else [data]
        return [t for i, x in enumerate(items) if (t := text_of(x, f"item {i} of '{p}'"))]
    text = read()
    return [text] if text else []
