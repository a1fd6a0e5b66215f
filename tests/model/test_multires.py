"""SpiralFormer multi-resolution recursion: causality, Proposition 1, LoopedFormer equivalence, Table 1."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recursive_lightning.model.config import TOPOLOGIES, ModelConfig, preset
from recursive_lightning.model.describe import describe
from recursive_lightning.model.recursive.model import RecursiveLM
from recursive_lightning.model.recursive.resolution import ResolutionStep, chunk_maps

BASE = dict(vocab_size=37, d_model=16, n_heads=2, max_seq_len=64)


def build(layout: str, **kw) -> RecursiveLM:
    torch.manual_seed(kw.pop("seed", 0))
    return RecursiveLM(ModelConfig.from_dict({**BASE, "layout": layout, **kw})).double()


def leaks(model: RecursiveLM, length: int, j: int, seed: int = 0) -> bool:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, model.cfg.vocab_size, (1, length), generator=g)
    y = x.clone()
    y[0, j] = (y[0, j] + 1) % model.cfg.vocab_size
    with torch.no_grad():
        return not torch.allclose(model(x)[:, :j], model(y)[:, :j], atol=1e-12, rtol=0)


@st.composite
def multires_configs(draw):
    steps = draw(st.integers(1, 3))
    chunk = [draw(st.sampled_from([1, 2, 3, 4, 8])) for _ in range(steps)]
    offsets = [draw(st.integers(0, g - 1)) for g in chunk]
    shifts = [g - 1 + draw(st.integers(0, 2)) for g in chunk]
    res = ",".join("1" if g == 1 else f"1/{g}" for g in chunk)
    return dict(
        layout=f"1+1x{{{res}}}+1",
        offset=offsets,
        shift=shifts,
        downscale=draw(st.sampled_from(["self_aggregation", "mean"])),
        upscale=draw(st.sampled_from(["allocation", "broadcast"])),
        topology=draw(st.sampled_from(TOPOLOGIES)),
        length=draw(st.integers(1, 29)),
        j=draw(st.integers(0, 28)),
    )


@settings(max_examples=60, deadline=None)
@given(multires_configs())
def test_strict_causality_property(c):
    length, j = c.pop("length"), c.pop("j")
    model = build(**c)
    assert not leaks(model, length, min(j, length - 1))


@settings(max_examples=30, deadline=None)
@given(multires_configs())
def test_prefix_consistency_property(c):
    """A position's logits do not depend on how many tokens follow it (what decoding relies on)."""
    length, _ = c.pop("length"), c.pop("j")
    model = build(**c)
    x = torch.randint(0, model.cfg.vocab_size, (1, length + 9))
    with torch.no_grad():
        torch.testing.assert_close(model(x[:, :length]), model(x)[:, :length], atol=1e-10, rtol=0)


@pytest.mark.parametrize("g", [2, 4, 8])
def test_proposition_1(g):
    """s <= g-2 leaks the future (for some input), s = g-1 and s = g never do (SpiralFormer App. C)."""
    res = f"1/{g}"
    length = 4 * g + 3
    for s, expect_leak in ((g - 2, True), (g - 1, False), (g, False)):
        model = build(f"1+1x{{{res}}}+1", shift=s, offset="zero", allow_noncausal=True, topology="anchor")
        found = any(leaks(model, length, j) for j in range(length))
        assert found == expect_leak, (g, s)


def test_noncausal_shift_refused_without_flag():
    with pytest.raises(Exception, match="Proposition 1"):
        build("1+1x{1/4}+1", shift=2)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_schedule_11_is_loopedformer(topology):
    spiral = build("2+2x{1,1}+2", topology=topology)
    looped = build("2+2R2+2", topology=topology)
    assert all(s.scorer is None and s.allocator is None for s in spiral.steps)
    assert spiral.state_dict().keys() == looped.state_dict().keys()
    looped.load_state_dict(spiral.state_dict())
    x = torch.randint(0, 37, (2, 19))
    torch.testing.assert_close(spiral(x), looped(x), atol=0, rtol=0)


