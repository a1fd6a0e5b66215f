"""``python -m recursive_lightning probe``: the papers' diagnostic probes of a checkpoint.

    probe CHECKPOINT [--data PATH] [--samples 500] [--seq-len N] [--batch-size N] [--out DIR]
                     [--token-index I] [--kernel rbf|linear] [--no-attention] [--no-mlflow]
    probe --compare RUN_DIR [RUN_DIR ...]      (or one sweep directory holding several run dirs)

``CHECKPOINT`` is a ``.ckpt`` file or a run directory (its newest good checkpoint is used). The
text is ``--data`` (file, folder, glob, ``hf:<dataset>`` or ``embedded``) or, by default, the run's own
``data.path`` (the embedded corpus when it trained on that);
documents the training split holds out (the same content hash as the shard writer) come first, then
the others, each followed by the end-of-text token, and the token stream is cut into ``--samples``
consecutive windows of ``--seq-len`` tokens - deterministic for a given tokenizer and text.

Computed (details of what is computed on what: :mod:`recursive_lightning.probes.capture`):

1. computation skew per block (MeSH Fig. 3), mean +- std over samples;
2. CKA matrix between ``h_emb, h^(0..K), h_out`` (MeSH Fig. 4; RBF by default, per sample over its
   tokens, then averaged);
3. top-50 normalised singular spectra (MeSH Fig. 5) and effective rank per state;
4. shared-subspace cumulative variance of ``h^(0..K)`` (MeSH App. E.8, Fig. 10);
5. MeSH router weights per step and slot (sequence mean; case-study sequence = sample 0 at
   ``--token-index``) and the Eq. 7 state composition (Fig. 11); static/dynamic coefficients;
6. for looped and multi-resolution models, attention probes of the loop-shared core: key-marginal
   entropy and Local Attention Mass per loop/layer/head, dynamic heads (top 40% by cross-loop range),
   ridgeline/box plots and layer x head heatmaps (SpiralFormer Sec. 4.1, App. I).

A Mela checkpoint (``model.arch: mela``) gets the Mela probes instead (:mod:`recursive_lightning.probes.mela`:
per HMM block application and memory chunk the surprise norm, theta, eta, alpha and the update's singular
values; MemStack's relative change of the decoder's memory rows per H cycle); ``--compare`` refuses it.

Outputs go to ``--out`` (default ``<run_dir>/probes/``, or ``probes/`` next to a loose checkpoint):
PNGs and ``probes.json`` with every plotted number (written atomically), both logged as artifacts
(``probes/``) of the checkpoint's MLflow run - or of a linked run created in ``<run_dir>/mlflow.db``
if that run is not found - together with a few scalar ``probe/...`` metrics.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recursive_lightning.errors import UserError
from recursive_lightning.probes.capture import COEFFICIENT_TERMS, Capture, ProbeSettings, capture

JSON_NAME = "probes.json"
FORMAT_VERSION = 1
DYNAMIC_FRAC = 0.4  # SpiralFormer Sec. 4.1: top 40% of heads by cross-loop range
DEFAULT_TOKEN_INDEX = 27  # MeSH Fig. 11: the case-study token "gu" is idx 27


# ---------------------------------------------------------------------------
# text -> token windows
# ---------------------------------------------------------------------------


@dataclass
class Samples:
    tokens: torch.Tensor  # [N, L] int64
    info: dict[str, Any]


def _documents(data: str | None) -> tuple[Iterator[str], str, bool]:
    """(documents, spec, prefer held-out documents)."""
    from recursive_lightning.data.sources import DataError, iter_documents, resolve_source

    if data is None:
        from recursive_lightning.data import corpus

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
    from recursive_lightning.data.shards import is_validation_document
    from recursive_lightning.data.sources import DataError
    from recursive_lightning.data.tokenizer import EOS_TOKEN

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
    held: list[int] = []
    rest_docs: list[str] = []
    rest_chars = 0
    pending: list[str] = []
    scanned = scanned_chars = 0
    # held-out documents are ~2% of a corpus: scan about 50x the text needed (at least 20M characters)
    max_scan_chars = max(400 * need, 20_000_000)
    try:
        for doc in docs:
            scanned += 1
            scanned_chars += len(doc)
            if scanned_chars > max_scan_chars and rest_chars >= 16 * need:
                break
            if not prefer_heldout:
                pending.append(doc)
                if len(pending) >= 32:
                    held.extend(encode(pending))
                    pending = []
                    if len(held) >= need:
                        break
                continue
            if is_validation_document(doc):
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
    heldout_tokens = len(held) if prefer_heldout else 0
    ids = held
    i = 0
    while len(ids) < need and i < len(rest_docs):
        ids.extend(encode(rest_docs[i : i + 32]))
        i += 32
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


# ---------------------------------------------------------------------------
# labels
# ---------------------------------------------------------------------------


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def state_label(name: str) -> str:
    """Trace state name -> mathtext label (``h(2)`` -> ``$h^{(2)}$``)."""
    if name == "h_emb":
        return r"$h_{\mathrm{emb}}$"
    if name == "h_out":
        return r"$h_{\mathrm{out}}$"
    m = re.fullmatch(r"h\((\d+)\)", name)
    return rf"$h^{{({m.group(1)})}}$" if m else name


def block_label(name: str, vanilla: bool = False) -> str:
    """Trace block name -> MeSH Fig. 3 label (``core 2`` -> ``2nd f_core``)."""
    if name == "prelude":
        return "Layers" if vanilla else "Prelude"
    if name == "coda":
        return "Coda"
    m = re.fullmatch(r"core (\d+)", name)
    return rf"{_ordinal(int(m.group(1)))} $f_{{\mathrm{{core}}}}$" if m else name


def _metric_key(name: str) -> str:
    return re.sub(r"[^\w./ -]", "", name.replace(" ", "_"))


def _loop_labels(summary: dict[str, Any]) -> list[str]:
    att = summary["attention"]
    out = []
    for t, g in zip(att["loops"], att["chunk"]):
        out.append(
            f"loop {t + 1}"
            if not att["multires"]
            else f"loop {t + 1} (1/{g})"
            if g > 1
            else f"loop {t + 1} (1)"
        )
    return out


# ---------------------------------------------------------------------------
# summary (every plotted number)
# ---------------------------------------------------------------------------


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().to("cpu", torch.float64).numpy()


def _mean_std(x: torch.Tensor | np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    a = _np(x) if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(a, axis=axis), np.nanstd(a, axis=axis)


def _clean(x: Any) -> Any:
    """numpy/torch -> JSON types, NaN/inf -> None."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return _clean(x.tolist())
    if isinstance(x, Mapping):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, np.floating | float):
        f = float(x)
        return f if math.isfinite(f) else None
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def _attention_summary(stat: torch.Tensor) -> dict[str, Any]:
    """``stat [N, T, layers, heads]`` -> head-wise per-loop means and the dynamic-head analysis."""
    from recursive_lightning.probes import metrics as M

    mean, std = _mean_std(stat)  # [T, layers, heads]
    T, nl, nh = mean.shape
    per_loop = torch.from_numpy(mean)
    rng = M.cross_loop_range(per_loop)
    dyn = M.dynamic_heads(per_loop, frac=DYNAMIC_FRAC).tolist()
    flat = mean.reshape(T, -1)
    return {
        "per_loop": mean,
        "per_loop_std": std,
        "range": rng.numpy(),
        "range_normalized": M.minmax_normalize(rng).numpy(),
        "dynamic_heads": [list(divmod(i, nh)) for i in dyn],
        "loop_mean_all": flat.mean(axis=1),
        "loop_mean_dynamic": flat[:, dyn].mean(axis=1) if dyn else [float("nan")] * T,
    }


