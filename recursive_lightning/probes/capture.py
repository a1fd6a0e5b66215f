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
  sample (:func:`metrics.gram_rbf`).
* **Singular spectra / effective rank** (MeSH Fig. 5) - per sample and state, the top-``k``
  normalised singular values ``sigma_i / sigma_0`` of the un-centred ``[L, d]`` matrix, and its
  effective rank (Roy & Vetterli).
* **Shared subspace** (MeSH App. E.8, Fig. 10) - per sample, on the loop states
  ``h^(0..K)`` (:func:`metrics.shared_subspace_variance`).
* **MeSH routing** (MeSH App. F, Fig. 11) - per sample, the write/read weights of every step
  ``t = -1..K-1`` and slot averaged over the sequence and at position ``token_index``, and the
  Eq. 7 state composition (:func:`metrics.mesh_state_composition`, token-wise, then averaged the
  same way).
* **Combination coefficients** (static/dynamic topologies, MeSH App. E.3) - per sample, the
  sequence mean of the 4 coefficients ``(core, residual, anchor, anchor_emb)`` of every step.
* **Attention probes** (SpiralFormer Sec. 4.1) - for layouts with a loop-shared core, per sample,
  loop, core layer and head: the key-marginal entropy and the Local Attention Mass of the causal
  attention map at the loop-native length ``L_t`` (window ``M_t = ceil(32 r_t)``, Eq. 23).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from recursive_lightning.model.recursive.mesh import MeSH
from recursive_lightning.model.recursive.model import RecursiveLM, Trace
from recursive_lightning.model.recursive.topology import Combination
from recursive_lightning.probes import metrics as M

__all__ = [
    "ProbeSettings",
    "Capture",
    "capture",
    "attention_loops",
    "COEFFICIENT_TERMS",
    "cka_matrix",
    "singular_values",
    "shared_subspace_variance",
]

COEFFICIENT_TERMS = ("core", "residual", "anchor", "anchor_emb")  # order of Combination.INIT


@dataclass
class ProbeSettings:
    """Knobs of the probes (defaults follow the papers)."""

    kernel: str = "rbf"  # CKA kernel (MeSH: RBF)
    sigma_frac: float = 1.0  # RBF bandwidth = sigma_frac * median pairwise distance
    cka_tokens: int | None = None  # None/0: all tokens of each sequence
    spectrum_k: int = 50  # MeSH Fig. 5: top 50
    subspace_k: int | None = None  # shared-subspace curve length; default min(d, 128)
    token_index: int | None = None  # None: 27 (MeSH Fig. 11's case-study token), clipped to L - 1
    attention: bool = True  # attention probes (only for layouts with a loop-shared core)
    batch_size: int = 16
    lam_gamma: float = 32.0  # SpiralFormer Eq. 23
    max_gram_bytes: int = 256 * 2**20  # CKA is computed in sample chunks whose Grams fit in this


@dataclass
class Capture:
    """Per-sample probe statistics (float64, CPU); sample index first."""

    n_samples: int
    seq_len: int
    d_model: int
    n_loop: int
    block_names: list[str]  # trace names: prelude, core 1..K, coda (zero-layer blocks dropped)
    state_names: list[str]  # h_emb, h(0) .. h(K), h_out
    skew: Tensor  # [N, blocks]
    cka: Tensor  # [N, S, S]
    spectra: Tensor  # [N, S, k]
    effective_rank: Tensor  # [N, S]
    subspace: Tensor | None = None  # [N, K+1, k] over h(0..K); None without loop steps
    routing: dict[str, Tensor] | None = None  # MeSH: write/read/comp x seq/tok, [N, K+1, B or K+2]
    coefficients: Tensor | None = None  # static/dynamic: [N, K, 4]
    attention: dict[str, Tensor] | None = None  # entropy/lam: [N, T, layers, heads]
    attention_loops: list[int] = field(default_factory=list)  # loop step index of each T entry
    attention_chunk: list[int] = field(default_factory=list)  # chunk size g_t per T entry
    attention_window: list[int] = field(default_factory=list)  # LAM window M_t per T entry
    token_index: int = 0
    cka_positions: int = 0  # tokens per sample used for CKA
    seconds: float = 0.0


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