def test_chunk_maps_and_dropped_positions():
    pi, rho = chunk_maps(10, 4, 2)  # chunk 0 = 0..1 (after 2 pads), chunk 1 = 2..5, chunk 2 = 6..9
    assert pi.tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert chunk_maps(9, 4, 2)[0].tolist() == [0, 0, 1, 1, 1, 1, -1, -1, -1]  # incomplete 6..8 dropped
    assert rho.tolist() == [2, 3, 0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("downscale, upscale", [("mean", "broadcast"), ("self_aggregation", "allocation")])
@pytest.mark.parametrize(
    "g, w, s, length", [(4, 1, 3, 14), (4, 2, 3, 9), (8, 4, 7, 30), (2, 0, 1, 7), (4, 1, 5, 13), (4, 3, 4, 3)]
)
def test_operators_match_equations(downscale, upscale, g, w, s, length):
    """S_down (Eqs. 16-18), S_up (Eqs. 19-21) and the shift (Eq. 22) against a direct per-position loop, over
    offsets, the overlap (s = g - 1) and parallel (s >= g) regimes and lengths that leave a trailing chunk;
    their gradients (to the states and the scorer/router weights) against autograd through that loop."""
    cfg = ModelConfig.from_dict({**BASE, "layout": "1+1x{1/4}+1", "downscale": downscale, "upscale": upscale})
    lam = 2.0
    torch.manual_seed(0)
    step = ResolutionStep(cfg, g, w, s, lam).double()
    h = torch.randn(1, length, 16, dtype=torch.double, requires_grad=True)
    z = step.down(h)
    pi, rho = chunk_maps(length, g, w)
    n = (length + w) // g
    ref_z = []
    for j in range(n):
        members = h[0, pi == j]
        if step.scorer is None:
            ref_z.append(members.sum(0) / g)  # Eq. 16: padding counts as zero
        else:
            alpha = step.scorer(members).squeeze(-1).softmax(0)  # Eq. 17 over the chunk's real positions
            ref_z.append((alpha[:, None] * members).sum(0))  # Eq. 18
    ref_z = torch.stack(ref_z)
    torch.testing.assert_close(z[0], ref_z)
    u = step.up(z, length)
    ref_u = torch.zeros(length, 16, dtype=torch.double)
    for i in range(length):
        src = i - s  # Eq. 22
        if src >= 0 and pi[src] >= 0:
            j = pi[src]
            if step.allocator is None:
                ref_u[i] = lam / g * ref_z[j]  # Eq. 20
            else:
                beta = step.allocator(ref_z[j]).softmax(-1)  # Eq. 21
                ref_u[i] = lam * beta[rho[src]] * ref_z[j]  # Eq. 19
    torch.testing.assert_close(u[0], ref_u)

    cotangents = torch.randn_like(z), torch.randn_like(u)
    params = [h, *step.parameters()]
    grads = torch.autograd.grad(
        (z * cotangents[0]).sum() + (u * cotangents[1]).sum(), params, materialize_grads=True
    )
    ref = torch.autograd.grad(
        (ref_z * cotangents[0][0]).sum() + (ref_u * cotangents[1][0]).sum(), params, materialize_grads=True
    )
    for got, want in zip(grads, ref, strict=True):  # α and β are softmaxed in float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("downscale, upscale", [("mean", "broadcast"), ("self_aggregation", "allocation")])
def test_operators_without_a_complete_chunk(downscale, upscale):
    """Fewer than g - ω positions: S_down yields no chunk, and S_up of no chunk is a zero update."""
    cfg = ModelConfig.from_dict({**BASE, "layout": "1+1x{1/4}+1", "downscale": downscale, "upscale": upscale})
    step = ResolutionStep(cfg, 4, 2, 3, 2.0)
    assert step.down(torch.randn(2, 1, 16)).shape == (2, 0, 16)
    u = step.up(torch.randn(2, 0, 16), 5)
    assert u.shape == (2, 5, 16) and not u.any()


def test_self_aggregation_and_allocation_are_normalised():
    cfg = ModelConfig.from_dict({**BASE, "layout": "1+1x{1/4}+1"})
    step = ResolutionStep(cfg, 4, 2, 3, 2.0).double()
    step.record = []
    h = torch.randn(2, 13, 16, dtype=torch.double)
    step.up(step.down(h), 13)
    alpha, beta = step.record[0]["alpha"], step.record[1]["beta"]
    torch.testing.assert_close(alpha.sum(-1), torch.ones_like(alpha.sum(-1)))
    assert (alpha[:, 0, :2] == 0).all()  # the left padding of chunk 0 gets no weight
    assert beta.shape == (2, 3, 4)


# SpiralFormer Table 1: (preset, layout, topology, non-embedding params (M), FLOPs (1e12), 4096 prefill)
TABLE1 = [
    ("pythia-160m", "12", "base", 85.1, 1.65),
    ("pythia-160m", "2+4x{1,1}+2", "anchor", 56.7, 1.65),
    ("pythia-160m", "2+4x{1,1}+2", "mesh", 56.7, 1.65),
    ("pythia-160m", "2+4x{1/8,1/4,1/2,1}+2", "mesh", 56.8, 1.48),
    ("pythia-160m", "4+4x{1/16,1/8,1/4,1/2}+4", "mesh", 85.1, 1.49),
    ("pythia-410m", "24", "base", 302.3, 4.59),
    ("pythia-410m", "4+8x{1,1}+4", "anchor", 201.5, 4.59),
    ("pythia-410m", "4+8x{1,1}+4", "mesh", 201.6, 4.59),
    ("pythia-410m", "4+8x{1/8,1/4,1/2,1}+4", "anchor", 201.6, 4.10),
    ("pythia-410m", "4+8x{1/8,1/4,1/2,1}+4", "mesh", 201.6, 4.11),
    ("pythia-410m", "8+8x{1/16,1/8,1/4,1/2}+8", "mesh", 302.4, 4.16),
    ("pythia-1b", "16", "base", 805.7, 9.67),
    ("pythia-1b", "3+5x{1,1}+3", "anchor", 553.9, 9.67),
    ("pythia-1b", "3+5x{1,1}+3", "mesh", 554.0, 9.67),
    ("pythia-1b", "3+5x{1/8,1/4,1/2,1}+3", "mesh", 554.1, 8.95),
    ("pythia-1b", "5+6x{1/16,1/8,1/4,1/2}+5", "mesh", 805.9, 8.96),
    ("pythia-1.4b", "24", "base", 1208.6, 14.08),
    ("pythia-1.4b", "4+8+8+4", "mesh", 1208.7, 14.08),
    ("pythia-1.4b", "4+8x{1,1}+4", "anchor", 805.7, 14.08),
    ("pythia-1.4b", "4+8x{1,1}+4", "mesh", 805.8, 14.08),
    ("pythia-1.4b", "4+8x{1/8,1/4,1/2,1}+4", "mesh", 805.9, 12.92),
    ("pythia-1.4b", "8+8x{1/16,1/8,1/4,1/2}+8", "mesh", 1208.8, 13.13),
]


@pytest.mark.parametrize("size, layout, topology, params_m, flops_t", TABLE1)
def test_spiralformer_table1(size, layout, topology, params_m, flops_t):
    d = describe(preset(size, layout=layout, topology=topology), seq_len=4096)
    assert abs(d["params_non_embedding"] / 1e6 - params_m) <= 0.1
    assert d["flops_forward"] / 1e12 == pytest.approx(flops_t, rel=0.02)