def summarize(cap: Capture, meta: dict[str, Any]) -> dict[str, Any]:
    """JSON-ready summary of a :class:`Capture` (means and stds over samples, full matrices)."""
    out: dict[str, Any] = {"format": FORMAT_VERSION, **meta}
    vanilla = meta.get("model", {}).get("kind") == "vanilla"
    mean, std = _mean_std(cap.skew)
    out["skew"] = {
        "blocks": cap.block_names,
        "labels": [block_label(b, vanilla) for b in cap.block_names],
        "mean": mean,
        "std": std,
        "definition": "2 ||f(h) - h||_F / (||f(h)||_F + ||h||_F) per sample (MeSH Fig. 3)",
    }
    mean, std = _mean_std(cap.cka)
    out["cka"] = {"states": cap.state_names, "mean": mean, "std": std, "tokens_per_sample": cap.cka_positions}
    mean, std = _mean_std(cap.spectra)
    out["spectra"] = {"states": cap.state_names, "k": cap.spectra.shape[-1], "mean": mean, "std": std}
    mean, std = _mean_std(cap.effective_rank)
    out["effective_rank"] = {"states": cap.state_names, "mean": mean, "std": std}
    out["shared_subspace"] = None
    if cap.subspace is not None:
        mean, std = _mean_std(cap.subspace)
        out["shared_subspace"] = {
            "states": cap.state_names[1 : cap.n_loop + 2],
            "k": cap.subspace.shape[-1],
            "mean": mean,
            "std": std,
        }
    out["mesh"] = None
    if cap.routing is not None:
        r = cap.routing
        K1, B = r["write_seq"].shape[1:]
        rows = [f"h({t})" for t in range(K1)]
        cols = ["h_emb"] + [f"h_m({i})" for i in range(-1, K1 - 1)]
        mesh: dict[str, Any] = {"steps": list(range(-1, K1 - 1)), "slots": B, "token_index": cap.token_index}
        for key in ("write", "read"):
            m, s = _mean_std(r[f"{key}_seq"])
            tm, _ = _mean_std(r[f"{key}_tok"])
            mesh[key] = {
                "mean": m,  # [K+1, B] mean over samples and tokens
                "std": s,  # std over samples of the sequence means
                "token_mean": tm,  # at --token-index, mean over samples
                "case_sequence": _np(r[f"{key}_seq"][0]),  # sample 0, sequence mean
                "case_token": _np(r[f"{key}_tok"][0]),  # sample 0 at --token-index
            }
        m, s = _mean_std(r["comp_seq"])
        tm, _ = _mean_std(r["comp_tok"])
        mesh["composition"] = {
            "rows": rows,
            "cols": cols,
            "mean": m,
            "std": s,
            "token_mean": tm,
            "case_sequence": _np(r["comp_seq"][0]),
            "case_token": _np(r["comp_tok"][0]),
            "gating_factor": np.diagonal(m[:, 1:]),  # Eq. 6: sum_b w_write,b^(t) w_read,b^(t)
        }
        out["mesh"] = mesh
    out["coefficients"] = None
    if cap.coefficients is not None:
        m, s = _mean_std(cap.coefficients)
        out["coefficients"] = {
            "terms": list(COEFFICIENT_TERMS),
            "states": [f"h({t + 1})" for t in range(m.shape[0])],
            "mean": m,
            "std": s,
        }
    out["attention"] = None
    if cap.attention is not None:
        _, T, nl, nh = cap.attention["entropy"].shape
        multires = any(g > 1 for g in meta.get("model", {}).get("chunk", []))
        out["attention"] = {
            "stack": "core0",
            "loops": cap.attention_loops,
            "chunk": cap.attention_chunk,
            "multires": multires,
            "lam_window": cap.attention_window,
            "layers": nl,
            "heads": nh,
            "dynamic_frac": DYNAMIC_FRAC,
            "entropy": _attention_summary(cap.attention["entropy"]),
            "lam": _attention_summary(cap.attention["lam"]),
        }
    return out


