"""The papers' diagnostic probes of a checkpoint (``probe_checkpoint``) or of several side by side
(``probe_compare``), as ``ProbeOptions`` say; the ``probe`` command (``commands/probe.py``) parses them:

    probe CHECKPOINT [--data PATH] [--samples 500] [--seq-len N] [--batch-size N] [--out DIR]
                     [--token-index I] [--kernel rbf|linear] [--no-attention] [--no-mlflow]
    probe --compare RUN_DIR [RUN_DIR ...]      (or one sweep directory holding several run dirs)

``CHECKPOINT`` is a ``.ckpt`` file or a run directory (its newest good checkpoint is used). The
text is ``--data`` (file, folder, glob, ``hf:<dataset>`` or ``embedded``) or, by default, the run's own
``data.path`` (the embedded corpus when it trained on that);
documents the training split holds out (the same content hash as the shard writer) come first, then
the others, each followed by the end-of-text token, and the token stream is cut into ``--samples``
consecutive windows of ``--seq-len`` tokens - deterministic for a given tokenizer and text.

Computed (one module per probe, in the order of :data:`recursive_lightning.probes.registry.PROBES`; what
is computed on what: :mod:`recursive_lightning.probes.capture`):

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

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recursive_lightning.errors import UserError
from recursive_lightning.probes import mela
from recursive_lightning.probes.capture import capture
from recursive_lightning.probes.captured import Capture, ProbeSettings
from recursive_lightning.probes.figures import Sheet
from recursive_lightning.probes.mela_figures import draw_mela
from recursive_lightning.probes.outputs import log_to_mlflow, write_json
from recursive_lightning.probes.registry import FORMAT_VERSION, draw, scalar_metrics, summarize
from recursive_lightning.probes.samples import Samples, load_samples, probe_data
from recursive_lightning.run_dir import RunDir, SweepDir
from recursive_lightning.tracking.runs import check_outputs, default_tracking_uri
from recursive_lightning.uris import mask_url

JSON_NAME = "probes.json"
DEFAULT_TOKEN_INDEX = 27  # MeSH Fig. 11: the case-study token "gu" is idx 27


# ---------------------------------------------------------------------------
# checkpoints and output locations
# ---------------------------------------------------------------------------


@dataclass
class ProbeOptions:
    """How ``probe_checkpoint`` / ``probe_compare`` probe (the ``probe`` command's options): the text (``data``:
    default the run's ``data.path``), ``samples`` windows of ``seq_len`` tokens (default the run's), forward
    ``batch_size`` (default ``auto_batch_size``), the figures' folder ``out`` (default ``<run_dir>/probes`` or
    ``probes_compare``), the MeSH case-study ``token_index``, the CKA ``kernel`` and ``cka_tokens`` (0: all),
    ``attention`` probes, logging to MLflow (``mlflow``, ``tracking_uri``) and a progress bar."""

    data: str | None = None
    samples: int = 500
    seq_len: int | None = None
    batch_size: int | None = None
    out: str | None = None
    token_index: int = DEFAULT_TOKEN_INDEX
    kernel: str = "rbf"
    cka_tokens: int = 0
    attention: bool = True
    mlflow: bool = True
    tracking_uri: str | None = None
    progress: bool = True


@dataclass
class Probed:
    label: str
    loaded: Any  # training.checkpoint.Loaded (model dropped after capture)
    run_dir: Path
    capture: Capture | mela.MelaCapture
    summary: dict[str, Any]


def _run_dir_of(arg: Path, ckpt: Path) -> Path:
    arg = arg.resolve()
    if arg.is_dir() and not (arg / "meta.pt").exists() and not (arg / ".metadata").exists():
        return arg
    ckpt = ckpt.resolve()
    return RunDir.of_checkpoint(ckpt).path


def _has_checkpoint(d: Path) -> bool:
    from recursive_lightning.training.checkpoint import candidates  # heavy

    return bool(candidates(RunDir(d).checkpoints) or candidates(d) or list(d.glob("*.ckpt")))


def expand_compare(paths: Sequence[str]) -> list[Path]:
    """Run dirs / checkpoint files to compare; a directory without a checkpoint of its own is a sweep directory
    (or its ``trials/``) whose sub-directories holding checkpoints are compared (sorted by name)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise UserError(
                f"--compare path '{p}' does not exist; pass run directories or a sweep directory."
            )
        if p.is_dir() and not _has_checkpoint(p):
            runs = SweepDir(p).runs_folder()  # a sweep keeps its trials in trials/
            subs = sorted(d for d in runs.iterdir() if d.is_dir() and _has_checkpoint(d))
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
    options: ProbeOptions,
    device: torch.device,
    seq_len: int | None = None,
    label: str | None = None,
    compare: bool = False,
) -> Probed:
    """Load one checkpoint, build its samples and capture + summarise the probes (model freed after);
    a Mela checkpoint gets the Mela probes (:mod:`recursive_lightning.probes.mela`), refused by compare."""
    from recursive_lightning.training.checkpoint import load_checkpoint  # heavy

    loaded = load_checkpoint(path, device=device)
    model = loaded.model
    is_mela = getattr(model.cfg, "arch", "recursive") == "mela"
    if is_mela and compare:
        raise UserError(
            f"probe --compare draws the looped-transformer probes side by side and '{path}' is a Mela "
            "checkpoint, whose memory probes have no common axes across runs; probe each Mela run on its own."
        )
    L = seq_len or options.seq_len or loaded.run.data.seq_len
    if L > model.cfg.max_seq_len:
        raise UserError(f"--seq-len {L} exceeds the model's max_seq_len {model.cfg.max_seq_len}.")
    samples = load_samples(
        loaded.tokenizer,
        probe_data(options.data, loaded.run),
        options.samples,
        L,
        vocab_size=model.cfg.vocab_size,
    )
    if is_mela:
        return _probe_mela(loaded, path, options, device, samples, label)
    attention = options.attention and model.layout.kind in ("looped", "multires")
    settings = ProbeSettings(
        kernel=options.kernel,
        cka_tokens=options.cka_tokens or None,
        token_index=_token_index(options.token_index, L),
        attention=attention,
        batch_size=options.batch_size or auto_batch_size(model, L, attention),
    )
    name = label or loaded.run.name
    cap = capture(model, samples.tokens, settings, progress=options.progress, desc=f"probe {name}")
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
    options: ProbeOptions,
    device: torch.device,
    samples: Samples,
    label: str | None,
) -> Probed:
    print(mela.SKIPPED, flush=True)
    model = loaded.model
    batch_size = options.batch_size or 16
    name = label or loaded.run.name
    cap = mela.capture_mela(
        model, samples.tokens, batch_size, progress=options.progress, desc=f"probe {name}"
    )
    run_dir = _run_dir_of(Path(path), Path(loaded.path))
    summary = {
        "format": FORMAT_VERSION,
        "probes": "mela",
        "checkpoint": str(Path(loaded.path).resolve()),
        "run_dir": str(run_dir),
        "global_step": loaded.global_step,
        "model": mela.model_meta(loaded),
        "data": samples.info,
        "settings": {"batch_size": batch_size, "device": str(device)},
        "timing": {"capture_s": cap.seconds},
        "mela": mela.summarize(cap),
    }
    loaded.model = None  # free the weights
    del model
    return Probed(name, loaded, run_dir, cap, summary)