# ---------------------------------------------------------------------------
# Fast equivalents of metrics.normalized_spectrum / effective_rank / shared_subspace_variance
# ---------------------------------------------------------------------------
# The reference functions in ``metrics`` use an SVD of every [L, d] state matrix; on CPU this
# dominates probing (about 10x the forward pass).  The same quantities follow from the
# eigen-decomposition of the small Gram matrix (d x d, or L x L if L < d) at a fraction of the
# cost.  Singular values come out with an absolute error of about 1e-8 sigma_0 (float64), far below
# what the log-scale spectra resolve; tests check agreement with the reference implementation.


def singular_values(X: Tensor) -> Tensor:
    """Singular values (descending, float64) of ``X [..., n, d]`` via the eigenvalues of its Gram."""
    X = X.to(torch.float64)
    n, d = X.shape[-2:]
    G = X.mT @ X if n >= d else X @ X.mT
    return torch.linalg.eigvalsh(G).flip(-1).clamp_min(0.0).sqrt()


def spectrum_from_singular_values(sv: Tensor, k: int = 50) -> Tensor:
    """``sigma_i / sigma_0`` for the top ``k`` values, zero-padded (= ``metrics.normalized_spectrum``)."""
    norm = sv / sv[..., :1]
    if norm.shape[-1] < k:
        norm = torch.cat([norm, norm.new_zeros(*norm.shape[:-1], k - norm.shape[-1])], dim=-1)
    return norm[..., :k]


def effective_rank_from_singular_values(sv: Tensor) -> Tensor:
    """``exp(H(sigma / sum sigma))`` (= ``metrics.effective_rank``)."""
    p = sv / sv.sum(-1, keepdim=True)
    return torch.exp(-torch.special.xlogy(p, p).sum(-1))


def shared_subspace_variance(states: Tensor, k_max: int | None = None, center: bool = True) -> Tensor:
    """Same result as :func:`metrics.shared_subspace_variance` (MeSH App. E.8) from Gram matrices.

    With ``G_s = X_s^T X_s`` and ``G = sum_s G_s`` (the Gram of the token-concatenation), the shared
    basis ``v_j`` are the eigenvectors of ``G`` (descending eigenvalue = squared singular value of the
    concatenation) and ``||X_s v_j||^2 = v_j^T G_s v_j``.
    """
    X = states.to(torch.float64)
    if center:
        X = X - X.mean(-2, keepdim=True)
    Gs = X.mT @ X  # [..., S, d, d]
    _, V = torch.linalg.eigh(Gs.sum(-3))  # ascending
    V = V.flip(-1).unsqueeze(-3)  # [..., 1, d, d] columns = shared directions, descending
    energy = ((Gs @ V) * V).sum(-2)  # [..., S, d]
    total = torch.diagonal(Gs, dim1=-2, dim2=-1).sum(-1)
    cum = energy.cumsum(-1) / total.unsqueeze(-1)
    d = cum.shape[-1]
    k = d if k_max is None else int(k_max)
    if k <= d:
        return cum[..., :k]
    return torch.cat([cum, cum[..., -1:].expand(*cum.shape[:-1], k - d)], dim=-1)


