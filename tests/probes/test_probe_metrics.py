"""Tests of the probes' metrics (skew, CKA, spectra, shared subspace, MeSH composition, attention probes)
against explicit reference formulas, and of their figures."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recursive_lightning.probes.attention import (
    cross_loop_range,
    dynamic_heads,
    key_marginal_entropy,
    lam_window,
    local_attention_mass,
    minmax_normalize,
    plot_attention_probe,
    plot_head_heatmaps,
    plot_head_range,
)
from recursive_lightning.probes.cka import cka_matrix, plot_cka
from recursive_lightning.probes.coefficients import plot_coefficients
from recursive_lightning.probes.mela_figures import (
    plot_application_heatmaps,
    plot_memstack_change,
    plot_update_spectrum,
)
from recursive_lightning.probes.mesh import (
    mesh_state_composition,
    plot_mesh_routers,
    plot_state_composition,
    state_composition_labels,
)
from recursive_lightning.probes.skew import computation_skew, plot_skew
from recursive_lightning.probes.spectra import (
    effective_rank,
    normalized_spectrum,
    plot_spectra,
    singular_values,
)
from recursive_lightning.probes.subspace import plot_shared_subspace, shared_subspace_variance

FAST = settings(max_examples=20, deadline=None)
KERNELS = ["rbf", "linear"]


def _rand(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _orthogonal(seed: int, d: int) -> torch.Tensor:
    q, r = torch.linalg.qr(_rand(seed, d, d))
    return q * torch.sign(torch.diagonal(r))


# ---------------------------------------------------------------------------
# CKA
# ---------------------------------------------------------------------------


def _median_distance(X: torch.Tensor) -> float:
    """Median of the n(n-1)/2 distinct pairwise distances (np.median: the two middle ones averaged)."""
    d = torch.cdist(X, X, compute_mode="donot_use_mm_for_euclid_dist")
    iu = torch.triu_indices(len(X), len(X), 1)
    return float(np.median(d[iu[0], iu[1]].numpy()))


def _reference_gram(X: torch.Tensor, kernel: str, sigma: float) -> torch.Tensor:
    if kernel == "linear":
        return X @ X.T
    d = torch.cdist(X, X, compute_mode="donot_use_mm_for_euclid_dist")
    return torch.exp(-(d**2) / (2 * sigma**2))


def _reference_cka(
    X: torch.Tensor, Y: torch.Tensor, kernel: str = "rbf", sigma_frac: float = 1.0, sigma: float | None = None
) -> float:
    """Kornblith et al. (2019) Eq. 3-4: tr(K H L H) / sqrt(tr(K H K H) tr(L H L H)), RBF bandwidth
    sigma_frac x the median pairwise distance of each matrix unless ``sigma`` is given."""
    n = X.shape[0]
    H = torch.eye(n, dtype=torch.float64) - 1.0 / n
    K = H @ _reference_gram(X, kernel, sigma or sigma_frac * _median_distance(X)) @ H
    L = H @ _reference_gram(Y, kernel, sigma or sigma_frac * _median_distance(Y)) @ H
    return ((K * L).sum() / torch.sqrt((K * K).sum() * (L * L).sum())).item()


def _cka(X: torch.Tensor, Y: torch.Tensor, kernel: str = "rbf", sigma_frac: float = 1.0) -> float:
    """CKA of two matrices through :func:`cka_matrix` (features zero-padded to a common width: neither
    kernel changes)."""
    d = max(X.shape[-1], Y.shape[-1])
    pad = [torch.nn.functional.pad(Z, (0, d - Z.shape[-1])) for Z in (X, Y)]
    return cka_matrix(torch.stack(pad), kernel=kernel, sigma_frac=sigma_frac)[0, 1].item()


@FAST
@given(seed=st.integers(0, 10_000), n=st.integers(4, 24), d=st.integers(1, 12))
def test_cka_self_is_one(seed: int, n: int, d: int) -> None:
    X = _rand(seed, n, d)
    for kernel in KERNELS:
        assert _cka(X, X, kernel=kernel) == pytest.approx(1.0, abs=1e-9)
        assert torch.allclose(
            torch.diagonal(cka_matrix(X[None], kernel=kernel)), torch.ones(1, dtype=torch.float64)
        )


@FAST
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(5, 24),
    d=st.integers(2, 10),
    scale=st.floats(0.05, 20.0),
)
def test_cka_invariant_to_orthogonal_and_isotropic_scaling(seed: int, n: int, d: int, scale: float) -> None:
    X = _rand(seed, n, d)
    Y = torch.tanh(X @ _rand(seed + 1, d, d)) + 0.5 * _rand(seed + 2, n, d)
    Q = _orthogonal(seed + 3, d)
    for kernel in KERNELS:
        ref = _cka(X, Y, kernel=kernel)
        assert 0.0 <= ref <= 1.0 + 1e-9
        assert _cka(scale * X @ Q, Y, kernel=kernel) == pytest.approx(ref, abs=1e-8)
        assert _cka(X, Y @ Q / scale, kernel=kernel) == pytest.approx(ref, abs=1e-8)


def test_rbf_cka_with_fixed_sigma_is_not_scale_invariant() -> None:
    # sanity check that the invariance above comes from the median heuristic
    X, Y = _rand(0, 16, 4), _rand(1, 16, 4)
    fixed = _reference_cka(X, Y, sigma=1.0)
    assert abs(fixed - _reference_cka(10 * X, Y, sigma=1.0)) > 1e-3
    assert _reference_cka(X, Y) == pytest.approx(_reference_cka(10 * X, Y), abs=1e-9)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("n", [12, 7])  # an even and an odd number of pairs for the median
def test_cka_matrix_matches_the_reference_formula(kernel: str, n: int) -> None:
    N, S, d = 3, 4, 6
    states = _rand(7, N, S, n, d)
    states[:, 2] = states[:, 1] + 0.1 * states[:, 2]  # correlated pair
    mat = cka_matrix(states, kernel=kernel, sigma_frac=0.8)
    assert mat.shape == (N, S, S)
    assert torch.allclose(mat, mat.transpose(-1, -2))
    for b in range(N):
        for i in range(S):
            for j in range(S):
                ref = _reference_cka(states[b, i], states[b, j], kernel=kernel, sigma_frac=0.8)
                assert mat[b, i, j].item() == pytest.approx(ref, abs=1e-9)


def test_linear_cka_matches_feature_space_formula() -> None:
    # Kornblith et al. (2019) Eq. 5: ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F) on centred data
    X, Y = _rand(3, 30, 5), _rand(4, 30, 7)
    Y[:, :5] += X
    Xc, Yc = X - X.mean(0), Y - Y.mean(0)
    ref = torch.linalg.norm(Yc.T @ Xc) ** 2 / (torch.linalg.norm(Xc.T @ Xc) * torch.linalg.norm(Yc.T @ Yc))
    assert _cka(X, Y, kernel="linear") == pytest.approx(ref.item(), rel=1e-10)
    # unrelated data is far from 1
    assert _cka(_rand(5, 200, 3), _rand(6, 200, 3), kernel="linear") < 0.2


# ---------------------------------------------------------------------------
# Computation skew
# ---------------------------------------------------------------------------


def test_computation_skew_identity_negation_and_scaling() -> None:
    h = _rand(0, 5, 7, 4)
    assert torch.allclose(computation_skew(h, h), torch.zeros(5, dtype=torch.float64))
    assert torch.allclose(computation_skew(h, -h), torch.full((5,), 2.0, dtype=torch.float64))
    # f(h) = 2h: 2 * ||h|| / (2||h|| + ||h||) = 2/3
    assert torch.allclose(computation_skew(h, 2 * h), torch.full((5,), 2 / 3, dtype=torch.float64))
    # per-sample: only sample 1 is changed
    out = h.clone()
    out[1] = -out[1]
    s = computation_skew(h, out)
    assert s[1].item() == pytest.approx(2.0) and s[0].item() == pytest.approx(0.0)


# ---------------------------------------------------------------------------
# Spectra / effective rank (from the Gram's eigenvalues; checked against an SVD)
# ---------------------------------------------------------------------------


def _spectrum(X: torch.Tensor, k: int) -> torch.Tensor:
    return normalized_spectrum(singular_values(X), k)


def test_singular_values_match_svd() -> None:
    for shape in ((3, 10, 4), (2, 4, 10), (40, 40)):
        X = _rand(sum(shape), *shape)
        sv, ref = singular_values(X), torch.linalg.svdvals(X)
        torch.testing.assert_close(sv, ref, atol=1e-8 * ref[..., :1].max().item(), rtol=0)


@FAST
@given(seed=st.integers(0, 10_000), r=st.integers(1, 6), n=st.integers(8, 20), d=st.integers(8, 16))
def test_spectrum_of_rank_r_matrix(seed: int, r: int, n: int, d: int) -> None:
    X = _rand(seed, n, r) @ _rand(seed + 1, r, d)
    s = _spectrum(X, 50)
    assert s.shape == (50,)
    assert int((s > 1e-6).sum()) == r
    assert s[0].item() == pytest.approx(1.0)
    assert torch.all(s[:-1] >= s[1:] - 1e-12)


def test_spectrum_batched_and_padding() -> None:
    X = _rand(1, 3, 10, 4)
    s = _spectrum(X, 6)
    assert s.shape == (3, 6)
    assert torch.all(s[:, 4:] == 0) and torch.all(s[:, :4] > 0)
    assert torch.allclose(s[1], _spectrum(X[1], 6))
    assert _spectrum(_rand(2, 100, 80), 50).shape == (50,)


def test_effective_rank() -> None:
    # on exact singular values (singular_values' own precision: test_singular_values_match_svd)
    def erank(X: torch.Tensor) -> torch.Tensor:
        return effective_rank(torch.linalg.svdvals(X))

    d = 32
    X = _rand(0, 4000, d)
    er = erank(X).item()
    assert 0.95 * d < er <= d
    rank1 = _rand(1, 50, 1) @ _rand(2, 1, 20)
    assert erank(rank1).item() == pytest.approx(1.0, abs=1e-6)
    Q = _orthogonal(3, 10)[:, :4]  # equal singular values -> erank == rank
    assert erank(Q).item() == pytest.approx(4.0, abs=1e-9)
    batched = erank(torch.stack([X[:100], X[:1].expand(100, -1)]))  # 2nd: identical rows
    assert batched.shape == (2,)
    assert batched[1].item() == pytest.approx(1.0, abs=1e-6)


# ---------------------------------------------------------------------------
# Shared subspace
# ---------------------------------------------------------------------------


def _reference_subspace(states: torch.Tensor, k: int) -> torch.Tensor:
    """MeSH App. E.8 literally: SVD of the token-concatenation of the centred states, cumulative energy of
    each state along its right singular vectors."""
    X = states - states.mean(-2, keepdim=True)
    *lead, S, n, d = X.shape
    Vh = torch.linalg.svd(X.reshape(*lead, S * n, d), full_matrices=False).Vh
    energy = ((X @ Vh.mT.unsqueeze(-3)) ** 2).sum(-2)
    cum = energy.cumsum(-1) / (X * X).sum((-2, -1)).unsqueeze(-1)
    if k <= cum.shape[-1]:
        return cum[..., :k]
    return torch.cat([cum, cum[..., -1:].expand(*cum.shape[:-1], k - cum.shape[-1])], dim=-1)


def test_shared_subspace_matches_the_svd_of_the_concatenation() -> None:
    states = _rand(4, 3, 4, 10, 8)
    for k in (5, 8, 12):
        torch.testing.assert_close(shared_subspace_variance(states, k_max=k), _reference_subspace(states, k))


@FAST
@given(seed=st.integers(0, 10_000), r=st.integers(1, 5), S=st.integers(1, 4))
def test_shared_subspace_same_r_dim_subspace(seed: int, r: int, S: int) -> None:
    n, d = 20, 12
    basis = _orthogonal(seed, d)[:, :r]  # [d, r]
    coeffs = _rand(seed + 1, 2, S, n, r) * torch.linspace(3.0, 0.5, r, dtype=torch.float64)
    states = coeffs @ basis.T + _rand(seed + 2, 2, S, 1, d)  # offsets are removed by centring
    C = shared_subspace_variance(states)
    assert C.shape == (2, S, d)
    assert torch.allclose(C[..., r - 1], torch.ones(2, S, dtype=torch.float64), atol=1e-9)
    assert torch.all(C[..., 1:] >= C[..., :-1] - 1e-12)
    if r > 1:
        assert torch.all(C[..., r - 2] < 1 - 1e-6)


def test_shared_subspace_orthogonal_states_and_kmax() -> None:
    n, d = 50, 3
    e = torch.eye(d, dtype=torch.float64)
    a = _rand(0, n, 1) * 3.0
    b = _rand(1, n, 1)
    a, b = (a - a.mean()) / a.std() * 3.0, (b - b.mean()) / b.std()
    states = torch.stack([a * e[0], b * e[1]])  # state 0 along e0 (larger), state 1 along e1
    C = shared_subspace_variance(states, k_max=5)
    assert C.shape == (2, 5)
    expected = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.float64)
    assert torch.allclose(C, expected, atol=1e-9)


# ---------------------------------------------------------------------------
# MeSH state composition
# ---------------------------------------------------------------------------


def _simulate_algorithm2(write: torch.Tensor, read: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """Literal Algorithm 2 (MeSH App. C) with given source vectors; returns states h^(0..K).

    write/read: [K+1, B]; sources: [K+2, D] = [h_emb, h_m^(-1), ..., h_m^(K-1)].
    """
    K1, B = write.shape
    buf = torch.zeros(B, sources.shape[1], dtype=sources.dtype)
    buf[0] = sources[0]
    states = []
    for j in range(K1):
        for b in range(B):
            buf[b] = buf[b] + sources[j + 1] * write[j, b]
        states.append(sum(buf[b] * read[j, b] for b in range(B)))
    return torch.stack(states)


def test_state_composition_one_hot_hand_computed() -> None:
    K, B = 2, 3
    write = torch.zeros(K + 1, B)
    write[:, 1] = 1.0  # everything written to slot 1
    read = torch.zeros(K + 1, B)
    read[:, 0] = read[:, 1] = 1.0  # read slot 0 + slot 1
    coef = mesh_state_composition(write, read)
    # h0 = emb + hm(-1); h1 = emb + hm(-1) + hm(0); h2 = emb + hm(-1) + hm(0) + hm(1)
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32)
    assert coef.shape == (K + 1, K + 2)
    assert torch.equal(coef, expected)
    # read only slot 1 -> h_emb never contributes
    read2 = torch.zeros(K + 1, B)
    read2[:, 1] = 1.0
    assert torch.equal(mesh_state_composition(write, read2)[:, 0], torch.zeros(K + 1))


def test_state_composition_reproduces_anchor_emb() -> None:
    # step j writes its output to its own slot j+1 and reads slot 0 (h_emb) + slot j+1:
    # h^(t+1) = h_m^(t) + h_emb  (anchor*, MeSH Sec. 3.1 / App. D)
    K = 3
    B = K + 2
    write = torch.zeros(K + 1, B)
    read = torch.zeros(K + 1, B)
    for j in range(K + 1):
        write[j, j + 1] = 1.0
        read[j, 0] = read[j, j + 1] = 1.0
    coef = mesh_state_composition(write, read)
    expected = torch.zeros(K + 1, K + 2)
    expected[:, 0] = 1.0
    for t in range(K + 1):
        expected[t, t + 1] = 1.0  # h^(t) <- h_m^(t-1) (prelude output for t = 0)
    assert torch.equal(coef, expected)


def test_state_composition_matches_algorithm2_simulation_batched() -> None:
    K, B, N, L, D = 3, 5, 2, 4, 6
    g = torch.Generator().manual_seed(0)
    write = torch.softmax(torch.randn(K + 1, N, L, B, generator=g, dtype=torch.float64), -1)
    read = torch.softmax(torch.randn(K + 1, N, L, B, generator=g, dtype=torch.float64), -1)
    coef = mesh_state_composition(write, read)
    assert coef.shape == (N, L, K + 1, K + 2)
    assert torch.all(torch.triu(coef[..., 1:], diagonal=1) == 0)  # no future sources
    for n in range(N):
        for pos in range(L):
            sources = torch.randn(K + 2, D, generator=g, dtype=torch.float64)
            states = _simulate_algorithm2(write[:, n, pos], read[:, n, pos], sources)
            assert torch.allclose(coef[n, pos] @ sources, states, atol=1e-12)
    rows, cols = state_composition_labels(K)
    assert len(rows) == K + 1 and len(cols) == K + 2


# ---------------------------------------------------------------------------
# Attention probes
# ---------------------------------------------------------------------------


def _uniform_causal(L: int) -> torch.Tensor:
    A = torch.tril(torch.ones(L, L, dtype=torch.float64))
    return A / A.sum(-1, keepdim=True)


def _banded(L: int, window: int, include_self: bool, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.arange(L)[:, None]
    k = torch.arange(L)[None, :]
    upper = k <= q if include_self else k < q
    mask = (k >= q - window) & upper
    mask[0, 0] = True  # the first query can only attend to itself
    A = torch.rand(L, L, generator=g, dtype=torch.float64) * mask
    return A / A.sum(-1, keepdim=True)


@pytest.mark.parametrize("L", [2, 7, 33])
def test_key_marginal_entropy_uniform_causal_analytic(L: int) -> None:
    # p(k) = (1/L) sum_{q>=k} 1/(q+1) = (H_L - H_k)/L with harmonic numbers H
    Hn = [sum(1.0 / i for i in range(1, m + 1)) for m in range(L + 1)]
    p = [(Hn[L] - Hn[k]) / L for k in range(L)]
    expected = -sum(pi * math.log(pi) for pi in p) / math.log(L)
    A = _uniform_causal(L).expand(2, 3, L, L)  # [batch, heads, L, L]
    ent = key_marginal_entropy(A)
    assert ent.shape == (2, 3)
    assert torch.allclose(ent, torch.full((2, 3), expected, dtype=torch.float64), atol=1e-12)


def test_key_marginal_entropy_extremes() -> None:
    L = 16
    sink = torch.zeros(1, L, L)
    sink[..., 0] = 1.0  # every query attends to key 0
    full = torch.full((1, L, L), 1.0 / L)
    assert key_marginal_entropy(sink).item() == pytest.approx(0.0, abs=1e-7)
    assert key_marginal_entropy(full, causal=False).item() == pytest.approx(1.0, abs=1e-6)
    # causal=True zeroes the upper triangle (rows are not re-normalised): p(k) propto L - k
    p = torch.arange(L, 0, -1, dtype=torch.float64)
    p = p / p.sum()
    expected = (-(p * p.log()).sum() / math.log(L)).item()
    assert key_marginal_entropy(full, causal=True).item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("L,window", [(16, 1), (20, 4), (33, 8)])
def test_lam_purely_local_attention(L: int, window: int) -> None:
    # include_self=True: attention banded within q-M..q has LAM exactly 1
    A = torch.stack([_banded(L, window, True, seed=s) for s in range(2)])  # [heads, L, L]
    assert torch.allclose(
        local_attention_mass(A, window, include_self=True), torch.ones(2, dtype=torch.float64)
    )
    # paper definition (k < q): strictly-backward band scores 1 on every query but q = 0
    B = _banded(L, window, False)
    assert local_attention_mass(B, window).item() == pytest.approx((L - 1) / L, abs=1e-12)
    # an attention sink on key 0 is local only for queries 1..M
    sink = torch.zeros(L, L, dtype=torch.float64)
    sink[:, 0] = 1.0
    assert local_attention_mass(sink, window).item() == pytest.approx(window / L, abs=1e-12)
    assert local_attention_mass(_uniform_causal(L)[None, None], window).shape == (1, 1)


def test_lam_window() -> None:
    assert [lam_window(r) for r in (1 / 8, 1 / 4, 1 / 2, 1)] == [4, 8, 16, 32]
    assert lam_window(1 / 3) == 11


def test_dynamic_heads() -> None:
    T, n = 4, 10
    ranges = torch.tensor([0.1, 0.9, 0.0, 0.5, 0.3, 0.8, 0.05, 0.2, 0.7, 0.15])
    base = torch.rand(n)
    stat = base.expand(T, n).clone()
    stat[1] += ranges  # max - min over loops == ranges
    idx = dynamic_heads(stat, frac=0.4)
    assert idx.tolist() == [1, 5, 8, 3]
    assert torch.allclose(cross_loop_range(stat), ranges, atol=1e-6)
    # [T, n_layers, n_heads] layout: flat index = layer * H + head
    stat3 = stat.reshape(T, 2, 5)
    assert dynamic_heads(stat3, frac=0.4).tolist() == [1, 5, 8, 3]
    assert len(dynamic_heads(torch.rand(3, 12), frac=0.4)) == 5
    assert len(dynamic_heads(torch.rand(3, 11), frac=0.4)) == 5  # "within the top 40%": ceil(4.4)
    assert len(dynamic_heads(torch.rand(3, 12), frac=1.0)) == 12
    nan_stat = stat.clone()
    nan_stat[0, 1] = float("nan")
    assert 1 not in dynamic_heads(nan_stat, frac=0.4).tolist()


def test_minmax_normalize() -> None:
    x = torch.tensor([[1.0, 3.0], [2.0, 5.0]])
    assert torch.allclose(minmax_normalize(x), torch.tensor([[0.0, 0.5], [0.25, 1.0]]))
    assert torch.equal(minmax_normalize(torch.ones(2, 2)), torch.zeros(2, 2))


# ---------------------------------------------------------------------------
# Plots: every function writes a non-empty PNG
# ---------------------------------------------------------------------------


def _plot_calls() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    N, K = 6, 3
    blocks = ["Prelude", "1st core", "2nd core", "3rd core", "Coda"]
    skew = {b: torch.rand(N, generator=g) for b in blocks}
    models = ["base", "+residual", "+anchor", "+mesh"]
    states = torch.randn(N, K + 2, 10, 8, generator=g, dtype=torch.float64)
    cka = cka_matrix(states)
    spec = normalized_spectrum(singular_values(states), k=8)  # [N, S, k]
    sub = shared_subspace_variance(states[:, 1:])  # [N, S, d]
    write = torch.softmax(torch.randn(K + 1, N, 5, K + 3, generator=g), -1)
    read = torch.softmax(torch.randn(K + 1, N, 5, K + 3, generator=g), -1)
    comp = mesh_state_composition(write, read)
    ent = torch.rand(4, 3, 4, generator=g)  # [T, layers, heads]
    labels = ["emb"] + [f"h{t}" for t in range(K + 1)]
    curves = {lab: spec[:, i] for i, lab in enumerate(labels)}
    sub_curves = {lab: sub[:, i] for i, lab in enumerate(labels[1:])}
    coef = {"states": ["h(1)", "h(2)"], "mean": torch.rand(2, 4, generator=g) - 0.5}
    apps = ["c1 L1 Lb0", "c1 Hb0", "c2 L1 Lb0", "c2 Hb0"]
    cycles = [1, 1, 2, 2]
    rates = torch.rand(4, 3, generator=g)
    sv = torch.rand(4, 3, 1, 8, generator=g).sort(dim=-1, descending=True).values
    return {
        "skew": lambda p: plot_skew({"model": skew}, p, title="skew"),
        "compare_skew": lambda p: plot_skew({m: skew for m in models}, p),
        "cka": lambda p: plot_cka({"m": cka}, p, labels={"m": labels}),
        "compare_cka": lambda p: plot_cka({m: cka for m in models}, p, labels={m: labels for m in models}),
        "spectra": lambda p: plot_spectra({"m": curves}, p),
        "compare_spectra": lambda p: plot_spectra({m: curves for m in models[:2]}, p),
        "subspace": lambda p: plot_shared_subspace({"m": sub_curves}, p),
        "compare_subspace": lambda p: plot_shared_subspace({"base": sub_curves, "mesh": sub_curves}, p),
        "compare_of_one_subspace": lambda p: plot_shared_subspace({"mesh": sub_curves}, p, single=False),
        "routers": lambda p: plot_mesh_routers({"m": (write, read)}, p),
        "compare_routers": lambda p: plot_mesh_routers({"mesh-a": (write, read), "mesh-b": (read, write)}, p),
        "composition": lambda p: plot_state_composition({"m": comp}, p),
        "compare_composition": lambda p: plot_state_composition({"a": comp, "b": comp[0, 0]}, p),
        "coefficients": lambda p: plot_coefficients({"m": coef}, p),
        "compare_coefficients": lambda p: plot_coefficients({"a": coef, "b": coef}, p, title="coefficients"),
        "attention": lambda p: plot_attention_probe(
            {"m": ent}, p, dynamic_frac=0.4, loop_labels=["1/8", "1/4", "1/2", "1"]
        ),
        "attention_lam": lambda p: plot_attention_probe(
            {"m": [[0.1, 0.2], [0.3, 0.3]]}, p, metric="LAM", loop_labels=["loop a", "loop b"]
        ),
        "compare_attention": lambda p: plot_attention_probe({"spiral": ent, "looped": ent[:3]}, p),
        "head_heatmaps": lambda p: plot_head_heatmaps(ent, p),
        "head_heatmaps_flat": lambda p: plot_head_heatmaps(ent.flatten(1), p, n_heads=4),
        "range_heatmap": lambda p: plot_head_range({"m": ent}, p, metric="LAM"),
        "compare_range_heatmaps": lambda p: plot_head_range({"spiral": ent, "looped": ent * 2}, p),
        # Mela: a gate that is not used (NaN) says so; many applications stack the tensors
        "mela_heatmaps": lambda p: plot_application_heatmaps(
            {"theta": rates, "eta": rates * float("nan")}, p, rows=apps, cols=["0", "1", "2"], groups=cycles
        ),
        "mela_spectrum": lambda p: plot_update_spectrum(sv, p, apps=apps, tensors=["W1"], groups=cycles),
        "mela_spectrum_dense": lambda p: plot_update_spectrum(
            sv.repeat(5, 1, 1, 1), p, apps=apps * 5, tensors=["W1"], groups=cycles * 5, reference=None
        ),
        "mela_memstack": lambda p: plot_memstack_change(torch.rand(N, 2, 4, generator=g), p),
        "mela_memstack_off": lambda p: plot_memstack_change(torch.zeros(N, 1, 3), p, enabled=False),
        "mela_memstack_h1": lambda p: plot_memstack_change(torch.zeros(N, 0, 3), p),
    }


_CALLS = _plot_calls()


@pytest.mark.parametrize("name", sorted(_CALLS))
def test_plot_writes_png(name: str, tmp_path) -> None:
    path = tmp_path / "sub" / f"{name}.png"
    out = _CALLS[name](path)
    assert out == path
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
