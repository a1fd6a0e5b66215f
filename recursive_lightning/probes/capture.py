"""Batched capture of the probe statistics from :meth:`RecursiveLM.traced`.

The model is run once per batch through ``model.traced`` (the model's own forward, nothing is
re-implemented here); every statistic is reduced *per sample* right away and only those small
per-sample results are kept, so memory does not grow with the hidden states of all samples.

What is computed on what (``N`` samples of ``L`` tokens, hidden size ``d``):

* **Computation skew** (MeSH Fig. 3) - per sample and block, on the block's full ``[L, d]``
  input/output matrices as recorded in ``Trace.blocks``: prelude ``h_emb -> f_pre(h_emb)``,
  loop step ``t`` ``h^(t) -> u~^(t)`` (the core output, i.e. ``f_core(h^(t))`` at full
  resolution, the up-scaled and shifted update for a multi-resolution step), coda
  ``h^(K) -> f_coda(.)``.  Blocks with zero layers (an empty prelude or coda) are identities and
  are left out.
* **CKA** (MeSH Fig. 4) - per sample, between the state matrices ``h in R^{L x d}`` (the
  ``L`` tokens of one sequence are the examples of the kernel), for all states ``h_emb,
  h^(0..K), h_out``; then averaged over samples.  This is exactly the paper's "hidden state
  matrices h in R^{seq x dim} ... mean similarity across 500 samples": no representation has to be
  kept across samples.  By default every token of the sequence is used; ``cka_tokens`` keeps
  that many evenly spaced positions instead (the same positions for every state), which bounds
  the ``O(L^2)`` Gram matrices for long sequences.  RBF bandwidth: median heuristic per state and
  sample (:func:`.cka.cka_matrix`).
* **Singular spectra / effective rank** (MeSH Fig. 5) - per sample and state, the top-``k``
  normalised singular values ``sigma_i / sigma_0`` of the un-centred ``[L, d]`` matrix, and its
  effective rank (Roy & Vetterli).
* **Shared subspace** (MeSH App. E.8, Fig. 10) - per sample, on the loop states
  ``h^(0..K)`` (:func:`.subspace.shared_subspace_variance`).
* **MeSH routing** (MeSH App. F, Fig. 11) - per sample, the write/read weights of every step
  ``t = -1..K-1`` and slot averaged over the sequence and at position ``token_index``, and the
  Eq. 7 state composition (:func:`.mesh.mesh_state_composition`, token-wise, then averaged the
  same way).
* **Combination coefficients** (static/dynamic topologies, MeSH App. E.3) - per sample, the
  sequence mean of the 4 coefficients ``(core, residual, anchor, anchor_emb)`` of every step.
* **Attention probes** (SpiralFormer Sec. 4.1) - for layouts with a loop-shared core, per sample,
  loop, core layer and head: the key-marginal entropy and the Local Attention Mass of the causal
  attention map at the loop-native length ``L_t`` (window ``M_t = ceil(32 r_t)``, Eq. 23).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from recursive_lightning.model.recursive.mesh import MeSH
from recursive_lightning.model.recursive.model import RecursiveLM, Trace
from recursive_lightning.model.recursive.topology import Combination
from recursive_lightning.probes.attention import key_marginal_entropy, lam_window, local_attention_mass
from recursive_lightning.probes.batches import run_batches
from recursive_lightning.probes.captured import Capture, ProbeSettings
from recursive_lightning.probes.cka import cka_in_chunks
from recursive_lightning.probes.mesh import mesh_state_composition
from recursive_lightning.probes.skew import computation_skew
from recursive_lightning.probes.spectra import effective_rank, normalized_spectrum, singular_values
from recursive_lightning.probes.subspace import shared_subspace_variance


def attention_loops(model: RecursiveLM, seq_len: int) -> list[int]:
    """Loop steps whose shared core actually runs at ``seq_len`` (a step with chunk ``g > L`` has no
    complete chunk and skips the core), i.e. the order of the core's captured attention maps."""
    return [t for t, g in enumerate(model.layout.chunk) if seq_len >= g]


