"""Diagnostic metrics for recursive (looped) transformers.

Pure, batched torch functions (no Python loops over samples, states or heads) that
reproduce the diagnostics of

* **MeSH** (Yu et al., "MeSH: Memory-as-State-Highways for Recursive Transformers"):
  computation skew (Fig. 1a / Fig. 3), pairwise CKA between hidden states
  (Fig. 1b / Fig. 4), normalised singular spectra (Fig. 1c / Fig. 5), the shared
  subspace analysis (App. E.8, Fig. 10) and the router-derived state composition of
  Eq. 7 (App. D, App. F, Fig. 11b);
* **SpiralFormer** (Sec. 4.1, App. I.1): key-marginal entropy, Local Attention Mass
  (LAM) and the selection of "dynamic heads".

Conventions shared by every function
-----------------------------------
* A *state* is a hidden-state matrix ``h in R^{L x D}`` (sequence x hidden), exactly as
  in the MeSH figures ("hidden state matrices h in R^{seq x dim}").  Functions accept
  arbitrary leading batch dimensions (``[..., L, D]``) so that all 500 samples (or
  all loop states) are processed in one call; the papers then report the mean (and
  std) over samples.
* Representation metrics (skew, CKA, spectra, effective rank, shared subspace) are
  computed **and returned in float64** (inputs are promoted).  Attention probes are
  computed in float32 (float64 inputs stay float64) because attention tensors are
  large and the probes are sums of probabilities.
* Quantities that are mathematically undefined for degenerate inputs (e.g. a
  constant state in CKA, a zero matrix for the normalised spectrum) come out as
  NaN instead of silently being replaced; use ``torch.nanmean`` when aggregating.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "computation_skew",
    "pairwise_sq_distances",
    "median_distance",
    "gram_linear",
    "gram_rbf",
    "center_gram",
    "cka",
    "cka_matrix",
    "normalized_spectrum",
    "effective_rank",
    "shared_subspace_variance",
    "key_marginal_entropy",
    "local_attention_mass",
    "lam_window",
    "cross_loop_range",
    "dynamic_heads",
    "minmax_normalize",
    "mesh_state_composition",
    "state_composition_labels",
]

Kernel = Literal["rbf", "linear"]


def _f64(x: Tensor) -> Tensor:
    return x.to(torch.float64)


def _attn_float(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float64 else x.to(torch.float32)


# ---------------------------------------------------------------------------
# Computation skew (MeSH Fig. 1a / Fig. 3)
# ---------------------------------------------------------------------------


def computation_skew(h_in: Tensor, h_out: Tensor) -> Tensor:
    """Relative update magnitude of one computational block, per sample.

    MeSH Fig. 1a and Fig. 3: for a block ``f`` mapping ``h -> f(h)``,

        skew = 2 ||f(h) - h||_F / (||f(h)||_F + ||h||_F),

    with the Frobenius norm taken over each sample's ``[L, D]`` state matrix.  The
    value lies in ``[0, 2]``: 0 for the identity, 2 for ``f(h) = -h``.  The papers
    plot the mean and std over 500 samples per block (prelude, 1st f_core, ...,
    coda).  Which tensors play ``h`` and ``f(h)`` for a block is the caller's choice
    (e.g. ``h_emb -> f_pre(h_emb)`` for the prelude, ``h^(t) -> h^(t+1)`` for a core
    iteration).

    Args:
        h_in: block input ``h``, shape ``[..., L, D]`` (typically ``[N, L, D]``).
        h_out: block output ``f(h)``, same shape as ``h_in``.

    Returns:
        float64 tensor of shape ``[...]`` (``[N]`` for ``[N, L, D]`` inputs).  NaN
        where both norms are zero.
    """
    if h_in.shape != h_out.shape:
        raise ValueError(f"h_in {tuple(h_in.shape)} and h_out {tuple(h_out.shape)} must match")
    if h_in.dim() < 2:
        raise ValueError("states must have shape [..., L, D]")
    x, y = _f64(h_in), _f64(h_out)
    diff = torch.linalg.matrix_norm(y - x, ord="fro")
    denom = torch.linalg.matrix_norm(y, ord="fro") + torch.linalg.matrix_norm(x, ord="fro")
    return 2.0 * diff / denom


# ---------------------------------------------------------------------------
# CKA (MeSH Fig. 1b / Fig. 4; Kornblith et al. 2019)
# ---------------------------------------------------------------------------


def pairwise_sq_distances(X: Tensor) -> Tensor:
    """Squared Euclidean distances between the rows of ``X``.

    Args:
        X: ``[..., n, d]``.

    Returns:
        float64 ``[..., n, n]``, symmetric, exactly zero on the diagonal, clamped at 0.
    """
    X = _f64(X)
    sq = (X * X).sum(-1)
    d2 = sq.unsqueeze(-1) + sq.unsqueeze(-2) - 2.0 * (X @ X.transpose(-1, -2))
    d2 = d2.clamp_min(0.0)
    n = X.shape[-2]
    eye = torch.eye(n, dtype=torch.bool, device=X.device)
    return d2.masked_fill(eye, 0.0)


def _median_lastdim(x: Tensor) -> Tensor:
    """Exact median along the last dim (mean of the two middle values if even)."""
    s = x.sort(dim=-1).values
    m = s.shape[-1]
    return 0.5 * (s[..., (m - 1) // 2] + s[..., m // 2])


def median_distance(X: Tensor, sq_dist: Tensor | None = None) -> Tensor:
    """Median Euclidean distance over the ``n(n-1)/2`` distinct pairs of rows.

    Args:
        X: ``[..., n, d]`` with ``n >= 2``.
        sq_dist: optional precomputed :func:`pairwise_sq_distances` of ``X``.

    Returns:
        float64 ``[...]``.
    """
    n = X.shape[-2]
    if n < 2:
        raise ValueError("median distance needs at least two rows")
    d2 = pairwise_sq_distances(X) if sq_dist is None else sq_dist
    iu = torch.triu_indices(n, n, offset=1, device=d2.device)
    pairs = d2[..., iu[0], iu[1]]
    # median of distances (not of squared distances): for an even number of pairs the
    # two middle distances are averaged.
    return _median_lastdim(pairs.sqrt())


def gram_linear(X: Tensor) -> Tensor:
    """Linear-kernel Gram matrix ``K = X X^T`` (Kornblith et al. 2019, linear CKA).

    Args:
        X: ``[..., n, d]``.

    Returns:
        float64 ``[..., n, n]``.
    """
    X = _f64(X)
    return X @ X.transpose(-1, -2)


def gram_rbf(X: Tensor, sigma: float | Tensor | None = None, sigma_frac: float = 1.0) -> Tensor:
    """RBF-kernel Gram matrix ``K_ij = exp(-||x_i - x_j||^2 / (2 sigma^2))``.

    Bandwidth (MeSH Fig. 1b/4 use "CKA with an RBF kernel" without stating sigma):
    when ``sigma`` is ``None`` we use the median heuristic of Kornblith et al. (2019,
    Sec. 3 "RBF CKA": "we selected sigma as a fraction of the median distance between
    examples"), i.e. ``sigma = sigma_frac * median_{i<j} ||x_i - x_j||``, computed
    separately for every matrix in the batch.  Two deliberate details:

    * the median is taken over the ``n(n-1)/2`` *distinct* pairs; the reference code of
      Kornblith et al. takes ``np.median`` of the full ``n x n`` squared-distance matrix
      (zero diagonal included), which biases sigma slightly down for small ``n``;
    * with the data-dependent sigma the kernel (hence CKA) is invariant to isotropic
      scaling and orthogonal transforms of ``X``, as linear CKA is.

    ``sigma_frac=1.0`` is the default of the reference implementation (``threshold=1.0``).

    Args:
        X: ``[..., n, d]``.
        sigma: explicit bandwidth (scalar or ``[...]`` tensor); overrides the heuristic.
        sigma_frac: fraction of the median distance used when ``sigma`` is ``None``.

    Returns:
        float64 ``[..., n, n]``.
    """
    d2 = pairwise_sq_distances(X)
    if sigma is None:
        sig = sigma_frac * median_distance(X, sq_dist=d2)
    else:
        sig = torch.as_tensor(sigma, dtype=torch.float64, device=d2.device)
    sig = sig.clamp_min(torch.finfo(torch.float64).tiny)
    two_sig2 = (2.0 * sig * sig)[..., None, None]
    return torch.exp(-d2 / two_sig2)


def center_gram(K: Tensor) -> Tensor:
    """Double-centre Gram matrices, ``H K H`` with ``H = I - 11^T / n`` (batched)."""
    return K - K.mean(-1, keepdim=True) - K.mean(-2, keepdim=True) + K.mean((-2, -1), keepdim=True)


def _gram(X: Tensor, kernel: Kernel, sigma_frac: float) -> Tensor:
    if kernel == "rbf":
        return gram_rbf(X, sigma_frac=sigma_frac)
    if kernel == "linear":
        return gram_linear(X)
    raise ValueError(f"unknown kernel {kernel!r}; expected 'rbf' or 'linear'")


def cka(X: Tensor, Y: Tensor, kernel: Kernel = "rbf", sigma_frac: float = 1.0) -> Tensor:
    """Centered Kernel Alignment between two representations of the same ``n`` tokens.

    Kornblith et al. (2019), Eq. (3)-(4), with the (biased) HSIC estimator
    ``HSIC(K, L) = tr(K H L H) / (n - 1)^2`` (the normaliser cancels):

        CKA(K, L) = HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L)).

    MeSH Fig. 1b / Fig. 4 use the RBF kernel on per-sample state matrices
    ``h in R^{seq x dim}`` and average over 500 samples.  See :func:`gram_rbf` for the
    bandwidth convention.

    Args:
        X: ``[..., n, d1]``.
        Y: ``[..., n, d2]`` (same leading dims and ``n``; feature dims may differ).
        kernel: ``"rbf"`` (MeSH default) or ``"linear"``.
        sigma_frac: RBF bandwidth as a fraction of the median pairwise distance.

    Returns:
        float64 ``[...]`` in ``[0, 1]``; NaN if either centred Gram is zero
        (e.g. a constant representation).
    """
    if X.shape[:-1] != Y.shape[:-1]:
        raise ValueError(f"X {tuple(X.shape)} and Y {tuple(Y.shape)} must share [..., n]")
    Kc = center_gram(_gram(X, kernel, sigma_frac))
    Lc = center_gram(_gram(Y, kernel, sigma_frac))
    hsic_xy = (Kc * Lc).sum((-2, -1))
    hsic_xx = (Kc * Kc).sum((-2, -1))
    hsic_yy = (Lc * Lc).sum((-2, -1))
    return hsic_xy / torch.sqrt(hsic_xx * hsic_yy)


def cka_matrix(
    states: Tensor | Sequence[Tensor],
    kernel: Kernel = "rbf",
    sigma_frac: float = 1.0,
) -> Tensor:
    """All-pairs CKA between ``S`` states in one batched computation (MeSH Fig. 1b / 4).

    The ``S`` centred Gram matrices are built in one batch, flattened to
    ``F in R^{S x n^2}``; ``HSIC_ij = <Kc_i, Kc_j>_F`` is then a single batched
    matmul ``F F^T`` (a sum of element-wise products), and
    ``CKA_ij = HSIC_ij / sqrt(HSIC_ii HSIC_jj)``.

    Args:
        states: ``[..., S, n, d]`` (e.g. ``[N, S, L, D]`` for N samples: pass the
            states ``h_emb, h^(0), ..., h^(K), h_out`` stacked on dim ``-3``), or a
            sequence of ``S`` tensors ``[..., n, d_s]`` (feature dims may differ).
        kernel: ``"rbf"`` (default, as in MeSH) or ``"linear"``.
        sigma_frac: RBF bandwidth as a fraction of the median distance (per state).

    Returns:
        float64 ``[..., S, S]``, symmetric with unit diagonal (NaN rows/cols for
        constant states).  Average over the sample dim to get the paper's heatmap.
    """
    if isinstance(states, Tensor):
        if states.dim() < 3:
            raise ValueError("states must have shape [..., S, n, d]")
        grams = _gram(states, kernel, sigma_frac)  # [..., S, n, n]
    else:
        grams = torch.stack([_gram(s, kernel, sigma_frac) for s in states], dim=-3)
    Kc = center_gram(grams)
    F = Kc.flatten(-2)  # [..., S, n^2]
    hsic = F @ F.transpose(-1, -2)  # [..., S, S]
    norm = torch.diagonal(hsic, dim1=-2, dim2=-1).sqrt()
    return hsic / (norm.unsqueeze(-1) * norm.unsqueeze(-2))


# ---------------------------------------------------------------------------
# Spectra (MeSH Fig. 1c / Fig. 5)
# ---------------------------------------------------------------------------


def _singular_values(X: Tensor, center: bool) -> Tensor:
    if X.dim() < 2:
        raise ValueError("X must have shape [..., n, d]")
    X = _f64(X)
    if center:
        X = X - X.mean(-2, keepdim=True)
    return torch.linalg.svdvals(X)


def normalized_spectrum(X: Tensor, k: int = 50, center: bool = False) -> Tensor:
    """Top-``k`` normalised singular values ``sigma_i / sigma_0`` of state matrices.

    MeSH Fig. 1c / Fig. 5: "the top 50 normalized singular values (sigma_i / sigma_0)
    for each hidden state matrix on a logarithmic Y-axis"; lines/bands are the mean and
    std over 500 samples, so pass ``[N, L, D]`` and aggregate over dim 0.  The paper
    does not centre the state matrix, hence ``center=False`` by default.

    Args:
        X: ``[n, d]`` or batched ``[..., n, d]``.
        k: number of values returned; if ``min(n, d) < k`` the tail is padded with 0.
        center: subtract the per-matrix row mean (token mean) before the SVD.

    Returns:
        float64 ``[..., k]``, first entry 1, non-increasing.  NaN for an all-zero matrix.
    """
    s = _singular_values(X, center)
    r = s.shape[-1]
    s = s / s[..., :1]
    if r >= k:
        return s[..., :k]
    pad = s.new_zeros((*s.shape[:-1], k - r))
    return torch.cat([s, pad], dim=-1)


def effective_rank(X: Tensor, center: bool = False) -> Tensor:
    """Effective rank of Roy & Vetterli (2007): ``exp(H(p))``, ``p_i = sigma_i / sum_j sigma_j``.

    Used as a scalar summary of the spectral decay MeSH Fig. 1c / 5 visualise
    ("a proxy for their effective rank").  Equals ``rank`` for a matrix with equal
    non-zero singular values, 1 for a rank-1 matrix, and is close to ``d`` for an
    ``n x d`` isotropic Gaussian with ``n >> d``.

    Args:
        X: ``[..., n, d]``.
        center: subtract the per-matrix token mean first.

    Returns:
        float64 ``[...]``; NaN for an all-zero matrix.
    """
    s = _singular_values(X, center)
    p = s / s.sum(-1, keepdim=True)
    H = -torch.special.xlogy(p, p).sum(-1)
    return torch.exp(H)


# ---------------------------------------------------------------------------
# Shared subspace (MeSH App. E.8, Fig. 10)
# ---------------------------------------------------------------------------


def shared_subspace_variance(states: Tensor, k_max: int | None = None, center: bool = True) -> Tensor:
    """Cumulative variance of each loop state explained by the *shared* principal basis.

    MeSH App. E.8 / Fig. 10: "We first define a 'Shared Subspace' by performing SVD on
    the concatenated hidden states of all loop iterations (h^(0), ..., h^(3)) and using
    the top singular directions as the shared basis. The plots then show the cumulative
    variance of each individual state when projected onto this shared subspace."

    Concretely, per sample: each state ``X_s in R^{n x d}`` is centred by its own token
    mean (``center=True``; the concatenation is then centred too), the states are
    concatenated along tokens into ``[S n, d]`` and its right singular vectors
    ``v_1, v_2, ...`` (descending singular value) form the shared basis.  The output is

        C[s, k-1] = sum_{j<=k} ||X_s v_j||^2 / ||X_s||_F^2 ,

    which is non-decreasing in ``k`` and reaches 1 once the basis spans the row space of
    ``X_s``.  Every state in a common ``r``-dimensional subspace reaches 1 at ``k = r``.

    Args:
        states: ``[..., S, n, d]`` (batch of samples first; the ``S`` loop states on
            dim ``-3``).
        k_max: number of basis directions reported (default ``d``).  Beyond the
            ``min(S n, d)`` available directions the curve is constant (padded with its
            last value: further directions are orthogonal to all the data).
        center: centre each state by its token mean (variance rather than raw energy).

    Returns:
        float64 ``[..., S, k_max]``; NaN for a state with zero variance.
    """
    if states.dim() < 3:
        raise ValueError("states must have shape [..., S, n, d]")
    X = _f64(states)
    if center:
        X = X - X.mean(-2, keepdim=True)
    *lead, S, n, d = X.shape
    concat = X.reshape(*lead, S * n, d)
    Vh = torch.linalg.svd(concat, full_matrices=False).Vh  # [..., r, d], r = min(S n, d)
    proj = X @ Vh.transpose(-1, -2).unsqueeze(-3)  # [..., S, n, r]
    energy = (proj * proj).sum(-2)  # [..., S, r]
    total = (X * X).sum((-2, -1))  # [..., S]
    cum = energy.cumsum(-1) / total.unsqueeze(-1)
    k = d if k_max is None else int(k_max)
    r = cum.shape[-1]
    if k <= r:
        return cum[..., :k]
    return torch.cat([cum, cum[..., -1:].expand(*cum.shape[:-1], k - r)], dim=-1)


# ---------------------------------------------------------------------------
# Attention probes (SpiralFormer Sec. 4.1, App. I.1)
# ---------------------------------------------------------------------------


def _query_positions(Lq: int, Lk: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Absolute key-axis position of each query (right-aligned when Lq < Lk) and key index."""
    if Lq > Lk:
        raise ValueError(f"expected Lq <= Lk for causal attention, got Lq={Lq}, Lk={Lk}")
    q = torch.arange(Lq, device=device) + (Lk - Lq)
    k = torch.arange(Lk, device=device)
    return q[:, None], k[None, :]