def _title(p: Probed) -> str:
    m = p.summary["model"]
    if m.get("arch") == "mela":
        return f"{p.label} (Mela, H={m['h_cycles']}, L={m['l_cycles']})"
    return f"{p.label} ({m['layout']}, {m['topology']})"


def _check_outputs(options: ProbeOptions, run_dirs: Sequence[Path], out: Path) -> None:
    """Before any probing: the figures' folder and each run's MLflow store must be writable."""
    check_outputs("probe", out, bool(options.out))
    if options.mlflow:
        for run_dir in run_dirs:
            check_outputs(
                "probe", out, bool(options.out), options.tracking_uri or default_tracking_uri(run_dir)
            )


def probe_checkpoint(checkpoint: str | os.PathLike, options: ProbeOptions, device: torch.device) -> str:
    """Probe one checkpoint (a ``.ckpt`` file or a run directory): figures and ``probes.json`` in ``options.out``,
    logged to its MLflow run; returns the line that says what was written where."""
    t0 = time.perf_counter()
    arg = Path(checkpoint)
    if arg.exists():  # else load_checkpoint says what is missing
        run_dir = _run_dir_of(arg, arg)
        _check_outputs(options, [run_dir], Path(options.out) if options.out else RunDir(run_dir).probes_dir)
    p = probe_one(checkpoint, options, device)
    out = Path(options.out) if options.out else RunDir(p.run_dir).probes_dir
    out.mkdir(parents=True, exist_ok=True)
    t1 = time.perf_counter()
    if p.summary.get("probes") == "mela":
        files = draw_mela(p.capture, out, _title(p))
        metrics = mela.scalar_metrics(p.summary["mela"])
    else:
        files = draw({p.label: (p.capture, p.summary)}, Sheet(out, _title(p)))
        metrics = scalar_metrics(p.summary)
    p.summary["figures"] = [f.name for f in files]
    p.summary["timing"]["plots_s"] = time.perf_counter() - t1
    p.summary["timing"]["total_s"] = time.perf_counter() - t0
    json_path = write_json(out / JSON_NAME, p.summary)
    msg = f"probe: {p.capture.n_samples} samples x {p.capture.seq_len} tokens; {len(files)} figures and {JSON_NAME} in {out}"
    if options.mlflow:
        try:
            uri, run_id = log_to_mlflow(
                p.run_dir,
                p.loaded,
                [*files, json_path],
                metrics,
                options.tracking_uri,
                "probes",
            )
            msg += f"; MLflow run {run_id} ({mask_url(uri)}), artifacts under probes/"
        except Exception as e:  # the local outputs are complete; tracking problems only warn
            print(mask_url(f"warning: could not log to MLflow ({type(e).__name__}: {e})."), file=sys.stderr)
    return msg


