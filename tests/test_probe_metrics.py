"""Tests for recursive_lightning.probes.metrics and recursive_lightning.probes.plots."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recursive_lightning.probes import metrics as M
from recursive_lightning.probes import plots as P

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


@FAST
@given(seed=st.integers(0, 10_000), n=st.integers(4, 24), d=st.integers(1, 12))
def test_cka_self_is_one(seed: int, n: int, d: int) -> None:
    X = _rand(seed, n, d)
    for kernel in KERNELS:
        assert M.cka(X, X, kernel=kernel).item() == pytest.approx(1.0, abs=1e-9)
        assert torch.allclose(
            torch.diagonal(M.cka_matrix(X[None], kernel=kernel)), torch.ones(1, dtype=torch.float64)
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
        ref = M.cka(X, Y, kernel=kernel)
        assert 0.0 <= ref.item() <= 1.0 + 1e-9
        assert M.cka(scale * X @ Q, Y, kernel=kernel).item() == pytest.approx(ref.item(), abs=1e-8)
        assert M.cka(X, Y @ Q / scale, kernel=kernel).item() == pytest.approx(ref.item(), abs=1e-8)


def test_rbf_cka_with_fixed_sigma_is_not_scale_invariant() -> None:
    # sanity check that the invariance above comes from the median heuristic
    X, Y = _rand(0, 16, 4), _rand(1, 16, 4)
    Kc = M.center_gram(M.gram_rbf(X, sigma=1.0))
    Kc2 = M.center_gram(M.gram_rbf(10 * X, sigma=1.0))
    Lc = M.center_gram(M.gram_rbf(Y, sigma=1.0))

    def _c(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a * b).sum() / torch.sqrt((a * a).sum() * (b * b).sum())).item()

    assert abs(_c(Kc, Lc) - _c(Kc2, Lc)) > 1e-3


@pytest.mark.parametrize("kernel", KERNELS)
def test_cka_matrix_matches_pairwise(kernel: str) -> None:
    N, S, n, d = 3, 4, 12, 6
    states = _rand(7, N, S, n, d)
    states[:, 2] = states[:, 1] + 0.1 * states[:, 2]  # correlated pair
    mat = M.cka_matrix(states, kernel=kernel, sigma_frac=0.8)
    assert mat.shape == (N, S, S)
    assert torch.allclose(mat, mat.transpose(-1, -2))
    for b in range(N):
        for i in range(S):
            for j in range(S):
                ref = M.cka(states[b, i], states[b, j], kernel=kernel, sigma_frac=0.8)
                assert mat[b, i, j].item() == pytest.approx(ref.item(), abs=1e-10)
    # list input with differing feature dims
    lst = [states[..., 0, :, :3], states[..., 1, :, :], states[..., 2, :, :5]]
    mat2 = M.cka_matrix(lst, kernel=kernel, sigma_frac=0.8)
    assert mat2[0, 0, 2].item() == pytest.approx(
        M.cka(lst[0][0], lst[2][0], kernel=kernel, sigma_frac=0.8).item()
    )


def test_linear_cka_matches_feature_space_formula() -> None:
    # Kornblith et al. (2019) Eq. 5: ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F) on centred data
    X, Y = _rand(3, 30, 5), _rand(4, 30, 7)
    Y[:, :5] += X
    Xc, Yc = X - X.mean(0), Y - Y.mean(0)
    ref = torch.linalg.norm(Yc.T @ Xc) ** 2 / (torch.linalg.norm(Xc.T @ Xc) * torch.linalg.norm(Yc.T @ Yc))
    assert M.cka(X, Y, kernel="linear").item() == pytest.approx(ref.item(), rel=1e-10)
    # unrelated data is far from 1
    assert M.cka(_rand(5, 200, 3), _rand(6, 200, 3), kernel="linear").item() < 0.2


def test_rbf_bandwidth_is_median_pairwise_distance() -> None:
    X = _rand(11, 9, 3)
    dists = torch.cdist(X, X)
    iu = torch.triu_indices(9, 9, 1)
    med = float(np.median(dists[iu[0], iu[1]].numpy()))
    assert M.median_distance(X).item() == pytest.approx(med, rel=1e-10)
    K = M.gram_rbf(X, sigma_frac=0.5)
    ref = torch.exp(-(dists**2) / (2 * (0.5 * med) ** 2))
    assert torch.allclose(K, ref, atol=1e-10)


# ---------------------------------------------------------------------------
# Computation skew
# ---------------------------------------------------------------------------


def test_computation_skew_identity_negation_and_scaling() -> None:
    h = _rand(0, 5, 7, 4)
    assert torch.allclose(M.computation_skew(h, h), torch.zeros(5, dtype=torch.float64))
    assert torch.allclose(M.computation_skew(h, -h), torch.full((5,), 2.0, dtype=torch.float64))
    # f(h) = 2h: 2 * ||h|| / (2||h|| + ||h||) = 2/3
    assert torch.allclose(M.computation_skew(h, 2 * h), torch.full((5,), 2 / 3, dtype=torch.float64))
    # per-sample: only sample 1 is changed
    out = h.clone()
    out[1] = -out[1]
    s = M.computation_skew(h, out)
    assert s[1].item() == pytest.approx(2.0) and s[0].item() == pytest.approx(0.0)


# ---------------------------------------------------------------------------
# Spectra / effective rank
# ---------------------------------------------------------------------------


@FAST
@given(seed=st.integers(0, 10_000), r=st.integers(1, 6), n=st.integers(8, 20), d=st.integers(8, 16))
def test_spectrum_of_rank_r_matrix(seed: int, r: int, n: int, d: int) -> None:
    X = _rand(seed, n, r) @ _rand(seed + 1, r, d)
    s = M.normalized_spectrum(X, k=50)
    assert s.shape == (50,)
    assert int((s > 1e-6).sum()) == r
    assert s[0].item() == pytest.approx(1.0)
    assert torch.all(s[:-1] >= s[1:] - 1e-12)


def test_spectrum_batched_and_padding() -> None:
    X = _rand(1, 3, 10, 4)
    s = M.normalized_spectrum(X, k=6)
    assert s.shape == (3, 6)
    assert torch.all(s[:, 4:] == 0) and torch.all(s[:, :4] > 0)
    assert torch.allclose(s[1], M.normalized_spectrum(X[1], k=6))
    assert M.normalized_spectrum(_rand(2, 100, 80), k=50).shape == (50,)


def test_effective_rank() -> None:
    d = 32
    X = _rand(0, 4000, d)
    er = M.effective_rank(X).item()
    assert 0.95 * d < er <= d
    rank1 = _rand(1, 50, 1) @ _rand(2, 1, 20)
    assert M.effective_rank(rank1).item() == pytest.approx(1.0, abs=1e-6)
    Q = _orthogonal(3, 10)[:, :4]  # equal singular values -> erank == rank
    assert M.effective_rank(Q).item() == pytest.approx(4.0, abs=1e-9)
    batched = M.effective_rank(torch.stack([X[:100], X[:1].expand(100, -1)]))  # 2nd: identical rows
    assert batched.shape == (2,)
    assert batched[1].item() == pytest.approx(1.0, abs=1e-6)


# ---------------------------------------------------------------------------
# Shared subspace
# ---------------------------------------------------------------------------


@FAST
@given(seed=st.integers(0, 10_000), r=st.integers(1, 5), S=st.integers(1, 4))
def test_shared_subspace_same_r_dim_subspace(seed: int, r: int, S: int) -> None:
    n, d = 20, 12
    basis = _orthogonal(seed, d)[:, :r]  # [d, r]
    coeffs = _rand(seed + 1, 2, S, n, r) * torch.linspace(3.0, 0.5, r, dtype=torch.float64)
    states = coeffs @ basis.T + _rand(seed + 2, 2, S, 1, d)  # offsets are removed by centring
    C = M.shared_subspace_variance(states)
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
    C = M.shared_subspace_variance(states, k_max=5)
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
    coef = M.mesh_state_composition(write, read)
    # h0 = emb + hm(-1); h1 = emb + hm(-1) + hm(0); h2 = emb + hm(-1) + hm(0) + hm(1)
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32)
    assert coef.shape == (K + 1, K + 2)
    assert torch.equal(coef, expected)
    # read only slot 1 -> h_emb never contributes
    read2 = torch.zeros(K + 1, B)
    read2[:, 1] = 1.0
    assert torch.equal(M.mesh_state_composition(write, read2)[:, 0], torch.zeros(K + 1))


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
    coef = M.mesh_state_composition(write, read)
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
    coef = M.mesh_state_composition(write, read)
    assert coef.shape == (N, L, K + 1, K + 2)
    assert torch.all(torch.triu(coef[..., 1:], diagonal=1) == 0)  # no future sources
    for n in range(N):
        for pos in range(L):
            sources = torch.randn(K + 2, D, generator=g, dtype=torch.float64)
            states = _simulate_algorithm2(write[:, n, pos], read[:, n, pos], sources)
            assert torch.allclose(coef[n, pos] @ sources, states, atol=1e-12)
    rows, cols = M.state_composition_labels(K)
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
    ent = M.key_marginal_entropy(A)
    assert ent.shape == (2, 3)
    assert torch.allclose(ent, torch.full((2, 3), expected, dtype=torch.float64), atol=1e-12)


def test_key_marginal_entropy_extremes() -> None:
    L = 16
    sink = torch.zeros(1, L, L)
    sink[..., 0] = 1.0  # every query attends to key 0
    full = torch.full((1, L, L), 1.0 / L)
    assert M.key_marginal_entropy(sink).item() == pytest.approx(0.0, abs=1e-7)
    assert M.key_marginal_entropy(full, causal=False).item() == pytest.approx(1.0, abs=1e-6)
    # causal=True zeroes the upper triangle (rows are not re-normalised): p(k) propto L - k
    p = torch.arange(L, 0, -1, dtype=torch.float64)
    p = p / p.sum()
    expected = (-(p * p.log()).sum() / math.log(L)).item()
    assert M.key_marginal_entropy(full, causal=True).item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("L,window", [(16, 1), (20, 4), (33, 8)])
def test_lam_purely_local_attention(L: int, window: int) -> None:
    # include_self=True: attention banded within q-M..q has LAM exactly 1
    A = torch.stack([_banded(L, window, True, seed=s) for s in range(2)])  # [heads, L, L]
    assert torch.allclose(
        M.local_attention_mass(A, window, include_self=True), torch.ones(2, dtype=torch.float64)
    )
    # paper definition (k < q): strictly-backward band scores 1 on every query but q = 0
    B = _banded(L, window, False)
    assert M.local_attention_mass(B, window).item() == pytest.approx((L - 1) / L, abs=1e-12)
    # an attention sink on key 0 is local only for queries 1..M
    sink = torch.zeros(L, L, dtype=torch.float64)
    sink[:, 0] = 1.0
    assert M.local_attention_mass(sink, window).item() == pytest.approx(window / L, abs=1e-12)
    assert M.local_attention_mass(_uniform_causal(L)[None, None], window).shape == (1, 1)


def test_lam_window() -> None:
    assert [M.lam_window(r) for r in (1 / 8, 1 / 4, 1 / 2, 1)] == [4, 8, 16, 32]
    assert M.lam_window(1 / 3) == 11


def test_dynamic_heads() -> None:
    T, n = 4, 10
    ranges = torch.tensor([0.1, 0.9, 0.0, 0.5, 0.3, 0.8, 0.05, 0.2, 0.7, 0.15])
    base = torch.rand(n)
    stat = base.expand(T, n).clone()
    stat[1] += ranges  # max - min over loops == ranges
    idx = M.dynamic_heads(stat, frac=0.4)
    assert idx.tolist() == [1, 5, 8, 3]
    assert torch.allclose(M.cross_loop_range(stat), ranges, atol=1e-6)
    # [T, n_layers, n_heads] layout: flat index = layer * H + head
    stat3 = stat.reshape(T, 2, 5)
    assert M.dynamic_heads(stat3, frac=0.4).tolist() == [1, 5, 8, 3]
    assert len(M.dynamic_heads(torch.rand(3, 12), frac=0.4)) == 5
    assert len(M.dynamic_heads(torch.rand(3, 11), frac=0.4)) == 5  # "within the top 40%": ceil(4.4)
    assert len(M.dynamic_heads(torch.rand(3, 12), frac=1.0)) == 12
    nan_stat = stat.clone()
    nan_stat[0, 1] = float("nan")
    assert 1 not in M.dynamic_heads(nan_stat, frac=0.4).tolist()


def test_minmax_normalize() -> None:
    x = torch.tensor([[1.0, 3.0], [2.0, 5.0]])
    assert torch.allclose(M.minmax_normalize(x), torch.tensor([[0.0, 0.5], [0.25, 1.0]]))
    assert torch.equal(M.minmax_normalize(torch.ones(2, 2)), torch.zeros(2, 2))


# ---------------------------------------------------------------------------
# Plots: every function writes a non-empty PNG
# ---------------------------------------------------------------------------


def _plot_calls() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    N, K = 6, 3
    blocks = P.skew_block_labels(K)
    skew = {b: torch.rand(N, generator=g) for b in blocks}
    models = ["base", "+residual", "+anchor", "+mesh"]
    states = torch.randn(N, K + 2, 10, 8, generator=g, dtype=torch.float64)
    cka = M.cka_matrix(states)
    spec = M.normalized_spectrum(states, k=8)  # [N, S, k]
    sub = M.shared_subspace_variance(states[:, 1:])  # [N, S, d]
    write = torch.softmax(torch.randn(K + 1, N, 5, K + 3, generator=g), -1)
    read = torch.softmax(torch.randn(K + 1, N, 5, K + 3, generator=g), -1)
    comp = M.mesh_state_composition(write, read)
    ent = torch.rand(4, 3, 4, generator=g)  # [T, layers, heads]
    labels = ["emb"] + [f"h{t}" for t in range(K + 1)]
    apps = ["c1 L1 Lb0", "c1 Hb0", "c2 L1 Lb0", "c2 Hb0"]
    cycles = [1, 1, 2, 2]
    rates = torch.rand(4, 3, generator=g)
    sv = torch.rand(4, 3, 1, 8, generator=g).sort(dim=-1, descending=True).values
    return {
        "skew": lambda p: P.plot_skew(skew, p, title="skew"),
        "compare_skew": lambda p: P.compare_skew({m: skew for m in models}, p),
        "compare_skew_subplots": lambda p: P.compare_skew({m: skew for m in models}, p, layout="subplots"),
        "cka": lambda p: P.plot_cka_heatmap(cka, p, labels=labels),
        "compare_cka": lambda p: P.compare_cka_heatmaps({m: cka for m in models}, p, labels=labels),
        "spectra": lambda p: P.plot_singular_spectra(spec, p, labels=labels),
        "compare_spectra": lambda p: P.compare_singular_spectra(
            {m: {lab: spec[:, i] for i, lab in enumerate(labels)} for m in models[:2]}, p
        ),
        "subspace": lambda p: P.plot_shared_subspace(sub, p),
        "compare_subspace": lambda p: P.compare_shared_subspace({"base": sub, "mesh": sub}, p),
        "routers": lambda p: P.plot_mesh_routers(write, read, p),
        "compare_routers": lambda p: P.compare_mesh_routers(
            {"mesh-a": (write, read), "mesh-b": (read, write)}, p
        ),
        "composition": lambda p: P.plot_state_composition(comp, p),
        "compare_composition": lambda p: P.compare_state_composition({"a": comp, "b": comp[0, 0]}, p),
        "attention": lambda p: P.plot_attention_probe(
            ent, p, dynamic_frac=0.4, loop_labels=["1/8", "1/4", "1/2", "1"]
        ),
        "attention_map": lambda p: P.plot_attention_probe(
            {"loop a": [0.1, 0.2], "loop b": [0.3, 0.3]}, p, metric="LAM"
        ),
        "compare_attention": lambda p: P.compare_attention_probe({"spiral": ent, "looped": ent[:3]}, p),
        "head_heatmaps": lambda p: P.plot_head_heatmaps(ent, p),
        "compare_head_heatmaps": lambda p: P.compare_head_heatmaps(
            {"spiral": ent, "looped": ent.flatten(1)}, p, n_heads=4
        ),
        "range_heatmap": lambda p: P.plot_head_range_heatmap(ent, p, metric="LAM"),
        "compare_range_heatmaps": lambda p: P.compare_head_range_heatmaps(
            {"spiral": ent, "looped": ent * 2}, p
        ),
        # Mela: a gate that is not used (NaN) says so; many applications stack the tensors
        "mela_heatmaps": lambda p: P.plot_application_heatmaps(
            {"theta": rates, "eta": rates * float("nan")}, p, rows=apps, cols=["0", "1", "2"], groups=cycles
        ),
        "mela_spectrum": lambda p: P.plot_update_spectrum(sv, p, apps=apps, tensors=["W1"], groups=cycles),
        "mela_spectrum_dense": lambda p: P.plot_update_spectrum(
            sv.repeat(5, 1, 1, 1), p, apps=apps * 5, tensors=["W1"], groups=cycles * 5, reference=None
        ),
        "mela_memstack": lambda p: P.plot_memstack_change(torch.rand(N, 2, 4, generator=g), p),
        "mela_memstack_off": lambda p: P.plot_memstack_change(torch.zeros(N, 1, 3), p, enabled=False),
        "mela_memstack_h1": lambda p: P.plot_memstack_change(torch.zeros(N, 0, 3), p),
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


def test_plot_module_exports_cover_all_calls() -> None:
    public = {n for n in P.__all__ if n.startswith(("plot_", "compare_"))}
    called = {
        "plot_skew",
        "compare_skew",
        "plot_cka_heatmap",
        "compare_cka_heatmaps",
        "plot_singular_spectra",
        "compare_singular_spectra",
        "plot_shared_subspace",
        "compare_shared_subspace",
        "plot_mesh_routers",
        "compare_mesh_routers",
        "plot_state_composition",
        "compare_state_composition",
        "plot_attention_probe",
        "compare_attention_probe",
        "plot_head_heatmaps",
        "compare_head_heatmaps",
        "plot_head_range_heatmap",
        "compare_head_range_heatmaps",
        "plot_application_heatmaps",
        "plot_update_spectrum",
        "plot_memstack_change",
    }
    assert public == called
