"""Model properties: causality for every topology and layout, exact parameter counts, MeSH subsumption."""

import copy
import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recursive_lightning.model.config import TOPOLOGIES, ModelConfig, preset
from recursive_lightning.model.describe import describe
from recursive_lightning.model.recursive.mesh import MeSH
from recursive_lightning.model.recursive.model import RecursiveLM

TINY = dict(vocab_size=61, d_model=32, n_heads=4, max_seq_len=64)


def tiny(layout: str, topology: str = "base", **kw) -> RecursiveLM:
    torch.manual_seed(0)
    return RecursiveLM(ModelConfig.from_dict({**TINY, "layout": layout, "topology": topology, **kw})).double()


def assert_causal(model: RecursiveLM, length: int = 24, trials: int = 4) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, model.cfg.vocab_size, (2, length), generator=g)
    base = model(x)
    for j in torch.randint(0, length, (trials,), generator=g).tolist():
        y = x.clone()
        y[:, j] = (
            y[:, j] + 1 + torch.randint(0, model.cfg.vocab_size - 1, (1,), generator=g)
        ) % model.cfg.vocab_size
        out = model(y)
        torch.testing.assert_close(out[:, :j], base[:, :j], atol=1e-9, rtol=0)
        assert not torch.allclose(out[:, j:], base[:, j:])  # and the perturbation is seen from j on


LAYOUTS = ["6", "2+2R3+2", "1+2+2+1", "0+2R2+0", "2+2x{1/4,1/2,1}+2"]


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_causal_every_topology_and_layout(layout, topology):
    if layout == "6" and topology != "base":
        pytest.skip("vanilla layouts have no topology")
    model = tiny(layout, topology)
    if topology in ("static", "dynamic"):  # move away from the initial point so every term matters
        with torch.no_grad():
            for p in model.topology.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    assert_causal(model)


def test_pythia_parameter_counts_exact():
    """docs/models.md, Numbers the code reproduces: 12d^2 + 13d per layer; MeSH Table 6."""
    vanilla = describe(preset("pythia-1.4b"), seq_len=8)
    assert vanilla["params_non_embedding"] == 1_208_602_624
    d = 2048
    assert vanilla["params_non_embedding"] == 24 * (12 * d * d + 13 * d) + 2 * d
    looped = describe(preset("pythia-1.4b", layout="4+8R2+4"), seq_len=8)
    assert looped["params_non_embedding"] == 805_736_448
    mesh = describe(preset("pythia-1.4b", layout="4+8R2+4", topology="mesh", buffer=5), seq_len=8)
    assert mesh["params_non_embedding"] == 805_797_918
    assert mesh["params_router"] == 61_470
    assert mesh["params_total"] - mesh["params_non_embedding"] == 2 * 50304 * d


def test_table7_flops():
    """SpiralFormer Table 1 convention: 14.08e12 for a 4096 prefill of 4+8R2+4 at 1.4B; MeSH Eq. 8."""
    base = describe(preset("pythia-1.4b", layout="4+8R2+4"))
    mesh = describe(preset("pythia-1.4b", layout="4+8R2+4", topology="mesh", buffer=5))
    assert base["flops_forward"] == pytest.approx(14.08e12, rel=0.02)
    assert base["flops_forward_fvcore"] == pytest.approx(5373.792e9, rel=0.01)  # MeSH Table 7
    assert mesh["flops_mesh_eq8"] == pytest.approx(0.755e9, rel=0.001)
    extra = mesh["flops_forward"] - base["flops_forward"]
    assert 0 < extra < 2 * mesh["flops_mesh_eq8"]  # router cost is of the order of Eq. 8
    assert extra / base["flops_forward"] < 1e-3


