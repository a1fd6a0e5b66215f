"""Adaptive exit measured: the ``eval`` command's ``--exit-kl 5e-4,1e-3`` and a sweep's
``evaluate: {exit_kl: [...], exit_max_tokens: N}``: what stopping a token's loop steps early
(model/recursive/adaptive_exit.py, Huginn Sec. 6) costs in perplexity and saves in loop steps.

Definition [our reading; Huginn reports its criterion on generation, not on perplexity]. Each ``--ppl`` set is
cut into exactly the windows of the ordinary sliding-window perplexity (``perplexity.plan_windows`` over
``[EOS] + document``, window ``max_length``, ``stride``), kept in order until ``exit_max_tokens`` tokens are to
be scored (the last window cut short). A window that scores its last k tokens of ``seq[begin:end]`` is decoded
teacher-forced, as ``generate --exit-kl`` decodes: its first ``len - k`` tokens are prefilled at full depth
(one token for disjoint windows), whose last state predicts the first scored token; each later token is
predicted by ``hidden_adaptive`` fed the true previous token, i.e. from the next-token distribution of the loop
step its previous position exited at, with the cache (and the KV-cache sharing of exited positions) as in
generation. Threshold 0 never exits, so it is the ordinary perplexity of the same tokens up to the float
rounding of cached decoding. Scores are float32 ``log_softmax`` of the logits, as ``perplexity.score_rows``.

Reported per set: the ``reference`` (the ordinary perplexity of the same windows at the maximum depth, no exit:
``perplexity.score_sequences``) and, at each threshold, perplexity, bits per byte (bytes of the scored text) and
``mean_loops``: the loop steps of the tokens ``hidden_adaptive`` predicted (as ``generate`` counts; the window
starts, predicted at full depth from a prefill, are ``tokens_at_full_depth``). The maximum depth is the largest
``--loops`` count, else the trained K.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from recursive_lightning.errors import UserError
from recursive_lightning.evaluation.options import EvalOptions
from recursive_lightning.evaluation.perplexity import (
    eos_id_of,
    exp_per,
    model_device,
    plan_windows,
    score_sequences,
)
from recursive_lightning.model.depth import at_depth, check_depth, trained_depth
from recursive_lightning.model.recursive.adaptive_exit import check_adaptive_exit, hidden_adaptive
from recursive_lightning.progress import Progress

Request = tuple[
    list[int], int
]  # (seq[begin:end], scored last k tokens): perplexity.score_sequences's request


def exit_request(model: torch.nn.Module, o: EvalOptions) -> tuple[list[float], int] | None:
    """(thresholds, maximum depth) that ``o`` asks of ``model``, checked before anything is computed: a model
    that cannot exit early or no ``--ppl`` set is one sentence (``o.depth_where_it_applies``: None)."""
    if not o.exit_kl:
        return None
    if not o.ppl_paths():
        raise UserError("--exit-kl scores text sets token by token: pass one with --ppl NAME=PATH.")
    try:
        thresholds = [check_adaptive_exit(model, t) for t in o.exit_kl]
        depth = check_depth(model, max(o.loops), "loops") if o.loops else trained_depth(model)
    except UserError:
        if o.depth_where_it_applies:  # a Mela, vanilla or multi-resolution trial: evaluated without exit
            return None
        raise
    return thresholds, depth


def threshold_key(threshold: float) -> str:
    """A threshold as a JSON and MLflow key part: the shortest exponent form that reads back as it, ``+``
    dropped (MLflow refuses it): 5e-4 -> ``5e-04``, 1.5e-3 -> ``1.5e-03``, 1e9 -> ``1e09``, 0 -> ``0``."""
    if threshold == 0:
        return "0"
    for digits in range(17):
        text = f"{threshold:.{digits}e}"
        if float(text) == threshold:
            break
    return text.replace("e+", "e")


def plan_requests(
    docs: Sequence[Sequence[int]], eos: int, max_length: int, stride: int | None, max_tokens: int
) -> tuple[list[Request], list[int]]:
    """The windows of ``perplexity.document_logprobs`` in order, cut to ``max_tokens`` scored tokens, and the
    tokens scored of each document (a prefix of it)."""
    requests: list[Request] = []
    scored: list[int] = []
    left = int(max_tokens)
    for toks in docs:
        if left <= 0:
            break
        seq = [int(eos), *map(int, toks)]
        n = 0
        for w in plan_windows(len(seq), 1, max_length, stride):
            end = min(w.end, w.target + left)
            if end <= w.target:
                break
            requests.append((seq[w.begin : end], end - w.target))
            n += end - w.target
            left -= end - w.target
        scored.append(n)
    return requests, scored


def _logprob(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """float64 log-probability of ``target`` (b,) under float32 ``log_softmax`` of ``logits`` (b, vocab)."""
    return F.log_softmax(logits.float(), dim=-1).gather(-1, target[:, None]).squeeze(-1).double()


@torch.no_grad()
def score_adaptive(
    model: torch.nn.Module,
    requests: Sequence[Request],
    threshold: float,
    batch_size: int = 16,
    progress: Progress | None = None,
) -> tuple[float, int]:
    """(sum of log-probabilities of every scored token, sum of the loop steps of the tokens ``hidden_adaptive``
    predicted) of ``requests`` decoded teacher-forced with adaptive exit at ``threshold``. Windows of the same
    shape go together, ``batch_size`` at a time (each row exits on its own)."""
    device = model_device(model)
    groups: dict[tuple[int, int], list[list[int]]] = {}
    for toks, k in requests:
        groups.setdefault((len(toks), k), []).append(toks)
    logprob, loops = 0.0, 0
    for (length, k), rows in groups.items():
        p = length - k  # prefilled tokens; the last predicts the first scored one
        for s in range(0, len(rows), max(1, int(batch_size))):
            x = torch.tensor(rows[s : s + max(1, int(batch_size))], dtype=torch.long, device=device)
            cache = model.new_cache()
            logits = model.head(model.hidden(x[:, :p], cache=cache)[:, -1])
            lp = [_logprob(logits, x[:, p])]
            for j in range(p + 1, length):  # x[:, j - 1] fed, x[:, j] scored
                logits, used = hidden_adaptive(model, x[:, j - 1 : j], cache, threshold)
                lp.append(_logprob(logits, x[:, j]))
                loops += int(used.sum())
                if progress is not None:
                    progress.update(x.shape[0])
            logprob += float(torch.stack(lp).sum())
            if progress is not None:
                progress.update(x.shape[0])
    return logprob, loops


def evaluate_adaptive_exit(
    model: torch.nn.Module,
    tokenizer: Any,
    texts: dict[str, list[str]],
    request: tuple[list[float], int],
    max_length: int,
    stride: int | None,
    max_tokens: int,
    batch_size: int = 16,
) -> dict[str, Any]:
    """The ``adaptive_exit`` section of an evaluation: per set its reference and, at each threshold, the
    perplexity, bits per byte and mean loop steps with adaptive exit (module docstring)."""
    thresholds, depth = request
    eos = eos_id_of(tokenizer)
    out: dict[str, Any] = {
        "max_loops": depth,
        "trained": trained_depth(model),
        "window": max_length,
        "stride": stride or max_length,
        "max_tokens": max_tokens,
        "sets": {},
        "reference": {},
        "thresholds": {threshold_key(t): {"threshold": t, "ppl": {}} for t in thresholds},
    }
    with at_depth(model, depth):
        for name, docs in texts.items():
            docs = [d for d in docs if d]
            enc = tokenizer.encode_batch(docs, add_special_tokens=False)
            requests, scored = plan_requests([e.ids for e in enc], eos, max_length, stride, max_tokens)
            tokens = sum(scored)
            n_bytes = sum(  # bytes of the scored text: a document scored in part up to its last scored token
                len((d if n == len(e.ids) else d[: e.offsets[n - 1][1]]).encode("utf-8"))
                for d, e, n in zip(docs, enc, scored)
                if n
            )
            out["sets"][name] = {
                "tokens": tokens,
                "documents": len(scored),
                "bytes": n_bytes,
                "tokens_at_full_depth": len(requests),
            }
            ref = score_sequences(model, requests, batch_size=batch_size)
            out["reference"][name] = _summary(-sum(r.logprob for r in ref), tokens, n_bytes)
            for t in thresholds:
                with Progress(f"eval exit-kl {threshold_key(t)} {name}", tokens) as p:
                    logprob, loops = score_adaptive(model, requests, t, batch_size, p)
                adaptive = tokens - len(requests)
                out["thresholds"][threshold_key(t)]["ppl"][name] = {
                    **_summary(-logprob, tokens, n_bytes),
                    "loop_steps": loops,
                    "mean_loops": loops / adaptive if adaptive else float("nan"),
                }
    for entry in out["thresholds"].values():
        steps = sum(r["loop_steps"] for r in entry["ppl"].values())
        adaptive = sum(s["tokens"] - s["tokens_at_full_depth"] for s in out["sets"].values())
        entry["mean_loops"] = steps / adaptive if adaptive else float("nan")
    return out


def _summary(nll: float, tokens: int, n_bytes: int) -> dict[str, float]:
    return {
        "nll": nll,
        "tokens": tokens,
        "ppl": exp_per(nll, tokens),
        "bits_per_byte": nll / (math.log(2) * n_bytes) if n_bytes else float("nan"),
    }


def exit_metrics(
    section: dict[str, Any] | None, metric_name: Callable[[str], str], prefix: str = "eval"
) -> dict[str, float]:
    """MLflow metrics of the section: ``eval/exit_kl_<thr>/ppl/<set>``, ``.../bpb/<set>``,
    ``eval/exit_kl_<thr>/mean_loops`` (all sets), and the reference ``eval/exit_reference/ppl/<set>``,
    ``.../bpb/<set>``, ``eval/exit_reference/loops`` (the maximum depth); ``metric_name`` makes a set's name
    a key part."""
    if not section:
        return {}
    out: dict[str, float] = {f"{prefix}/exit_reference/loops": section["max_loops"]}
    for name, r in section["reference"].items():
        out[f"{prefix}/exit_reference/ppl/{metric_name(name)}"] = r["ppl"]
        out[f"{prefix}/exit_reference/bpb/{metric_name(name)}"] = r["bits_per_byte"]
    for key, entry in section["thresholds"].items():
        out[f"{prefix}/exit_kl_{key}/mean_loops"] = entry["mean_loops"]
        for name, r in entry["ppl"].items():
            out[f"{prefix}/exit_kl_{key}/ppl/{metric_name(name)}"] = r["ppl"]
            out[f"{prefix}/exit_kl_{key}/bpb/{metric_name(name)}"] = r["bits_per_byte"]
    return out