def key_marginal_entropy(attn: Tensor, causal: bool = True) -> Tensor:
    """Normalised key-marginal entropy per head (SpiralFormer Sec. 4.1).

    For a head's attention matrix ``A in R^{L x L}`` (rows = queries, sum to 1) the
    key marginal is formed by averaging over queries,

        p(k) propto (1/L) sum_q A(q, k),     k = 0..L-1,

    (re-normalised to sum to 1) and the entropy is normalised by the log of the number
    of keys:

        H = -sum_k p(k) log p(k) / log L   in [0, 1].

    Lower = concentrated key usage (selective), higher = diffuse (global).  The paper
    computes the metric per sequence and then averages each head's value over 500
    sequences; this function returns the per-sequence values.

    Args:
        attn: ``[..., H, Lq, Lk]`` attention probabilities at the loop-native length
            (``Lq == Lk == L_t`` in the paper; for ``Lq < Lk`` queries are taken to be
            the last ``Lq`` positions, as with a KV cache).
        causal: zero the entries above the causal diagonal (``k > q``) before averaging
            (a no-op for a proper causal attention matrix; guards against padded or
            garbage upper triangles).  Rows are not re-normalised; the marginal is.
            The normaliser stays ``log Lk`` as in the paper.

    Returns:
        ``[..., H]`` (float32, or float64 for float64 input).  Defined as 0 when
        ``Lk == 1``.
    """
    A = _attn_float(attn)
    Lq, Lk = A.shape[-2], A.shape[-1]
    if causal:
        qpos, kpos = _query_positions(Lq, Lk, A.device)
        A = A.masked_fill(kpos > qpos, 0.0)
    p = A.mean(-2)
    p = p / p.sum(-1, keepdim=True)
    ent = -torch.special.xlogy(p, p).sum(-1)
    if Lk <= 1:
        return torch.zeros_like(ent)
    return ent / math.log(Lk)