def scalar_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """A few headline numbers for MLflow (``probe/...``)."""
    out: dict[str, float] = {}
    for b, v in zip(summary["skew"]["blocks"], summary["skew"]["mean"]):
        out[f"probe/skew/{_metric_key(b)}"] = v
    for s, v in zip(summary["effective_rank"]["states"], summary["effective_rank"]["mean"]):
        out[f"probe/effective_rank/{_metric_key(s)}"] = v
    states, cka = summary["cka"]["states"], np.asarray(summary["cka"]["mean"], dtype=float)
    for i in range(len(states) - 1):
        if re.fullmatch(r"h\(\d+\)", states[i]) and re.fullmatch(r"h\(\d+\)", states[i + 1]):
            out[f"probe/cka/{_metric_key(states[i])}_{_metric_key(states[i + 1])}"] = cka[i, i + 1]
    if summary.get("attention"):
        for metric in ("entropy", "lam"):
            for t, v in zip(summary["attention"]["loops"], summary["attention"][metric]["loop_mean_all"]):
                out[f"probe/attention/{metric}/loop{t + 1}"] = v
    return {k: float(v) for k, v in out.items() if v is not None and math.isfinite(float(v))}


# ---------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------


def _plot_coefficients(models: Mapping[str, dict[str, Any]], path: Path, title: str | None = None) -> Path:
    """Heatmap(s) of the static/dynamic combination coefficients (state x term), MeSH App. E.3."""
    import matplotlib

    from recursive_lightning.probes import plots as P

    mats = {k: np.asarray(v["mean"], dtype=float) for k, v in models.items()}
    m = len(mats)
    nr = max(a.shape[0] for a in mats.values())
    with matplotlib.rc_context(P._STYLE):
        fig, axes = P._new_fig(1, m, (m * 4.2, 0.45 * nr + 1.8))
        for i, (name, mat) in enumerate(mats.items()):
            vmax = float(np.nanmax(np.abs(mat))) if mat.size else 1.0
            rows = [state_label(s) for s in models[name]["states"]]
            im = P._draw_heatmap(
                axes[0, i],
                mat,
                rows,
                list(COEFFICIENT_TERMS),
                cmap="RdBu_r",
                vmin=-vmax,
                vmax=vmax,
                annotate=True,
            )
            fig.colorbar(im, ax=axes[0, i], fraction=0.046, pad=0.04)
            axes[0, i].set_title(name if m > 1 else (title or "Combination coefficients"))
            axes[0, i].set_xlabel("term")
        if m > 1 and title:
            fig.suptitle(title)
        return P._save(fig, path)


def _spectra_curves(cap: Capture) -> dict[str, np.ndarray]:
    return {state_label(s): _np(cap.spectra[:, i]) for i, s in enumerate(cap.state_names)}


def _subspace_curves(cap: Capture) -> dict[str, np.ndarray]:
    names = cap.state_names[1 : cap.n_loop + 2]
    return {state_label(s): _np(cap.subspace[:, i]) for i, s in enumerate(names)}