def _has_shared_core(model: RecursiveLM) -> bool:
    return model.layout.kind in ("looped", "multires") and model.layout.n_loop > 0


def _kept_blocks(model: RecursiveLM, trace: Trace) -> list[int]:
    lay = model.layout
    keep = []
    for i, (name, _, _) in enumerate(trace.blocks):
        if (name == "prelude" and lay.prelude == 0) or (name == "coda" and lay.coda == 0):
            continue
        keep.append(i)
    return keep


def _cka_positions(seq_len: int, cka_tokens: int | None) -> Tensor | None:
    if not cka_tokens or cka_tokens >= seq_len:
        return None
    return torch.linspace(0, seq_len - 1, cka_tokens).round().long().unique()


class _Accumulator:
    def __init__(self, model: RecursiveLM, settings: ProbeSettings, seq_len: int) -> None:
        self.model, self.s, self.L = model, settings, seq_len
        self.lists: dict[str, list[Tensor]] = {}
        self.block_names: list[str] | None = None
        self.state_names: list[str] | None = None
        self.kept: list[int] = []
        self.positions = _cka_positions(seq_len, settings.cka_tokens)
        self.loops = attention_loops(model, seq_len) if settings.attention and _has_shared_core(model) else []

    def add(self, key: str, value: Tensor) -> None:
        self.lists.setdefault(key, []).append(value.detach().to("cpu", torch.float64))

    def update(self, trace: Trace) -> None:
        s = self.s
        if self.block_names is None:
            self.kept = _kept_blocks(self.model, trace)
            self.block_names = [trace.blocks[i][0] for i in self.kept]
            self.state_names = [name for name, _ in trace.states]
        # 1. computation skew per block
        skews = [computation_skew(trace.blocks[i][1], trace.blocks[i][2]) for i in self.kept]
        self.add("skew", torch.stack(skews, dim=-1))
        # 2.-4. representation metrics on the stacked states [b, S, L, d]
        states = torch.stack([h for _, h in trace.states], dim=1)
        cka_in = states if self.positions is None else states[:, :, self.positions.to(states.device)]
        self.add("cka", cka_in_chunks(cka_in, s.kernel, s.sigma_frac, s.max_gram_bytes))
        sv = singular_values(states)  # [b, S, min(L, d)], one decomposition for both metrics
        self.add("spectra", normalized_spectrum(sv, s.spectrum_k))
        self.add("effective_rank", effective_rank(sv))
        n_loop = self.model.layout.n_loop
        if n_loop > 0:
            kmax = s.subspace_k or min(states.shape[-1], 128)
            loop_states = states[:, 1 : n_loop + 2]  # h(0) .. h(K)
            self.add("subspace", shared_subspace_variance(loop_states, k_max=kmax))
        # 5. MeSH routing and Eq. 7 composition
        if trace.routing is not None:
            w = torch.stack(trace.routing["write"])  # [K+1, b, L, B]
            r = torch.stack(trace.routing["read"])
            comp = mesh_state_composition(w, r)  # [b, L, K+1, K+2]
            i = s.token_index
            self.add("write_seq", w.float().mean(2).transpose(0, 1))  # [b, K+1, B]
            self.add("read_seq", r.float().mean(2).transpose(0, 1))
            self.add("write_tok", w[:, :, i].transpose(0, 1))
            self.add("read_tok", r[:, :, i].transpose(0, 1))
            self.add("comp_seq", comp.mean(1))  # [b, K+1, K+2]
            self.add("comp_tok", comp[:, i])
        # static / dynamic combination coefficients
        if trace.coefficients:
            b = states.shape[0]
            rows = []
            for a in trace.coefficients:
                a = a.float()
                rows.append(a.expand(b, 4) if a.dim() == 1 else a.reshape(b, -1, 4).mean(1))
            self.add("coefficients", torch.stack(rows, dim=1))  # [b, K, 4]
        # 6. attention probes on the loop-shared core
        if self.loops and trace.attention is not None:
            self._attention(trace.attention.get("core0") or [])

    def _attention(self, per_layer: list[list[Tensor]]) -> None:
        if not per_layer:
            return
        ent_layers, lam_layers = [], []
        chunk = self.model.layout.chunk
        for maps in per_layer:  # one list per core layer: one map per call (loop step)
            if len(maps) != len(self.loops):
                raise RuntimeError(
                    f"expected {len(self.loops)} attention maps per core layer, got {len(maps)}"
                )
            # the maps are exactly causal (softmax of -inf above the diagonal), so the entropy's
            # causal masking pass is skipped (identical result)
            ent = [key_marginal_entropy(a, causal=False) for a in maps]  # each [b, H]
            lam = [
                local_attention_mass(a, lam_window(1.0 / chunk[t], self.s.lam_gamma))
                for a, t in zip(maps, self.loops)
            ]
            ent_layers.append(torch.stack(ent, dim=1))  # [b, T, H]
            lam_layers.append(torch.stack(lam, dim=1))
        self.add("entropy", torch.stack(ent_layers, dim=2))  # [b, T, layers, H]
        self.add("lam", torch.stack(lam_layers, dim=2))

    def get(self, key: str) -> Tensor | None:
        parts = self.lists.get(key)
        return torch.cat(parts) if parts else None