def lam_window(resolution_ratio: float, gamma: float = 32.0) -> int:
    """SpiralFormer Eq. (23): window size ``M_t = ceil(gamma * r_t)`` with ``gamma = 32``."""
    # round first to avoid ceil(4.000000000001) == 5 from float noise
    return int(math.ceil(round(gamma * resolution_ratio, 9)))


def local_attention_mass(attn: Tensor, window: int, include_self: bool = False) -> Tensor:
    """Local Attention Mass (LAM) per head (SpiralFormer Sec. 4.1, Eq. 23).

    With the causal local backward window ``W(q) = {k : q - M <= k < q}`` (``M`` =
    ``window``, e.g. :func:`lam_window`),

        LAM = (1/L) sum_q sum_{k in W(q)} A(q, k).

    Note that the paper's window is strictly backward (``k < q``): the diagonal
    (self-attention to the current token) is *not* counted, so the first query (whose
    only key is itself) always contributes 0 and ``LAM <= (L - 1)/L`` for any causal
    attention.  ``include_self=True`` widens the window to ``q - M <= k <= q``, under
    which any attention supported within ``M`` tokens back (diagonal included) scores
    exactly 1.

    Args:
        attn: ``[..., H, Lq, Lk]`` attention probabilities (``Lq < Lk``: queries are
            the last ``Lq`` key positions).
        window: ``M >= 0``.
        include_self: also count the diagonal ``k = q`` (not the paper's definition).

    Returns:
        ``[..., H]`` in ``[0, 1]`` (float32, or float64 for float64 input), the
        per-sequence value; the paper averages it over sequences per head.
    """
    if window < 0:
        raise ValueError("window must be >= 0")
    A = _attn_float(attn)
    Lq, Lk = A.shape[-2], A.shape[-1]
    qpos, kpos = _query_positions(Lq, Lk, A.device)
    upper = kpos <= qpos if include_self else kpos < qpos
    mask = (kpos >= qpos - window) & upper
    return (A * mask.to(A.dtype)).sum(-1).mean(-1)