def _skew_values(cap: Capture, summary: dict[str, Any]) -> dict[str, np.ndarray]:
    return {lab: _np(cap.skew[:, i]) for i, lab in enumerate(summary["skew"]["labels"])}


def draw_single(cap: Capture, summary: dict[str, Any], out: Path, title: str) -> list[Path]:
    from recursive_lightning.probes import plots as P

    files = [
        P.plot_skew(_skew_values(cap, summary), out / "skew.png", title=f"Computation skew - {title}"),
        P.plot_cka_heatmap(
            cap.cka, out / "cka.png", labels=[state_label(s) for s in cap.state_names], title=f"CKA - {title}"
        ),
        P.plot_singular_spectra(
            _spectra_curves(cap), out / "spectra.png", title=f"Singular spectra - {title}"
        ),
    ]
    if cap.subspace is not None:
        files.append(
            P.plot_shared_subspace(
                _subspace_curves(cap), out / "shared_subspace.png", title=f"Shared subspace - {title}"
            )
        )
    if cap.routing is not None:
        r, i = cap.routing, cap.token_index
        tok = summary.get("data", {}).get("case_token_text")
        tok_desc = f"token {i}" + (f" ({tok!r})" if tok else "")
        files.append(
            P.plot_mesh_routers(
                r["write_seq"].transpose(0, 1),
                r["read_seq"].transpose(0, 1),
                out / "mesh_routers.png",
                title=f"MeSH routers, mean over samples and tokens - {title}",
            )
        )
        files.append(
            P.plot_mesh_routers(
                r["write_tok"][0],
                r["read_tok"][0],
                out / "mesh_routers_token.png",
                title=f"MeSH routers, sample 0 at {tok_desc} - {title}",
            )
        )
        files.append(
            P.plot_state_composition(
                r["comp_seq"], out / "state_composition.png", title=f"State composition (Eq. 7) - {title}"
            )
        )
        files.append(
            P.plot_state_composition(
                r["comp_tok"][0],
                out / "state_composition_token.png",
                title=f"State composition, sample 0 at {tok_desc}",
            )
        )
    if summary.get("coefficients"):
        files.append(
            _plot_coefficients(
                {title: summary["coefficients"]}, out / "coefficients.png", title=f"Coefficients - {title}"
            )
        )
    if cap.attention is not None:
        labels = _loop_labels(summary)
        for metric, name in (("entropy", "Key-marginal entropy"), ("lam", "LAM")):
            per_loop = np.asarray(summary["attention"][metric]["per_loop"], dtype=float)
            files.append(
                P.plot_attention_probe(
                    per_loop,
                    out / f"attention_{metric}_dynamic.png",
                    metric=name,
                    loop_labels=labels,
                    dynamic_frac=DYNAMIC_FRAC,
                    title=f"{name}, dynamic heads (top 40%) - {title}",
                )
            )
            files.append(
                P.plot_attention_probe(
                    per_loop,
                    out / f"attention_{metric}_all.png",
                    metric=name,
                    loop_labels=labels,
                    title=f"{name}, all heads - {title}",
                )
            )
            files.append(
                P.plot_head_heatmaps(
                    per_loop,
                    out / f"attention_{metric}_heads.png",
                    metric=name,
                    loop_labels=labels,
                    title=f"{name} per layer and head - {title}",
                )
            )
            files.append(
                P.plot_head_range_heatmap(
                    per_loop,
                    out / f"attention_{metric}_range.png",
                    metric=name,
                    frac=DYNAMIC_FRAC,
                    title=rf"Cross-loop range of {name} - {title}",
                )
            )
    return files