@settings(max_examples=25, deadline=None)
@given(
    d=st.integers(1, 24).map(lambda x: 32 * x), slots=st.integers(1, 9), loops=st.integers(1, 5)
)  # even rotary dims
def test_router_parameter_formula(d, slots, loops):
    """MeSH App. E.4: (N_loop + 1) * d * B * 2 weights, plus (N_loop + 1) * B * 2 biases."""
    cfg = ModelConfig.from_dict(
        {
            "vocab_size": 11,
            "d_model": d,
            "n_heads": 4,
            "layout": f"1+1R{loops}+1",
            "topology": "mesh",
            "buffer": slots,
        }
    )
    with torch.device("meta"):
        m = RecursiveLM(cfg)
    n = sum(p.numel() for p in m.topology.parameters())
    assert n == (loops + 1) * d * slots * 2 + (loops + 1) * slots * 2


def test_buffer_default_is_nloop_plus_3():
    assert preset("cpu-tiny", layout="2+4R2+2", topology="mesh").buffer_slots == 5
    assert preset("cpu-tiny", layout="2+4R4+2", topology="mesh").buffer_slots == 7


def test_depth_aware_init():
    m = RecursiveLM(preset("cpu-base", layout="2+4R3+2"))  # N_compute = 16
    std = m.prelude.layers[0].attn.proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(2 * 16), rel=0.1)
    assert m.prelude.layers[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert m.emb_scale == pytest.approx(math.sqrt(256))


def _set_router(router: torch.nn.Linear, slot: int, margin: float = 60.0) -> None:
    with torch.no_grad():
        router.weight.zero_()
        router.bias.fill_(-margin)
        router.bias[slot] = margin


def _clone_weights(src: RecursiveLM, dst: RecursiveLM) -> None:
    own = {k: v for k, v in src.state_dict().items() if not k.startswith("topology.")}
    missing, unexpected = dst.load_state_dict(own, strict=False)
    assert not unexpected and all(k.startswith("topology.") for k in missing)


def test_mesh_reproduces_residual():
    """Hand-set routers: write the prelude output and every core output into slot 1, read slot 1.
    Then h^(0) = h_pre and h^(t+1) = h^(t) + f_core(h^(t)): exactly the residual topology."""
    mesh = tiny("2+2R3+2", "mesh")
    residual = tiny("2+2R3+2", "residual")
    _clone_weights(mesh, residual)
    for t in range(4):
        _set_router(mesh.topology.write[t], 1)
        _set_router(mesh.topology.read[t], 1)
    x = torch.randint(0, 61, (2, 20))
    torch.testing.assert_close(mesh(x), residual(x), atol=1e-4, rtol=0)


def test_mesh_reproduces_anchor_emb():
    """Slot 0 holds h_emb (Eq. 2); writing f_core's output into it and reading it gives h_emb + f_core(h):
    anchor* for a single loop step (reads are convex, so one slot can carry the sum only once)."""
    mesh = tiny("2+2R1+2", "mesh")
    anchor = tiny("2+2R1+2", "anchor_emb")
    _clone_weights(mesh, anchor)
    _set_router(mesh.topology.write[0], 1)
    _set_router(mesh.topology.read[0], 1)  # h^(0) = prelude output, as in anchor*
    _set_router(mesh.topology.write[1], 0)
    _set_router(mesh.topology.read[1], 0)
    x = torch.randint(0, 61, (2, 20))
    torch.testing.assert_close(mesh(x), anchor(x), atol=1e-4, rtol=0)


def test_mesh_routing_is_inspectable_and_traced_logits_match():
    m = tiny("2+2R2+2", "mesh")
    x = torch.randint(0, 61, (2, 12))
    logits, trace = m.traced(x, attention=True)
    torch.testing.assert_close(logits, m(x))
    assert len(trace.routing["write"]) == 3 and trace.routing["read"][0].shape == (2, 12, 5)
    torch.testing.assert_close(trace.routing["read"][1].sum(-1), torch.ones(2, 12, dtype=torch.double))
    assert [n for n, _ in trace.states] == ["h_emb", "h(0)", "h(1)", "h(2)", "h_out"]
    assert [n for n, _, _ in trace.blocks] == ["prelude", "core 1", "core 2", "coda"]
    assert len(trace.attention["core0"]) == 2 and len(trace.attention["core0"][0]) == 2  # 2 layers x 2 loops
    assert isinstance(m.topology, MeSH) and m.topology.record is None


def test_unshared_cores_have_distinct_weights():
    m = tiny("1+2+2+1", "mesh")
    assert (
        len(m.cores) == 2 and m.cores[0].layers[0].attn.qkv.weight is not m.cores[1].layers[0].attn.qkv.weight
    )
    assert (
        describe(preset("pythia-1.4b", layout="4+8+8+4", topology="mesh"), seq_len=8)["params_non_embedding"]
        == 1_208_602_624 + 61_470
    )


def test_generate_greedy():
    m = tiny("2+2R2+2", "anchor")
    out = m.generate(torch.randint(0, 61, (1, 5)), 4)
    assert out.shape == (1, 9)
    ref = copy.deepcopy(out[:, :5])
    for _ in range(4):
        ref = torch.cat([ref, m(ref)[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, ref)


def test_mesh_read_equals_the_materialised_buffer():
    """The factored buffer gives exactly Eq. 5-6 on the explicit (B, b, l, d) buffer of Algorithm 2."""
    m = tiny("2+2R3+2", "mesh")
    topo = m.topology
    h_emb = torch.randn(2, 7, 32, dtype=torch.double)
    h, carry = topo.start(h_emb, torch.randn(2, 7, 32, dtype=torch.double))
    for t in range(3):
        u = torch.randn(2, 7, 32, dtype=torch.double)
        h_next, carry = topo.step(t, h, u, carry)
        buffer = MeSH.buffer(carry)  # Eq. 2 + every write
        w_read = topo.read[t + 1](h).softmax(-1)
        torch.testing.assert_close(h_next, (buffer * w_read.permute(2, 0, 1).unsqueeze(-1)).sum(0))
        assert buffer.shape == (6, 2, 7, 32)  # B = N_loop + 3
        torch.testing.assert_close(
            buffer[:, 0, 0].sum(0) - h_emb[0, 0], sum(w[0][0, 0] for w in carry["writes"])
        )
        h = h_next


@pytest.mark.skipif(shutil.which("cc") is None, reason="torch.compile on the CPU needs a C++ compiler")
@pytest.mark.parametrize("scope", ["layers", "model"])
def test_compiled_model_trains_like_eager(scope):
    """``train.compile`` (training/parallel.compile_model) on a multi-resolution MeSH model: per layer (the core
    compiled once and called at two sequence lengths) or the whole forward (routers, S_down / S_up and the
    MeSH reads fused); loss and every gradient equal eager mode."""
    from recursive_lightning.training.parallel import compile_model

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=97, d_model=64, n_heads=4, max_seq_len=64, layout="1+2x{1/2,1}+1", topology="mesh"
    )
    eager = RecursiveLM(cfg)
    compiled = copy.deepcopy(eager)
    compile_model(compiled, scope)
    idx, tgt = torch.randint(0, 97, (2, 48)), torch.randint(0, 97, (2, 48))
    eager.loss(idx, tgt).backward()
    loss = compiled.loss(idx, tgt)
    loss.backward()
    torch.testing.assert_close(loss, eager.loss(idx, tgt))
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("start,length", [(0, 64), (17, 30), (100, 28), (120, 20), (200, 5)])
def test_rotary_table_equals_computed_angles(start, length):
    """A stack's cos/sin table (positions < max_seq_len) gives exactly the computed angles; past its end the
    angles are computed."""
    from recursive_lightning.model.block import Rotary

    rot = Rotary(ModelConfig(vocab_size=97, d_model=64, n_heads=4, max_seq_len=128), table=True)
    for dtype in (torch.float32, torch.float64):
        got = rot.cos_sin_range(start, length, torch.device("cpu"), dtype)
        want = rot.cos_sin(torch.arange(start, start + length), dtype)
        assert all(torch.equal(g, w) and g.dtype == dtype for g, w in zip(got, want))


class _Repeats(torch.nn.Module):
    """A layer whose FLOPs depend on a plain attribute, not on its weights' shapes."""

    def __init__(self, reps: int) -> None:
        super().__init__()
        self.reps, self.lin = reps, torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.reps):
            x = self.lin(x)
        return x


class _Project(torch.nn.Module):
    """Through ``width`` dimensions and back: FLOPs set by a weight's shape alone."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(width, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.T @ self.w


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 8)
        self.layers = torch.nn.ModuleList(_Repeats(r) for r in (1, 1, 3, 1))
        self.head = torch.nn.ModuleList([_Project(8), _Project(16)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in [*self.layers, self.layers[0]]:
            x = layer(x)
        return self.head[1](self.head[0](x))


def test_replayed_calls_count_as_a_full_meta_forward():
    """describe replays a call that repeats one already counted (the same module again, or another layer of
    one stack): every module path's count equals an unreplayed count's. Layers that differ in a plain
    attribute (3 repeats) or in weight shapes (the head) run (fails with either left out of the key, or
    with counts left at the first layer's path)."""
    from recursive_lightning.model.describe import _count_forward

    with torch.device("meta"):
        model = _Stack()
    full = _count_forward(model, 16, 2).get_flop_counts()
    fast = _count_forward(model, 16, 2, [*model.layers, *model.head]).get_flop_counts()
    assert {k: dict(v) for k, v in fast.items()} == {k: dict(v) for k, v in full.items()}
    assert sum(full["_Stack.layers.2"].values()) == 3 * sum(full["_Stack.layers.1"].values()) > 0


@pytest.mark.parametrize(
    "layout,extra",
    [
        ("2+2R3+2", {"topology": "mesh"}),
        ("1+2x{1/4,1/2,1}+1", {"topology": "mesh", "downscale": "self_aggregation", "upscale": "allocation"}),
        ("1+2+2+1", {"topology": "anchor"}),
        ("4", {}),
    ],
)
def test_describe_counts_every_layer_of_a_recursive_model(layout, extra):
    """describe replays the repeated layers of the prelude, cores and coda: every module path's count equals
    an unreplayed meta forward's (fails with a layer's count left at another's path)."""
    from recursive_lightning.model.build import build_on_meta
    from recursive_lightning.model.describe import _count_forward

    cfg = preset("cpu-tiny", layout=layout, **extra)
    model = build_on_meta(RecursiveLM, cfg)
    full = _count_forward(model, 64, 2).get_flop_counts()
    layers = [m for stack in model.layer_lists() for m in stack]
    fast = _count_forward(model, 64, 2, layers).get_flop_counts()
    assert {k: dict(v) for k, v in fast.items()} == {k: dict(v) for k, v in full.items()}
    assert describe(cfg, seq_len=64, batch_size=2)["flops_forward"] == sum(full["Global"].values())


def test_describe_never_loads_the_compiler_and_counts_the_same():
    """`describe` counts on the meta device without importing torch._dynamo (torch's meta kernels ask for it
    only to mark functions the compiler must not trace); it leaves no such mark behind, and the count is the
    one made with the compiler loaded (fails with the stand-in's marks kept, or the stand-in left loaded)."""
    script = """
import gc, json, sys
from recursive_lightning import cli
argv = ["describe", "--preset", "cpu-mela", "--seq-len", "300", "--json"]
assert cli.main(argv) == 0
assert cli.main(["describe", "--preset", "cpu-tiny", "--layout", "1+2R3+1", "--json", "--train-loops", "uniform:1-3"]) == 0
assert "torch._dynamo" not in sys.modules
assert not [f for f in gc.get_objects() if callable(f) and "__dynamo_disable" in getattr(f, "__dict__", {})]
import torch._dynamo
assert hasattr(torch._dynamo, "optimize")
argv[2] = "cpu-tiny"
assert cli.main(argv) == 0
"""
    from conftest import ENV, ROOT

    out = subprocess.run(
        [sys.executable, "-c", script], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    mela, loops, tiny_ = (json.loads(line) for line in out.stdout.splitlines())
    assert mela == describe(preset("cpu-mela"), seq_len=300)
    assert tiny_ == describe(preset("cpu-tiny"), seq_len=300)
    assert loops["train_loops_mean"] == 2 and loops["flops_train_per_token_expected"] > 0