def capture(
    model: RecursiveLM,
    tokens: Tensor,
    settings: ProbeSettings | None = None,
    progress: bool | Callable[[Iterable], Iterable] = True,
    desc: str = "probe",
) -> Capture:
    """Run ``model.traced`` over ``tokens [N, L]`` in batches and return the per-sample statistics.

    The model is put in eval mode for the duration (and restored); parameters, buffers and the
    model's outputs are untouched (``traced`` resets every recording hook it sets).
    """
    s = settings or ProbeSettings()
    if tokens.dim() != 2 or tokens.numel() == 0:
        raise ValueError("tokens must be a non-empty [N, L] tensor")
    N, L = tokens.shape
    index = min(27, L - 1) if s.token_index is None else s.token_index
    if not -L <= index < L:
        raise ValueError(f"token_index {index} is outside a sequence of {L} tokens")
    s = ProbeSettings(**{**s.__dict__, "token_index": index % L})
    acc = _Accumulator(model, s, L)
    stacks = {f"core{i}" for i in range(len(model.cores))} if acc.loops else False

    def step(start: int, batch: Tensor) -> None:
        _, trace = model.traced(batch, attention=stacks)
        acc.update(trace)

    seconds = run_batches(model, tokens, s.batch_size, step, progress, desc)
    chunk = model.layout.chunk
    attention = None
    if acc.get("entropy") is not None:
        attention = {"entropy": acc.get("entropy"), "lam": acc.get("lam")}
    routing = None
    if isinstance(model.topology, MeSH):
        routing = {
            k: acc.get(k) for k in ("write_seq", "read_seq", "write_tok", "read_tok", "comp_seq", "comp_tok")
        }
    return Capture(
        n_samples=N,
        seq_len=L,
        d_model=model.cfg.d_model,
        n_loop=model.layout.n_loop,
        block_names=acc.block_names or [],
        state_names=acc.state_names or [],
        skew=acc.get("skew"),
        cka=acc.get("cka"),
        spectra=acc.get("spectra"),
        effective_rank=acc.get("effective_rank"),
        subspace=acc.get("subspace"),
        routing=routing,
        coefficients=acc.get("coefficients") if isinstance(model.topology, Combination) else None,
        attention=attention,
        attention_loops=list(acc.loops) if attention is not None else [],
        attention_chunk=[chunk[t] for t in acc.loops] if attention is not None else [],
        attention_window=[lam_window(1.0 / chunk[t], s.lam_gamma) for t in acc.loops]
        if attention is not None
        else [],
        token_index=s.token_index,
        cka_positions=L if acc.positions is None else int(acc.positions.numel()),
        seconds=seconds,
    )