def draw_compare(results: Mapping[str, tuple[Capture, dict[str, Any]]], out: Path) -> list[Path]:
    from recursive_lightning.probes import plots as P

    files = [
        P.compare_skew(
            {k: _skew_values(c, s) for k, (c, s) in results.items()},
            out / "compare_skew.png",
            title="Computation skew",
        ),
        P.compare_cka_heatmaps(
            {k: c.cka for k, (c, _) in results.items()},
            out / "compare_cka.png",
            labels={k: [state_label(s) for s in c.state_names] for k, (c, _) in results.items()},
            title="CKA between hidden states",
        ),
        P.compare_singular_spectra(
            {k: _spectra_curves(c) for k, (c, _) in results.items()},
            out / "compare_spectra.png",
            title="Normalised singular spectra",
        ),
    ]
    looped = {k: _subspace_curves(c) for k, (c, _) in results.items() if c.subspace is not None}
    if looped:
        files.append(
            P.compare_shared_subspace(looped, out / "compare_shared_subspace.png", title="Shared subspace")
        )
    mesh = {k: c for k, (c, _) in results.items() if c.routing is not None}
    if mesh:
        files.append(
            P.compare_mesh_routers(
                {
                    k: (c.routing["write_seq"].transpose(0, 1), c.routing["read_seq"].transpose(0, 1))
                    for k, c in mesh.items()
                },
                out / "compare_mesh_routers.png",
                title="MeSH routers (mean over samples and tokens)",
            )
        )
        files.append(
            P.compare_state_composition(
                {k: c.routing["comp_seq"] for k, c in mesh.items()},
                out / "compare_state_composition.png",
                title="State composition (Eq. 7)",
            )
        )
    coef = {k: s["coefficients"] for k, (_, s) in results.items() if s.get("coefficients")}
    if coef:
        files.append(
            _plot_coefficients(coef, out / "compare_coefficients.png", title="Combination coefficients")
        )
    att = {k: s for k, (_, s) in results.items() if s.get("attention")}
    if att:
        for metric, name in (("entropy", "Key-marginal entropy"), ("lam", "LAM")):
            per_loop = {
                k: np.asarray(s["attention"][metric]["per_loop"], dtype=float) for k, s in att.items()
            }
            labels = max((_loop_labels(s) for s in att.values()), key=len)
            if len({p.shape[0] for p in per_loop.values()}) > 1 or any(
                s["attention"]["multires"] for s in att.values()
            ):
                labels = [f"loop {t + 1}" for t in range(len(labels))]
            files.append(
                P.compare_attention_probe(
                    per_loop,
                    out / f"compare_attention_{metric}_dynamic.png",
                    metric=name,
                    loop_labels=labels,
                    dynamic_frac=DYNAMIC_FRAC,
                    title=f"{name}, dynamic heads (top 40%)",
                )
            )
            files.append(
                P.compare_attention_probe(
                    per_loop,
                    out / f"compare_attention_{metric}_all.png",
                    metric=name,
                    loop_labels=labels,
                    title=f"{name}, all heads",
                )
            )
            files.append(
                P.compare_head_range_heatmaps(
                    per_loop,
                    out / f"compare_attention_{metric}_range.png",
                    metric=name,
                    frac=DYNAMIC_FRAC,
                    title=f"Cross-loop range of {name}",
                )
            )
    return files


# ---------------------------------------------------------------------------
# checkpoints, output locations, MLflow
# ---------------------------------------------------------------------------


@dataclass
class Probed:
    label: str
    loaded: Any  # training.checkpoint.Loaded (model dropped after capture)
    run_dir: Path
    capture: Capture
    summary: dict[str, Any]


def _run_dir_of(arg: Path, ckpt: Path) -> Path:
    arg = arg.resolve()
    if arg.is_dir() and not (arg / "meta.pt").exists() and not (arg / ".metadata").exists():
        return arg
    ckpt = ckpt.resolve()
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


def _has_checkpoint(d: Path) -> bool:
    from recursive_lightning.training.checkpoint import candidates

    return bool(candidates(d / "checkpoints") or candidates(d) or list(d.glob("*.ckpt")))


def expand_compare(paths: Sequence[str]) -> list[Path]:
    """Run dirs / checkpoint files to compare; a single directory without a checkpoint of its own is a
    sweep directory whose sub-directories holding checkpoints are compared (sorted by name)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise UserError(
                f"--compare path '{p}' does not exist; pass run directories or a sweep directory."
            )
        if p.is_dir() and not _has_checkpoint(p):
            subs = sorted(d for d in p.iterdir() if d.is_dir() and _has_checkpoint(d))
            if not subs:
                raise UserError(
                    f"'{p}' holds no checkpoint and no run directories with checkpoints to compare."
                )
            out.extend(subs)
        else:
            out.append(p)
    if len(out) < 2:
        raise UserError(f"--compare needs at least two checkpoints; found {len(out)} in {', '.join(paths)}.")
    return out


def _model_meta(loaded: Any) -> dict[str, Any]:
    cfg, lay = loaded.model.cfg, loaded.model.layout
    return {
        "name": loaded.run.name,
        "layout": lay.text,
        "kind": lay.kind,
        "topology": cfg.topology,
        "d_model": cfg.d_model,
        "n_heads": cfg.n_heads,
        "n_loop": lay.n_loop,
        "chunk": list(lay.chunk),
        "buffer_slots": cfg.buffer_slots if cfg.topology == "mesh" else None,
        "parameters": sum(p.numel() for p in loaded.model.parameters()),
    }


def _mlflow_run(uri: str, run_dir: Path, loaded: Any) -> tuple[str, bool]:
    """(run id, created): the checkpoint's own MLflow run, or a linked run made for the probes."""
    from recursive_lightning.tracking.runs import RUN_ID_FILE, client, create_run, ensure_experiment

    c = client(uri)
    ids = [loaded.mlflow_run_id]
    id_file = run_dir / RUN_ID_FILE
    if id_file.is_file():
        ids.append(id_file.read_text().strip())
    for rid in dict.fromkeys(i for i in ids if i):
        try:
            c.get_run(rid)
            return rid, False
        except Exception:
            continue
    exp_id = ensure_experiment(uri, loaded.run.name, run_dir / "mlartifacts")
    key = hashlib.sha256(str(Path(loaded.path).resolve()).encode()).hexdigest()[:16]
    found = c.search_runs([exp_id], filter_string=f"tags.`probe.checkpoint_id` = '{key}'", max_results=1)
    if found:
        return found[0].info.run_id, True
    tags = {
        "probe.checkpoint": str(Path(loaded.path).resolve()),
        "probe.checkpoint_id": key,
        "probe.linked_run_id": next((i for i in ids if i), "") or "",
    }
    return create_run(uri, exp_id, f"probe-{loaded.run.name}", tags=tags), True


