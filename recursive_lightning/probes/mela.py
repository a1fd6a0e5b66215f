"""Probes of a Mela checkpoint: what the neural memories do and what MemStack adds.

The model is run once per batch of samples through its own forward (``MelaLM.hidden``, nothing is
re-implemented here) and two things are recorded:

* **Memory updates**, per HMM block application (``HierarchicalMemory.applications``, named
  ``cycle i / L step s / L-block j`` and ``cycle i / H-block j``, cycles and steps from 1, blocks from 0)
  and per memory chunk ``t`` (the C patches of text chunk ``t``; text chunk ``t + 1`` reads the HMM's
  output at this chunk, retrieved from the memory after this update with ``memory_read: after``, before it
  with ``before``): from :attr:`NeuralMemory.record`, the values the update actually used - the surprise norm
  ``||sum_i theta_i grad l(M_{t-1}; x_i)||_F`` per memory tensor (Eq. 11's gradient term), the
  learning rate theta (mean over the chunk's positions), the momentum eta_t and the forgetting alpha_t
  (alpha is 1 and eta absent where ``memory_update`` has none) - and the singular values of the update
  added to M (after Newton-Schulz when ``memory_update`` is ``newton_schulz``). The record averages over
  batch and memory heads; batches are then averaged weighted by their size. A forward hook on every
  NeuralMemory hands its record entries to the block application that is running, so the entries are
  attributed in execution order and checked against ``applications``.
* **MemStack** (Eq. 13), per H cycle ``i < H`` and text chunk ``j``: ``||z(i)||_F / ||y(i)||_F`` over the
  chunk's C memory rows, where ``y(i)`` are the memory rows after decoder layer ``i`` (forward hook on
  ``MelaLM.layers[i - 1]``, i.e. before the addition) and ``z(i)`` the rows the model adds there
  (captured by wrapping ``memory_rows`` for the duration). Chunk 0 receives nothing (exactly 0), and so
  does every chunk with ``memstack: false``. Summaries average over samples and over chunks 1..n-1.

Memory stays bounded: only per-batch scalars and spectra are kept (``[applications, chunks, tensors,
k]``) plus three numbers per sample, cycle and chunk. Figures: :mod:`recursive_lightning.probes.mela_figures`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from recursive_lightning.errors import UserError
from recursive_lightning.probes.batches import run_batches

RATES = ("theta", "eta", "alpha")
SKIPPED = (
    "probe: Mela checkpoint; the looped-transformer probes (skew, CKA, spectra, MeSH, attention) do not "
    "apply, writing the Mela memory and MemStack probes instead."
)


# ---------------------------------------------------------------------------
# names
# ---------------------------------------------------------------------------


def applications(cfg: Any) -> list[dict[str, Any]]:
    """Every memory block application of one HMM forward, in execution order, with its name."""
    out: list[dict[str, Any]] = []
    for i in range(1, cfg.h_cycles + 1):
        for s in range(1, cfg.l_cycles + 1):
            for j in range(cfg.l_layers):
                out.append(
                    {
                        "name": f"cycle {i} / L step {s} / L-block {j}",
                        "short": f"c{i} L{s} Lb{j}",
                        "module": "l",
                        "cycle": i,
                        "l_step": s,
                        "block": j,
                    }
                )
        for j in range(cfg.h_layers):
            out.append(
                {
                    "name": f"cycle {i} / H-block {j}",
                    "short": f"c{i} Hb{j}",
                    "module": "h",
                    "cycle": i,
                    "l_step": None,
                    "block": j,
                }
            )
    for a in out:
        a["gradients"] = a["cycle"] == cfg.h_cycles  # HLR: the first H-1 cycles run without gradients
    return out


# ---------------------------------------------------------------------------
# capture
# ---------------------------------------------------------------------------


@dataclass
class MelaCapture:
    """Probe statistics of a MelaLM (float64 numpy, CPU)."""

    n_samples: int
    seq_len: int
    text_chunks: int  # decoder chunks of P*C tokens (the last may be padded)
    memory_chunks: int  # = text_chunks - 1: chunks the HMM updates its memories on
    applications: list[dict[str, Any]]
    tensor_shapes: list[tuple[int, int]]  # per memory head: (in, out) of each memory-MLP tensor
    surprise: np.ndarray | None  # [A, T, I]; None without neural memory
    theta: np.ndarray | None  # [A, T]
    eta: np.ndarray | None  # [A, T] (NaN where the update has no momentum)
    alpha: np.ndarray | None  # [A, T] (1 where the update has no forgetting)
    singular: np.ndarray | None  # [A, T, I, k] singular values of the update added to M
    memstack_ratio: np.ndarray  # [N, H-1, text_chunks]: ||z(i)|| / ||memory rows after layer i||
    memstack_z: np.ndarray  # [N, H-1, text_chunks]: ||z(i)||_F over the chunk's C rows
    memstack_rows: np.ndarray  # [N, H-1, text_chunks]: ||memory rows after layer i||_F
    seconds: float = 0.0
    tensor_labels: list[str] = field(default_factory=list)
    cfg: Any = None  # the model's ModelConfig


def _memories(model: nn.Module) -> list[tuple[tuple[str, int], nn.Module]]:
    out = []
    for key, module in (("l", model.hmm.l_module), ("h", model.hmm.h_module)):
        for j, block in enumerate(module.blocks):
            if block.memory is not None:
                out.append(((key, j), block.memory))
    return out


class _Recorder:
    """Hooks for one capture: NeuralMemory records per application, MemStack rows per decoder layer."""

    def __init__(self, model: nn.Module) -> None:
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        self.expected = list(model.hmm.applications)
        self.memories = _memories(model)
        self.calls: list[tuple[tuple[str, int], list[dict[str, Any]]]] = []
        self.stack: list[torch.Tensor] = []
        self.cycles = cfg.h_cycles - 1
        self.z: list[torch.Tensor | None] = [None] * self.cycles
        self.rows: list[torch.Tensor | None] = [None] * self.cycles
        self.handles: list[Any] = []

    def __enter__(self) -> _Recorder:
        for key, mem in self.memories:
            mem.record = []
            self.handles.append(mem.register_forward_hook(self._memory_hook(key)))
        for a in range(min(self.cycles, len(self.model.layers))):
            self.handles.append(self.model.layers[a].register_forward_hook(self._layer_hook(a)))
        original = self.model.memory_rows

        def memory_rows(x: torch.Tensor, n_chunks: int) -> list[torch.Tensor]:
            rows = original(x, n_chunks)
            self.stack = rows[1:]  # MemStack's z(1..H-1), each (b, n_chunks, C, d), as the model adds them
            return rows

        self.model.memory_rows = memory_rows  # instance attribute: shadows the method until __exit__
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        for _, mem in self.memories:
            mem.record = None
        self.model.__dict__.pop("memory_rows", None)

    def _memory_hook(self, key: tuple[str, int]) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.calls.append((key, module.record))
            module.record = []

        return hook

    def _layer_hook(self, a: int) -> Callable:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            C = self.cfg.chunk_size
            before = output[:, :C].float()  # the memory rows after layer a, before Eq. 13's addition
            bn = before.shape[0]
            self.rows[a] = before.reshape(bn, -1).norm(dim=1)
            if a < len(self.stack):
                z = self.stack[a].float().reshape(bn, -1)
                self.z[a] = z.norm(dim=1)
            else:  # no MemStack: nothing is added
                self.z[a] = torch.zeros_like(self.rows[a])

        return hook

    def start_batch(self) -> None:
        self.calls, self.stack = [], []
        self.z = [None] * self.cycles
        self.rows = [None] * self.cycles


def capture_mela(
    model: nn.Module,
    tokens: torch.Tensor,
    batch_size: int = 16,
    progress: bool | Callable[[Iterable], Iterable] = True,
    desc: str = "probe",
) -> MelaCapture:
    """Run ``model.hidden`` over ``tokens [N, L]`` in batches of ``batch_size`` and return the Mela probe
    statistics. Eval mode for the duration; every hook and record attribute is removed afterwards."""
    cfg = model.cfg
    if tokens.dim() != 2 or tokens.numel() == 0:
        raise ValueError("tokens must be a non-empty [N, L] tensor")
    N, L = tokens.shape
    PC = cfg.tokens_per_chunk
    n = -(-L // PC)
    if n < 2:
        raise UserError(
            f"--seq-len {L} fills only one Mela chunk of P*C = {PC} tokens, whose memory is the learned "
            f"initial one; probe at least {PC + 1} tokens so that the memory is updated."
        )
    T, H1 = n - 1, cfg.h_cycles - 1
    apps = applications(cfg)
    if [(a["module"], a["block"]) for a in apps] != list(model.hmm.applications):
        raise RuntimeError("probes/mela.py names the HMM block applications in another order than the model")
    memories = _memories(model)
    shapes = [tuple(w.shape[-2:]) for w in memories[0][1].init_weights] if memories else []
    A, I_ = len(apps), len(shapes)
    k = min(min(s) for s in shapes) if shapes else 0
    sums = {
        "surprise": np.zeros((A, T, I_)),
        "singular": np.zeros((A, T, I_, k)),
        **{r: np.zeros((A, T)) for r in RATES},
    }
    ratio, znorm, rnorm = (np.zeros((N, H1, n)) for _ in range(3))

    def step(s0: int, batch: torch.Tensor) -> None:
        b = batch.shape[0]
        rec.start_batch()
        model.hidden(batch)
        if memories:
            _add_memory_calls(sums, rec.calls, list(model.hmm.applications), b)
        for c in range(H1):
            zc = rec.z[c].double().view(b, n).cpu().numpy()
            rc = rec.rows[c].double().view(b, n).cpu().numpy()
            znorm[s0 : s0 + b, c] = zc
            rnorm[s0 : s0 + b, c] = rc
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio[s0 : s0 + b, c] = np.where(zc == 0, 0.0, zc / rc)

    with _Recorder(model) as rec:
        seconds = run_batches(model, tokens, batch_size, step, progress, desc)
    mean = {key: v / N for key, v in sums.items()}
    has = bool(memories)
    return MelaCapture(
        n_samples=N,
        seq_len=L,
        text_chunks=n,
        memory_chunks=T,
        applications=apps,
        tensor_shapes=shapes,
        tensor_labels=[f"$W_{{{i + 1}}}$ ({a}x{b})" for i, (a, b) in enumerate(shapes)],
        surprise=mean["surprise"] if has else None,
        theta=mean["theta"] if has else None,
        eta=mean["eta"] if has else None,
        alpha=mean["alpha"] if has else None,
        singular=mean["singular"] if has else None,
        memstack_ratio=ratio,
        memstack_z=znorm,
        memstack_rows=rnorm,
        seconds=seconds,
        cfg=cfg,
    )


def _add_memory_calls(sums: dict[str, np.ndarray], calls: list, want: list, b: int) -> None:
    """Add one batch's recorded memory updates (``b`` samples each) to the running ``sums`` by application,
    chunk and tensor: surprise, the update's singular values and the rates."""
    got = [key for key, _ in calls]
    # memory_carry cycles runs every application once per chunk (chunk-major), none once
    if not got or len(got) % len(want) or got != want * (len(got) // len(want)):
        raise RuntimeError(f"recorded memory applications {got} differ from the model's")
    for c, (_, rows) in enumerate(calls):
        a, offset = c % len(want), c // len(want)
        for row in rows:
            t, i = row["chunk"] + offset, row["tensor"]
            sums["surprise"][a, t, i] += b * row["surprise_norm"]
            sums["singular"][a, t, i] += b * row["update_singular_values"].double().numpy()
            if i == 0:  # theta, eta, alpha are shared by the tensors of one update
                for r in RATES:
                    sums[r][a, t] += b * row[r]


# ---------------------------------------------------------------------------
# summary, metrics
# ---------------------------------------------------------------------------


def _chunk_mean_std(per_sample: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, H-1, n] -> mean and std over samples of each sample's mean over chunks 1..n-1."""
    if per_sample.shape[-1] < 2:
        z = np.zeros(per_sample.shape[1])
        return z, z
    m = per_sample[:, :, 1:].mean(axis=2)
    return m.mean(axis=0), m.std(axis=0)


def model_meta(loaded: Any) -> dict[str, Any]:
    cfg = loaded.model.cfg
    keys = (
        "d_model",
        "n_heads",
        "hmm_width",
        "h_cycles",
        "l_cycles",
        "h_layers",
        "l_layers",
        "patch_size",
        "chunk_size",
        "memory_heads",
        "memory_depth",
        "memory_update",
        "memory_read",
        "neural_memory",
        "hmm_attention",
        "fusion",
        "memstack",
    )
    return {
        "name": loaded.run.name,
        "arch": "mela",
        "kind": "mela",
        "decoder_layers": len(loaded.model.layers),
        **{k: getattr(cfg, k) for k in keys},
        "parameters": sum(p.numel() for p in loaded.model.parameters()),
    }


def summarize(cap: MelaCapture) -> dict[str, Any]:
    """JSON-ready dict of every plotted number: ``memory`` (per application and chunk) and ``memstack``."""
    cfg = cap.cfg
    update = cfg.memory_update
    memory: dict[str, Any] | None = None
    if cap.surprise is not None:
        records = []
        for a, app in enumerate(cap.applications):
            for t in range(cap.memory_chunks):
                records.append(
                    {
                        "application": app["name"],
                        "application_index": a,
                        "chunk": t,
                        "surprise_norm": cap.surprise[a, t],
                        "theta": cap.theta[a, t],
                        "eta": cap.eta[a, t],
                        "alpha": cap.alpha[a, t],
                        "update_singular_values": cap.singular[a, t],
                    }
                )
        memory = {
            "memory_update": update,
            "memory_read": getattr(cfg, "memory_read", None),
            "newton_schulz": update == "newton_schulz",
            "ns_steps": cfg.ns_steps if update == "newton_schulz" else None,
            "memory_heads": cfg.memory_heads,
            "tensors": [{"index": i, "shape_per_head": list(s)} for i, s in enumerate(cap.tensor_shapes)],
            "chunks": cap.memory_chunks,
            "records": records,
            "definitions": {
                "chunk": "memory chunk t = the C patches of text chunk t; text chunk t+1 reads the HMM's "
                "output at chunk t, retrieved from the memory after (memory_read: after) or before (before) "
                "chunk t's update",
                "surprise_norm": "||sum_{i in chunk} theta_i grad_M l(M_{t-1}; x_i)||_F per memory tensor "
                "(Eq. 11's gradient term), mean over samples and memory heads",
                "theta": "learning rate memory_max_lr * sigmoid(.), mean over the chunk's patches, samples and heads",
                "eta": "sigmoid momentum eta_t of the chunk (null: the update has no momentum)",
                "alpha": "sigmoid forgetting alpha_t of the chunk (1: the update has no forgetting)",
                "update_singular_values": "singular values of the update added to M per memory tensor"
                + (" (after Newton-Schulz)" if update == "newton_schulz" else " (no Newton-Schulz)")
                + ", descending, mean over samples and heads",
            },
        }
    mean, std = _chunk_mean_std(cap.memstack_ratio)
    memstack = {
        "enabled": bool(cfg.memstack),
        "cycles": list(range(1, cfg.h_cycles)),
        "decoder_layer": list(range(1, cfg.h_cycles)),
        "relative_change": {
            "mean": mean,
            "std": std,
            "per_chunk": cap.memstack_ratio.mean(axis=0),
        },
        "z_norm_per_chunk": cap.memstack_z.mean(axis=0),
        "rows_norm_per_chunk": cap.memstack_rows.mean(axis=0),
        "definition": "||z(i)||_F / ||y(i)||_F over a text chunk's C memory rows, y(i) = the memory rows "
        "after decoder layer i before MemStack adds z(i) (Eq. 13); per_chunk = mean over samples per "
        "text chunk (chunk 0 receives nothing), mean/std = over samples of the mean over chunks 1..n-1",
    }
    return {
        "applications": cap.applications,
        "text_chunks": cap.text_chunks,
        "memory": memory,
        "memstack": memstack,
    }


def scalar_metrics(mela: dict[str, Any]) -> dict[str, float]:
    """A few ``probe/mela/...`` scalars for MLflow."""
    out: dict[str, float] = {}
    memory = mela.get("memory")
    if memory:
        recs = memory["records"]
        used = {"plain": ("theta",), "momentum": ("theta", "eta")}.get(memory["memory_update"], RATES)
        for key in used:
            vals = [r[key] for r in recs if r[key] is not None and math.isfinite(r[key])]
            if vals:
                out[f"probe/mela/{key}"] = float(np.mean(vals))
        out["probe/mela/surprise_norm"] = float(np.mean([np.mean(r["surprise_norm"]) for r in recs]))
        top = [np.max(r["update_singular_values"]) for r in recs if len(r["update_singular_values"])]
        if top:
            out["probe/mela/update_sv_max"] = float(np.mean(top))
    ms = mela["memstack"]
    for c, v in zip(ms["cycles"], ms["relative_change"]["mean"]):
        out[f"probe/mela/memstack/cycle{c}"] = float(v)
    return {k: v for k, v in out.items() if math.isfinite(v)}