def cka_matrix(states: Tensor, kernel: str = "rbf", sigma_frac: float = 1.0) -> Tensor:
    """Same result as :func:`metrics.cka_matrix` for ``states [..., S, n, d]``, with fewer passes.

    Squared distances come from the Gram ``X X^T`` (in place), the median pairwise distance of the RBF
    bandwidth from two ``kthvalue`` selections instead of a full sort, and the kernel and its
    double-centring are formed in place; ``HSIC_ij = <Kc_i, Kc_j>_F`` is one batched matmul.
    """
    X = states.to(torch.float64)
    K = X @ X.mT  # [..., S, n, n]
    n = K.shape[-1]
    if kernel == "rbf":
        sq = K.diagonal(dim1=-2, dim2=-1).clone()
        d2 = K.mul_(-2.0).add_(sq.unsqueeze(-1)).add_(sq.unsqueeze(-2)).clamp_min_(0.0)
        d2.diagonal(dim1=-2, dim2=-1).zero_()
        iu = torch.triu_indices(n, n, offset=1, device=d2.device)
        pairs = d2[..., iu[0], iu[1]]  # [..., S, n(n-1)/2] squared distances
        m = pairs.shape[-1]
        lo = pairs.kthvalue((m - 1) // 2 + 1, dim=-1).values
        hi = pairs.kthvalue(m // 2 + 1, dim=-1).values if m % 2 == 0 else lo
        del pairs
        sigma = (sigma_frac * 0.5 * (lo.sqrt() + hi.sqrt())).clamp_min(torch.finfo(torch.float64).tiny)
        K = d2.div_((-2.0 * sigma * sigma)[..., None, None]).exp_()
    elif kernel != "linear":
        raise ValueError(f"unknown kernel {kernel!r}; expected 'rbf' or 'linear'")
    row = K.mean(-1, keepdim=True)
    col = K.mean(-2, keepdim=True)
    tot = row.mean(-2, keepdim=True)
    Kc = K.sub_(row).sub_(col).add_(tot)
    F = Kc.flatten(-2)
    hsic = F @ F.mT
    norm = torch.diagonal(hsic, dim1=-2, dim2=-1).sqrt()
    return hsic / (norm.unsqueeze(-1) * norm.unsqueeze(-2))


def _cka_chunks(states: Tensor, settings: ProbeSettings) -> Tensor:
    """Per-sample CKA matrices ``[b, S, S]`` of ``states [b, S, n, d]``, in sample chunks."""
    b, S, n, _ = states.shape
    per_sample = S * n * n * 8 * 2  # the in-place kernel matrix + the pair list for the median (float64)
    chunk = max(1, min(b, settings.max_gram_bytes // max(per_sample, 1)))
    out = [
        cka_matrix(states[i : i + chunk], kernel=settings.kernel, sigma_frac=settings.sigma_frac)
        for i in range(0, b, chunk)
    ]
    return torch.cat(out)


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
        skews = [M.computation_skew(trace.blocks[i][1], trace.blocks[i][2]) for i in self.kept]
        self.add("skew", torch.stack(skews, dim=-1))
        # 2.-4. representation metrics on the stacked states [b, S, L, d]
        states = torch.stack([h for _, h in trace.states], dim=1)
        cka_in = states if self.positions is None else states[:, :, self.positions.to(states.device)]
        self.add("cka", _cka_chunks(cka_in, s))
        sv = singular_values(states)  # [b, S, min(L, d)], one decomposition for both metrics
        self.add("spectra", spectrum_from_singular_values(sv, s.spectrum_k))
        self.add("effective_rank", effective_rank_from_singular_values(sv))
        n_loop = self.model.layout.n_loop
        if n_loop > 0:
            kmax = s.subspace_k or min(states.shape[-1], 128)
            loop_states = states[:, 1 : n_loop + 2]  # h(0) .. h(K)
            self.add("subspace", shared_subspace_variance(loop_states, k_max=kmax))
        # 5. MeSH routing and Eq. 7 composition
        if trace.routing is not None:
            w = torch.stack(trace.routing["write"])  # [K+1, b, L, B]
            r = torch.stack(trace.routing["read"])
            comp = M.mesh_state_composition(w, r)  # [b, L, K+1, K+2]
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
            ent = [M.key_marginal_entropy(a, causal=False) for a in maps]  # each [b, H]
            lam = [
                M.local_attention_mass(a, M.lam_window(1.0 / chunk[t], self.s.lam_gamma))
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
    import time

    s = settings or ProbeSettings()
    if tokens.dim() != 2 or tokens.numel() == 0:
        raise ValueError("tokens must be a non-empty [N, L] tensor")
    N, L = tokens.shape
    index = min(27, L - 1) if s.token_index is None else s.token_index
    if not -L <= index < L:
        raise ValueError(f"token_index {index} is outside a sequence of {L} tokens")
    s = ProbeSettings(**{**s.__dict__, "token_index": index % L})
    device = next(model.parameters()).device
    acc = _Accumulator(model, s, L)
    batches = [tokens[i : i + s.batch_size] for i in range(0, N, s.batch_size)]
    it: Iterable = batches
    if callable(progress):
        it = progress(batches)
    elif progress:  # a bar on a terminal, a line every 30 s in a log
        from recursive_lightning.progress import tracked

        it = tracked(batches, desc, lambda b: b.numel())
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            for batch in it:
                _, trace = model.traced(
                    batch.to(device),
                    attention={f"core{i}" for i in range(len(model.cores))} if acc.loops else False,
                )
                acc.update(trace)
                del trace
    finally:
        model.train(was_training)
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
        attention_window=[M.lam_window(1.0 / chunk[t], s.lam_gamma) for t in acc.loops]
        if attention is not None
        else [],
        token_index=s.token_index,
        cka_positions=L if acc.positions is None else int(acc.positions.numel()),
        seconds=time.perf_counter() - t0,
    )