def cross_loop_range(per_loop_stat: Tensor) -> Tensor:
    """``Delta m = max_t m^(t) - min_t m^(t)`` over loops (SpiralFormer App. I.1).

    Args:
        per_loop_stat: ``[T, ...]`` head-wise metric per loop (already averaged over
            sequences, as in the paper).

    Returns:
        ``[...]`` cross-loop range per head.
    """
    return per_loop_stat.amax(0) - per_loop_stat.amin(0)


def dynamic_heads(per_loop_stat: Tensor, frac: float = 0.4) -> Tensor:
    """Indices of the "dynamic heads": top ``frac`` of heads by cross-loop range.

    SpiralFormer Sec. 4.1 / App. I.1: "A head (l, h) is called dynamic under metric m
    if its Delta m_{l,h} is within the top 40% among all heads in the loop-shared
    block (ranked separately for each metric)", with
    ``Delta m = max_t m^(t) - min_t m^(t)`` computed after averaging over sequences.

    The number selected is ``ceil(frac * n_heads)`` (so "within the top 40%" keeps a
    head whose rank fraction is < 0.4, e.g. 4 of 10, 5 of 12).  Ties are broken by the
    lower flat index; heads with a non-finite range are ranked last.

    Args:
        per_loop_stat: ``[T, n_heads_total]`` or ``[T, n_layers, n_heads]`` (trailing
            dims are flattened row-major, so index ``i`` is ``(i // H, i % H)``).
        frac: fraction of heads selected (paper: 0.4).

    Returns:
        int64 ``[ceil(frac * n)]`` flat head indices ordered by decreasing range.
    """
    if per_loop_stat.dim() < 2:
        raise ValueError("per_loop_stat must have shape [T, n_heads...]")
    if not 0.0 <= frac <= 1.0:
        raise ValueError("frac must be in [0, 1]")
    stat = per_loop_stat.reshape(per_loop_stat.shape[0], -1)
    rng = cross_loop_range(stat)
    rng = torch.where(torch.isfinite(rng), rng, torch.full_like(rng, -float("inf")))
    n = rng.numel()
    n_sel = min(n, math.ceil(frac * n - 1e-9))
    order = torch.sort(rng, descending=True, stable=True).indices
    return order[:n_sel]