def _labels(probed: list[Probed], paths: list[Path]) -> list[str]:
    keys = []
    for p in probed:
        m = p.summary["model"]
        keys.append("vanilla" if m["kind"] == "vanilla" else m["topology"])
    if len(set(keys)) == len(keys):
        return keys
    names = [path.resolve().name if path.is_dir() else path.resolve().parent.name for path in paths]
    names = [
        n if n != RunDir.CHECKPOINTS else path.resolve().parent.parent.name for n, path in zip(names, paths)
    ]
    if len(set(names)) == len(names):
        return names
    return [f"{n}-{i}" for i, n in enumerate(names)]


def _compare_out(options: ProbeOptions, compare: Sequence[str], run_dirs: Sequence[Path]) -> Path:
    if options.out:
        return Path(options.out)
    if len(compare) == 1:
        return Path(compare[0]) / "probes_compare"
    return Path(os.path.commonpath([str(d) for d in run_dirs])) / "probes_compare"


def probe_compare(compare: Sequence[str], options: ProbeOptions, device: torch.device) -> str:
    """Probe several run directories (or one sweep directory's runs, ``expand_compare``) on the same text
    windows and draw their figures side by side; returns the line that says what was written where."""
    t0 = time.perf_counter()
    paths = expand_compare(compare)
    run_dirs = [_run_dir_of(path, path) for path in paths]
    _check_outputs(options, run_dirs, _compare_out(options, compare, run_dirs))
    probed: list[Probed] = []
    seq_len = options.seq_len
    for path in paths:
        p = probe_one(path, options, device, seq_len=seq_len, label=path.name, compare=True)
        seq_len = seq_len or p.capture.seq_len  # every model sees the same text windows
        probed.append(p)
    for p, label in zip(probed, _labels(probed, paths)):
        p.label = label
    out = _compare_out(options, compare, [p.run_dir for p in probed])
    out.mkdir(parents=True, exist_ok=True)
    results = {p.label: (p.capture, p.summary) for p in probed}
    t1 = time.perf_counter()
    files = draw(results, Sheet(out))
    summary = {
        "format": FORMAT_VERSION,
        "compare": [p.label for p in probed],
        "figures": [f.name for f in files],
        "models": {p.label: p.summary for p in probed},
        "timing": {"plots_s": time.perf_counter() - t1, "total_s": time.perf_counter() - t0},
    }
    json_path = write_json(out / JSON_NAME, summary)
    msg = f"probe --compare: {', '.join(results)}; {len(files)} figures and {JSON_NAME} in {out}"
    if options.mlflow:
        logged = []
        for p in probed:
            try:
                _, run_id = log_to_mlflow(
                    p.run_dir,
                    p.loaded,
                    [*files, json_path],
                    scalar_metrics(p.summary),
                    options.tracking_uri,
                    "probes_compare",
                )
                logged.append(run_id)
            except Exception as e:
                print(
                    f"warning: could not log {p.label} to MLflow ({type(e).__name__}: {e}).", file=sys.stderr
                )
        if logged:
            msg += f"; logged under probes_compare/ of MLflow runs {', '.join(logged)}"
    return msg