def log_to_mlflow(
    run_dir: Path,
    loaded: Any,
    files: Sequence[Path],
    metrics: dict[str, float] | None,
    tracking_uri: str | None,
    artifact_path: str,
) -> tuple[str, str]:
    from recursive_lightning.tracking.runs import (
        default_tracking_uri,
        log_artifact,
        log_metrics,
        set_terminated,
    )

    uri = tracking_uri or default_tracking_uri(run_dir)
    run_id, created = _mlflow_run(uri, run_dir, loaded)
    for f in files:
        log_artifact(uri, run_id, f, artifact_path)
    if metrics:
        log_metrics(uri, run_id, metrics, step=loaded.global_step)
    if created:
        set_terminated(uri, run_id, "FINISHED")
    return uri, run_id


def write_json(path: Path, data: dict[str, Any]) -> Path:
    from recursive_lightning.files import atomic_write_text

    atomic_write_text(path, json.dumps(_clean(data), indent=1, allow_nan=False) + "\n")
    return path


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="recursive_lightning probe",
        description="Diagnostic probes of a checkpoint (MeSH Sec. 2/4.1, App. E.8/F; SpiralFormer Sec. 4): "
        "figures and probes.json.",
    )
    p.add_argument("checkpoint", nargs="?", help="a .ckpt file or a run directory")
    p.add_argument(
        "--compare",
        nargs="+",
        metavar="RUN_DIR",
        help="probe several run dirs (or one sweep dir) and draw the figures side by side",
    )
    p.add_argument(
        "--data",
        help="text file, folder, glob, hf:<dataset> or embedded (default: the run's data.path, else the embedded corpus)",
    )
    p.add_argument(
        "--samples", type=int, default=500, help="number of sequences (default 500, as in the papers)"
    )
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the run's data.seq_len)")
    p.add_argument(
        "--batch-size",
        type=int,
        help="sequences per forward (default 16, fewer if the recorded attention maps would pass ~8 GB)",
    )
    p.add_argument("--out", help="output directory (default <run_dir>/probes, or <sweep>/probes_compare)")
    p.add_argument(
        "--token-index",
        type=int,
        default=DEFAULT_TOKEN_INDEX,
        help="token position of the MeSH router/composition case study (default 27, clipped to the sequence)",
    )
    p.add_argument("--kernel", choices=("rbf", "linear"), default="rbf", help="CKA kernel (default rbf)")
    p.add_argument(
        "--cka-tokens",
        type=int,
        default=0,
        help="evenly spaced token positions per sample used for CKA (default 0 = all tokens)",
    )
    p.add_argument("--no-attention", action="store_true", help="skip the attention probes")
    p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default sqlite:///<run_dir>/mlflow.db)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _check_args(args: argparse.Namespace) -> None:
    if bool(args.checkpoint) == bool(args.compare):
        raise UserError("pass either one CHECKPOINT or --compare RUN_DIR [RUN_DIR ...], not both or neither.")
    for name in ("samples", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}.")
    if args.seq_len is not None and args.seq_len < 2:
        raise UserError(f"--seq-len must be at least 2, not {args.seq_len}.")
    if args.cka_tokens < 0 or args.cka_tokens == 1:
        raise UserError(f"--cka-tokens must be 0 (all tokens) or at least 2, not {args.cka_tokens}.")


def _device(name: str | None) -> torch.device:
    if name:
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise UserError(f"--device '{name}' is not a device name such as cpu or cuda.") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise UserError(f"--device {name} was asked for but CUDA is not available here.")
        return dev
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _token_index(index: int, seq_len: int) -> int:
    if index >= seq_len or index < -seq_len:
        if index == DEFAULT_TOKEN_INDEX:
            return seq_len - 1 if index >= seq_len else index
        raise UserError(f"--token-index {index} lies outside a sequence of {seq_len} tokens.")
    return index % seq_len


ATTENTION_BYTES = 8 * 2**30