def minmax_normalize(x: Tensor, eps: float = 1e-12) -> Tensor:
    """Min-max normalise to ``[0, 1]`` over all entries (SpiralFormer App. I.1, Fig. 5).

    ``x' = (x - min x) / (max x - min x)``; "if max(x) - min(x) is numerically
    negligible (or values are non-finite), we set all entries to 0".
    """
    x = x.to(torch.float64) if not x.is_floating_point() else x
    if not bool(torch.isfinite(x).all()):
        return torch.zeros_like(x)
    lo, hi = x.min(), x.max()
    if float(hi - lo) <= eps:
        return torch.zeros_like(x)
    return (x - lo) / (hi - lo)


# ---------------------------------------------------------------------------
# MeSH state composition (MeSH Eq. 6-7, Algorithm 2, App. F Fig. 11b)
# ---------------------------------------------------------------------------


def mesh_state_composition(write: Tensor, read: Tensor) -> Tensor:
    """Coefficients ``alpha`` of MeSH Eq. 7: contribution of each source to each state.

    Derived by unrolling Algorithm 2 (MeSH App. C) with linear bookkeeping of the buffer.
    Router index ``j = 0..K`` corresponds to MeSH step ``t = j - 1`` (``j = 0`` is the
    transitional prelude step ``t = -1``).  Sources are
    ``[h_emb, h_m^(-1), h_m^(0), ..., h_m^(K-1)]`` (``K + 2`` columns), states are
    ``h^(0..K)`` (``K + 1`` rows).

    * ``M^(0)``: slot 0 holds ``h_emb`` (coefficient 1), other slots 0 (Eq. 2).
    * Step ``j`` writes its source ``s = j + 1`` (``h_m^(j-1)``; the prelude output for
      ``j = 0``) with ``w_write^(j)`` (Eq. 5 / Alg. 2 lines 11, 20), so slot ``b`` holds
      source ``s`` with weight ``write[s-1, b]`` for every step ``j >= s - 1``.
    * Step ``j`` then reads ``h^(j) = sum_b m_b w_read,b^(j)`` (Alg. 2 lines 13, 22).

    Hence, token-wise (the weights are per position),

        alpha[j, 0]     = read[j, 0]                                    (h_emb)
        alpha[j, s>=1]  = [s - 1 <= j] * sum_b write[s-1, b] read[j, b]   (h_m^(s-2))

    i.e. ``alpha = [read[..., :1] | tril(read @ write^T)]`` - one batched matmul over
    slots.  The diagonal ``sum_b w_write,b^(t) w_read,b^(t)`` is the "gating factor" of
    Eq. 6.  With softmax routers rows need not sum to 1.

    Args:
        write: ``[K+1, ..., B]`` write weights ``w_write^(-1..K-1)`` (e.g.
            ``[K+1, N, L, B]`` for N sequences of length L).
        read: ``[K+1, ..., B]`` read weights, same shape.

    Returns:
        ``[..., K+1, K+2]`` (dtype of the inputs, at least float32): row ``t`` is state
        ``h^(t)``, columns are ``[h_emb, h_m^(-1), h_m^(0), ..., h_m^(K-1)]``.  Average
        over tokens/samples for the Fig. 11b heatmap.
    """
    if write.shape != read.shape:
        raise ValueError(f"write {tuple(write.shape)} and read {tuple(read.shape)} must match")
    if write.dim() < 2:
        raise ValueError("router weights must have shape [K+1, ..., B]")
    dtype = torch.promote_types(torch.promote_types(write.dtype, read.dtype), torch.float32)
    w = write.to(dtype).movedim(0, -2)  # [..., K+1, B]
    r = read.to(dtype).movedim(0, -2)  # [..., K+1, B]
    gain = torch.tril(r @ w.transpose(-1, -2))  # [..., K+1 (state), K+1 (written source)]
    return torch.cat([r[..., :1], gain], dim=-1)


def state_composition_labels(K: int) -> tuple[list[str], list[str]]:
    """Row/column labels (matplotlib mathtext) for :func:`mesh_state_composition`.

    Returns:
        ``(rows, cols)`` with rows ``h^(0..K)`` and columns
        ``[h_emb, h_m^(-1), ..., h_m^(K-1)]``.
    """
    rows = [rf"$h^{{({t})}}$" for t in range(K + 1)]
    cols = [r"$h_{\mathrm{emb}}$"] + [rf"$h_m^{{({i})}}$" for i in range(-1, K)]
    return rows, cols