def auto_batch_size(model: Any, seq_len: int, attention: bool) -> int:
    """16, or fewer so that one batch's recorded attention maps (every layer call keeps a float32
    ``[b, heads, L_t, L_t]`` map while ``traced`` runs) stay below about 8 GB."""
    if not attention:
        return 16
    lay, cfg = model.layout, model.cfg
    calls = (lay.prelude + lay.coda) * seq_len**2
    calls += sum(lay.cores[c] * (seq_len // g) ** 2 for c, g in zip(lay.core_index, lay.chunk))
    per_sample = 4 * cfg.n_heads * calls
    return int(max(1, min(16, ATTENTION_BYTES // max(per_sample, 1))))


def probe_one(
    path: str | os.PathLike,
    args: argparse.Namespace,
    device: torch.device,
    seq_len: int | None = None,
    label: str | None = None,
    compare: bool = False,
) -> Probed:
    """Load one checkpoint, build its samples and capture + summarise the probes (model freed after);
    a Mela checkpoint gets the Mela probes (:mod:`recursive_lightning.probes.mela`), refused by compare."""
    from recursive_lightning.training.checkpoint import load_checkpoint

    loaded = load_checkpoint(path, device=device)
    model = loaded.model
    mela = getattr(model.cfg, "arch", "recursive") == "mela"
    if mela and compare:
        raise UserError(
            f"probe --compare draws the looped-transformer probes side by side and '{path}' is a Mela "
            "checkpoint, whose memory probes have no common axes across runs; probe each Mela run on its own."
        )
    L = seq_len or args.seq_len or loaded.run.data.seq_len
    if L > model.cfg.max_seq_len:
        raise UserError(f"--seq-len {L} exceeds the model's max_seq_len {model.cfg.max_seq_len}.")
    samples = load_samples(
        loaded.tokenizer, probe_data(args.data, loaded.run), args.samples, L, vocab_size=model.cfg.vocab_size
    )
    if mela:
        return _probe_mela(loaded, path, args, device, samples, label)
    attention = not args.no_attention and model.layout.kind in ("looped", "multires")
    settings = ProbeSettings(
        kernel=args.kernel,
        cka_tokens=args.cka_tokens or None,
        token_index=_token_index(args.token_index, L),
        attention=attention,
        batch_size=args.batch_size or auto_batch_size(model, L, attention),
    )
    name = label or loaded.run.name
    cap = capture(model, samples.tokens, settings, progress=not args.no_progress, desc=f"probe {name}")
    run_dir = _run_dir_of(Path(path), Path(loaded.path))
    try:
        tok_text = loaded.tokenizer.decode([int(samples.tokens[0, cap.token_index])])
    except Exception:
        tok_text = None
    meta = {
        "checkpoint": str(Path(loaded.path).resolve()),
        "run_dir": str(run_dir),
        "global_step": loaded.global_step,
        "model": _model_meta(loaded),
        "data": {**samples.info, "case_token_text": tok_text},
        "settings": {
            "kernel": settings.kernel,
            "rbf_sigma": "median pairwise token distance per sample and state (x1.0)",
            "cka_tokens": cap.cka_positions,
            "spectrum_k": settings.spectrum_k,
            "token_index": cap.token_index,
            "batch_size": settings.batch_size,
            "attention": cap.attention is not None,
            "lam_gamma": settings.lam_gamma,
            "device": str(device),
        },
        "timing": {"capture_s": cap.seconds},
    }
    summary = summarize(cap, meta)
    loaded.model = None  # free the weights; only the statistics are needed from here on
    del model
    return Probed(name, loaded, run_dir, cap, summary)


def _probe_mela(
    loaded: Any,
    path: str | os.PathLike,
    args: argparse.Namespace,
    device: torch.device,
    samples: Samples,
    label: str | None,
) -> Probed:
    from recursive_lightning.probes import mela as MP

    print(MP.SKIPPED, flush=True)
    model = loaded.model
    batch_size = args.batch_size or 16
    name = label or loaded.run.name
    cap = MP.capture_mela(
        model, samples.tokens, batch_size, progress=not args.no_progress, desc=f"probe {name}"
    )
    run_dir = _run_dir_of(Path(path), Path(loaded.path))
    summary = {
        "format": FORMAT_VERSION,
        "probes": "mela",
        "checkpoint": str(Path(loaded.path).resolve()),
        "run_dir": str(run_dir),
        "global_step": loaded.global_step,
        "model": MP.model_meta(loaded),
        "data": samples.info,
        "settings": {"batch_size": batch_size, "device": str(device)},
        "timing": {"capture_s": cap.seconds},
        "mela": MP.summarize(cap),
    }
    loaded.model = None  # free the weights
    del model
    return Probed(name, loaded, run_dir, cap, summary)


def _title(p: Probed) -> str:
    m = p.summary["model"]
    if m.get("arch") == "mela":
        return f"{p.label} (Mela, H={m['h_cycles']}, L={m['l_cycles']})"
    return f"{p.label} ({m['layout']}, {m['topology']})"


def _check_outputs(args: argparse.Namespace, run_dirs: Sequence[Path], out: Path) -> None:
    """Before any probing: the figures' folder and each run's MLflow store must be writable."""
    from recursive_lightning.tracking.runs import check_outputs, default_tracking_uri

    check_outputs("probe", out, bool(args.out))
    if not args.no_mlflow:
        for run_dir in run_dirs:
            check_outputs("probe", out, bool(args.out), args.tracking_uri or default_tracking_uri(run_dir))


def _run_single(args: argparse.Namespace, device: torch.device) -> int:
    t0 = time.perf_counter()
    arg = Path(args.checkpoint)
    if arg.exists():  # else load_checkpoint says what is missing
        run_dir = _run_dir_of(arg, arg)
        _check_outputs(args, [run_dir], Path(args.out) if args.out else run_dir / "probes")
    p = probe_one(args.checkpoint, args, device)
    out = Path(args.out) if args.out else p.run_dir / "probes"
    out.mkdir(parents=True, exist_ok=True)
    t1 = time.perf_counter()
    if p.summary.get("probes") == "mela":
        from recursive_lightning.probes import mela as MP

        files = MP.draw(p.capture, out, _title(p))
        metrics = MP.scalar_metrics(p.summary["mela"])
    else:
        files = draw_single(p.capture, p.summary, out, _title(p))
        metrics = scalar_metrics(p.summary)
    p.summary["figures"] = [f.name for f in files]
    p.summary["timing"]["plots_s"] = time.perf_counter() - t1
    p.summary["timing"]["total_s"] = time.perf_counter() - t0
    json_path = write_json(out / JSON_NAME, p.summary)
    msg = f"probe: {p.capture.n_samples} samples x {p.capture.seq_len} tokens; {len(files)} figures and {JSON_NAME} in {out}"
    if not args.no_mlflow:
        try:
            uri, run_id = log_to_mlflow(
                p.run_dir,
                p.loaded,
                [*files, json_path],
                metrics,
                args.tracking_uri,
                "probes",
            )
            msg += f"; MLflow run {run_id} ({uri}), artifacts under probes/"
        except Exception as e:  # the local outputs are complete; tracking problems only warn
            print(f"warning: could not log to MLflow ({type(e).__name__}: {e}).", file=sys.stderr)
    print(msg)
    return 0


def _labels(probed: list[Probed], paths: list[Path]) -> list[str]:
    keys = []
    for p in probed:
        m = p.summary["model"]
        keys.append("vanilla" if m["kind"] == "vanilla" else m["topology"])
    if len(set(keys)) == len(keys):
        return keys
    names = [path.resolve().name if path.is_dir() else path.resolve().parent.name for path in paths]
    names = [n if n != "checkpoints" else path.resolve().parent.parent.name for n, path in zip(names, paths)]
    if len(set(names)) == len(names):
        return names
    return [f"{n}-{i}" for i, n in enumerate(names)]


def _compare_out(args: argparse.Namespace, run_dirs: Sequence[Path]) -> Path:
    if args.out:
        return Path(args.out)
    if len(args.compare) == 1:
        return Path(args.compare[0]) / "probes_compare"
    return Path(os.path.commonpath([str(d) for d in run_dirs])) / "probes_compare"


def _run_compare(args: argparse.Namespace, device: torch.device) -> int:
    t0 = time.perf_counter()
    paths = expand_compare(args.compare)
    run_dirs = [_run_dir_of(path, path) for path in paths]
    _check_outputs(args, run_dirs, _compare_out(args, run_dirs))
    probed: list[Probed] = []
    seq_len = args.seq_len
    for path in paths:
        p = probe_one(path, args, device, seq_len=seq_len, label=path.name, compare=True)
        seq_len = seq_len or p.capture.seq_len  # every model sees the same text windows
        probed.append(p)
    for p, label in zip(probed, _labels(probed, paths)):
        p.label = label
    out = _compare_out(args, [p.run_dir for p in probed])
    out.mkdir(parents=True, exist_ok=True)
    results = {p.label: (p.capture, p.summary) for p in probed}
    t1 = time.perf_counter()
    files = draw_compare(results, out)
    summary = {
        "format": FORMAT_VERSION,
        "compare": [p.label for p in probed],
        "figures": [f.name for f in files],
        "models": {p.label: p.summary for p in probed},
        "timing": {"plots_s": time.perf_counter() - t1, "total_s": time.perf_counter() - t0},
    }
    json_path = write_json(out / JSON_NAME, summary)
    msg = f"probe --compare: {', '.join(results)}; {len(files)} figures and {JSON_NAME} in {out}"
    if not args.no_mlflow:
        logged = []
        for p in probed:
            try:
                _, run_id = log_to_mlflow(
                    p.run_dir,
                    p.loaded,
                    [*files, json_path],
                    scalar_metrics(p.summary),
                    args.tracking_uri,
                    "probes_compare",
                )
                logged.append(run_id)
            except Exception as e:
                print(
                    f"warning: could not log {p.label} to MLflow ({type(e).__name__}: {e}).", file=sys.stderr
                )
        if logged:
            msg += f"; logged under probes_compare/ of MLflow runs {', '.join(logged)}"
    print(msg)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    _check_args(args)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    device = _device(args.device)
    if args.compare:
        return _run_compare(args, device)
    return _run_single(args, device)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
